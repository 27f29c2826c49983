"""Activation: ``import aidaptiv_ds`` installs the hooks; without an enabled section DeepSpeed's own
classes run untouched; ``uninstall`` restores every attribute."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _oracle import REPO, oracle, run

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

ARGS = ["--model", "mlp", "--zinit", "--dtype", "bf16", "--hidden", "1024", "--layers", "2", "--steps", "3"]


@pytest.mark.parametrize("how", ["absent", "disabled"])
def test_deepspeed_classes_without_an_enabled_section(how, tmp_path_factory):
    backend, extra = ("native", []) if how == "absent" else ("aidaptiv", ["--extra", '{"enabled": false}'])
    res = run(backend, ARGS + extra, str(tmp_path_factory.mktemp(how)))
    assert res["swapper"] == "AsyncPartitionedParameterSwapper"
    assert res["optimizer_swapper"] == "PartitionedOptimizerSwapper"
    assert res["losses"] == oracle(ARGS, str(tmp_path_factory.getbasetemp()))["losses"]


def _py(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def test_import_before_deepspeed_installs_on_deepspeed_import():
    out = _py("import aidaptiv_ds, sys; assert 'deepspeed' not in sys.modules; import deepspeed; "
              "import deepspeed.runtime.zero.partition_parameters as pp; print(pp.AsyncPartitionedParameterSwapper.__name__)")
    assert out == "param_swapper_factory"


def test_import_after_deepspeed_installs_at_once():
    out = _py("import deepspeed, aidaptiv_ds; import deepspeed.runtime.zero.stage3 as s3; "
              "print(s3.DeepSpeedZeroOptimizer_Stage3.__name__)")
    assert out == "AidaptivZeroOptimizer_Stage3"


def test_opt_out_of_autoinstall():
    p = subprocess.run([sys.executable, "-c", "import aidaptiv_ds, deepspeed; import deepspeed.runtime.zero.stage3 as s3; "
                        "print(s3.DeepSpeedZeroOptimizer_Stage3.__name__)"],
                       env=dict(os.environ, PYTHONPATH=REPO, AIDAPTIV_DS_NO_AUTOINSTALL="1"), capture_output=True,
                       text=True, timeout=300)
    assert p.stdout.strip().splitlines()[-1] == "DeepSpeedZeroOptimizer_Stage3"


def test_uninstall_restores_every_attribute():
    out = _py("import deepspeed, deepspeed.runtime.zero.partition_parameters as pp, deepspeed.runtime.zero.stage3 as s3, "
              "deepspeed.runtime.zero.parameter_offload as po\n"
              "before = (deepspeed.initialize, pp.Init.__init__, pp.AsyncPartitionedParameterSwapper, "
              "s3.DeepSpeedZeroOptimizer_Stage3, getattr(po.PartitionedParameterCoordinator, "
              "'_PartitionedParameterCoordinator__prefetch_nvme_param_partitions'))\n"
              "import os; os.environ['AIDAPTIV_DS_NO_AUTOINSTALL'] = '1'\n"
              "from aidaptiv_ds.integration import install, uninstall\n"
              "assert install()\n"
              "assert pp.AsyncPartitionedParameterSwapper is not before[2]\n"
              "uninstall()\n"
              "after = (deepspeed.initialize, pp.Init.__init__, pp.AsyncPartitionedParameterSwapper, "
              "s3.DeepSpeedZeroOptimizer_Stage3, getattr(po.PartitionedParameterCoordinator, "
              "'_PartitionedParameterCoordinator__prefetch_nvme_param_partitions'))\n"
              "print(all(a is b for a, b in zip(before, after)))")
    assert out == "True"


def test_site_hook_activates_an_unmodified_process(tmp_path, monkeypatch):
    """``aidaptiv-ds site-hook install`` writes the .pth that ``pip install`` ships: its import line
    leaves DeepSpeed alone until a config with an ``"aidaptiv"`` section reaches it (even a disabled
    one: aidaptiv_ds decides), which imports aidaptiv_ds and installs the hooks."""
    from aidaptiv_ds.cli import site_hook
    from aidaptiv_ds.cli.main import main as cli

    monkeypatch.setattr(site_hook, "pth_path", lambda: str(tmp_path / site_hook.PTH_NAME))
    assert cli(["site-hook", "install"]) == 0
    assert (tmp_path / site_hook.PTH_NAME).read_text() == "import _aidaptiv_ds_autoload\n"
    out = _py(f"import site; site.addsitedir({str(tmp_path)!r}); import sys; assert 'aidaptiv_ds' not in sys.modules; "
              "import deepspeed, deepspeed.runtime.zero.stage3 as s3; assert 'aidaptiv_ds' not in sys.modules\n"
              "before = s3.DeepSpeedZeroOptimizer_Stage3.__name__\n"
              "try:\n    deepspeed.initialize(model=None, config={'aidaptiv': {'enabled': False}})\n"
              "except Exception:\n    pass\n"
              "print(before, s3.DeepSpeedZeroOptimizer_Stage3.__name__, 'aidaptiv_ds' in sys.modules)")
    assert out == "DeepSpeedZeroOptimizer_Stage3 AidaptivZeroOptimizer_Stage3 True"
    assert cli(["site-hook", "remove"]) == 0
    assert not (tmp_path / site_hook.PTH_NAME).exists()


def test_the_site_hook_and_the_package_watchers_find_deepspeed_together():
    """Both deepspeed watchers on sys.meta_path (the site hook of a fresh install and the package's own):
    each asks the other finders, so without the reentrancy guard finding ``deepspeed`` recursed without end
    (the first CI run after the site hook landed: RecursionError in collection)."""
    import sys

    import _aidaptiv_ds_autoload
    from aidaptiv_ds import _autoload

    saved = list(sys.meta_path)
    try:
        sys.meta_path[:0] = [_aidaptiv_ds_autoload._DeepSpeedWatcher(), _autoload._DeepSpeedWatcher()]
        spec = sys.meta_path[0].find_spec("deepspeed", None)
        assert spec is not None and spec.name == "deepspeed"
        assert sys.meta_path[1].find_spec("deepspeed", None) is not None
    finally:
        sys.meta_path[:] = saved
