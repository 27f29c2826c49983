"""The JSON switch without an import (issue 11.4): after ``pip install``, a DeepSpeed config with an
``"aidaptiv"`` section is enough -- the script never imports aidaptiv_ds.

* the wheel carries ``aidaptiv_ds_autoload.pth`` at its top level (and in its RECORD, so ``pip
  uninstall`` removes it), with the hook's module;
* at interpreter start the hook imports nothing but itself (no torch, DeepSpeed, pydantic, nor
  aidaptiv_ds); after ``import deepspeed`` aidaptiv_ds is still not imported, only two thin
  wrappers are in place; ``AIDAPTIV_DS_NO_AUTOINSTALL=1`` leaves DeepSpeed untouched;
* a script with the section and no import trains on aidaptiv_ds's swappers (with the hook loaded
  from a site directory in CI; ``slow``: in a fresh venv from the wheel, and from an editable
  install).
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile

import pytest

from _oracle import REPO

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

SCRIPT = os.path.join(REPO, "tests", "scripts", "no_import_train.py")
PTH = "aidaptiv_ds_autoload.pth"
MODULE = "_aidaptiv_ds_autoload.py"
from conftest import EXT_DIR  # noqa: E402  (one per venv, built before the first test)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AIDAPTIV_DS_NO_AUTOINSTALL")}
    env.update(TORCH_EXTENSIONS_DIR=EXT_DIR, **extra)
    return env


def _source_copy(dst: str) -> str:
    """The project's tracked files (what a checkout holds) in ``dst``: builds never touch the worktree."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        if os.path.isfile(os.path.join(REPO, f)):
            os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, f), os.path.join(dst, f))
    return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("wheel")
    src = _source_copy(str(root / "src"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(root / "dist"), src], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (whl,) = [os.path.join(root / "dist", f) for f in os.listdir(root / "dist") if f.endswith(".whl")]
    return whl


def test_the_wheel_ships_the_pth_at_its_top_level(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert PTH in names and MODULE in names
        assert z.read(PTH).decode() == "import _aidaptiv_ds_autoload\n"
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        listed = {ln.split(",")[0] for ln in z.read(record).decode().splitlines()}
        assert {PTH, MODULE} <= listed  # pip uninstall removes them


_PROBE = """
import json, site, sys
before = set(sys.modules)
site.addsitedir(sys.argv[1])
loaded = sorted(set(sys.modules) - before)
hook = "_aidaptiv_ds_autoload" in sys.modules
out = {"loaded_by_hook": loaded, "watchers": [type(f).__name__ for f in sys.meta_path if "DeepSpeed" in type(f).__name__]}
sys.path.extend(json.loads(sys.argv[2]))  # this environment's packages, without running its .pth files
import deepspeed

out.update(after_deepspeed=sorted(m for m in sys.modules if m.startswith("aidaptiv_ds")),  # DeepSpeed loads pydantic
           wrapped=getattr(deepspeed.initialize, "_aidaptiv_site", False), hook=hook)
print("RESULT " + json.dumps(out))
"""


def _probe(sitedir: str, **env) -> dict:
    p = subprocess.run([sys.executable, "-S", "-c", _PROBE, sitedir, json.dumps(site.getsitepackages())], env=_env(**env),
                       capture_output=True,
                       text=True, timeout=300, cwd="/")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])


@pytest.fixture
def sitedir(tmp_path, wheel) -> str:
    """A site directory with just the hook (the .pth and its module, from the wheel)."""
    d = tmp_path / "site"
    d.mkdir()
    with zipfile.ZipFile(wheel) as z:
        for name in (PTH, MODULE):
            (d / name).write_bytes(z.read(name))
    return str(d)


def test_the_hook_costs_nothing_until_deepspeed_and_imports_aidaptiv_only_for_the_section(sitedir):
    out = _probe(sitedir)
    assert out["hook"] and out["loaded_by_hook"] == ["_aidaptiv_ds_autoload"], out  # no torch, no DeepSpeed, ...
    assert out["watchers"] == ["_DeepSpeedWatcher"]
    assert out["wrapped"] and out["after_deepspeed"] == [], out  # DeepSpeed imported: still nothing of ours
    off = _probe(sitedir, AIDAPTIV_DS_NO_AUTOINSTALL="1")
    assert off["watchers"] == [] and not off["wrapped"]


