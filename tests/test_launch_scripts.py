"""A launch script runs the package of the checkout it belongs to, ahead of any installed copy.

With an editable install of one checkout, ``python launch/compare.py`` run from a second checkout used to import
the installed package (the first checkout's code) and measured it: the benchmark runner's workers take
``PYTHONPATH`` from the imported package, and the report named the first checkout's commit, not the one the
script was run from. Each script now puts its own checkout first on ``sys.path``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess  # each case starts a Python process (tests/conftest.py)

LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch")
SCRIPTS = ["aidaptiv_run.py", "compare.py", "finetune.py", "generate.py", "large_model.py", "memory_sweep.py",
           "moments_accuracy.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_launch_script_imports_the_package_beside_it(tmp_path, script):
    checkout = tmp_path / "other_checkout"
    (checkout / "launch").mkdir(parents=True)
    (checkout / "aidaptiv_ds").mkdir()
    (checkout / "aidaptiv_ds" / "__init__.py").write_text('raise SystemExit("imported the checkout beside the script")\n')
    shutil.copy(os.path.join(LAUNCH, script), checkout / "launch" / script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, str(checkout / "launch" / script), "--help"], capture_output=True, text=True,
                       env=env, cwd=str(tmp_path), timeout=120)
    assert "imported the checkout beside the script" in p.stderr, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
