"""``aidaptiv-ds gc``: dead stores are listed and removed; live ones are never touched."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from aidaptiv_ds.cli.main import main as cli
from aidaptiv_ds.io.engine import IOEngine
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore
import pytest

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gc_removes_dead_stores_only(tmp_path, capsys):
    cache = str(tmp_path)
    # a dead store: a process that kept its files and exited (its lock died with it)
    code = (f"from aidaptiv_ds.store import *; from aidaptiv_ds.io.engine import IOEngine; import torch; "
            f"st = SlabStore(Namespace([{cache!r}], 'dead', 0), [PathSpec({cache!r}, capacity=64 << 20)], "
            f"engine=IOEngine(), keep=True); st.put('x', torch.ones(1000)).wait(); st.close()")
    assert subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO)).returncode == 0
    live = SlabStore(Namespace([cache], "live", 0), [PathSpec(cache, capacity=64 << 20)], engine=IOEngine())
    live.put("y", __import__("torch").ones(1000)).wait()
    try:
        assert cli(["gc", "--cache", cache, "--json"]) == 0
        rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows["dead"]["live"] is False and rows["live"]["live"] is True
        assert cli(["gc", "--cache", cache, "--delete", "--json"]) == 0
        rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows["dead"]["deleted"] and not os.path.exists(rows["dead"]["dir"])
        assert not os.path.exists(os.path.dirname(rows["dead"]["dir"]))  # nor its empty run directory
        assert not rows["live"]["deleted"] and os.path.exists(rows["live"]["dir"])
    finally:
        live.close()
