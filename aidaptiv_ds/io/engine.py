"""Asynchronous reads and writes of tensor bytes at file offsets, with no compiled extension.

Design (cf. DeepSpeed's ``async_io`` op, ``ops/csrc/aio``, which needs libaio and a JIT build):

* one worker pool per *drive* (a cache path): ``threads_per_drive`` threads calling
  ``os.preadv``/``os.pwritev``, which release the GIL, so transfers run in parallel with training;
* requests are split at ``block_size`` bytes; each chunk is queued by priority, so demand reads
  go before prefetch reads, which go before write-back (``READ_DEMAND < READ_PREFETCH < WRITE_BACK``);
* ``O_DIRECT`` whenever address, offset and length are multiples of the file's alignment (the
  drive's logical block size, at most a page); buffered I/O otherwise, and for the whole file when
  the filesystem refuses ``O_DIRECT`` (one warning naming the path);
* ``EIO``/``EAGAIN``/``EINTR`` are retried ``max_retries`` times with a short back-off, then the
  request fails with a :class:`StorageIOError` naming path, offset and length; ``ENOSPC`` fails at
  once. A future never reports success for bytes that were not transferred.

While a timeline records (:data:`aidaptiv_ds.spans.ACTIVE`), every system call is one span on the
lane ``"io <drive> #<worker>"`` (category ``"read"``/``"write"``) with its bytes, offset, priority and
the seconds its chunk waited in the queue; otherwise the hot path pays one global read per request
and per system call.
"""
from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import os
import queue
import threading
import time
import warnings

import torch

from .. import spans
from ..errors import AidaptivConfigError, AidaptivWarning
from .buffers import PAGE_BYTES, byte_view
from .errors import StorageIOError
from .futures import IOFuture
from .syscalls import SysIO, default_sysio

log = logging.getLogger("aidaptiv_ds")

READ_DEMAND = 0
READ_PREFETCH = 1
WRITE_BACK = 2

_RETRYABLE = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY}
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectIOFallbackWarning(AidaptivWarning):
    """A filesystem refused ``O_DIRECT``; that path now uses buffered I/O."""


@dataclasses.dataclass
class DriveStats:
    """Counters of one drive (cache path), cumulative since the engine started.

    Bytes are what the system calls transferred (including alignment padding the caller asked for);
    ``*_busy_s`` is the sum over worker threads of seconds spent inside the calls.
    """
    bytes_read: int = 0
    bytes_written: int = 0
    read_ops: int = 0
    write_ops: int = 0
    read_busy_s: float = 0.0
    write_busy_s: float = 0.0
    retries: int = 0

    def snapshot(self) -> DriveStats:
        return dataclasses.replace(self)


class FileHandle:
    """An open file on one drive: an ``O_DIRECT`` descriptor (when allowed) and a buffered one."""

    def __init__(self, engine: IOEngine, path: str, drive: str, alignment: int, create: bool) -> None:
        self.path, self.drive, self.alignment = path, drive, alignment
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.fd_buffered: int | None = engine.sysio.open(path, flags)
        self.fd_direct: int | None = None
        self._retired: list[int] = []
        if engine.direct and _O_DIRECT:
            try:
                self.fd_direct = engine.sysio.open(path, flags | _O_DIRECT)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                engine.warn_fallback(path, f"open(O_DIRECT) failed: {os.strerror(e.errno)}")

    @property
    def direct(self) -> bool:
        return self.fd_direct is not None

    def disable_direct(self) -> None:
        """Use the buffered descriptor from now on (the direct one stays open until :meth:`close`,
        since another worker may be inside a call on it)."""
        if self.fd_direct is not None:
            self._retired.append(self.fd_direct)
            self.fd_direct = None

    def close(self) -> None:
        self.disable_direct()
        for fd in self._retired:
            os.close(fd)
        self._retired = []
        if self.fd_buffered is not None:
            os.close(self.fd_buffered)
            self.fd_buffered = None

    def fileno(self) -> int:
        """The buffered descriptor (for ``fstat``, ``fallocate``, reflinks).

        Raises:
            ValueError: the handle was closed.
        """
        if self.fd_buffered is None:
            raise ValueError(f"aidaptiv_ds: {self.path} is closed")
        return self.fd_buffered

    def sync(self) -> None:
        """``fdatasync`` the file so buffered writes reach the drive."""
        if self.fd_buffered is not None:
            os.fdatasync(self.fd_buffered)


