"""IOEngine: round trips (4 dtypes, 1 element .. MiBs, odd sizes and offsets, direct and buffered),
many requests in flight, chunking, short transfers, priorities, end of file, close, futures."""
from __future__ import annotations

import errno
import os
import sys
import threading
import time

import pytest
import torch

from _storage_helpers import DTYPES, rand_tensor, same_bytes
from aidaptiv_ds.io import (READ_DEMAND, READ_PREFETCH, WRITE_BACK, IOEngine, StorageIOError, alloc_aligned,
                            combine, default_engine, wait_all)
from aidaptiv_ds.io.buffers import PAGE_BYTES, byte_view
from aidaptiv_ds.io.futures import IOFuture
from aidaptiv_ds.io.syscalls import SysIO

SIZES = [1, 3, 1023, 4097, (1 << 20) + 7, 3 * (1 << 20) + 5]


class RecordingIO(SysIO):
    """Real system calls, recording (op, direct?, offset, nbytes) of each."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int]] = []
        self._lock = threading.Lock()

    def _rec(self, op, fd, offset, bufs):
        with self._lock:
            self.calls.append((op, fd, offset, sum(len(b) for b in bufs)))

    def preadv(self, fd, bufs, offset, path):
        self._rec("read", fd, offset, bufs)
        return super().preadv(fd, bufs, offset, path)

    def pwritev(self, fd, bufs, offset, path):
        self._rec("write", fd, offset, bufs)
        return super().pwritev(fd, bufs, offset, path)


@pytest.fixture
def engine():
    eng = IOEngine(threads_per_drive=4)
    yield eng
    eng.close()


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    out = alloc_aligned(t.numel() * t.element_size(), dtype=t.dtype)[: t.numel()]
    out.copy_(t)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
def test_round_trip_dtypes_and_odd_sizes(tmp_path, engine, dtype, numel):
    fh = engine.open(str(tmp_path / "f.bin"))
    try:
        src = rand_tensor(numel, dtype, seed=numel)
        # page-aligned buffer at an aligned offset (direct I/O), torch buffer at an odd offset (buffered)
        engine.write(fh, 0, _aligned_copy(src)).wait()
        engine.write(fh, (32 << 20) + 1234, src).wait()
        a = torch.empty_like(src)
        b = alloc_aligned(src.numel() * src.element_size(), dtype=dtype)[: src.numel()]
        assert engine.read(fh, (32 << 20) + 1234, a).wait() == src.numel() * src.element_size()
        engine.read(fh, 0, b).wait()
        assert same_bytes(a, src) and same_bytes(b, src)
    finally:
        fh.close()


def test_direct_io_used_when_aligned_and_buffered_otherwise(tmp_path):
    rec = RecordingIO()
    eng = IOEngine(sysio=rec, block_size=1 << 20)
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        assert fh.direct, "the filesystem under tmp_path refused O_DIRECT"
        buf = alloc_aligned(2 << 20)
        buf.copy_(rand_tensor(2 << 20, torch.uint8))
        eng.write(fh, 0, buf).wait()
        eng.read(fh, 4096, buf[: 1 << 20]).wait()
        eng.read(fh, 100, buf[: 1 << 20]).wait()            # unaligned offset
        eng.read(fh, 0, buf[1:4097]).wait()                  # unaligned address
        fds = [fd for _, fd, _, _ in rec.calls]
        assert fds[:3] == [fh.fd_direct] * 3                 # 2 write chunks + 1 read
        assert fds[3:] == [fh.fd_buffered] * 2
        fh.close()
    finally:
        eng.close()


def test_many_requests_in_flight(tmp_path, engine):
    fh = engine.open(str(tmp_path / "f.bin"))
    sizes = [(i * 7919) % (300 << 10) + 1 + i for i in range(64)]
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += n + (pos % 3) * 512
    src = [rand_tensor(n, torch.uint8, seed=i) for i, n in enumerate(sizes)]
    futs = [engine.write(fh, o, t) for o, t in zip(offs, src)]
    assert wait_all(futs) == sum(sizes)
    outs = [torch.empty_like(t) for t in src]
    futs = [engine.read(fh, o, t) for o, t in zip(offs, outs)]
    wait_all(futs)
    assert all(same_bytes(a, b) for a, b in zip(outs, src))
    fh.close()


def test_vectored_submit_and_chunking(tmp_path):
    rec = RecordingIO()
    eng = IOEngine(sysio=rec, block_size=64 << 10)
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        parts = [rand_tensor(5000, torch.uint8, 1), rand_tensor(3, torch.uint8, 2),
                 rand_tensor(300_001, torch.uint8, 3)]
        total = sum(p.numel() for p in parts)
        eng.submit(fh, True, 777, parts, WRITE_BACK).wait()
        sizes = [n for op, _, _, n in rec.calls if op == "write"]
        assert sum(sizes) == total and max(sizes) <= 64 << 10 and len(sizes) == -(-total // (64 << 10))
        out = torch.empty(total, dtype=torch.uint8)
        eng.read(fh, 777, out).wait()
        assert same_bytes(out, torch.cat(parts))
        fh.close()
    finally:
        eng.close()


class ShortIO(SysIO):
    """Transfers at most ``limit`` bytes per call (like a signal-interrupted or device-limited call)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls = 0

    @staticmethod
    def _cut(bufs, limit):
        out, left = [], limit
        for b in bufs:
            if left <= 0:
                break
            out.append(b[:left])
            left -= len(out[-1])
        return out

    def preadv(self, fd, bufs, offset, path):
        self.calls += 1
        return super().preadv(fd, self._cut(bufs, self.limit), offset, path)

    def pwritev(self, fd, bufs, offset, path):
        self.calls += 1
        return super().pwritev(fd, self._cut(bufs, self.limit), offset, path)


