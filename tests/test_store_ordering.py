"""Request ordering in the store: a read never returns bytes older than a write issued before it,
and overlapping writes land in issue order (what the swappers rely on for async write-back).

Checked by event order, not by the clock: the drive below (:class:`GatedIO`) holds every write until
the test opens a gate, and logs each system call as it starts and ends.
"""
from __future__ import annotations

import threading
import time

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


class SizedGatedIO(GatedIO):
    """:class:`GatedIO` logging ``(op, bytes)`` of every call as it starts; :attr:`started` is set when a
    write has reached the drive (the one worker then holds it until the gate opens)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def pwritev(self, fd, bufs, offset, path):
        self.started.set()  # a worker holds this write now
        self.gate.wait(FALLBACK_S)
        self.note("write", sum(len(b) for b in bufs))
        return SysIO.pwritev(self, fd, bufs, offset, path)

    def preadv(self, fd, bufs, offset, path):
        self.note("read", sum(len(b) for b in bufs))
        return SysIO.preadv(self, fd, bufs, offset, path)


def test_a_write_a_read_waits_for_inherits_the_reads_priority(tmp_path):
    """[Note: priority inheritance] (io/engine.py): a demand read of bytes a write-back is still writing
    waits for that write, so the write is served at the read's priority (before queued prefetch reads),
    and the read then keeps the place it was issued in. One worker, so the queue decides the order."""
    from aidaptiv_ds.io.engine import READ_DEMAND, READ_PREFETCH, WRITE_BACK

    io = SizedGatedIO()
    st = SlabStore(Namespace([str(tmp_path)], "order", 0), [PathSpec(str(tmp_path), capacity=64 << 20)],
                   engine=IOEngine(sysio=io, threads_per_drive=1))
    KiB = 1 << 10
    try:
        for key, n in (("plug", 1024 * KiB), ("b", 256 * KiB), ("c", 512 * KiB)):
            st.allocate(key, n)
        io.gate.set()
        st.write("c", alloc_aligned(512 * KiB)).wait()
        io.gate.clear()
        io.log.clear()
        io.started.clear()
        plug = st.write("plug", alloc_aligned(1024 * KiB), 0, WRITE_BACK)  # holds the one worker
        assert io.started.wait(FALLBACK_S)  # ... once it has reached the drive
        new = alloc_aligned(256 * KiB)
        new.fill_(7)
        w = st.write("b", new, 0, WRITE_BACK)
        prefetch = [st.read("c", alloc_aligned(512 * KiB), 0, READ_PREFETCH) for _ in range(3)]
        out = alloc_aligned(256 * KiB)
        r = st.read("b", out, 0, READ_DEMAND)
        io.open_gate()
        for f in [plug, w, r, *prefetch]:
            f.wait()
        assert torch.equal(out, new)  # still ordered after the write
        calls = [e for e in io.log if e[0] in ("read", "write")]
        assert calls[:3] == [("write", 1024 * KiB), ("write", 256 * KiB), ("read", 256 * KiB)], calls
        assert calls[3:] == [("read", 512 * KiB)] * 3, calls
    finally:
        st.close()


def test_a_prefetch_read_someone_waits_for_becomes_demand(tmp_path):
    """``IOFuture.wait`` expedites what it waits for: a queued prefetch read jumps the other prefetches."""
    from aidaptiv_ds.io.engine import READ_PREFETCH, WRITE_BACK

    io = SizedGatedIO()
    st = SlabStore(Namespace([str(tmp_path)], "order", 0), [PathSpec(str(tmp_path), capacity=64 << 20)],
                   engine=IOEngine(sysio=io, threads_per_drive=1))
    KiB = 1 << 10
    sizes = (128 * KiB, 256 * KiB, 512 * KiB)
    try:
        st.allocate("plug", 1024 * KiB)
        for i, n in enumerate(sizes):
            st.allocate(f"c{i}", n)
        io.gate.set()
        for i, n in enumerate(sizes):
            st.write(f"c{i}", alloc_aligned(n)).wait()
        io.gate.clear()
        io.log.clear()
        io.started.clear()
        plug = st.write("plug", alloc_aligned(1024 * KiB), 0, WRITE_BACK)  # holds the one worker
        assert io.started.wait(FALLBACK_S)  # ... once it has reached the drive
        reads = [st.read(f"c{i}", alloc_aligned(n), 0, READ_PREFETCH) for i, n in enumerate(sizes)]
        waiter = threading.Thread(target=reads[-1].wait)
        waiter.start()
        deadline = time.monotonic() + FALLBACK_S
        while not _queued_at_demand(reads[-1]) and time.monotonic() < deadline:  # wait() expedites, then blocks
            time.sleep(0.001)
        io.open_gate()
        waiter.join(FALLBACK_S)
        for f in [plug, *reads]:
            f.wait()
        calls = [e for e in io.log if e[0] in ("read", "write")]
        assert calls == [("write", 1024 * KiB), ("read", sizes[2]), ("read", sizes[0]), ("read", sizes[1])], calls
    finally:
        st.close()


def _queued_at_demand(fut) -> bool:
    """The store request behind ``fut`` is queued at demand priority (its expedite hook's request)."""
    return fut._expedite.__defaults__[0].priority == 0


def test_wait_expedites_before_blocking():
    from aidaptiv_ds.io.futures import DEMAND, IOFuture

    f = IOFuture(1, 1)
    seen = []
    f._expedite = lambda p: (seen.append(p), f._chunk_done())
    f.wait()
    assert seen == [DEMAND]
    f.wait()  # done: no second call
    assert seen == [DEMAND]