class _Chunk:
    """One system call's worth of a request: a file offset and its (address, memoryview) pieces;
    ``priority`` (raised by :meth:`IOEngine.boost`; ``issued``: the one it was submitted with) and ``queued_at``
    (perf_counter at submission, 0.0 when no timeline records) for the timeline."""
    __slots__ = ("fh", "write", "offset", "segs", "future", "priority", "issued", "queued_at", "order", "index",
                 "taken")

    def __init__(self, fh, write, offset, segs, future, priority=READ_DEMAND, queued_at=0.0, order=0, index=0):
        self.fh, self.write, self.offset, self.segs, self.future = fh, write, offset, segs, future
        self.priority, self.issued, self.queued_at = priority, priority, queued_at
        # the queue's order within a priority: the request's order, then a unique tie-break
        self.order, self.index = order, index
        self.taken = False  # a worker started it (a boosted chunk is queued twice: the second entry is skipped)


def _split(segs: list[tuple[int, memoryview]], block: int) -> list[list[tuple[int, memoryview]]]:
    """Group (address, view) pieces into chunks of at most ``block`` bytes, splitting pieces at block edges."""
    chunks, cur, size = [], [], 0
    for addr, mv in segs:
        pos = 0
        while pos < len(mv):
            take = min(len(mv) - pos, block - size)
            cur.append((addr + pos, mv[pos:pos + take]))
            size += take
            pos += take
            if size == block:
                chunks.append(cur)
                cur, size = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def _advance(segs: list[tuple[int, memoryview]], k: int) -> list[tuple[int, memoryview]]:
    """The pieces left after ``k`` bytes of ``segs`` were transferred."""
    out = []
    for addr, mv in segs:
        if k >= len(mv):
            k -= len(mv)
            continue
        out.append((addr + k, mv[k:]))
        k = 0
    return out


_PRIORITY_NAMES = {READ_DEMAND: "demand", READ_PREFETCH: "prefetch", WRITE_BACK: "write-back"}


def _trace_call(drive: str, c: _Chunk, op: str, k: int, off: int, t0: float, dt: float) -> None:
    """One system call as a timeline span (only called while a timeline records)."""
    worker = threading.current_thread().name.rsplit("-", 1)[-1]
    args = {"drive": drive, "bytes": k, "offset": off, "file": os.path.basename(c.fh.path),
            "priority": _PRIORITY_NAMES.get(c.priority, c.priority)}
    if c.issued != c.priority:  # raised while queued (priority inheritance, a wait on it)
        args["issued"] = _PRIORITY_NAMES.get(c.issued, c.issued)
    if c.queued_at:
        args["queued_s"] = max(t0 - c.queued_at, 0.0)
    spans.complete(op, t0, t0 + dt, f"io {drive} #{worker}", op, **args)


class _Drive:
    def __init__(self, engine: IOEngine, name: str, threads: int) -> None:
        self.name = name
        self.queue: queue.PriorityQueue = queue.PriorityQueue()
        self.stats = DriveStats()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=engine._worker, args=(self,), daemon=True,
                                         name=f"aidaptiv-io-{name}-{i}") for i in range(threads)]
        for t in self.threads:
            t.start()


