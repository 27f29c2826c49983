"""Request ordering in the store: a read never returns bytes older than a write issued before it,
and overlapping writes land in issue order (what the swappers rely on for async write-back).

Checked by event order, not by the clock: the drive below (:class:`GatedIO`) holds every write until
the test opens a gate, and logs each system call as it starts and ends.
"""
from __future__ import annotations

import threading

import torch

from aidaptiv_ds.io.buffers import alloc_aligned
from aidaptiv_ds.io.engine import IOEngine
from aidaptiv_ds.io.syscalls import SysIO
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore

#: longest a test waits for the gate before opening it itself (a store that blocked its caller would
#: otherwise hang the test; the event log then shows the wrong order and the test fails)
FALLBACK_S = 30.0


class GatedIO(SysIO):
    """Writes wait for :attr:`gate`; every call is logged as ``(event, op, offset, first byte)``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.log: list = []
        self._lock = threading.Lock()

    def note(self, *event) -> None:
        with self._lock:
            self.log.append(event)

    def open_gate(self) -> None:
        self.note("gate opened")
        self.gate.set()

    def pwritev(self, fd, bufs, offset, path):
        self.gate.wait(FALLBACK_S)
        n = super().pwritev(fd, bufs, offset, path)
        self.note("write done", offset, bytes(bufs[0][:1])[0])
        return n

    def preadv(self, fd, bufs, offset, path):
        self.note("read start", offset)
        n = super().preadv(fd, bufs, offset, path)
        self.note("read done", offset)
        return n

    def index(self, *event) -> int:
        return self.log.index(event)


def store(tmp_path, io: GatedIO):
    return SlabStore(Namespace([str(tmp_path)], "order", 0), [PathSpec(str(tmp_path), capacity=64 << 20)],
                     engine=IOEngine(sysio=io, threads_per_drive=4))


def test_read_after_write_sees_the_write(tmp_path):
    io = GatedIO()
    st = store(tmp_path, io)
    try:
        st.allocate("x", 1 << 20)
        old, new = alloc_aligned(1 << 20), alloc_aligned(1 << 20)
        old.fill_(1)
        new.fill_(2)
        io.gate.set()
        st.write("x", old).wait()
        io.gate.clear()
        io.log.clear()
        w = st.write("x", new)  # held in the drive
        out = alloc_aligned(1 << 20)
        r = st.read("x", out)  # queued behind the write, without blocking the caller
        io.note("read issued")
        assert not r.done() and not w.done()
        io.open_gate()
        r.wait()  # must not overtake the write
        assert w.done() and torch.equal(out, new)
        events = [e[0] for e in io.log]
        assert events.index("read issued") < events.index("gate opened"), io.log  # the caller did not block
        assert events.index("write done") < events.index("read start"), io.log  # the read waited for the write
    finally:
        io.gate.set()
        st.close()


def test_overlapping_writes_land_in_issue_order(tmp_path):
    io = GatedIO()
    st = store(tmp_path, io)
    try:
        st.allocate("y", 8 << 20)
        futs = []
        for v in range(1, 9):  # eight overlapping writes of the same range, issued back to back, all held
            b = alloc_aligned(8 << 20)
            b.fill_(v)
            futs.append(st.write("y", b))
        io.open_gate()
        out = alloc_aligned(8 << 20)
        st.read("y", out).wait()
        assert all(f.done() for f in futs) and torch.all(out == 8)
        landed = [e[2] for e in io.log if e[0] == "write done"]
        assert landed[0] == 1 and landed == sorted(landed) and set(landed) == set(range(1, 9)), landed
    finally:
        io.gate.set()
        st.close()


def test_disjoint_requests_do_not_wait_for_each_other(tmp_path):
    io = GatedIO()
    st = store(tmp_path, io)
    try:
        st.allocate("a", 1 << 20)
        st.allocate("b", 1 << 20)
        w = st.write("a", alloc_aligned(1 << 20))  # held in the drive
        st.read("b", alloc_aligned(1 << 20)).wait()
        io.note("read b returned")
        assert not w.done()
        io.open_gate()
        w.wait()
        events = [e[0] for e in io.log]
        assert events.index("read b returned") < events.index("gate opened") < events.index("write done"), io.log
    finally:
        io.gate.set()
        st.close()
