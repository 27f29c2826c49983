"""The exit handler destroys a gloo default process group a script left (aidaptiv_ds/process_group.py).

In a fresh interpreter each: the test process itself may hold a default group of an in-process engine test."""
from __future__ import annotations

import atexit
import os
import subprocess
import sys

import pytest
from _oracle import REPO

from aidaptiv_ds import process_group

CHILD = """
import sys, torch.distributed as dist
from aidaptiv_ds import process_group
process_group._destroy_gloo_default_group()  # no group yet: nothing to do, no error
assert not dist.is_initialized()
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
assert dist.is_initialized()
process_group._destroy_gloo_default_group()
print("destroyed" if not dist.is_initialized() else "left")
"""


@pytest.mark.subprocess
def test_destroys_a_gloo_group_left_initialized(tmp_path):
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-1] == "destroyed"


def test_registered_once(monkeypatch):
    calls = []
    monkeypatch.setattr(process_group, "_REGISTERED", False)
    monkeypatch.setattr(atexit, "register", lambda fn: calls.append(fn))
    process_group.destroy_gloo_group_at_exit()
    process_group.destroy_gloo_group_at_exit()
    assert calls == [process_group._destroy_gloo_default_group]


def test_free_ports_come_from_below_the_ephemeral_range_and_bind():
    """``free_port`` avoids the kernel's ephemeral range, which every outgoing connection draws from (a port
    taken there between the check and the rendezvous failed a test with EADDRINUSE), and never repeats."""
    import socket

    from aidaptiv_ds.ports import ephemeral_range, free_port

    lo, _ = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(1024 <= p < lo for p in ports), (lo, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # still free


def test_a_port_slice_confines_the_draws_to_its_part_of_the_range(monkeypatch):
    """ports.py [Note: a slice per process tree]: with ``AIDAPTIV_PORT_SLICE=i/n`` (what tests/conftest.py gives each
    pytest-xdist worker) every port comes from the ``i``-th of ``n`` parts, so two workers never draw the same one;
    a malformed value draws from the whole range."""
    from aidaptiv_ds.ports import _slice, ephemeral_range, free_port

    lo, _ = ephemeral_range()
    first, last = max(1024, lo - 12000), lo - 1
    parts = [_slice(first, last, f"{i}/2") for i in (0, 1)]
    assert parts[0][0] == first and parts[0][1] < parts[1][0] and parts[1][1] <= last
    for i, (a, b) in enumerate(parts):
        monkeypatch.setenv("AIDAPTIV_PORT_SLICE", f"{i}/2")
        assert all(a <= free_port() <= b for _ in range(10))
    assert _slice(first, last, "2/2") == _slice(first, last, "x") == (first, last)


WORKER = """
import atexit, sys
from aidaptiv_ds.process_group import run_worker

class Finalized:
    def __del__(self):  # runs in finalization only; a worker ended by run_worker never gets there
        sys.stdout.write("finalized\\n")

keep = Finalized()
atexit.register(lambda: sys.stdout.write("atexit ran\\n"))

def main():
    sys.stdout.write("main done")  # no newline: left in the buffer for run_worker's flush
    return int(sys.argv[1])

run_worker(main)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("code", [0, 3])
def test_a_worker_runs_its_exit_handlers_flushes_and_skips_finalization(code):
    """[Note: harness processes skip finalization]: the ``atexit`` handlers run, buffered output reaches the
    pipe, the exit status is ``main``'s, and finalization (where gloo's last objects abort) never runs."""
    p = subprocess.run([sys.executable, "-c", WORKER, str(code)], capture_output=True, text=True, timeout=120,
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == code, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["main doneatexit ran"], p.stdout


def test_a_ranks_abort_line_is_kept_above_the_launchers_traceback():
    """A rank that dies by ``std::terminate`` prints no "Error"; the fuzzer's tail still leads with its line
    (stop 43's CI failure showed only torchrun's traceback, and the cause was lost)."""
    from aidaptiv_ds.bench.fuzz import _tail

    log = "\n".join(["step 3 loss 1.0", "terminate called without an active exception"]
                    + [f"  launcher traceback line {i}" for i in range(40)])
    tail = _tail(log).splitlines()
    assert tail[0] == "terminate called without an active exception"
    assert tail[-1] == "  launcher traceback line 39"
