"""A packed region: items laid end to end at byte granularity, read and written in aligned blocks.

Parameter partitions are packed in creation order (so one module's partitions are one contiguous
range and one fetch is one sequential read) with no per-item padding (so a 128-byte norm weight
costs 128 bytes of writes, not a 4 KiB block). The region lives in store extents ("chunks")
appended as it grows: the first of ``first_chunk`` bytes, each next one a quarter of the region's
capacity so far (at least what the append needs, at most ``chunk_bytes``). [Note: the margin] The
chunks then hold at most a quarter more than the items, or one first chunk (4 MiB), and never more
than one ``chunk_bytes`` (256 MiB) more: the slab reserves what the state needs plus that, not the
up to twice as much that doubling chunks held.

I/O is always block-aligned (``store.alignment``): a write of ``[start, end)`` becomes a write of
the enclosing aligned range ``[A, B)`` whose partial head and tail blocks are filled
read-modify-write. The latest content of each boundary block is kept in a small *edge cache*, so
consecutive writes (the sub-groups of an optimizer step) do not read them back. Ordering comes
from the store: a request waits for earlier in-flight writes it overlaps, so an older boundary
block never lands last and a read never returns bytes older than a write issued before it.
"""
from __future__ import annotations

import bisect
import collections
import threading

import torch

from ..io.buffers import alloc_aligned, round_down, round_up
from ..io.engine import READ_DEMAND, WRITE_BACK
from ..io.futures import IOFuture, combine, wait_all
from .store import SlabStore


