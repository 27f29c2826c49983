"""A tiered unit: one record per unit of state the tiers move, its typed slots and its life (issue 39).

A unit is what the tiers move as one: a run of packed parameter partitions, an optimizer sub-group (its fp32
master weights and the optimizer's per-element states), a gradient slice, an activation, a KV block. Its bytes
are one extent on the drives and one host buffer in DRAM, read and written in one sequential transfer; the
tensors compute works on are views of that buffer. It is the counterpart of FSDP2's ``FSDPParam``:

* :class:`UnitLayout` says where each tensor lies and in which dtype (typed :class:`Slot` s), so the swapper,
  the checkpoint writer and the planner read one record instead of each computing ``numel x elsize x slots``;
* :class:`TieredUnit` is the unit in the host tier: its buffer, its layout, its key, and the fields its
  :class:`UnitState` follows from, changed only by the transitions below, which
  :class:`~aidaptiv_ds.tiers.host_tier.HostTier` runs under its lock ([Note: a unit's transitions]). Owners (the
  parameter and optimizer swappers, the gradient store, the activation and KV block stores) hold units and ask
  the tier for transitions; they never change a unit themselves (``tests/test_layers.py`` checks both).

[Note: packing] Slots are packed in order, each starting where the previous ends, rounded up to its own
element size (a view of a dtype needs that alignment; for slots of one dtype nothing is rounded). A layout
of ``k`` fp32 slots is therefore the fp32 ``[k, numel]`` tensor the checkpoint format has always stored
(``checkpoint/format.py``), byte for byte, and a unit whose later slots are not filled yet (an optimizer
before its first step) is read and written as the prefix of its first slots
(:meth:`UnitLayout.prefix_bytes`).

[Note: quantized slots]
A slot of ``block`` > 0 is block-quantized (``tiers/blockwise.py``, int8 moments): ``numel`` uint8 codes, then,
from the next 4-byte boundary, one fp32 scale per block of ``block`` elements. Its values are read and written
only as fp32 through :meth:`Slot.read` / :meth:`Slot.write`, over ranges that start on a block boundary;
:meth:`Slot.view` gives the codes.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Hashable, Sequence

import torch

from ..errors import AidaptivError
from ..io.futures import IOFuture
from . import blockwise


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor of a unit: ``numel`` elements of ``dtype`` at byte ``offset`` of the unit's bytes.

    ``block`` > 0: block-quantized ([Note: quantized slots]): ``dtype`` is uint8 (the codes), ``signed`` picks the
    map (``tiers/blockwise.py``).
    """
    name: str
    dtype: torch.dtype
    offset: int
    numel: int
    block: int = 0
    signed: bool = True

    @property
    def quantized(self) -> bool:
        return self.block > 0

    @property
    def nbytes(self) -> int:
        """Bytes of the slot's elements (``numel x dtype.itemsize``; the codes of a quantized slot)."""
        return self.numel * self.dtype.itemsize

    @property
    def scale_offset(self) -> int:
        """Byte offset of a quantized slot's fp32 scales (after the codes, 4-byte aligned)."""
        return -(-(self.offset + self.nbytes) // blockwise.SCALE_BYTES) * blockwise.SCALE_BYTES

    @property
    def end(self) -> int:
        """Byte offset one past the slot's last byte (its scales' for a quantized slot)."""
        if self.quantized:
            return self.scale_offset + blockwise.SCALE_BYTES * -(-self.numel // self.block)
        return self.offset + self.nbytes

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """The slot as a flat tensor of ``dtype`` (shape ``(numel,)``; a quantized slot's codes) viewing ``buf``
        (uint8, the unit's bytes from offset 0; at least :attr:`end` bytes). No copy.

        Raises:
            ValueError: ``buf`` is not uint8 or is shorter than the slot's end.
        """
        if buf.dtype != torch.uint8 or buf.numel() < self.end:
            raise ValueError(f"slot {self.name!r} needs a uint8 buffer of >= {self.end} bytes, got "
                             f"{buf.dtype} of {buf.numel()}")
        return buf[self.offset:self.offset + self.nbytes].view(self.dtype)

    def scales(self, buf: torch.Tensor) -> torch.Tensor:
        """A quantized slot's fp32 scales, one per block (shape ``(ceil(numel / block),)``), viewing ``buf``."""
        return self._scales(buf, 0, self.numel)

    def _scales(self, buf: torch.Tensor, start: int, length: int) -> torch.Tensor:
        if start % self.block:
            raise ValueError(f"slot {self.name!r} is quantized in blocks of {self.block}: a range must start on a "
                             f"block boundary, not at element {start}")
        first = start // self.block
        return buf[self.scale_offset:self.end].view(torch.float32)[first:first + -(-length // self.block)]

    def _range(self, start: int, length: int | None) -> int:
        length = self.numel - start if length is None else length
        if start < 0 or length < 0 or start + length > self.numel:
            raise ValueError(f"slot {self.name!r} of {self.numel} elements has no range [{start}, {start + length})")
        return length

    def read(self, buf: torch.Tensor, start: int = 0, length: int | None = None,
             out: torch.Tensor | None = None, index: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start + length)`` (default: to the end) as fp32 ``(length,)``: a view for an fp32
        slot, else widened exactly or dequantized (``tiers/blockwise.py``) into ``out`` (fp32, at least
        ``length`` elements; its first ``length`` are used) or a new tensor. ``index``: int32 scratch of at least
        ``length`` elements for a quantized slot's map indices (``blockwise.dequantize``).

        Raises:
            ValueError: the range is outside the slot, or does not start on a block of a quantized slot.
        """
        length = self._range(start, length)
        codes = self.view(buf)[start:start + length]
        if self.dtype == torch.float32 and not self.quantized:
            return codes
        dst = None if out is None else out[:length]
        if self.quantized:
            return blockwise.dequantize(codes, self._scales(buf, start, length), self.signed, out=dst, index=index)
        return codes.float() if dst is None else dst.copy_(codes)

    def write(self, buf: torch.Tensor, values: torch.Tensor, start: int = 0, overwrite: bool = False) -> None:
        """Store ``values`` (``(length,)``, any float dtype) at elements ``[start, start + length)``: copied
        (``Tensor.copy_``: round to nearest even when narrowing) or quantized (a quantized slot's range must start
        on a block boundary and end on one or at the slot's end). Writing a slot's own fp32 view is a no-op copy.
        ``overwrite``: ``values`` is the caller's scratch, which quantizing may overwrite (``blockwise.quantize``).

        Raises:
            ValueError: the range is outside the slot, or not made of whole blocks of a quantized slot.
        """
        length = self._range(start, values.numel())
        dst = self.view(buf)[start:start + length]
        if not self.quantized:
            dst.copy_(values.reshape(-1))
            return
        if length % self.block and start + length != self.numel:
            raise ValueError(f"slot {self.name!r}: a quantized write must end on a block of {self.block} or at the "
                             f"slot's end, not at element {start + length}")
        src = values.reshape(-1)
        blockwise.quantize(src if src.dtype == torch.float32 else src.float(), dst,
                           self._scales(buf, start, length), self.signed,
                           overwrite=overwrite and src.dtype == torch.float32)


@dataclasses.dataclass(frozen=True)
class MomentFormat:
    """How an optimizer's moments are stored (``"optimizer_state": {"moments": ...}``): a dtype, or uint8 codes
    quantized in blocks of ``block`` (``tiers/blockwise.py``)."""
    name: str
    dtype: torch.dtype
    block: int = 0

    @property
    def bytes_per_element(self) -> float:
        """Stored bytes per element (4 fp32, 2 bf16, 1 + 4/256 int8 with its scales)."""
        return self.dtype.itemsize + (blockwise.SCALE_BYTES / self.block if self.block else 0.0)

    def spec(self, name: str, signed: bool = True) -> tuple:
        """A :meth:`UnitLayout.packed` spec of a moment slot in this format."""
        return (name, self.dtype, self.block, signed) if self.block else (name, self.dtype)


#: the formats ``optimizer_state.moments`` names
MOMENT_FORMATS = {"fp32": MomentFormat("fp32", torch.float32), "bf16": MomentFormat("bf16", torch.bfloat16),
                  "int8": MomentFormat("int8", torch.uint8, blockwise.BLOCK)}


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """Where each slot of a unit of ``numel`` elements lies ([Note: packing]).

    Build one with :meth:`packed`; ``slots[0]`` is the first (for an optimizer sub-group, its master weights).
    """
    numel: int
    slots: tuple[Slot, ...]

    @classmethod
    def packed(cls, numel: int, specs: Sequence[tuple]) -> UnitLayout:
        """Slots named and typed by ``specs`` (in order), each of ``numel`` elements, packed end to end.

        A spec is ``(name, dtype)``, or ``(name, torch.uint8, block, signed)`` for a block-quantized slot
        ([Note: quantized slots]; :meth:`MomentFormat.spec` builds one).

        Raises:
            ValueError: ``numel`` < 0 or two slots share a name.
        """
        if numel < 0:
            raise ValueError(f"a unit cannot hold {numel} elements")
        names = [sp[0] for sp in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"slot names repeat: {names}")
        slots, off = [], 0
        for name, dtype, *quant in specs:
            block, signed = (int(quant[0]), bool(quant[1])) if quant else (0, True)
            if block and dtype != torch.uint8:
                raise ValueError(f"slot {name!r}: a quantized slot holds uint8 codes, not {dtype}")
            size = dtype.itemsize
            off = -(-off // size) * size
            slot = Slot(name, dtype, off, numel, block, signed)
            slots.append(slot)
            off = slot.end
        return cls(numel, tuple(slots))

    def all_of(self, dtype: torch.dtype, k: int | None = None) -> bool:
        """The first ``k`` slots (all when None) are all plain ``dtype``: their bytes are one ``[k, numel]`` tensor
        of it."""
        return all(s.dtype == dtype and not s.quantized for s in self.slots[:len(self.slots) if k is None else k])

    def prefix_bytes(self, k: int | None = None) -> int:
        """Bytes of the first ``k`` slots (all when None): where slot ``k - 1`` ends; 0 for ``k`` = 0."""
        k = len(self.slots) if k is None else k
        if not 0 <= k <= len(self.slots):
            raise ValueError(f"a unit of {len(self.slots)} slots has no prefix of {k}")
        return self.slots[k - 1].end if k else 0

    def widened(self, buf: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The first ``k`` slots as one ``[k, numel]`` tensor of ``dtype``: a view of ``buf`` when they are all
        ``dtype`` already, else a new tensor with each slot converted (exact for a wider ``dtype``; a quantized
        slot dequantized)."""
        if self.all_of(dtype, k):
            return buf[:k * self.numel * dtype.itemsize].view(dtype).reshape(k, self.numel)
        out = torch.empty(k, self.numel, dtype=dtype)
        for j, s in enumerate(self.slots[:k]):
            out[j].copy_(s.read(buf) if s.quantized else s.view(buf))
        return out

    def fill(self, buf: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` (``[k, numel]``, any float dtype) into the first ``k`` slots of ``buf``, each converted
        to its slot's dtype (``Tensor.copy_``: round to nearest even when narrowing; quantized for a quantized
        slot, :meth:`Slot.write`)."""
        for j, s in enumerate(self.slots[:rows.shape[0]]):
            s.write(buf, rows[j])


def optimizer_layout(numel: int, master: torch.dtype, moments: MomentFormat, slots: int,
                     moment_slots: int = 2) -> UnitLayout:
    """An optimizer sub-group's layout: the master weights in ``master``, then ``slots - 1`` states, the first
    ``moment_slots`` of them (Adam's moments) in ``moments`` and any further ones in ``master``. Quantized moments
    take the signed map for ``state1`` (``exp_avg``) and the unsigned one for ``state2`` (``exp_avg_sq``: Adam's
    state names sort in that order). The swapper lays its extents out with it and the planner counts them with it.
    """
    specs = [("master", master)] + [moments.spec(f"state{j}", signed=j == 1) if j <= moment_slots
                                    else (f"state{j}", master) for j in range(1, slots)]
    return UnitLayout.packed(numel, specs)


class UnitState(enum.Enum):
    """Where a unit is in its life ([Note: a unit's transitions]); :attr:`TieredUnit.state` derives it from the
    unit's fields."""
    NEW = "new"  # built, not in a tier yet
    READING = "reading"  # in the tier, its read still filling ``buf``
    IN_USE = "in_use"  # referenced by compute (never evicted)
    PREFETCHED = "prefetched"  # read ahead of use, not used yet (working memory)
    WRITING = "writing"  # unreferenced, its write-back in flight (working memory)
    RESIDENT = "resident"  # planned to stay in DRAM
    CACHED = "cached"  # unreferenced, kept while the budget allows
    GONE = "gone"  # left the tier (evicted or dropped); its owner was told (``on_drop``)


class UnitStateError(AidaptivError, RuntimeError):
    """A transition a unit's state does not allow (a bug of its owner or of the tier)."""


_ALL = frozenset(UnitState)
_IN_TIER = _ALL - {UnitState.NEW, UnitState.GONE}

# [Note: a unit's transitions]
# A unit's state follows from its fields (in the tier or not, references, a read or write in flight, read ahead,
# resident); the fields change only through the transitions below, each allowed from the states in
# ``TRANSITIONS`` and refused otherwise (:class:`UnitStateError`, naming the unit, the transition and the state).
# :class:`HostTier` runs them under its lock, so a state read under that lock is the unit's state.
#   enter       NEW/GONE -> READING, PREFETCHED, RESIDENT, CACHED or WRITING (``HostTier.add``: a unit built with a
#               read in flight is READING; one "loaded" is already filled)
#   pin         any but GONE -> IN_USE        (``acquire``; a NEW unit may be pinned before it enters, so that
#               entering at a budget of 0 does not evict it at once)
#   unpin       IN_USE -> CACHED / RESIDENT / WRITING (``release``; refused without a reference)
#   mark_dirty  any but GONE                  (the bytes will differ from the copy below: written before it goes)
#   mark_used   any                           (a read-ahead unit was used by copy: it is cached from now on)
#   write_back  any but GONE, dirty -> WRITING once unreferenced (the write is decided: the unit is clean)
#   written     WRITING -> CACHED / RESIDENT  (its write completed)
#   discard     any                           (its bytes are stale: clean, never written)
#   evict       in the tier, unreferenced -> GONE (a dirty one is written back first and goes once written)
#   leave       in the tier -> GONE           (evicted or dropped; the owner is told after the lock)
# ``pin``, ``mark_dirty`` and ``write_back`` of a unit that left the tier are its owner's bugs (a reference the
# budget does not see, a write of bytes nobody will read), so they raise.
TRANSITIONS: dict[str, frozenset[UnitState]] = {
    "enter": frozenset({UnitState.NEW, UnitState.GONE}),
    "pin": _ALL - {UnitState.GONE},
    "unpin": _ALL,  # and a reference held
    "mark_dirty": _ALL - {UnitState.GONE},
    "mark_used": _ALL,
    "write_back": _ALL - {UnitState.GONE},  # and dirty
    "written": _ALL,  # of the write in flight, when it is the one given
    "discard": _ALL,
    "evict": _IN_TIER - {UnitState.IN_USE},
    "leave": _IN_TIER,
}


class TieredUnit:
    """One unit of state in the host tier: its host bytes, its layout, and where it is in its life.

    Owners build a unit and hand it to :class:`~aidaptiv_ds.tiers.host_tier.HostTier`; from then on only the
    tier changes it, through the transitions of [Note: a unit's transitions].

    Attributes:
        key: identity in the tier.
        buf: the host buffer (any dtype; ``nbytes`` is what is booked).
        layout: the unit's typed slots (:class:`UnitLayout`), or None for a unit of one untyped run of bytes.
        kind: which owner's unit (``"param"``, ``"opt"``, ``"grad"``, ``"act"``, ``"kv"``); the eviction policy
            ranks kinds ([Note: ranking the kinds in training], ``tiers/eviction.py``).
        members: ids used to compute the next use (default ``(key,)``).
        resident: planned to stay in DRAM (never evicted).
        refs: compute references (a referenced unit is never evicted).
        dirty: the bytes differ from the copy below; ``writeback`` must run before it may be dropped.
        ready: pending read filling ``buf`` (wait before use), or None.
        writing: pending write-back from ``buf``, or None.
        prefetched: read ahead of use and not used yet (booked as working memory).
        writeback: ``fn(unit) -> IOFuture`` that writes ``buf`` below (the owner's: it names extent and span).
        on_drop: ``fn(unit)`` called when the unit leaves the tier (owners unmap it there), after the tier's lock.
    """

    __slots__ = ("key", "buf", "nbytes", "layout", "members", "resident", "refs", "dirty", "ready", "writing",
                 "prefetched", "writeback", "on_drop", "last_use", "kind", "in_tier", "was_in_tier")

    def __init__(self, key: Hashable, buf: torch.Tensor, nbytes: int | None = None, members=None,
                 resident: bool = False, kind: str = "", writeback: Callable | None = None,
                 on_drop: Callable | None = None, ready: IOFuture | None = None, prefetched: bool = False,
                 dirty: bool = False, layout: UnitLayout | None = None) -> None:
        self.key = key
        self.buf = buf
        self.nbytes = int(nbytes if nbytes is not None else buf.numel() * buf.element_size())
        self.layout = layout
        self.members = tuple(members) if members is not None else (key,)
        self.resident = resident
        self.refs = 0
        self.dirty = dirty
        self.ready = ready
        self.writing: IOFuture | None = None
        self.prefetched = prefetched
        self.writeback = writeback
        self.on_drop = on_drop
        self.last_use = 0
        self.kind = kind
        self.in_tier = False
        self.was_in_tier = False

    def __repr__(self) -> str:
        return f"TieredUnit({self.key!r}, {self.kind or 'untyped'}, {self.nbytes} B, {self.state.value})"

    @property
    def state(self) -> UnitState:
        """The unit's :class:`UnitState` now (a read that completed counts as done)."""
        if not self.in_tier:
            return UnitState.GONE if self.was_in_tier else UnitState.NEW
        if self.refs:
            return UnitState.IN_USE
        if self.ready is not None and not self.ready.done():
            return UnitState.READING
        if self.writing is not None:
            return UnitState.WRITING
        if self.prefetched:
            return UnitState.PREFETCHED
        return UnitState.RESIDENT if self.resident else UnitState.CACHED

    @property
    def cached(self) -> bool:
        """Unreferenced, not read ahead, no write in flight and not resident: what the budget may evict."""
        return not self.resident and self.refs == 0 and not self.prefetched and self.writing is None

    def wait_ready(self) -> None:
        """Block until the unit's read (if any) completed; raise its error."""
        if self.ready is not None:
            self.ready.wait()
            self.ready = None

    # ---------------------------------------------------------------- transitions (HostTier, under its lock)
    def expect(self, transition: str) -> None:
        """Raise :class:`UnitStateError` unless ``transition`` is allowed in the unit's state now."""
        allowed = TRANSITIONS[transition]
        if allowed is _ALL:  # nothing to check: skip deriving the state (unpin: once per module fetch)
            return
        state = self.state
        if state not in allowed:
            where = "no longer in the host tier" if state is UnitState.GONE else "not allowed there"
            raise UnitStateError(f"{transition} of unit {self.key!r}, which is {state.value}: {where} "
                                 f"([Note: a unit's transitions])")

    def enter(self, tick: int) -> None:
        """Into the tier (``HostTier.add``)."""
        self.expect("enter")
        self.in_tier = self.was_in_tier = True
        self.last_use = tick

    def pin(self, tick: int) -> None:
        """Take a compute reference (``HostTier.acquire``)."""
        self.expect("pin")
        self.refs += 1
        self.prefetched = False
        self.last_use = tick

    def unpin(self) -> int:
        """Drop a compute reference; returns the references left."""
        self.expect("unpin")
        if self.refs <= 0:
            raise UnitStateError(f"unit {self.key!r} released more often than acquired")
        self.refs -= 1
        return self.refs

    def touch(self, tick: int) -> None:
        """Used now (a lookup hit)."""
        self.last_use = tick

    def mark_dirty(self) -> None:
        self.expect("mark_dirty")
        self.dirty = True

    def mark_used(self) -> None:
        self.expect("mark_used")
        self.prefetched = False

    def set_members(self, members) -> None:
        self.members = tuple(members)

    def write_back(self, fut: IOFuture) -> None:
        """Its write-back is decided: ``fut`` writes ``buf`` below; the unit is clean from now on."""
        self.expect("write_back")
        if not self.dirty or self.writing is not None:
            raise UnitStateError(f"write_back of unit {self.key!r}: clean or a write still in flight")
        self.dirty = False
        self.writing = fut

    def writing_from(self, fut: IOFuture) -> None:
        """A clean unit whose bytes ``fut`` is writing below (``HostTier.add_writing``), before it enters."""
        self.expect("enter")
        self.writing = fut

    def written(self, fut: IOFuture | None = None) -> None:
        """The write in flight completed (``fut``: only when it is that write; None: whichever it was)."""
        self.expect("written")
        if fut is None or self.writing is fut:
            self.writing = None

    def discard(self) -> None:
        """Its bytes are stale: clean, never written (``HostTier.drop``)."""
        self.expect("discard")
        self.dirty = False

    def leave(self, evicted: bool = False) -> None:
        """Out of the tier (dropped, or ``evicted``: unreferenced, checked)."""
        self.expect("evict" if evicted else "leave")
        self.in_tier = False
