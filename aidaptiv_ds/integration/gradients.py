"""Gradient partitions in the tiers: one accumulation slice per optimizer sub-group, in DRAM within the
budget and on the cache drives beyond it.

DeepSpeed 0.19.8's Stage 3 keeps every gradient partition of the rank in one flat host buffer
whenever the optimizer is offloaded (``grad_partitions_flat_buffer``, ``stage3.py:786-800``: 4 B/param
in fp32, 2 B in bf16, for the whole run), so host memory grows with the model whatever the offload
does. The Stage-3 subclass (:mod:`aidaptiv_ds.integration.stage3`) never allocates that buffer; the
gradient partitions accumulate here instead.

[Note: the state machine of one sub-group's gradient]

Each sub-group has a :class:`SubGroupGrads` record; its gradient is one tensor of ``numel`` elements
in the gradient-accumulation dtype, laid out as DeepSpeed's ``grad_position`` (the sub-group's
partitions end to end). Its states:

* ``EMPTY``: no gradient in this accumulation window (the sub-group's gradient is zero);
* ``HELD``: the window's gradient exists; its bytes are in a DRAM slice (``slice``), on the drive
  (``on_drive``: the last write-back holds them), or both (a clean cached slice).

``EMPTY -> HELD`` at the first partition that arrives in the window (a fresh zeroed slice);
``HELD -> EMPTY`` when the optimizer step consumed it (:meth:`GradientStore.consume`), or when the
window is thrown away (fp16 overflow, :meth:`GradientStore.discard_all`). A slice that is being
filled (its sub-group received a partition in the current micro-step and not all of them yet) is
*open*: pinned as working memory, up to :attr:`GradientStore.window_bytes`; the least recently
filled open slice is unpinned first. An unpinned slice is a dirty cached slice of the DRAM tier:
kept while the budget allows, written to its extent when evicted (counted by the ledger like every
write), read back when the next micro-step or the optimizer step needs it.

[Note: arithmetic, as DeepSpeed's]

``accumulate`` does what DeepSpeed's ``partition_grads`` does to its flat buffer (``stage3.py:2006-2052``):
the first partition of the window is copied in (``copy_``), later ones are added in the accumulation
dtype (``add_(g.to(dtype))``), so the bits are DeepSpeed's. One difference, on purpose: DeepSpeed
decides copy-or-add by the micro-step counter, so a partition that first arrives in a later
micro-step of the window is added to whatever an *earlier* step left in its buffer. Here the
window's buffer starts at zero, so a parameter that gets no gradient in some micro-steps or a
whole window contributes exactly the gradients of this window (see ``docs/gradients.md``).
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from collections.abc import Callable

import torch

from ..io.buffers import alloc_aligned, round_up
from ..io.engine import READ_DEMAND, READ_PREFETCH, WRITE_BACK
from ..tiers.unit import TieredUnit
from .runtime import Runtime

log = logging.getLogger("aidaptiv_ds")


class GradState(enum.Enum):
    EMPTY = "empty"
    HELD = "held"


@dataclasses.dataclass
class SubGroupGrads:
    """Gradient accumulation state of one optimizer sub-group (see the module's notes).

    Attributes:
        index: the sub-group's index (DeepSpeed's ``sub_group_id``).
        numel: elements of the sub-group's gradient (sum of its partitions' ``partition_numel``).
        expected: partitions that receive a gradient (``requires_grad`` and real data on this rank).
        state: :class:`GradState`.
        arrived: ``ds_id`` s that received a gradient in this window.
        arrived_now: ``ds_id`` s that received one in the current micro-step (backward).
        slice: the DRAM slice holding the bytes, or None.
        on_drive: the extent holds the window's current bytes (the last write-back).
        extent: key of the spill extent (allocated on the first write-back).
        pinned: this store holds a reference on ``slice`` (it is open in the backward window, or the
            optimizer is using it), so the DRAM tier cannot evict it.
        resident: the slice is booked as resident DRAM (within the gradients' share of the budget,
            never evicted) rather than cached (evicted and written when the budget needs room).
    """
    index: int
    numel: int
    expected: int
    state: GradState = GradState.EMPTY
    arrived: set = dataclasses.field(default_factory=set)
    arrived_now: set = dataclasses.field(default_factory=set)
    slice: TieredUnit | None = None
    on_drive: bool = False
    extent: str | None = None
    pinned: bool = False
    resident: bool = False
    nonfinite: bool = False  # an inf or NaN was accumulated in this window (tracked for fp16 only)

    @property
    def complete_now(self) -> bool:
        """Every partition that receives gradients did so in the current micro-step."""
        return self.expected > 0 and len(self.arrived_now) >= self.expected


class GradientStore:
    """The gradients of one engine's optimizer sub-groups (one per Stage-3 optimizer).

    Args:
        runtime: the process runtime (store, tier, I/O wait timer).
        engine_id: distinguishes the extents of several engines in one process.
        dtype: the gradient-accumulation dtype (DeepSpeed's ``gradient_accumulation_dtype``).
        numels: elements per sub-group.
        expected: partitions per sub-group that receive gradients.
        window_bytes: open (pinned) slices kept at most; at least the largest slice.
        resident_bytes: the gradients' share of the DRAM budget (the residency plan's).
        resident_subgroups: the sub-groups whose slices are resident (never evicted, never written),
            as the residency plan chose them; the others are cached (evicted and written when the
            budget needs room). None: first come, while they fit in ``resident_bytes``.
        device_sync: called before host code reads a slice that device copies wrote into
            (``stream.synchronize`` of the stream the copies ran on); None on CPU ranks.
    """

    def __init__(self, runtime: Runtime, engine_id: int, dtype: torch.dtype, numels: list[int],
                 expected: list[int], window_bytes: int = 0, resident_bytes: int = 0,
                 device_sync: Callable[[], None] | None = None, resident_subgroups: list[int] | None = None) -> None:
        self.rt = runtime
        self.engine_id = engine_id
        self.dtype = dtype
        self.elsize = dtype.itemsize
        self.groups = [SubGroupGrads(i, int(n), int(e)) for i, (n, e) in enumerate(zip(numels, expected))]
        largest = max((self._nbytes(g) for g in self.groups), default=0)
        self.window_bytes = max(int(window_bytes), largest)
        self.resident_limit = int(resident_bytes)
        self.resident_subgroups = None if resident_subgroups is None else set(resident_subgroups)
        self.device_sync = device_sync
        self._open: collections.OrderedDict[int, SubGroupGrads] = collections.OrderedDict()
        self.spilled_bytes = 0  # gradient bytes written to the cache tier (also in the ledger)
        self.read_back_bytes = 0
        self._counting_now = True  # arrivals count as "in the last micro-step" (count_arrivals_now)

    # ------------------------------------------------------------------ sizes
    def _nbytes(self, g: SubGroupGrads) -> int:
        return round_up(g.numel * self.elsize, self.rt.store.alignment)

    def total_bytes(self) -> int:
        """Bytes of every sub-group's gradient (what DeepSpeed's flat buffer would hold, aligned)."""
        return sum(self._nbytes(g) for g in self.groups)

    def open_bytes(self) -> int:
        return sum(self._nbytes(g) for g in self._open.values())

    def resident_bytes(self) -> int:
        return sum(self._nbytes(g) for g in self.groups if g.resident and g.slice is not None)

    # ------------------------------------------------------------------ slices
    def _key(self, g: SubGroupGrads) -> tuple:
        return ("grad", self.engine_id, g.index)

    def _writeback(self, g: SubGroupGrads):
        def write(s: TieredUnit):
            if self.device_sync is not None:
                self.device_sync()
            if g.extent is None:
                g.extent = f"grad{self.engine_id}/{g.index}"
                self.rt.store.allocate(g.extent, self._nbytes(g))
            fut = self.rt.store.write(g.extent, s.buf[: self._nbytes(g)], 0, WRITE_BACK)
            g.on_drive = True
            self.spilled_bytes += self._nbytes(g)
            return fut
        return write

    def _on_drop(self, g: SubGroupGrads):
        def dropped(s: TieredUnit) -> None:
            if g.slice is s:
                g.slice = None
                g.resident = False
        return dropped

    def _new_slice(self, g: SubGroupGrads, buf: torch.Tensor, ready=None, dirty: bool = True) -> TieredUnit:
        if self.resident_subgroups is not None:
            g.resident = g.index in self.resident_subgroups
        else:
            g.resident = self.resident_bytes() + self._nbytes(g) <= self.resident_limit
        s = TieredUnit(self._key(g), buf, kind="grad", dirty=dirty, ready=ready, prefetched=ready is not None,
                       resident=g.resident, writeback=self._writeback(g), on_drop=self._on_drop(g))
        g.slice = s
        return s

    def _pin(self, g: SubGroupGrads) -> None:
        if not g.pinned:
            self.rt.tier.acquire(g.slice)
            g.pinned = True

    def _unpin(self, g: SubGroupGrads) -> None:
        if g.pinned:
            g.pinned = False
            if g.slice is not None:
                self.rt.tier.release(g.slice)

    def _load(self, g: SubGroupGrads, priority: int) -> TieredUnit | None:
        """The slice of a HELD gradient, reading it back from its extent when not in DRAM."""
        if g.state is GradState.EMPTY:
            return None
        if g.slice is not None:
            return g.slice
        if not g.on_drive:
            raise RuntimeError(f"aidaptiv_ds: the gradient of sub-group {g.index} is neither in DRAM nor on the drive")
        buf = alloc_aligned(self._nbytes(g), dtype=self.dtype)
        fut = self.rt.store.read(g.extent, buf, 0, priority)
        self.read_back_bytes += self._nbytes(g)
        s = self._new_slice(g, buf, ready=fut, dirty=False)
        self.rt.tier.add(s)
        return s

    def prefetch(self, index: int) -> None:
        """Start reading sub-group ``index`` 's gradient back if it is only on the drive (no-op otherwise)."""
        if 0 <= index < len(self.groups):
            self._load(self.groups[index], READ_PREFETCH)

    # ------------------------------------------------------------------ backward
    def open(self, index: int) -> SubGroupGrads:
        """Make sub-group ``index`` 's gradient writable in DRAM (pinned as working memory) and return
        its record; an EMPTY one gets a zeroed slice. Unpins the oldest open slices past the window."""
        g = self.groups[index]
        if g.state is GradState.EMPTY:
            g.state = GradState.HELD
            g.on_drive = False
            s = self._new_slice(g, alloc_aligned(self._nbytes(g), dtype=self.dtype, zero=True))
            self._pin(g)
            self.rt.tier.add(s)
        else:
            s = self._load(g, READ_DEMAND)
            with self.rt.io_wait:
                s.wait_ready()
            self._pin(g)
            self.rt.tier.mark_dirty(s)  # about to change: the drive's copy is stale from here
            g.on_drive = False
        if index in self._open:
            self._open.move_to_end(index)
        else:
            self._open[index] = g
            while len(self._open) > 1 and self.open_bytes() > self.window_bytes:
                self.close(next(iter(self._open)))
        return g

    def view(self, g: SubGroupGrads, offset: int, numel: int) -> torch.Tensor:
        """Elements ``[offset, offset + numel)`` of an open sub-group's gradient (a view, accumulation dtype)."""
        return g.slice.buf[offset: offset + numel]

    def arrive(self, g: SubGroupGrads, ds_id: int) -> bool:
        """Record that partition ``ds_id`` of ``g`` got a gradient now; True when it is its first of the window."""
        first = ds_id not in g.arrived
        g.arrived.add(ds_id)
        if self._counting_now:
            g.arrived_now.add(ds_id)
        return first

    def count_arrivals_now(self, counting: bool) -> None:
        """Whether the next arrivals count as arrivals "in the current micro-step" (``arrived_now``).

        Always True micro-batch by micro-batch. A layer-major step (``layer_major.py``, [Note: exact
        against micro-batch-major]) runs every micro-batch inside one backward, block by block: only
        the pieces of the last micro-batch are the accumulation boundary, so only their arrivals count
        towards a sub-group's ``complete_now`` and the norms of earlier gradients."""
        self._counting_now = bool(counting)

    def check_finite(self, g: SubGroupGrads, accumulated: torch.Tensor) -> None:
        """Record an inf/NaN in a partition's just-accumulated values (``accumulated``: its view, or the
        device copy with the same values). Only when accumulating in fp16, where DeepSpeed's overflow
        check scans its flat buffer; an inf or NaN, once accumulated, stays until the window ends."""
        if self.dtype == torch.float16 and not g.nonfinite:
            g.nonfinite = not bool(torch.isfinite(accumulated).all())

    def any_nonfinite(self) -> bool:
        """Some gradient of this window holds an inf or NaN (fp16 accumulation)."""
        return any(g.nonfinite for g in self.groups if g.state is GradState.HELD)

    def close(self, index: int) -> None:
        """Unpin an open slice (its sub-group is done for this micro-step, or the window is full)."""
        g = self._open.pop(index, None)
        if g is not None:
            self._unpin(g)

    def end_backward(self) -> None:
        """End of a backward pass: unpin every open slice and forget the micro-step's arrivals."""
        for i in list(self._open):
            self.close(i)
        for g in self.groups:
            g.arrived_now.clear()

    # ------------------------------------------------------------------ optimizer step
    def fp32_grad(self, index: int, priority: int = READ_DEMAND) -> torch.Tensor:
        """Sub-group ``index`` 's gradient as fp32 (``numel`` elements), as DeepSpeed's optimizer sees it:
        the accumulated values converted with ``Tensor.to`` (exact widening from bf16/fp16), zeros for a
        sub-group that got no gradient in the window. The slice stays pinned until :meth:`consume`.

        Returns:
            A CPU fp32 tensor: the slice itself when accumulating in fp32, else a converted copy.
        """
        g = self.groups[index]
        s = self._load(g, priority)
        if s is None:
            return torch.zeros(g.numel, dtype=torch.float32)
        with self.rt.io_wait:
            s.wait_ready()
        self._pin(g)  # the optimizer uses it now
        if self.device_sync is not None:
            self.device_sync()
        view = s.buf[: g.numel]
        return view if self.dtype == torch.float32 else view.to(torch.float32)

    def release(self, index: int) -> None:
        """The optimizer is done reading sub-group ``index`` 's gradient without stepping (a read-only
        swap-in): unpin it, keep it."""
        g = self.groups[index]
        if index not in self._open:
            self._unpin(g)

    def consume(self, index: int) -> None:
        """The optimizer step took sub-group ``index`` 's gradient: drop it without writing (``EMPTY``)."""
        g = self._open.pop(index, None) or self.groups[index]
        s = g.slice
        if s is not None:  # out of the tier first (clean): releasing our reference must not evict it as dirty
            self.rt.tier.drop(s)
        g.pinned = False  # the reference went with the slice
        g.slice = None
        g.resident = False
        g.state = GradState.EMPTY
        g.on_drive = False
        g.arrived.clear()
        g.arrived_now.clear()
        g.nonfinite = False

    def discard_all(self) -> None:
        """Throw the window's gradients away (the step was skipped, or every sub-group was stepped)."""
        for g in self.groups:
            self.consume(g.index)

    def replace(self, index: int, fp32: torch.Tensor) -> None:
        """Set sub-group ``index`` 's gradient to ``fp32`` (``numel`` elements; DeepSpeed's ``safe_set``
        gradient APIs write fp32 values back through ``writeback_optimizer_state_and_gradients``)."""
        g = self.groups[index]
        was_open = index in self._open
        self.open(index)
        g.slice.buf[: g.numel].copy_(fp32.reshape(-1).to(self.dtype))
        if not was_open:
            self.close(index)

    def counters(self) -> dict:
        return {"grad_spilled_bytes": self.spilled_bytes, "grad_read_back_bytes": self.read_back_bytes}