class PackedRegion:
    """Byte-granular items in block-aligned store extents.

    Args:
        store: the slab store holding the chunks.
        name: key prefix of the chunks (``"<name>/<k>"``).
        chunk_bytes: largest chunk extent in bytes (a multiple of the store's alignment).
        first_chunk: size of the first chunk; each next one is a quarter of the capacity so far, up
            to ``chunk_bytes`` (a small model takes little space; a large one gets large sequential
            chunks). Default 4 MiB.
        edge_cache_blocks: boundary blocks kept in memory (4 KiB each at the default alignment).
    """

    def __init__(self, store: SlabStore, name: str, chunk_bytes: int = 256 << 20, first_chunk: int = 4 << 20,
                 edge_cache_blocks: int = 4096) -> None:
        self.store = store
        self.name = name
        self.block = store.alignment
        self.chunk_bytes = round_up(chunk_bytes, self.block)
        self.first_chunk = min(round_up(first_chunk, self.block), self.chunk_bytes)
        self.size = 0
        self._starts: list[int] = []  # region offset of each chunk; chunk k spans [starts[k], starts[k] + sizes[k])
        self._sizes: list[int] = []
        self._capacity = 0
        self._lock = threading.RLock()
        self._edges: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
        self._edge_limit = edge_cache_blocks
        self._pending: list[IOFuture] = []  # writes not known to be complete (for flush)
        self._released: set[int] = set()  # chunks given back to the store (release_chunks)
        self._written_end = 0  # no byte at or past this offset was ever written ([Note: blocks never written])
        self.boundary_reads = 0

    # ------------------------------------------------------------------ space
    def append(self, nbytes: int, align: int = 1) -> int:
        """Reserve ``nbytes`` at the end (start aligned to ``align`` bytes); return the start offset.

        Raises:
            StorageFullError: a new chunk does not fit on the cache paths.
        """
        with self._lock:
            start = round_up(self.size, align)
            end = start + int(nbytes)
            while self._capacity < end:
                k = len(self._starts)
                size = self.next_chunk_size(self._capacity, end - self._capacity)
                self.store.allocate(f"{self.name}/{k}", size)
                self._starts.append(self._capacity)
                self._sizes.append(size)
                self._capacity += size
            self.size = end
            return start

    def next_chunk_size(self, capacity: int, short: int) -> int:
        """Bytes of the chunk added to a region of ``capacity`` bytes that lacks ``short`` bytes (see
        the module docstring): ``capacity / 4``, at least ``first_chunk`` and ``short`` (whole blocks),
        at most ``chunk_bytes``."""
        want = max(capacity // 4, round_up(short, self.block), self.first_chunk)
        return round_up(min(want, self.chunk_bytes), self.block)

    def reopen(self, size: int) -> None:
        """Adopt ``size`` bytes already in the store (after :meth:`SlabStore` reopened an index).

        Raises:
            KeyError: a chunk the size implies is missing from the store index.
        """
        with self._lock:
            self.size, self._starts, self._sizes, self._capacity = size, [], [], 0
            self._released = set()
            self._written_end = size  # written by an earlier process: every byte may hold data
            while self._capacity < size:
                k = len(self._starts)
                ext = self.store.extent(f"{self.name}/{k}")
                if ext is None:
                    raise KeyError(f"{self.name}: chunk {k} missing from the store index")
                self._starts.append(self._capacity)
                self._sizes.append(ext.nbytes)
                self._capacity += ext.nbytes

    def unreferenced_chunks(self, live: list[tuple[int, int]]) -> list[int]:
        """Indices of the chunks (still held) that no byte range of ``live`` (region ``[start, end)``
        pairs) overlaps once widened to whole blocks."""
        with self._lock:
            used = set()
            for start, end in live:
                a, b = self.aligned(start, end)
                k = bisect.bisect_right(self._starts, a) - 1
                while k < len(self._starts) and self._starts[k] < b:
                    used.add(k)
                    k += 1
            return [k for k in range(len(self._starts)) if k not in used and k not in self._released]

    def release_chunks(self, chunks: list[int]) -> int:
        """Give the extents of ``chunks`` back to the store (their bytes become undefined) and return
        the bytes given back. A later read or write touching them raises ``KeyError``. Writes issued
        to them are waited for first; reads still in flight keep their place in the store's order (a
        write that reuses the space waits for them).

        [Note: why] fp32 partitions are first written here by ``zero.Init`` and then read from their
        master slot (``AidaptivParamSwapper.alias_to_master``): the region's 4 B/param would stay
        allocated on the drives for nothing.
        """
        self.flush()
        with self._lock:
            freed = 0
            for k in chunks:
                if k in self._released:
                    continue
                self.store.free(f"{self.name}/{k}")
                self._released.add(k)
                freed += self._sizes[k]
                lo, hi = self._starts[k] // self.block, (self._starts[k] + self._sizes[k]) // self.block
                for idx in [i for i in self._edges if lo <= i < hi]:
                    del self._edges[idx]
            if self._starts and len(self._starts) - 1 in self._released:
                self.size = self._capacity  # the next append starts a chunk of its own, not in a released one
            return freed

    def chunk_extents(self, chunks: list[int]) -> list[tuple[int, int]]:
        """``(store offset, bytes)`` of the extents of ``chunks`` (held ones)."""
        out = []
        for k in chunks:
            ext = self.store.extent(f"{self.name}/{k}")
            if ext is not None:
                out.append((ext.offset, ext.nbytes))
        return out

    def held_spans(self) -> list[tuple[int, int]]:
        """Region byte ranges ``[start, end)`` of the chunks not released, merged, clipped to ``size``."""
        out: list[tuple[int, int]] = []
        for k, (a, n) in enumerate(zip(self._starts, self._sizes, strict=True)):
            b = min(a + n, self.size)
            if k in self._released or a >= b:
                continue
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    def read_all(self, priority: int = READ_DEMAND) -> tuple[IOFuture, torch.Tensor]:
        """Read region bytes ``[0, size)`` into one buffer (``round_up(size)`` bytes, region byte ``x`` at
        ``buf[x]``); released chunks are not read (their bytes stay zero)."""
        buf = alloc_aligned(round_up(self.size, self.block), zero=bool(self._released))
        futs = [self.read(a, b, buf=buf[a:round_up(b, self.block)], priority=priority)[0] for a, b in self.held_spans()]
        return combine(futs, buf.numel(), keepalive=buf), buf

    def write_all(self, src: torch.Tensor, priority: int = WRITE_BACK) -> IOFuture:
        """Write region bytes ``[0, size)`` from ``src`` (uint8, region byte ``x`` at ``src[x]``), skipping
        released chunks."""
        futs = [self.write(a, b - a, lambda v, a=a, b=b: v.copy_(src[a:b]), priority=priority)[0]
                for a, b in self.held_spans()]
        return combine(futs, self.size, keepalive=src)

    def _pieces(self, a: int, b: int):
        """``(chunk_key, offset_in_chunk, offset_in_request, length)`` for aligned region bytes ``[a, b)``."""
        out = []
        pos = a
        k = bisect.bisect_right(self._starts, pos) - 1
        while pos < b:
            off = pos - self._starts[k]
            n = min(self._sizes[k] - off, b - pos)
            out.append((f"{self.name}/{k}", off, pos - a, n))
            pos += n
            k += 1
        return out

    # ------------------------------------------------------------------ reads
    def aligned(self, start: int, end: int) -> tuple[int, int]:
        """The block-aligned range ``[A, B)`` that encloses ``[start, end)``."""
        return round_down(start, self.block), round_up(end, self.block)

    def read(self, start: int, end: int, buf: torch.Tensor | None = None, priority: int = READ_DEMAND
             ) -> tuple[IOFuture, torch.Tensor, int]:
        """Read the aligned range enclosing ``[start, end)`` (after any overlapping write issued earlier).

        Returns:
            ``(future, buf, skip)``: ``buf`` (uint8, ``B - A`` bytes, page aligned; allocated when not
            given) holds region bytes ``[A, B)`` once the future completes, so region byte ``x`` is
            ``buf[x - A]`` and ``start`` is at ``buf[skip]``.
        """
        a, b = self.aligned(start, end)
        if buf is None:
            buf = alloc_aligned(b - a)
        futs = [self.store.read(key, buf[rel:rel + n], off, priority) for key, off, rel, n in self._pieces(a, b)]
        return combine(futs, b - a, keepalive=buf), buf, start - a

    # ------------------------------------------------------------------ writes
    def write(self, start: int, nbytes: int, fill, priority: int = WRITE_BACK) -> tuple[IOFuture, torch.Tensor, int]:
        """Write region bytes ``[start, start + nbytes)``.

        Args:
            start, nbytes: the byte range in the region.
            fill: ``fill(view)`` writes the new bytes into ``view`` (uint8, ``nbytes`` long) — e.g. a
                cast copy of fp32 master weights into bf16 — so the data is staged exactly once.
            priority: engine priority of the write.

        Returns:
            ``(future, staging, skip)``: the write's future; the staging buffer (region bytes
            ``[A, B)``, valid now and usable as a clean copy once the future completes); the offset
            of ``start`` in it. The staging buffer must not be modified before the future completes.
        """
        end = start + nbytes
        a, b = self.aligned(start, end)
        staging = alloc_aligned(b - a)
        with self._lock:
            if start > a:
                staging[: self.block].copy_(self._edge_block(a))
            if end < b and (b - self.block >= a + self.block or start == a):
                staging[b - a - self.block:].copy_(self._edge_block(b - self.block))
            fill(staging[start - a:end - a])
            self._written_end = max(self._written_end, end)
            futs = [self.store.write(key, staging[rel:rel + n], off, priority)
                    for key, off, rel, n in self._pieces(a, b)]
            fut = combine(futs, b - a, keepalive=staging)
            self._pending = [f for f in self._pending if not f.done()] + [fut]
            self._remember_edges(a, b, staging)
        return fut, staging, start - a

    def _edge_block(self, blk_start: int) -> torch.Tensor:
        """The current bytes of the block at region offset ``blk_start`` (lock held): from the edge cache, as
        zeros where no byte of it was ever written, otherwise read from the drive.

        [Note: blocks never written] Items are appended and first written in creation order, so the block
        holding the end of the last write is also the start of the next item: a fresh region's first write
        (``start == A`` with a partial tail) and every item appended past the bytes written so far would
        read back a block whose bytes no one wrote (one 4 KiB read per region, and one per item when the
        edge cache missed). Bytes at or past :attr:`_written_end` hold nothing, so those blocks are zeros
        and cost no I/O. A reopened region (:meth:`reopen`) counts all of its bytes as written."""
        idx = blk_start // self.block
        cached = self._edges.get(idx)
        if cached is not None:
            self._edges.move_to_end(idx)
            return cached
        if blk_start >= self._written_end:
            return torch.zeros(self.block, dtype=torch.uint8)
        self.boundary_reads += 1
        fut, buf, _ = self.read(blk_start, blk_start + self.block)
        fut.wait()
        return buf

    def _remember_edges(self, a: int, b: int, staging: torch.Tensor) -> None:
        first, last = a // self.block, (b // self.block) - 1
        for idx in [i for i in self._edges if first < i < last]:
            del self._edges[idx]
        for idx in {first, last}:
            rel = (idx - first) * self.block
            self._edges[idx] = staging[rel:rel + self.block].clone()
            self._edges.move_to_end(idx)
        while len(self._edges) > self._edge_limit:
            self._edges.popitem(last=False)

    def flush(self) -> None:
        """Wait for every write issued so far."""
        with self._lock:
            pending, self._pending = self._pending, []
        wait_all(pending)


class ExtentView:
    """The first ``size`` bytes of one store extent seen as a read-only region (the read API of
    :class:`PackedRegion`): fp32 parameter partitions read straight from their sub-group's master
    slot, which holds exactly those bytes (:mod:`aidaptiv_ds.planner.residency`, ``alias_params``).

    Args:
        store: the slab store; key: the extent; size: bytes of the view (from the extent's start).
    """

    def __init__(self, store: SlabStore, key: str, size: int) -> None:
        self.store = store
        self.name = key
        self.block = store.alignment
        self.size = int(size)

    def aligned(self, start: int, end: int) -> tuple[int, int]:
        """The block-aligned range ``[A, B)`` that encloses ``[start, end)``."""
        return round_down(start, self.block), round_up(end, self.block)

    def read(self, start: int, end: int, buf: torch.Tensor | None = None, priority: int = READ_DEMAND
             ) -> tuple[IOFuture, torch.Tensor, int]:
        """As :meth:`PackedRegion.read` (ordered after in-flight writes of the extent by the store)."""
        a, b = self.aligned(start, end)
        if buf is None:
            buf = alloc_aligned(b - a)
        return self.store.read(self.name, buf[: b - a], a, priority), buf, start - a

    def flush(self) -> None:
        """Nothing to wait for: the view is never written through."""