class IOEngine:
    """Worker pools doing positioned I/O on behalf of the store and the DeepSpeed handle adapter.

    Args:
        block_size: largest single system call in bytes (requests are split at this size).
        threads_per_drive: worker threads per drive; each keeps one request in flight.
        max_retries: extra attempts for ``EIO``/``EAGAIN``/``EINTR`` before a request fails.
        retry_delay_s: seconds to wait before the first retry (doubles each time).
        direct: try ``O_DIRECT``; False forces buffered I/O everywhere.
        sysio: the system-call object (tests pass a :class:`~aidaptiv_ds.io.syscalls.FaultyIO`).
    """

    def __init__(self, block_size: int = 8 << 20, threads_per_drive: int = 4, max_retries: int = 3,
                 retry_delay_s: float = 0.02, direct: bool = True, sysio: SysIO | None = None) -> None:
        if block_size < PAGE_BYTES or block_size % PAGE_BYTES:
            raise AidaptivConfigError(f"aidaptiv.io.block_size: {block_size} must be a positive multiple of "
                                      f"{PAGE_BYTES} bytes")
        if threads_per_drive < 1:
            raise AidaptivConfigError(f"aidaptiv.io.threads_per_drive: {threads_per_drive} must be >= 1")
        self.block_size = int(block_size)
        self.threads_per_drive = int(threads_per_drive)
        self.max_retries = int(max_retries)
        self.retry_delay_s = float(retry_delay_s)
        self.direct = bool(direct)
        self.sysio = sysio or default_sysio()
        self._drives: dict[str, _Drive] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._ties = itertools.count()  # the chunks' tie-break in the queues (next() is atomic in CPython)
        self._warned: set[str] = set()
        self.fallback_paths: dict[str, str] = {}
        #: the first write that failed for good (after the retries): its bytes are not on the drive,
        #: whoever waited for it; the runtime refuses to go on or checkpoint after one
        self.failed_write: BaseException | None = None
        self._closed = False

    # ------------------------------------------------------------------ setup
    def warn_fallback(self, path: str, reason: str) -> None:
        """Record (and warn once per path) that ``path`` uses buffered I/O instead of ``O_DIRECT``."""
        with self._lock:
            first = path not in self._warned
            self._warned.add(path)
            self.fallback_paths[path] = reason
        if first:
            msg = (f"aidaptiv_ds: {path}: the filesystem refuses O_DIRECT ({reason}); using buffered I/O there. "
                   f"Throughput and page-cache use may suffer; put aidaptiv.cache_paths on ext4/xfs on the cache "
                   f"drive for direct I/O.")
            log.warning(msg)
            warnings.warn(msg, DirectIOFallbackWarning, stacklevel=3)

    def _drive(self, name: str) -> _Drive:
        with self._lock:
            d = self._drives.get(name)
            if d is None:
                if self._closed:
                    raise RuntimeError("aidaptiv_ds: I/O engine is closed")
                d = self._drives[name] = _Drive(self, name, self.threads_per_drive)
            return d

    def open(self, path: str, drive: str | None = None, create: bool = True, alignment: int = PAGE_BYTES
             ) -> FileHandle:
        """Open ``path`` for positioned I/O on the worker pool of ``drive`` (default: the file's directory)."""
        drive = drive or os.path.dirname(os.path.abspath(path))
        self._drive(drive)
        return FileHandle(self, path, drive, alignment, create)

    # ------------------------------------------------------------------ requests
    def read(self, fh: FileHandle, offset: int, buf: torch.Tensor, priority: int = READ_DEMAND) -> IOFuture:
        """Read ``buf.nbytes`` bytes at ``offset`` of ``fh`` into contiguous CPU tensor ``buf``."""
        return self.submit(fh, False, offset, [buf], priority)

    def write(self, fh: FileHandle, offset: int, buf: torch.Tensor, priority: int = WRITE_BACK) -> IOFuture:
        """Write the bytes of contiguous CPU tensor ``buf`` at ``offset`` of ``fh``.

        The caller must not modify ``buf`` until the returned future completes.
        """
        return self.submit(fh, True, offset, [buf], priority)

    def next_order(self) -> int:
        """A place in the queues' order (requests of one priority are served in this order): reserve it
        when a request is decided but submitted later, so it keeps its place (see :meth:`submit`)."""
        with self._lock:
            self._seq += 1
            return self._seq

    def submit(self, fh: FileHandle, write: bool, offset: int, bufs: list[torch.Tensor],
               priority: int = READ_DEMAND, order: int | None = None, chunks_out: list | None = None) -> IOFuture:
        """Vectored request: the file range ``[offset, offset + total bytes)`` to or from ``bufs`` in order.

        One sequential transfer per ``block_size`` bytes (``preadv``/``pwritev`` with one iovec per
        buffer piece), so a stripe's units scattered over a host buffer are still one request.
        Each buffer must be a contiguous CPU tensor left untouched until the future completes.

        Args:
            order: the request's place among requests of its priority (:meth:`next_order`); default: now.
            chunks_out: a list the request's queued chunks are appended to, for :meth:`boost`.
        """
        segs = []
        for b in bufs:
            if b.device.type != "cpu":
                raise ValueError(f"aidaptiv_ds I/O buffers must be CPU tensors, got {b.device}")
            raw = byte_view(b)
            if raw.numel():
                segs.append((raw.data_ptr(), raw.numpy().data))
        nbytes = sum(len(mv) for _, mv in segs)
        chunks = _split(segs, self.block_size)
        fut = IOFuture(nbytes, len(chunks), keepalive=bufs)
        drive = self._drive(fh.drive)
        if order is None:
            order = self.next_order()
        pos = offset
        queued_at = time.perf_counter() if spans.ACTIVE is not None else 0.0
        for piece in chunks:
            # unique tie-break after (priority, order): one store request may be several engine requests
            c = _Chunk(fh, write, pos, piece, fut, priority, queued_at, order, next(self._ties))
            if chunks_out is not None:
                chunks_out.append(c)
            drive.queue.put((priority, order, c.index, c))
            pos += sum(len(mv) for _, mv in piece)
        return fut

    def boost(self, chunks: list, priority: int) -> int:
        """Serve the not yet started ``chunks`` (from :meth:`submit`'s ``chunks_out``) at ``priority``
        when that is more urgent than theirs; returns how many were re-queued.

        [Note: priority inheritance] A demand or prefetch read of bytes that a write-back is still writing
        must wait for that write (the store orders them), but the write-back is queued behind every read:
        at a step's start the next forward's first read waited for its sub-group's write-back while that
        write waited behind the read-ahead of later blocks (148M fp32, budget 0: 0.32 s before the first
        block, timeline). The store boosts the write to the waiting read's priority instead, and a read
        issued as a prefetch becomes a demand read when someone blocks on it (``IOFuture.wait``).
        """
        moved = 0
        for c in chunks:
            drive = self._drives.get(c.fh.drive)
            if drive is None:
                continue
            with drive.lock:
                if c.taken or priority >= c.priority:
                    continue
                c.priority = priority
                drive.queue.put((priority, c.order, c.index, c))
            moved += 1
        return moved

    # ------------------------------------------------------------------ workers
    def _worker(self, drive: _Drive) -> None:
        while True:
            *_, chunk = drive.queue.get()
            if chunk is None:
                return
            with drive.lock:
                if chunk.taken:  # queued again by boost(): this entry is the stale one
                    continue
                chunk.taken = True
            try:
                self._run(drive, chunk)
                chunk.future._chunk_done()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                if chunk.write:
                    with self._lock:
                        self.failed_write = self.failed_write or e
                chunk.future._chunk_done(e)
            # [Note: a boosted chunk's stale entry] its memoryviews pin the whole host buffer, and a chunk
            # boost() re-queued is in the queue twice: the stale entry, at the old priority, is popped only
            # when the queue gets down to that priority (a write-back behind every read). Drop the views
            # now, not when the stale entry or the drive's next request comes by.
            chunk.segs = ()
            chunk = None

    def _run(self, drive: _Drive, c: _Chunk) -> None:
        segs = c.segs
        n = sum(len(mv) for _, mv in segs)
        done = 0
        attempts = 0
        op = "write" if c.write else "read"
        fh = c.fh
        while done < n:
            a = fh.alignment
            off = c.offset + done
            use_direct = (fh.fd_direct is not None and off % a == 0
                          and all(addr % a == 0 and len(mv) % a == 0 for addr, mv in segs))
            fd = fh.fd_direct if use_direct else fh.fd_buffered
            if fd is None:
                raise StorageIOError(op, fh.path, off, n - done, errno.EBADF,
                                     detail="the file was closed while this request was queued")
            t0 = time.perf_counter()
            try:
                if c.write:
                    k = self.sysio.pwritev(fd, [mv for _, mv in segs], off, fh.path)
                else:
                    k = self.sysio.preadv(fd, [mv for _, mv in segs], off, fh.path)
            except OSError as e:
                if use_direct and e.errno == errno.EINVAL:
                    self.warn_fallback(fh.path, f"{op} with O_DIRECT failed: {os.strerror(e.errno)}")
                    fh.disable_direct()
                    continue
                attempts += 1
                if e.errno in _RETRYABLE and attempts <= self.max_retries:
                    with drive.lock:
                        drive.stats.retries += 1
                    time.sleep(self.retry_delay_s * (2 ** (attempts - 1)))
                    continue
                raise StorageIOError(op, fh.path, off, n - done, e.errno, attempts=attempts) from e
            dt = time.perf_counter() - t0
            with drive.lock:
                if c.write:
                    drive.stats.bytes_written += k
                    drive.stats.write_ops += 1
                    drive.stats.write_busy_s += dt
                else:
                    drive.stats.bytes_read += k
                    drive.stats.read_ops += 1
                    drive.stats.read_busy_s += dt
            if spans.ACTIVE is not None:
                _trace_call(drive.name, c, op, k, off, t0, dt)
            if k <= 0:
                raise StorageIOError(op, fh.path, off, n - done, None,
                                     detail="end of file reached" if not c.write else "no bytes accepted")
            done += k
            segs = _advance(segs, k)

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, DriveStats]:
        """A snapshot of per-drive counters, keyed by drive name."""
        with self._lock:
            drives = list(self._drives.values())
        out = {}
        for d in drives:
            with d.lock:
                out[d.name] = d.stats.snapshot()
        return out

    def totals(self) -> DriveStats:
        """Counters summed over all drives."""
        t = DriveStats()
        for s in self.stats().values():
            for f in dataclasses.fields(DriveStats):
                setattr(t, f.name, getattr(t, f.name) + getattr(s, f.name))
        return t

    def close(self) -> None:
        """Stop the worker threads once queued requests are done."""
        with self._lock:
            self._closed = True
            drives = list(self._drives.values())
            self._drives = {}
        for d in drives:
            for _ in d.threads:
                d.queue.put((1 << 30, 1 << 62, 0, None))
        for d in drives:
            for t in d.threads:
                t.join()


_DEFAULT: IOEngine | None = None
_DEFAULT_LOCK = threading.Lock()


def default_engine() -> IOEngine:
    """The process-wide engine used when a caller does not bring its own."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = IOEngine()
        return _DEFAULT
