"""The slab store: named extents in one logical space, striped over the slabs of N cache paths.

* **Extents.** ``allocate(key, nbytes)`` gives an aligned range of the logical space; the same key
  always maps to the same range (stable placement: rewriting a key overwrites its bytes in place),
  ``free(key)`` returns it for reuse.
* **Placement.** ``"striped"``: one weighted RAID-0 segment over all paths (see
  :mod:`~aidaptiv_ds.store.striping`), so large transfers use every drive and bytes per path follow
  the weights. ``"affinity"``: segment 0 is the rank's primary path alone, segment 1 the other
  paths striped; allocation fills segment 0 first and spills only when it is full.
* **Space.** Each path's capacity is its configured limit or its free space at open minus a
  reserve. :meth:`preflight` refuses a plan that does not fit, naming the path, the bytes needed
  and the bytes free, before anything is written; slabs grow with ``fallocate``.
* **Order.** A request overlapping earlier in-flight writes (a write: also reads) is submitted when
  they complete (chained, the caller does not block): a read never returns bytes older than a
  write issued before it, nor bytes of a write issued after it; overlapping writes land in order.
* **Integrity.** Optional CRC32 of every ``alignment``-sized block (4 KiB) of logical space, recorded
  when a write is submitted and verified when a read completes. Every request is block-aligned, so
  every block a request touches is covered entirely: every byte read is verified, an extent's first
  and last blocks included. Host memory: 5 bytes per block (0.12 % of the store), in
  :attr:`SlabStore.crc_bytes`.
* **Accounting.** Bytes read and written per path, and the endurance ledger of each path.
* **Restart.** :meth:`save_index` persists keys, extents and checksums (``index.json`` with its own
  CRC, the block CRCs in ``index.crc`` with theirs); reopening the same namespace restores them (the
  layout must be the same) and refuses an index whose CRC does not match.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import warnings
import zlib

import numpy as np
import torch

from ..errors import AidaptivConfigError
from ..io.atomic import ChecksumMismatch, atomic_write, dumps_checked, loads_checked
from ..io.buffers import alloc_aligned, byte_view, round_up
from ..io.engine import READ_DEMAND, WRITE_BACK, IOEngine, default_engine
from ..io.errors import ChecksumError, StorageError, StorageFullError
from ..io.futures import IOFuture, combine
from .allocator import ExtentAllocator, OutOfSpace
from .layout import CachePathError, Namespace, dead_store_hint
from .ledger import EnduranceLedger, EnduranceRating, LedgerError, LedgerWarning
from .slab import Slab, free_bytes
from .striping import StripeLayout


def extent_kind(key: str) -> str:
    """The kind of an extent key: its first ``/``-separated part without a trailing engine number
    (``"opt0/3"`` -> ``"opt"``, ``"grad1/0"`` -> ``"grad"``, ``"params/bfloat16/c2"`` -> ``"params"``)."""
    return key.split("/", 1)[0].rstrip("0123456789") or key


log = logging.getLogger("aidaptiv_ds")

INDEX_VERSION = 2  # 2: stripe patterns from striping.choose_slots (v1 used 32 slots; its layout differs)


@dataclasses.dataclass
class PathSpec:
    """One cache path as the store sees it.

    Attributes:
        path: directory on the cache drive.
        weight: relative bandwidth (GB/s from ``bench-io`` or the data sheet); sets its stripe share.
        capacity: most bytes the store may put there (None: free space at open minus the reserve).
        rating: the drive's endurance rating (for the ledger's projections).
    """
    path: str
    weight: float = 1.0
    capacity: int | None = None
    rating: EnduranceRating = dataclasses.field(default_factory=EnduranceRating)


@dataclasses.dataclass(frozen=True)
class Extent:
    """A named, aligned range ``[offset, offset + nbytes)`` of the store's logical space (bytes)."""
    key: str
    offset: int
    nbytes: int


