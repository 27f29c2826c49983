"""The tier guard of tests/conftest.py: a test without a tier marker is a unit test, and starting a child
process or building a DeepSpeed engine from one fails it with the marker to add."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import PROBES, TierViolation


def test_this_test_is_classified_unit(request):
    assert request.node.get_closest_marker("unit") is not None


def test_a_child_process_from_a_unit_test_fails_with_the_marker_to_add(tmp_path):
    flag = tmp_path / "ran"
    with pytest.raises(TierViolation, match=r"is a unit test .* starts a child process \(python\)\. "
                                            r"Mark it @pytest.mark.subprocess"):
        subprocess.run([sys.executable, "-c", f"open({str(flag)!r}, 'w')"], check=True)
    with pytest.raises(TierViolation, match="forks"):
        os.fork()
    assert not flag.exists()  # refused before the child started


def test_a_library_probe_is_allowed():
    assert "ldconfig" in PROBES
    out = subprocess.run(["uname", "-s"], capture_output=True, text=True, check=True)
    assert out.stdout.strip()


def test_a_deepspeed_engine_from_a_unit_test_fails_with_the_marker_to_add():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init

    with pytest.raises(TierViolation, match="builds a DeepSpeed engine. Mark it @pytest.mark.engine"):
        DeepSpeedEngine(args=None, model=None)
    with pytest.raises(TierViolation, match="enters deepspeed.zero.Init. Mark it @pytest.mark.engine"):
        Init(config_dict_or_path={"train_batch_size": 1})


@pytest.mark.subprocess
def test_a_marked_test_may_start_a_child_process():
    out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "42"


def _callable_ids(path: str, func: str) -> set:
    """The ids a ``parametrize`` with an ``ids`` function gives ``func`` of test module ``path`` (computed at
    import, e.g. from seeded fuzz draws, so not spelled in the file)."""
    import importlib
    import pathlib

    fn = getattr(importlib.import_module(pathlib.Path(path).stem), func, None)
    out: set = set()
    for mark in getattr(fn, "pytestmark", []):
        ids = mark.kwargs.get("ids")
        if mark.name == "parametrize" and callable(ids):
            out |= {ids(v) for v in mark.args[1]}
    return out


def test_every_slow_variant_still_exists():
    """Each node id of conftest.SLOW_VARIANTS names a test function (and, for a parametrized id, a
    parameter id) that is still in its file: a renamed test must not fall back into the default run."""
    import pathlib
    import re

    from conftest import SLOW_VARIANTS

    root = pathlib.Path(__file__).resolve().parents[1]
    for nodeid in SLOW_VARIANTS:
        path, name = nodeid.split("::")
        func, _, param = name.partition("[")
        text = (root / path).read_text()
        assert re.search(rf"^def {re.escape(func)}\(", text, re.M), f"{nodeid}: no function {func} in {path}"
        if param and param.rstrip("]") in _callable_ids(path, func):  # ids a function computes (fuzz draws)
            continue
        for part in param.rstrip("]").split("-") if param else []:
            if any(ch.isalpha() for ch in part):  # computed numeric ids (a budget) are not spelled in the file
                assert part in text, f"{nodeid}: parameter {part!r} not found in {path}"


def test_a_left_over_build_lock_is_removed_and_a_build_is_kept(tmp_path):
    """A torch build killed half-way leaves ``<op>/lock``, on which every later build of that op waits
    forever; the session removes it before its own build and leaves the build's outputs alone."""
    from conftest import EXT_DIR, clear_stale_build_locks

    assert os.environ["TORCH_EXTENSIONS_DIR"] == EXT_DIR  # exported to every child of the session
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").write_text("")
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"\0")
    (tmp_path / "async_io").mkdir()
    assert clear_stale_build_locks(str(tmp_path)) == [str(tmp_path / "deepspeed_shm_comm" / "lock")]
    assert sorted(os.listdir(tmp_path / "deepspeed_shm_comm")) == ["deepspeed_shm_comm.so"]
    assert clear_stale_build_locks(str(tmp_path)) == []
