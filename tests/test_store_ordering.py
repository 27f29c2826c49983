"""Request ordering in the store: a read never returns bytes older than a write issued before it,
and overlapping writes land in issue order (what the swappers rely on for async write-back)."""
from __future__ import annotations

import time

import torch

from aidaptiv_ds.io.buffers import alloc_aligned
from aidaptiv_ds.io.engine import IOEngine
from aidaptiv_ds.io.syscalls import SysIO
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore


class SlowWrites(SysIO):
    """Writes take ``delay`` seconds (a slow drive), reads are immediate."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def pwritev(self, fd, bufs, offset, path):
        time.sleep(self.delay)
        return super().pwritev(fd, bufs, offset, path)


def store(tmp_path, delay=0.3):
    return SlabStore(Namespace([str(tmp_path)], "order", 0), [PathSpec(str(tmp_path), capacity=64 << 20)],
                     engine=IOEngine(sysio=SlowWrites(delay), threads_per_drive=4))


def test_read_after_write_sees_the_write(tmp_path):
    st = store(tmp_path)
    st.allocate("x", 1 << 20)
    old, new = alloc_aligned(1 << 20), alloc_aligned(1 << 20)
    old.fill_(1)
    new.fill_(2)
    st.write("x", old).wait()
    w = st.write("x", new)  # still sleeping in the drive
    out = alloc_aligned(1 << 20)
    t0 = time.perf_counter()
    r = st.read("x", out)  # queued behind the write, without blocking the caller
    assert time.perf_counter() - t0 < 0.1 and not r.done()
    r.wait()  # must not overtake the write
    assert w.done() and torch.equal(out, new)
    st.close()


def test_overlapping_writes_land_in_issue_order(tmp_path):
    st = store(tmp_path, delay=0.05)
    st.allocate("y", 8 << 20)
    bufs = []
    for v in range(1, 9):  # eight overlapping writes of the same range, issued back to back
        b = alloc_aligned(8 << 20)
        b.fill_(v)
        bufs.append(st.write("y", b))
    out = alloc_aligned(8 << 20)
    st.read("y", out).wait()
    assert torch.all(out == 8)
    st.close()


def test_disjoint_requests_do_not_wait_for_each_other(tmp_path):
    st = store(tmp_path, delay=0.5)
    st.allocate("a", 1 << 20)
    st.allocate("b", 1 << 20)
    w = st.write("a", alloc_aligned(1 << 20))
    t0 = time.perf_counter()
    st.read("b", alloc_aligned(1 << 20)).wait()
    assert time.perf_counter() - t0 < 0.4 and not w.done()
    w.wait()
    st.close()