def _train(python: list[str], cache: str, *extra: str, env: dict | None = None, cwd: str = "/") -> tuple[int, str]:
    p = subprocess.run([*python, SCRIPT, cache, *extra], env=env or _env(), capture_output=True, text=True,
                       timeout=900, cwd=cwd)
    return p.returncode, p.stdout + p.stderr


def _result(out: str) -> dict:
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


def _ours(res: dict) -> None:
    assert not res["imported_before_initialize"] and res["imported"]
    assert res["optimizer"] == "AidaptivZeroOptimizer_Stage3" and res["optimizer_swapper"] == "AidaptivOptimizerSwapper"
    assert res["param_swapper"] == "AidaptivParamSwapper" and all(x == x for x in res["losses"])


def test_a_script_that_never_imports_aidaptiv_ds_trains_on_it(tmp_path, sitedir):
    """The section alone is enough: the hook (from a site directory, the package from this checkout)."""
    runner = [sys.executable, "-c", "import runpy, site, sys; site.addsitedir(sys.argv.pop(1)); sys.argv.pop(0); "
              "runpy.run_path(sys.argv[0], run_name='__main__')", sitedir]
    rc, out = _train(runner, str(tmp_path / "cache"), "--json", str(tmp_path / "ds.json"),
                     env=_env(PYTHONPATH=REPO))
    assert rc == 0, out[-4000:]
    res = _result(out)
    _ours(res)
    assert res["aidaptiv_file"].startswith(REPO)


# ------------------------------------------------------------------------------------------- fresh venvs
def _venv(path: str) -> str:
    """A fresh venv whose own site-packages is empty but which sees this environment's packages
    (torch, DeepSpeed...) through a path entry: no download, and none of this environment's .pth
    files (such as the editable finder of this checkout) run there."""
    subprocess.run([sys.executable, "-m", "venv", path], check=True, capture_output=True, timeout=300)
    py = os.path.join(path, "bin", "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "_shared_packages.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    return py


@pytest.mark.slow
def test_wheel_install_in_a_fresh_venv(tmp_path, wheel):
    py = _venv(str(tmp_path / "venv"))
    p = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for how in ([], ["--json", str(tmp_path / "ds.json")]):  # a dict, and a JSON file as --deepspeed passes it
        rc, out = _train([py], str(tmp_path / f"cache{len(how)}"), *how)
        assert rc == 0, out[-4000:]
        res = _result(out)
        _ours(res)
        assert res["aidaptiv_file"].startswith(str(tmp_path / "venv"))
    # (without the hook DeepSpeed's own NVMe path JIT-builds its async_io op here -- more than 15 minutes
    # on this machine, failing where libaio is missing, the trial's "Unable to JIT load the async_io op")
    p = subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", "aidaptiv_ds"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    left = subprocess.run([py, "-c", f"import os, sysconfig; print(os.path.exists(os.path.join("
                                     f"sysconfig.get_paths()['purelib'], {PTH!r})))"], capture_output=True, text=True)
    assert left.stdout.strip() == "False"  # uninstall removed the hook


@pytest.mark.slow
def test_editable_install_in_a_fresh_venv(tmp_path):
    """``pip install -e .`` (PEP 660, build isolation: it needs setuptools and wheel from the index)."""
    src = _source_copy(str(tmp_path / "src"))
    py = _venv(str(tmp_path / "venv"))
    p = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "-e", src], capture_output=True, text=True,
                       timeout=900)
    if p.returncode and ("Could not find a version" in p.stderr or "No matching distribution" in p.stderr):
        pytest.skip(f"no index with setuptools/wheel for the isolated build: {p.stderr[-500:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    rc, out = _train([py], str(tmp_path / "cache"))
    assert rc == 0, out[-4000:]
    res = _result(out)
    _ours(res)
    assert res["aidaptiv_file"] == os.path.join(src, "aidaptiv_ds", "__init__.py")