@pytest.mark.parametrize("direct,limit", [(True, 64 << 10), (False, 12345)])
def test_short_transfers_are_continued(tmp_path, direct, limit):
    sysio = ShortIO(limit)
    eng = IOEngine(sysio=sysio, direct=direct, block_size=1 << 20)
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        src = _aligned_copy(rand_tensor(3 << 20, torch.uint8))
        eng.submit(fh, True, 0, [src[:1 << 20], src[1 << 20:]], WRITE_BACK).wait()
        out = alloc_aligned(3 << 20)
        eng.read(fh, 0, out).wait()
        assert same_bytes(out, src)
        assert sysio.calls >= 2 * -(-(3 << 20) // limit)
        assert os.path.getsize(fh.path) == 3 << 20
        fh.close()
    finally:
        eng.close()


def test_read_past_end_of_file_fails_with_path_and_offset(tmp_path, engine):
    p = str(tmp_path / "short.bin")
    with open(p, "wb") as f:
        f.write(b"x" * 10000)
    fh = engine.open(p, create=False)
    buf = alloc_aligned(16384)
    with pytest.raises(StorageIOError) as ei:
        engine.read(fh, 0, buf).wait()
    e = ei.value
    assert e.path == p and e.offset == 10000 and e.nbytes == 16384 - 10000
    assert p in str(e) and "offset 10000" in str(e)
    fh.close()


class GateIO(SysIO):
    """The first call blocks until ``release`` is set; every call is recorded in order."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.order: list[tuple[str, int]] = []

    def _gate(self, op, offset):
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10)
        self.order.append((op, offset))

    def preadv(self, fd, bufs, offset, path):
        self._gate("read", offset)
        return super().preadv(fd, bufs, offset, path)

    def pwritev(self, fd, bufs, offset, path):
        self._gate("write", offset)
        return super().pwritev(fd, bufs, offset, path)


def test_priorities_demand_before_prefetch_before_write_back(tmp_path):
    gate = GateIO()
    eng = IOEngine(sysio=gate, threads_per_drive=1, block_size=4096)
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        buf = alloc_aligned(8 * 4096, zero=True)
        first = eng.write(fh, 0, buf[:4096])               # occupies the only worker
        assert gate.entered.wait(5)
        futs = [eng.write(fh, 4096, buf[:8192], WRITE_BACK),       # 2 chunks
                eng.read(fh, 0, buf[8192:12288], READ_PREFETCH),
                eng.read(fh, 0, buf[12288:16384], READ_DEMAND),
                eng.read(fh, 0, buf[16384:20480], READ_PREFETCH)]
        gate.release.set()
        wait_all([first] + futs)
        assert [op for op, _ in gate.order] == ["write", "read", "read", "read", "write", "write"]
        assert gate.order[4:] == [("write", 4096), ("write", 8192)]   # FIFO within a priority
        fh.close()
    finally:
        gate.release.set()
        eng.close()


class SlowIO(SysIO):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def pwritev(self, fd, bufs, offset, path):
        time.sleep(self.delay)
        return super().pwritev(fd, bufs, offset, path)


def test_close_finishes_queued_requests_then_refuses_new_ones(tmp_path):
    eng = IOEngine(sysio=SlowIO(0.02), threads_per_drive=2)
    fh = eng.open(str(tmp_path / "f.bin"))
    src = rand_tensor(8 * 4096, torch.uint8)
    futs = [eng.write(fh, i * 4096, src[i * 4096:(i + 1) * 4096]) for i in range(8)]
    eng.close()
    assert all(f.done() for f in futs) and wait_all(futs) == 8 * 4096
    with pytest.raises(RuntimeError, match="closed"):
        eng.open(str(tmp_path / "g.bin"))
    with open(fh.path, "rb") as f:
        assert f.read() == src.numpy().tobytes()
    fh.close()


def test_closing_a_file_under_queued_requests_fails_them_clearly(tmp_path):
    """Requests still queued when their file is closed fail with EBADF naming the path (never success,
    never a bare TypeError from a None descriptor)."""
    gate = GateIO()
    eng = IOEngine(sysio=gate, threads_per_drive=1)
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        buf = alloc_aligned(4 * 4096)
        futs = [eng.write(fh, i * 4096, buf[i * 4096:(i + 1) * 4096]) for i in range(4)]
        assert gate.entered.wait(5)
        fh.close()
        gate.release.set()
        for f in futs:
            with pytest.raises(StorageIOError) as ei:
                f.wait(5)
            assert ei.value.errno == errno.EBADF and ei.value.path == fh.path
    finally:
        gate.release.set()
        eng.close()


def test_stats_count_bytes_per_drive(tmp_path, engine):
    d1, d2 = tmp_path / "a", tmp_path / "b"
    d1.mkdir(), d2.mkdir()
    f1, f2 = engine.open(str(d1 / "x")), engine.open(str(d2 / "y"))
    engine.write(f1, 0, alloc_aligned(1 << 20)).wait()
    engine.write(f2, 0, alloc_aligned(3 << 20)).wait()
    engine.read(f2, 0, alloc_aligned(2 << 20)).wait()
    s = engine.stats()
    assert s[str(d1)].bytes_written == 1 << 20 and s[str(d2)].bytes_written == 3 << 20
    assert s[str(d2)].bytes_read == 2 << 20 and s[str(d1)].bytes_read == 0
    assert engine.totals().bytes_written == 4 << 20
    f1.close(), f2.close()


def test_rejects_bad_arguments(tmp_path, engine):
    with pytest.raises(ValueError):
        IOEngine(block_size=1000)
    with pytest.raises(ValueError):
        IOEngine(threads_per_drive=0)
    fh = engine.open(str(tmp_path / "f"))
    with pytest.raises(ValueError, match="contiguous"):
        engine.write(fh, 0, torch.zeros(4, 4).t())
    fh.close()


def test_default_engine_is_one_per_process():
    assert default_engine() is default_engine()


def test_alloc_aligned_is_page_aligned_for_every_dtype():
    for dt in DTYPES:
        t = alloc_aligned(12345, dtype=dt)
        assert t.data_ptr() % PAGE_BYTES == 0 and t.dtype == dt
        assert t.numel() * t.element_size() >= 12345 and t.numel() * t.element_size() % PAGE_BYTES == 0
        assert byte_view(t).numel() == t.numel() * t.element_size()


# ---------------------------------------------------------------------------- futures
class _RacyEvent(threading.Event):
    """``is_set()`` answers from before a concurrent completion (a worker that already counted the last
    chunk and is inside ``_finish``) that runs to its end in between: the interleaving that loses a
    callback when completion does not synchronise with registration."""

    def __init__(self, fut: IOFuture) -> None:
        super().__init__()
        self.fut, self.armed = fut, True

    def is_set(self) -> bool:
        was = super().is_set()
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            t = threading.Thread(target=self.fut._finish)
            t.start()
            t.join(0.3)  # a fixed future blocks on its lock here; a racy one finishes first
        return was


def test_done_callback_registered_during_completion_is_not_lost():
    fut = IOFuture(10, 1)
    fut._event = _RacyEvent(fut)
    called = []
    fut.add_done_callback(lambda f: called.append(f))
    assert fut.wait(2) == 10
    for _ in range(100):
        if called:
            break
        time.sleep(0.01)
    assert called == [fut], "a completion callback was lost (combined futures would hang)"


def test_combine_first_error_wins_and_skips_finalizer():
    ok, bad = IOFuture(4, 1), IOFuture(4, 1)
    ran = []
    c = combine([ok, bad], 8, finalizer=lambda: ran.append(1))
    ok._chunk_done()
    assert not c.done()
    bad._chunk_done(StorageIOError("write", "/x", 4096, 4, 5))
    with pytest.raises(StorageIOError, match="/x"):
        c.wait(1)
    assert ran == []
    c2 = combine([], 0, finalizer=lambda: (_ for _ in ()).throw(ValueError("bad crc")))
    with pytest.raises(ValueError, match="bad crc"):
        c2.wait(1)


def test_wait_all_drains_everything_before_raising():
    a, b, c = IOFuture(1, 1), IOFuture(1, 1), IOFuture(1, 1)
    a._chunk_done(StorageIOError("read", "/p", 0, 1, 5))
    b._chunk_done()
    threading.Timer(0.1, c._chunk_done).start()
    with pytest.raises(StorageIOError):
        wait_all([a, b, c])
    assert c.done()
    with pytest.raises(TimeoutError):
        IOFuture(1, 1).wait(0.01)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_finished_request_lets_go_of_its_buffer(tmp_path, engine):
    """Once a request completes (and its future is gone) the engine holds no reference to the buffer: a
    worker's last chunk used to pin it (its memoryviews) until that drive's next request, so a dropped
    host slice, e.g. a 0.4 GB optimizer sub-group after its write-back, stayed in memory until then."""
    def refs(t: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    fh = engine.open(str(tmp_path / "f.bin"))
    try:
        for op in ("write", "read"):
            buf = alloc_aligned(1 << 20)
            before = refs(buf)
            getattr(engine, op)(fh, 0, buf).wait()
            deadline = time.monotonic() + 5
            while refs(buf) != before and time.monotonic() < deadline:  # the worker returns to its queue
                time.sleep(0.01)
            assert refs(buf) == before, op
    finally:
        fh.close()


class OffsetGateIO(SysIO):
    """Blocks the first call at each offset of ``gates`` until its event is set (``entered[offset]`` is set
    when a worker gets there)."""

    def __init__(self, offsets) -> None:
        self.release = {o: threading.Event() for o in offsets}
        self.entered = {o: threading.Event() for o in offsets}

    def _gate(self, offset):
        ev = self.release.get(offset)
        if ev is not None and not self.entered[offset].is_set():
            self.entered[offset].set()
            assert ev.wait(10)

    def preadv(self, fd, bufs, offset, path):
        self._gate(offset)
        return super().preadv(fd, bufs, offset, path)

    def pwritev(self, fd, bufs, offset, path):
        self._gate(offset)
        return super().pwritev(fd, bufs, offset, path)


def test_a_boosted_request_lets_go_of_its_buffer_before_its_stale_entry_comes_by(tmp_path):
    """A boosted chunk is queued twice; the stale entry at the old priority (a write-back's: behind every
    read) used to pin the buffer through the chunk's memoryviews until a worker popped it, so an optimizer
    sub-group whose write-back someone had waited for stayed in host memory after the write and after the
    DRAM tier dropped it (640M fp32 Llama at budget 0: 0.3-0.9 GiB of swap buffers beside the tier's own,
    [Note: a boosted chunk's stale entry] in io/engine.py)."""
    def refs(t: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    gate = OffsetGateIO([0, 3 * 4096])
    eng = IOEngine(sysio=gate, threads_per_drive=1, block_size=4096)
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        first = eng.write(fh, 0, alloc_aligned(4096, zero=True))           # occupies the only worker
        assert gate.entered[0].wait(5)
        buf = alloc_aligned(4096, zero=True)
        before = refs(buf)
        chunks: list = []
        w = eng.submit(fh, True, 4096, [buf], WRITE_BACK, chunks_out=chunks)
        assert eng.boost(chunks, READ_DEMAND) == 1                          # its stale entry stays at WRITE_BACK
        later = eng.write(fh, 3 * 4096, alloc_aligned(4096, zero=True), READ_DEMAND)  # holds the worker next
        del chunks
        gate.release[0].set()
        w.wait()
        assert gate.entered[3 * 4096].wait(5)                               # the stale entry is still queued
        del w
        deadline = time.monotonic() + 5
        while refs(buf) != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refs(buf) == before
        gate.release[3 * 4096].set()
        wait_all([first, later])
        fh.close()
    finally:
        for ev in gate.release.values():
            ev.set()
        eng.close()


def test_a_callback_added_while_earlier_ones_run_waits_its_turn():
    """[Note: callbacks before waiters]: the store adds its byte counter to an engine request, then (holding its
    lock) the combining future's callback. When the request finished in between and the counter waited for the
    store's lock, the late callback ran at once on the adder's thread: the combined request completed and its
    waiters woke before the count (test_param_swapper_unit saw 4096 > 4096 in the full suite). The late callback
    must run after the earlier one, on the finishing thread, and the waiters after both."""
    from aidaptiv_ds.io.futures import IOFuture
    f = IOFuture(10, 1)
    order, inside, gate = [], threading.Event(), threading.Event()

    def counter(fut):
        inside.set()
        gate.wait(30)  # the store's lock, held by the thread that adds the next callback
        order.append("counter")
    f.add_done_callback(counter)
    c = threading.Thread(target=f._chunk_done)
    c.start()
    assert inside.wait(30)  # the request is complete and its first callback is running
    f.add_done_callback(lambda fut: order.append("combine"))
    assert order == [] and not f.done()  # queued behind the counter, not run here
    gate.set()
    c.join(30)
    assert order == ["counter", "combine"] and f.done()
    f.add_done_callback(lambda fut: order.append("late"))  # once every callback ran: at once, on this thread
    assert order[-1] == "late"


def test_every_callback_runs_when_one_raises(caplog):
    """A callback that raises does not strand the others (a combined request waits on one of them) nor the
    waiters, nor change the request's outcome; its error is logged."""
    from aidaptiv_ds.io.futures import IOFuture, combine
    f = IOFuture(10, 1)
    seen = []

    def bad(fut):
        raise ValueError("a callback's bug")
    f.add_done_callback(bad)
    both = combine([f], 10)
    f.add_done_callback(lambda fut: seen.append("after"))
    with caplog.at_level("ERROR", logger="aidaptiv_ds.io.futures"):
        f._chunk_done()
    assert f.done() and both.done() and seen == ["after"] and f.wait() == 10 and both.wait() == 10
    assert f.exception() is None and "a callback's bug" in caplog.text


def test_a_waiter_wakes_after_the_requests_callbacks_ran():
    """[Note: callbacks before waiters] (io/futures.py): a callback's bookkeeping (the store's byte counters,
    the in-flight set) is done when ``wait`` returns, and a callback of a failed request sees its error. The
    callback is held until the waiter had time to (wrongly) wake; the waiter must come after it."""
    from aidaptiv_ds.io.futures import IOFuture
    f = IOFuture(10, 1)
    order, gate, done = [], threading.Event(), threading.Event()

    def callback(fut):
        gate.wait(30)
        order.append(("callback", type(fut.exception()).__name__))
    f.add_done_callback(callback)

    def waiter():
        with pytest.raises(RuntimeError):
            f.wait()
        order.append(("waiter", ""))
        done.set()
    w = threading.Thread(target=waiter)
    w.start()
    c = threading.Thread(target=f._chunk_done, args=(RuntimeError("chunk failed"),))
    c.start()
    assert not done.wait(0.5)  # still asleep while the callback runs (a busy machine can only hide a fault)
    gate.set()
    c.join(30)
    w.join(30)
    assert order == [("callback", "RuntimeError"), ("waiter", "")]
    late = []
    f.add_done_callback(lambda fut: late.append(fut.exception()))  # after completion: at once, with the error
    assert len(late) == 1 and isinstance(late[0], RuntimeError)
