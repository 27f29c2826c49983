"""DeepSpeed's CPU all-reduce segments (integration/shm_buffer.py, [Note: the buffer DeepSpeed never unlinks]):
the path as DeepSpeed names it, and the sweep of one rendezvous port's segments a harness runs after its children
exit. That a rank of our backend unlinks its own at exit is checked by the launcher test in test_multirank.py."""
from __future__ import annotations

import os

import pytest

from aidaptiv_ds.integration import shm_buffer
from aidaptiv_ds.ports import free_port

pytestmark = pytest.mark.skipif(not os.path.isdir(shm_buffer.SHM_DIR), reason="no /dev/shm on this machine")


def test_the_path_is_deepspeeds_name():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    assert shm_buffer.allreduce_buffer_path(1, env, uid=0) == "/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_29511_1"
    assert shm_buffer.allreduce_buffer_path(0, {}, uid=7) == "/dev/shm/deepspeed_allreduce_buffer_7___0"  # unset


def test_the_sweep_takes_one_ports_segments_and_nothing_else(monkeypatch):
    port, other = free_port(), free_port()
    uid = os.getuid()
    mine = [f"/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{r}" for r in (0, 1)]
    theirs = f"/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_{other}_0"
    for p in [*mine, theirs]:
        with open(p, "wb") as f:
            f.write(b"x")
    try:
        assert shm_buffer.release_allreduce_buffers_of_port(port) == 2
        assert not any(os.path.exists(p) for p in mine) and os.path.exists(theirs)
        assert shm_buffer.release_allreduce_buffers_of_port(port) == 0  # nothing left, no error
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(other))
        assert shm_buffer.release_allreduce_buffer(0) and not os.path.exists(theirs)
        assert not shm_buffer.release_allreduce_buffer(0)  # gone already: False, no error
    finally:
        for p in [*mine, theirs]:
            if os.path.exists(p):
                os.unlink(p)
