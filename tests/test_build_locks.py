"""Left-over torch extension build locks (aidaptiv_ds/integration/build_locks.py): a lock left by a killed
build is refused with the file and the fix before DeepSpeed waits on it forever; a live build is not."""
from __future__ import annotations

import os
import time
import warnings

import pytest

from aidaptiv_ds.integration.build_locks import (
    STALE_AFTER_S,
    BuildLockWarning,
    StaleBuildLockError,
    check_build_locks,
    extensions_root,
    find_build_locks,
)


def _lock(root, op: str, age_s: float) -> str:
    d = root / op
    d.mkdir(parents=True, exist_ok=True)
    p = d / "lock"
    p.write_text("")
    t = time.time() - age_s
    os.utime(p, (t, t))
    return str(p)


def _proc(tmp_path, cwds: dict[str, str], hidden: dict[str, str | None] | None = None) -> str:
    """A fake /proc: one directory per pid with a ``cwd`` symlink; ``hidden`` pids have an unreadable
    ``cwd`` (a directory: readlink fails with EINVAL) and the given command line (None: unreadable too)."""
    proc = tmp_path / "proc"
    for pid, cwd in cwds.items():
        (proc / pid).mkdir(parents=True)
        os.symlink(cwd, proc / pid / "cwd")
    for pid, cmd in (hidden or {}).items():
        (proc / pid / "cwd").mkdir(parents=True)
        if cmd is None:
            (proc / pid / "cmdline").mkdir()
        else:
            (proc / pid / "cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0")
    (proc / "self-not-a-pid").mkdir(parents=True)
    return str(proc)


def test_a_stale_lock_is_refused_naming_the_file_and_the_fix(tmp_path):
    root = tmp_path / "ext"
    path = _lock(root, "deepspeed_shm_comm", 3600)
    # pid 1 hides its cwd (as a sandbox's init does) but is no build tool
    proc = _proc(tmp_path, {"2": "/", "3": str(tmp_path)}, hidden={"1": "/process_api --init"})
    with pytest.raises(StaleBuildLockError) as e:
        check_build_locks(str(root), proc=proc)
    msg = str(e.value)
    assert path in msg and "60 minutes old" in msg and f"rm {path}" in msg and "forever" in msg
    assert os.path.exists(path)  # we name it, the user deletes it


def test_a_running_build_and_a_fresh_lock_are_left_alone(tmp_path):
    root = tmp_path / "ext"
    _lock(root, "deepspeed_shm_comm", 3600)
    _lock(root, "cpu_adam", STALE_AFTER_S / 2)          # just taken: the build may not have started ninja yet
    (root / "async_io").mkdir()                         # built, no lock
    proc = _proc(tmp_path, {"1": "/", "77": str(root / "deepspeed_shm_comm")})  # ninja runs in the build dir
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_build_locks(str(root), proc=proc)
    locks = find_build_locks(str(root), proc=proc)
    assert [(b.op, b.building) for b in locks] == [("deepspeed_shm_comm", True), ("cpu_adam", False)]


@pytest.mark.parametrize("cmd", ["/usr/bin/ninja -v", None], ids=["ninja", "unreadable"])
def test_an_old_lock_whose_owner_cannot_be_checked_is_only_warned_about(tmp_path, cmd):
    root = tmp_path / "ext"
    path = _lock(root, "deepspeed_shm_comm", 3600)
    proc = _proc(tmp_path, {"1": "/"}, hidden={"2": cmd})
    with pytest.warns(BuildLockWarning, match=f"rm {path}"):
        check_build_locks(str(root), proc=proc)


def test_no_root_or_no_lock_is_nothing_to_check(tmp_path):
    assert find_build_locks(str(tmp_path / "missing")) == []
    (tmp_path / "op").mkdir()
    assert find_build_locks(str(tmp_path)) == []


def test_the_root_is_torchs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == str(tmp_path)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    import torch
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert os.path.join(extensions_root(), "probe") == _get_build_directory("probe", False)
    assert torch.version.cuda is not None or extensions_root().endswith("_cpu")


def test_deepspeed_initialize_with_the_section_refuses_before_building(tmp_path, monkeypatch):
    """Through the hook: an enabled config on a root holding a stale lock fails at once, not after a hang."""
    import deepspeed
    import torch

    import aidaptiv_ds  # noqa: F401  (installs the hooks)

    root = tmp_path / "ext"
    _lock(root, "deepspeed_shm_comm", 3600)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    cache = tmp_path / "cache"
    cache.mkdir()
    nvme = {"device": "nvme", "nvme_path": str(cache)}
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme},
           "aidaptiv": {"enabled": True, "cache_paths": [str(cache)], "dram_budget": 0}}
    m = torch.nn.Linear(4, 4)
    with pytest.raises(StaleBuildLockError, match="deepspeed_shm_comm"):
        deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)


def test_a_lock_released_while_checking_is_not_refused(tmp_path, monkeypatch):
    """The build that owned an old lock can end between the scan and the refusal (its ninja exits
    milliseconds before the lock goes): the check looks once more before it raises."""
    from aidaptiv_ds.integration import build_locks

    root = tmp_path / "ext"
    path = _lock(root, "deepspeed_shm_comm", 3600)
    monkeypatch.setattr(build_locks.time, "sleep", lambda _s: os.unlink(path))
    check_build_locks(str(root), proc=_proc(tmp_path, {"1": "/"}))
