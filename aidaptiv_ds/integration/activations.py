"""Boundary activations in the tiers: the block inputs a layer-major step keeps from its forward to its backward
(``layer_major.py``), as slices of the DRAM tier, written to the cache drives beyond the budget (issue 38).

[Note: a boundary activation's life]
``keep`` copies a block's input of one micro-batch into a page-aligned host buffer and adds it to the DRAM tier
as a dirty cached slice of kind ``"act"`` (device memory is freed when the caller drops its tensor). Within the
budget it stays; beyond it the tier evicts it like any dirty slice: written once to its extent on the cache
drives (booked by the ledger), the buffer freed. ``prefetch`` starts reading the ones a block's backward will
take next; ``take`` returns the tensor (in DRAM, or read back) and drops the slice without writing it: each
boundary activation is written at most once and read at most once per step, as the planner's layer-major
schedule counts it (``planner/schedule.py``: ``Aw`` written and read, ``Ad`` in DRAM).

Eviction: the tier ranks ``"act"`` slices above parameter slices (``TRAINING_KIND_RANK``), so they take what
the budget leaves before the parameter cache does ([Note: which DRAM the activations take] in the planner),
and among themselves the oldest go first: block 0's inputs, the last the backward needs.

Extents are allocated at a slot's first eviction (one per block and micro-batch, reused step after step, grown
when a longer sequence needs more) and freed with the store.
"""
from __future__ import annotations

import dataclasses

import torch

from ..io.buffers import alloc_aligned, round_up
from ..io.engine import READ_DEMAND, READ_PREFETCH, WRITE_BACK
from ..tiers.unit import TieredUnit
from .runtime import Runtime


@dataclasses.dataclass
class _Kept:
    """One kept activation: its slice while in DRAM (None once evicted), its tensor's shape, dtype and device."""
    key: tuple
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    slice: TieredUnit | None = None
    on_drive: bool = False
    read_back: bool = False  # its slice is a read from the drive (counted in ``read_bytes``)


class BoundaryStore:
    """The boundary activations of one engine's layer-major steps ([Note: a boundary activation's life]).

    Args:
        runtime: the process runtime (store, DRAM tier, I/O wait timer).
        engine_id: distinguishes the extents of several engines in one process.
    """

    def __init__(self, runtime: Runtime, engine_id: int) -> None:
        self.rt = runtime
        self.engine_id = engine_id
        self._kept: dict[tuple, _Kept] = {}
        self._extent_bytes: dict[tuple, int] = {}
        self.written_bytes = 0  # to the cache drives (also in the ledger)
        self.read_bytes = 0
        #: taken from DRAM instead of read back: its write-back still in flight (a slow drive), or kept by the
        #: budget. Each kept activation is taken once, from one or the other: read + DRAM = kept, on any drive
        self.dram_bytes = 0
        runtime.attach_boundary_store(self)

    def _extent(self, key: tuple) -> str:
        return "act{}/{}/{}".format(self.engine_id, *key)

    def _writeback(self, k: _Kept):
        def write(s: TieredUnit):
            name = self._extent(k.key)
            have = self._extent_bytes.get(k.key, 0)
            if have < k.nbytes:
                if have:
                    self.rt.store.free(name)
                self.rt.store.allocate(name, k.nbytes)
                self._extent_bytes[k.key] = k.nbytes
            fut = self.rt.store.write(name, s.buf[: k.nbytes], 0, WRITE_BACK)
            k.on_drive = True
            self.written_bytes += k.nbytes
            return fut
        return write

    def _on_drop(self, k: _Kept):
        def dropped(s: TieredUnit) -> None:
            if k.slice is s:
                k.slice = None
        return dropped

    def _slice(self, k: _Kept, buf: torch.Tensor, dirty: bool, ready=None) -> TieredUnit:
        s = TieredUnit(("act", self.engine_id) + k.key, buf, kind="act", dirty=dirty, ready=ready,
                       prefetched=ready is not None, writeback=self._writeback(k), on_drop=self._on_drop(k))
        k.slice = s
        return s

    def keep(self, key: tuple, x: torch.Tensor) -> tuple:
        """Keep ``x`` (any shape, dtype and device) under ``key`` (block, micro-batch) until :meth:`take`.

        Returns:
            ``key``, the token :meth:`take` takes.
        """
        old = self._kept.pop(key, None)
        if old is not None and old.slice is not None:
            self.rt.tier.drop(old.slice)
        nbytes = round_up(max(x.numel() * x.element_size(), 1), self.rt.store.alignment)
        k = _Kept(key, x.shape, x.dtype, x.device, nbytes)
        buf = alloc_aligned(nbytes, dtype=torch.uint8)
        buf[: x.numel() * x.element_size()].view(x.dtype).view(x.shape).copy_(x.detach())
        self._kept[key] = k
        self.rt.tier.add(self._slice(k, buf, dirty=True))
        return key

    def prefetch(self, keys) -> None:
        """Start reading back those of ``keys`` that are only on the drives."""
        for key in keys:
            k = self._kept.get(key)
            if k is not None and k.slice is None and k.on_drive:
                self._read(k, READ_PREFETCH)

    def _read(self, k: _Kept, priority: int) -> TieredUnit:
        buf = alloc_aligned(k.nbytes, dtype=torch.uint8)
        fut = self.rt.store.read(self._extent(k.key), buf, 0, priority)
        self.read_bytes += k.nbytes
        k.read_back = True
        s = self._slice(k, buf, dirty=False, ready=fut)
        self.rt.tier.add(s)
        return s

    def take(self, key: tuple) -> torch.Tensor:
        """The activation kept under ``key``, on its device; it leaves the store (never written again).

        Raises:
            KeyError: nothing is kept under ``key``.
        """
        k = self._kept.pop(key)
        s = k.slice if k.slice is not None else self._read(k, READ_DEMAND)
        if not k.read_back:
            self.dram_bytes += k.nbytes
        self.rt.tier.acquire(s)
        with self.rt.io_wait:
            s.wait_ready()
        n = 1
        for d in k.shape:
            n *= d
        x = s.buf[: n * k.dtype.itemsize].view(k.dtype).view(k.shape)
        if k.device.type != "cpu":
            x = x.to(k.device)
        self.rt.tier.release(s)
        self.rt.tier.drop(s)  # out of the budget's books: on a CPU rank the view keeps the buffer (working memory)
        return x

    def discard(self) -> None:
        """Forget every kept activation (a step that failed between its forward and its backward)."""
        for k in self._kept.values():
            if k.slice is not None:
                self.rt.tier.drop(k.slice)
        self._kept.clear()