@dataclasses.dataclass(eq=False)
class _Request:
    """One store request's scheduling state: its priority (raised while something more urgent waits
    behind it), its reserved place in the engine's order, its queued chunks (until it completes) and
    the earlier overlapping requests it is still ordered after (until it is submitted)."""
    priority: int
    order: int
    chunks: list = dataclasses.field(default_factory=list)
    deps: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A request still transferring logical bytes ``[start, end)``: later requests over those bytes are ordered
    after it (a write after any overlapping request, a read after overlapping writes)."""
    start: int
    end: int
    future: IOFuture
    request: _Request

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


class _Segment:
    def __init__(self, start: int, end: int, layout: StripeLayout) -> None:
        self.start, self.end, self.layout = start, end, layout


class SlabStore:
    """Named extents striped over one slab per cache path. One per process and namespace.

    Args:
        namespace: where the files go (host/run/rank directories; locked while open).
        paths: the cache paths, in the order of ``namespace.cache_paths``.
        engine: the I/O engine (default: the process-wide one).
        policy: ``"striped"`` or ``"affinity"`` (see module docstring).
        primary: index of the primary path for ``"affinity"``.
        stripe_unit: stripe unit in bytes.
        alignment: extent and I/O alignment in bytes (the direct-I/O block size).
        checksum: record and verify the CRC32 of every ``alignment``-sized block (a block lies on one
            path, so a mismatch names the one path and offset that hold it).
        keep: keep the files on :meth:`close` (default: delete them on a clean shutdown).
        local_ranks: processes of the run on this node, each with its own store on the same cache
            paths; a path without a configured capacity gives each of them an equal part of its free
            space (default 1: this store alone).

    Raises:
        StoreInUseError: another process owns the namespace.
        StorageError: a persisted index with a different layout exists in the namespace.
    """

    def __init__(self, namespace: Namespace, paths: list[PathSpec], engine: IOEngine | None = None,
                 policy: str = "striped", primary: int = 0, stripe_unit: int = 1 << 20, alignment: int = 4096,
                 checksum: bool = False, keep: bool = False,
                 local_ranks: int = 1) -> None:
        if len(paths) != len(namespace.cache_paths):
            raise ValueError("one PathSpec per namespace cache path")
        if policy not in ("striped", "affinity"):
            raise AidaptivConfigError(f"aidaptiv.placement: {policy!r} is not a policy; use 'striped' or 'affinity'")
        if stripe_unit % alignment:
            raise AidaptivConfigError(f"aidaptiv.stripe_unit ({stripe_unit}) must be a multiple of the I/O alignment "
                                      f"({alignment} bytes)")
        self.ns = namespace
        self.paths = paths
        self.engine = engine or default_engine()
        self.policy = policy
        self.primary = primary % len(paths)
        self.stripe_unit = stripe_unit
        self.alignment = alignment
        self.checksum = checksum
        # [Note: checksum granularity] One CRC per alignment block, the unit of every request: a
        # coarser block (1 MiB before) is covered only in part by requests that start or end inside
        # it (an extent's first and last block, a packed partition), and such blocks could be neither
        # recorded nor verified. A block never spans two stripe units, so an error names one drive.
        self.checksum_block = alignment
        self.keep = keep
        if int(local_ranks) < 1:
            raise ValueError(f"local_ranks: {local_ranks} must be >= 1 (the processes of this run on this node)")
        self.local_ranks = int(local_ranks)
        self._lock = threading.RLock()
        self._extents: dict[str, Extent] = {}
        self._crc = np.zeros(0, dtype=np.uint32)  # CRC32 per block
        self._crc_valid = np.zeros(0, dtype=np.bool_)  # whether the block's CRC is known
        self.bytes_written = [0] * len(paths)
        self.bytes_read = [0] * len(paths)
        self.bytes_read_by_kind: dict[str, int] = {}  # extent_kind(key) -> bytes read (io_counters_by_kind)
        self._ledgered = [0] * len(paths)
        self._writes_inflight: list[_InFlight] = []
        self._reads_inflight: list[_InFlight] = []
        self._inflight: set[IOFuture] = set()  # requests not yet complete; close() waits for them
        self._ledger_warned: set = set()  # (ledger file, errno) already reported by flush_ledger
        self._closed = False

        namespace.acquire()
        try:
            self.slabs = [Slab(namespace.slab_path(i), namespace.cache_paths[i], self.engine,
                               drive=namespace.cache_paths[i], alignment=alignment) for i in range(len(paths))]
            self.ledgers = [EnduranceLedger(namespace.node_dir(i), namespace.cache_paths[i], p.rating,
                                            namespace.run, namespace.rank) for i, p in enumerate(paths)]
            index = self._load_index()
            caps = index["phys_caps"] if index else self._phys_caps()
            self._build_segments({int(k): v for k, v in caps.items()} if index else caps)
            self.allocator = ExtentAllocator(alignment, capacity=self.segments[-1].end)
            if index:
                self._restore(index)
        except BaseException:
            namespace.release()
            raise

    # ------------------------------------------------------------------ layout
    def _run_slab_bytes(self, i: int) -> int:
        """Bytes the slabs of the *other* ranks of this run on this node hold on path ``i`` (``st_blocks``)."""
        run_dir, total = self.ns.run_dir(i), 0
        try:
            names = os.listdir(run_dir)
        except FileNotFoundError:
            return 0
        for name in names:
            if not name.startswith("rank") or name == f"rank{self.ns.rank}":
                continue
            try:
                total += os.stat(os.path.join(run_dir, name, "slab.bin")).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    def _phys_caps(self) -> dict[int, int]:
        """Bytes each path may hold: its configured capacity, else a weighted share of the free space
        of its filesystem (paths on one filesystem split it, so the sum is never over-counted),
        minus a reserve of 2% of the filesystem, at most 1 GiB. With ``local_ranks`` > 1 the node's
        ranks split it too: the pool (free space plus what this run's slabs on this node already
        hold, so the split does not depend on which rank opened first) is divided equally among them;
        otherwise each rank would plan with the whole drive, and a rank spilling onto another's
        primary path (``affinity``) would find it full."""
        caps: dict[int, int] = {}
        by_fs: dict[int, list[int]] = {}
        for i, p in enumerate(self.paths):
            if p.capacity is not None:
                caps[i] = int(p.capacity)
            else:
                by_fs.setdefault(os.stat(self.ns.cache_paths[i]).st_dev, []).append(i)
        for members in by_fs.values():
            cp = self.ns.cache_paths[members[0]]
            st = os.statvfs(cp)
            reserve = min(1 << 30, st.f_blocks * st.f_frsize // 50)
            held = sum(self.slabs[i].size for i in members)
            if self.local_ranks > 1:
                held += sum(self._run_slab_bytes(i) for i in members)
            pool = max(free_bytes(cp) + held - reserve, 0) // self.local_ranks
            wsum = sum(self.paths[i].weight for i in members)
            for i in members:
                caps[i] = int(pool * self.paths[i].weight / wsum)
        return {i: caps[i] // self.stripe_unit * self.stripe_unit for i in range(len(self.paths))}

    def _build_segments(self, caps: dict[int, int]) -> None:
        self.phys_caps = caps
        idx = list(range(len(self.paths)))
        if self.policy == "striped" or len(idx) == 1:
            lay = StripeLayout(idx, [self.paths[i].weight for i in idx], self.stripe_unit)
            self.segments = [_Segment(0, lay.logical_capacity(caps), lay)]
        else:
            first = StripeLayout([self.primary], [1.0], self.stripe_unit)
            rest = [i for i in idx if i != self.primary]
            second = StripeLayout(rest, [self.paths[i].weight for i in rest], self.stripe_unit)
            c0 = first.logical_capacity(caps)
            self.segments = [_Segment(0, c0, first), _Segment(c0, c0 + second.logical_capacity(caps), second)]

    def planned_share(self) -> list[float]:
        """Fraction of the first segment's bytes that lands on each path (the "intended share")."""
        lay = self.segments[0].layout
        return [lay.share(i) for i in range(len(self.paths))]

    def _map(self, logical: int, length: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """``[(path, phys, [(offset_in_request, length), ...]), ...]`` for logical bytes."""
        out = []
        for seg in self.segments:
            a, b = max(logical, seg.start), min(logical + length, seg.end)
            if a >= b:
                continue
            for path, runs in seg.layout.map(a - seg.start, b - a).items():
                for r in runs:
                    out.append((path, r.phys, [(o + a - logical, n) for o, n in r.parts]))
        return out

    def _ensure_physical(self, logical_end: int, what: str) -> None:
        for seg in self.segments:
            if logical_end <= seg.start:
                break
            need = seg.layout.phys_size(min(logical_end, seg.end) - seg.start)
            for path, nbytes in need.items():
                self.slabs[path].ensure(seg.layout.phys_base[path] + nbytes, what, limit=self.phys_caps[path])

    # ------------------------------------------------------------------ space
    def capacity(self) -> int:
        """Logical bytes the store can hold in total."""
        return self.segments[-1].end

    def allocated(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._extents.values())

    def preflight(self, nbytes: int, what: str = "the training state") -> None:
        """Refuse, before anything is written, a plan that needs ``nbytes`` more bytes than fit.

        Also reserves the space (grows the slabs with ``fallocate``), so it cannot be taken later.

        Raises:
            StorageFullError: naming the first path short of space, the bytes it needs and has free.
        """
        with self._lock:
            need_end = self.allocator.high_water + round_up(nbytes, self.alignment)
            fits = need_end <= self.capacity()
            if not fits:
                self._raise_full(need_end, what)
            self._ensure_physical(need_end, what)

    def _raise_full(self, logical_end: int, what: str) -> None:
        """Raise :class:`StorageFullError` for the first path whose share of ``[0, logical_end)`` exceeds it."""
        for k, seg in enumerate(self.segments):
            if logical_end <= seg.start:
                break
            end = logical_end if k == len(self.segments) - 1 else min(logical_end, seg.end)
            for path, nbytes in sorted(seg.layout.phys_size(end - seg.start).items()):
                need = seg.layout.phys_base[path] + nbytes
                if need > self.phys_caps[path]:
                    cp = self.ns.cache_paths[path]
                    free = min(free_bytes(cp) + self.slabs[path].size, self.phys_caps[path])
                    raise StorageFullError(cp, need, free, what, dead_store_hint(cp, need, free))
        cp, cap = self.ns.cache_paths[0], self.capacity()
        raise StorageFullError(cp, logical_end, cap, what, dead_store_hint(cp, logical_end, cap))

    # ------------------------------------------------------------------ extents
    def allocate(self, key: str, nbytes: int) -> Extent:
        """The extent of ``key``, allocated on first use (``nbytes`` rounded up to the alignment).

        Stable placement: an existing extent of at least ``nbytes`` is returned unchanged; a smaller
        one is freed and a new one allocated (its old bytes are not carried over).

        Raises:
            StorageFullError: the paths cannot hold it (nothing is written).
        """
        n = round_up(max(int(nbytes), 1), self.alignment)
        with self._lock:
            ext = self._extents.get(key)
            if ext is not None and ext.nbytes >= n:
                return ext
            if ext is not None:
                self.free(key)
            try:
                off = self.allocator.alloc(n)
            except OutOfSpace:
                self._raise_full(self.allocator.high_water + n, f"extent {key!r}")
            try:
                self._ensure_physical(off + n, f"extent {key!r}")
            except BaseException:
                self.allocator.free(off, n)
                raise
            ext = self._extents[key] = Extent(key, off, n)
            self._invalidate_crc(off, n)
            return ext

    def extent(self, key: str) -> Extent | None:
        with self._lock:
            return self._extents.get(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._extents)

    def swap_extents(self, a: str, b: str) -> None:
        """Exchange the bytes of two extents of the same size by exchanging their places (no I/O): what
        was written to ``b`` is read under ``a`` from now on, and the other way round. Requests in
        flight keep their order, which follows byte places, not keys: a read of ``a`` issued after this
        waits for a write to ``b`` issued before it. The copy-on-commit of a speculative optimizer step
        (new state written beside the old one, made current when the step is accepted).

        Raises:
            KeyError: either extent does not exist; ValueError: their sizes differ.
        """
        with self._lock:
            ea, eb = self._extents[a], self._extents[b]
            if ea.nbytes != eb.nbytes:
                raise ValueError(f"extents {a!r} ({ea.nbytes} bytes) and {b!r} ({eb.nbytes} bytes) differ in size")
            self._extents[a] = Extent(a, eb.offset, eb.nbytes)
            self._extents[b] = Extent(b, ea.offset, ea.nbytes)

    def free(self, key: str) -> None:
        """Return ``key``'s extent for reuse (its bytes become undefined)."""
        with self._lock:
            ext = self._extents.pop(key, None)
            if ext is not None:
                self.allocator.free(ext.offset, ext.nbytes)
                self._invalidate_crc(ext.offset, ext.nbytes)

    # ------------------------------------------------------------------ I/O
    def write(self, key: str, buf: torch.Tensor, offset: int = 0, priority: int = WRITE_BACK) -> IOFuture:
        """Write contiguous CPU tensor ``buf`` at byte ``offset`` of extent ``key``.

        ``offset`` and ``buf``'s byte length must be multiples of the alignment (use :meth:`put`
        for arbitrary tensors). ``buf`` must stay untouched until the future completes.

        Raises:
            KeyError: no such extent; ValueError: out of the extent's range or unaligned.
        """
        return self._io(True, key, buf, offset, priority)

    def read(self, key: str, buf: torch.Tensor, offset: int = 0, priority: int = READ_DEMAND) -> IOFuture:
        """Read ``buf``'s byte length at byte ``offset`` of extent ``key`` into ``buf``.

        The future raises :class:`ChecksumError` if checksums are on and a fully read block differs.
        """
        return self._io(False, key, buf, offset, priority)

    def _io(self, write: bool, key: str, buf: torch.Tensor, offset: int, priority: int) -> IOFuture:
        if self._closed:
            raise StorageError("aidaptiv_ds: store is closed")
        raw = byte_view(buf)
        n = raw.numel()
        with self._lock:
            ext = self._extents.get(key)
        if ext is None:
            raise KeyError(f"aidaptiv_ds: no extent {key!r} in the store")
        if offset < 0 or offset + n > ext.nbytes:
            raise ValueError(f"extent {key!r}: bytes [{offset}, {offset + n}) outside its {ext.nbytes} bytes")
        if offset % self.alignment or n % self.alignment:
            raise ValueError(f"extent {key!r}: offset {offset} and length {n} must be multiples of {self.alignment}")
        logical = ext.offset + offset
        finalizer = None
        if self.checksum:
            if write:
                self._record_crc(logical, raw)
            else:
                finalizer = self._verifier(key, logical, raw)
        with self._lock:
            self._writes_inflight = [w for w in self._writes_inflight if not w.future.done()]
            self._reads_inflight = [r for r in self._reads_inflight if not r.future.done()]
            req = _Request(priority, self.engine.next_order())
            before = [w for w in self._writes_inflight if w.overlaps(logical, logical + n)]
            if write:  # nor may a write change bytes an earlier read is still transferring
                before += [r for r in self._reads_inflight if r.overlaps(logical, logical + n)]
            if before:  # ordered after the overlapping requests issued before it, without blocking the caller
                req.deps = [b.request for b in before]
                for r in req.deps:  # [Note: priority inheritance] (io/engine.py)
                    self._boost(r, priority)
                out = IOFuture(n, 1, keepalive=buf)
                after = combine([b.future for b in before], 0)
                after.add_done_callback(lambda _f: self._chain(out, write, logical, n, raw, req, finalizer))
            else:
                out = self._submit(write, logical, n, raw, req, finalizer, buf)
            self._inflight.add(out)
            (self._writes_inflight if write else self._reads_inflight).append(_InFlight(logical, logical + n, out, req))
        if not write:
            out.add_done_callback(self._kind_counter(extent_kind(key), n))
        out._expedite = lambda p, req=req: self._expedite(req, p)
        out.add_done_callback(self._retire)
        out.add_done_callback(lambda _f: req.chunks.clear())  # the chunks' views pin the buffer: let it go
        return out

    def _expedite(self, req: _Request, priority: int) -> None:
        with self._lock:
            self._boost(req, priority)

    def _boost(self, req: _Request, priority: int) -> None:
        """Serve ``req`` (and what it still waits for) at ``priority`` when that is more urgent: a request
        someone waits behind must not wait behind less urgent ones itself. Called under the lock."""
        if priority >= req.priority:
            return
        req.priority = priority
        self.engine.boost(req.chunks, priority)
        for r in req.deps:
            self._boost(r, priority)

    def _submit(self, write: bool, logical: int, n: int, raw: torch.Tensor, req: _Request, finalizer, keepalive
                ) -> IOFuture:
        """Hand the request's runs to the engine (one sequential transfer per run), at its priority and
        in its place in the order (reserved when it was issued, so a request that waited for an earlier
        overlapping one is not queued behind everything issued meanwhile). Called under the lock."""
        futs = []
        req.deps = []
        for path, phys, parts in self._map(logical, n):
            f = self.engine.submit(self.slabs[path].fh, write, phys, [raw[o:o + m] for o, m in parts], req.priority,
                                   order=req.order, chunks_out=req.chunks)
            f.add_done_callback(self._counter(path, write, sum(m for _, m in parts)))
            futs.append(f)
        return combine(futs, n, finalizer, keepalive=keepalive)

    def _chain(self, out: IOFuture, write: bool, logical: int, n: int, raw: torch.Tensor, req: _Request,
               finalizer) -> None:
        """Submit a request whose earlier overlapping writes completed (an engine thread calls this);
        ``out`` completes with it. A failed earlier write does not stop it: its owner gets that error."""
        try:
            with self._lock:  # the priority may be raised while it waited: read it with the boosts excluded
                inner = self._submit(write, logical, n, raw, req, finalizer, None)
        except BaseException as e:  # noqa: BLE001 - delivered to the waiter of out
            out._chunk_done(e)
            return
        inner.add_done_callback(lambda f: out._chunk_done(f.exception()))

    def _retire(self, f: IOFuture) -> None:
        with self._lock:
            self._inflight.discard(f)

    def drain(self) -> None:
        """Wait until every request submitted so far has completed (errors stay with their futures)."""
        with self._lock:
            pending = list(self._inflight)
        for f in pending:
            try:
                f.wait()
            except BaseException:  # noqa: BLE001 - reported to whoever waits on that future
                pass

    def _counter(self, path: int, write: bool, nbytes: int):
        def count(f: IOFuture) -> None:
            if f.exception() is None:
                with self._lock:
                    (self.bytes_written if write else self.bytes_read)[path] += nbytes
        return count

    def _kind_counter(self, kind: str, nbytes: int):
        def count(f: IOFuture) -> None:
            if f.exception() is None:
                with self._lock:
                    self.bytes_read_by_kind[kind] = self.bytes_read_by_kind.get(kind, 0) + nbytes
        return count

    def put(self, key: str, tensor: torch.Tensor, priority: int = WRITE_BACK) -> IOFuture:
        """Store any contiguous tensor under ``key`` (copied into an aligned, zero-padded buffer)."""
        raw = byte_view(tensor.detach().cpu().contiguous())
        self.allocate(key, raw.numel())
        staging = alloc_aligned(round_up(max(raw.numel(), 1), self.alignment), zero=True)
        staging[: raw.numel()].copy_(raw)
        return self.write(key, staging, 0, priority)

    def get(self, key: str, out: torch.Tensor, priority: int = READ_DEMAND) -> IOFuture:
        """Read ``out``'s byte length from the start of ``key`` into contiguous ``out`` (any dtype)."""
        raw = byte_view(out)
        staging = alloc_aligned(round_up(max(raw.numel(), 1), self.alignment))
        fut = self.read(key, staging, 0, priority)
        return combine([fut], raw.numel(), finalizer=lambda: raw.copy_(staging[: raw.numel()]), keepalive=out)

    # ------------------------------------------------------------------ checksums
    @property
    def crc_bytes(self) -> int:
        """Host memory held by the block CRCs (bytes)."""
        return self._crc.nbytes + self._crc_valid.nbytes

    def _grow_crc(self, nblocks: int) -> None:
        if nblocks > len(self._crc):
            n = max(nblocks, 2 * len(self._crc))
            crc, valid = np.zeros(n, dtype=np.uint32), np.zeros(n, dtype=np.bool_)
            crc[: len(self._crc)], valid[: len(self._crc_valid)] = self._crc, self._crc_valid
            self._crc, self._crc_valid = crc, valid

    def _invalidate_crc(self, logical: int, n: int) -> None:
        if not self.checksum:
            return
        b = self.checksum_block
        lo, hi = logical // b, -(-(logical + n) // b)
        with self._lock:
            self._grow_crc(hi)
            self._crc_valid[lo:hi] = False

    def _block_crcs(self, raw: torch.Tensor) -> np.ndarray:
        b = self.checksum_block
        mv = raw.numpy().data
        return np.fromiter((zlib.crc32(mv[s:s + b]) for s in range(0, len(mv), b)), dtype=np.uint32,
                           count=len(mv) // b)

    def _record_crc(self, logical: int, raw: torch.Tensor) -> None:
        """Record the CRC of every block of a write (``logical`` and the length are block-aligned)."""
        crcs = self._block_crcs(raw)
        lo = logical // self.checksum_block
        with self._lock:
            self._grow_crc(lo + len(crcs))
            self._crc[lo:lo + len(crcs)] = crcs
            self._crc_valid[lo:lo + len(crcs)] = True

    def _verifier(self, key: str, logical: int, raw: torch.Tensor):
        """The finalizer of a read: compare the blocks read with the CRCs recorded when the read was
        issued. [Note: a snapshot, not the live array] A write issued after this read (it waits for
        the read, so the read returns the older bytes) records its CRCs at once; comparing with
        those would report the older bytes as corrupt."""
        b = self.checksum_block
        lo, nblocks = logical // b, raw.numel() // b
        with self._lock:
            n = max(min(lo + nblocks, len(self._crc)) - lo, 0)
            want, known = self._crc[lo:lo + n].copy(), self._crc_valid[lo:lo + n].copy()

        def verify() -> None:
            got = self._block_crcs(raw)
            bad = np.flatnonzero(known & (want != got[:n]))
            if len(bad):
                blk = lo + int(bad[0])
                path, phys, _ = self._map(blk * b, b)[0]
                raise ChecksumError(key, self.slabs[path].path, phys, b, int(want[bad[0]]), int(got[bad[0]]))
        return verify

    # ------------------------------------------------------------------ accounting
    def io_counters(self) -> dict:
        """Bytes read and written per cache path by this store since it opened."""
        with self._lock:
            return {p: {"bytes_read": r, "bytes_written": w}
                    for p, r, w in zip(self.ns.cache_paths, self.bytes_read, self.bytes_written, strict=True)}

    def read_bytes_by_kind(self) -> dict[str, int]:
        """Bytes read since the store opened per kind of extent (:func:`extent_kind` of the key:
        ``"opt"`` for optimizer sub-groups, ``"grad"`` for gradient slices, ``"params"`` for parameter
        partitions), counted when a read completes. The per-path counters hold the same bytes."""
        with self._lock:
            return dict(self.bytes_read_by_kind)

    def count_metadata_write(self, nbytes: int, path: int = 0) -> None:
        """Book ``nbytes`` written to a file of this store's namespace outside the slab (an index or
        header its owner keeps beside it) on cache path ``path``, so the ledger counts them too."""
        with self._lock:
            self.bytes_written[path] += int(nbytes)

    def flush_ledger(self) -> None:
        """Book bytes written since the last call in each path's endurance ledger.

        A ledger file that cannot be written (drive full, read-only, directory removed) does not stop
        training: the training state's space was reserved at start, so the failure is reported once
        per path and error as a :class:`LedgerWarning` naming the file, and its bytes stay booked in
        memory until a later flush succeeds.
        """
        with self._lock:
            deltas = [w - done for w, done in zip(self.bytes_written, self._ledgered, strict=True)]
            self._ledgered = list(self.bytes_written)
        for led, d in zip(self.ledgers, deltas, strict=True):
            led.add(d)
            try:
                led.flush()
            except LedgerError as e:
                key = (led.file, getattr(e, "errno", None))
                if key not in self._ledger_warned:
                    self._ledger_warned.add(key)
                    msg = (f"{e} The endurance ledger is not updated until that succeeds (the bytes are kept in "
                           f"memory); training goes on, since its space on the drive was reserved at start.")
                    log.warning(msg)
                    warnings.warn(msg, LedgerWarning, stacklevel=2)

    def check_files(self) -> None:
        """Raise if the namespace directory of a path was removed (or replaced) while the store is open.

        The slabs stay usable through their open descriptors, so nothing else would notice; but the
        owner lock went with the directory, another run could now take the same namespace, and the
        drive's space is held by files nobody can see. Cheap (one ``stat`` per path): the runtime calls
        it after every optimizer step.

        Raises:
            CachePathError: naming the cache path, the directory that disappeared and the fix.
        """
        for i, cp in enumerate(self.ns.cache_paths):
            if not self.ns.still_owned(i):
                raise CachePathError(
                    f"aidaptiv_ds: {self.ns.rank_dir(i)} on cache path {cp} was removed while this run was using "
                    f"it (its owner lock went with it, so another run could take the same namespace, and the slab "
                    f"is reachable only through this process). Fix: resume from the last checkpoint; clean cache paths "
                    f"with `aidaptiv-ds gc --cache {cp} --delete`, which never deletes a live store.")

    # ------------------------------------------------------------------ persistence
    def save_index(self) -> None:
        """Persist extents, layout and checksums beside the slab (:mod:`aidaptiv_ds.io.atomic`: temp
        file, checked writes, fsync, rename, directory fsync). ``index.json`` carries its own CRC; the
        block CRCs go to ``index.crc`` (written first, its size and CRC recorded in the index)."""
        with self._lock:
            data = {
                "version": INDEX_VERSION, "policy": self.policy, "primary": self.primary,
                "stripe_unit": self.stripe_unit, "alignment": self.alignment,
                "weights": [p.weight for p in self.paths], "phys_caps": self.phys_caps,
                "checksum_block": self.checksum_block,
                "extents": {k: [e.offset, e.nbytes] for k, e in self._extents.items()},
                "crc": None,
            }
            blob = self._crc_valid.tobytes() + self._crc.tobytes() if self.checksum else None
        for s in self.slabs:
            s.sync()
        path = self.ns.index_path()
        written = 0
        if blob is not None:
            atomic_write(path[:-len(".json")] + ".crc", blob)
            data["crc"] = {"file": os.path.basename(path)[:-len(".json")] + ".crc", "bytes": len(blob),
                           "crc32": zlib.crc32(blob), "blocks": len(blob) // 5}
            written += len(blob)
        payload = dumps_checked(data, indent=None)
        atomic_write(path, payload)
        with self._lock:
            self.bytes_written[0] += written + len(payload)

    def _index_damaged(self, what: str) -> StorageError:
        return StorageError(
            f"aidaptiv_ds: the kept store index {self.ns.index_path()} {what}: the extents and checksums it records "
            f"cannot be trusted, so the store is not reopened. Fix: delete this store (`aidaptiv-ds gc --cache "
            f"{self.ns.cache_paths[0]} --run {self.ns.run} --delete`) and start again from the last checkpoint "
            f"(or run `aidaptiv-ds unpack` again).")

    def _load_index(self) -> dict | None:
        try:
            with open(self.ns.index_path(), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            data = loads_checked(raw, self.ns.index_path(), required=False)  # indexes before self_crc32: unchecked
        except ChecksumMismatch as e:
            raise self._index_damaged(f"is damaged ({e})") from None
        mine = {"policy": self.policy, "primary": self.primary, "stripe_unit": self.stripe_unit,
                "alignment": self.alignment, "weights": [p.weight for p in self.paths]}
        theirs = {k: data.get(k) for k in mine}
        if data.get("version") != INDEX_VERSION or theirs != mine:
            raise StorageError(
                f"aidaptiv_ds: {self.ns.index_path()} was written with a different layout ({theirs}) than this "
                f"store's ({mine}). Fix: use the same placement settings to reopen it, or a new aidaptiv.run_name.")
        return data

    def _restore(self, data: dict) -> None:
        for key, (off, n) in sorted(data["extents"].items(), key=lambda kv: kv[1][0]):
            self.allocator.reserve(off, n)
            self._extents[key] = Extent(key, off, n)
        crc = data.get("crc")
        if not self.checksum or crc is None:
            return
        if not isinstance(crc, dict) or data.get("checksum_block") != self.checksum_block:
            log.warning("aidaptiv_ds: %s holds block checksums of an older aidaptiv_ds (%s-byte blocks); the kept "
                        "store's blocks are verified again once they are rewritten", self.ns.index_path(),
                        data.get("checksum_block"))
            return
        cpath = os.path.join(os.path.dirname(self.ns.index_path()), crc["file"])
        try:
            with open(cpath, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            raise self._index_damaged(f"names {cpath}, which is missing") from None
        if len(blob) != crc["bytes"] or zlib.crc32(blob) != crc["crc32"]:
            raise self._index_damaged(f"names {cpath}, whose size or CRC32 does not match it ({len(blob)} bytes)")
        n = int(crc["blocks"])
        self._crc_valid = np.frombuffer(blob[:n], dtype=np.bool_).copy()
        self._crc = np.frombuffer(blob[n:], dtype=np.uint32).copy()

    def physical_runs(self, key: str, offset: int, nbytes: int) -> list[tuple[int, int, int, int]]:
        """Where bytes ``[offset, offset + nbytes)`` of extent ``key`` lie on the drives:
        ``[(slab_fd, physical_offset, length, offset_in_request), ...]`` (for copy-on-write clones)."""
        with self._lock:
            ext = self._extents[key]
        out = []
        for path, phys, parts in self._map(ext.offset + offset, nbytes):
            pos = phys
            for rel, n in parts:
                out.append((self.slabs[path].fh.fileno(), pos, n, rel))
                pos += n
        return out

    def close(self, keep: bool | None = None) -> None:
        """Finish the requests in flight, flush the ledger, keep the files (with an index) or delete
        them, release the namespace."""
        if self._closed:
            return
        keep = self.keep if keep is None else keep
        self._closed = True  # no new requests; the queued ones finish before the slabs close
        try:
            self.drain()
            if keep:
                self.save_index()
            self.flush_ledger()  # after the index, so its bytes are booked too
        finally:  # even when the index cannot be saved: close the slabs, free the drive and the namespace
            for s in self.slabs:
                s.close()
            if keep:
                self.ns.release()
            else:
                self.ns.remove_files()
