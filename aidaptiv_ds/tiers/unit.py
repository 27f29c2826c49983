"""The layout of a tiered unit: typed slots packed end to end in one extent (issue 39).

A unit is what the tiers move as one: an optimizer sub-group (its fp32 master weights and the optimizer's
per-element states), later a gradient slice or a KV block. Its bytes are one extent on the drives and one
host slice in DRAM, read and written in one sequential transfer; the tensors the optimizer works on are
views of that slice. :class:`UnitLayout` says where each tensor lies and in which dtype, so the swapper,
the checkpoint writer and the planner read one record instead of each computing ``numel x elsize x slots``.

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
from collections.abc import Sequence

import torch

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
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start + length)`` (default: to the end) as fp32 ``(length,)``: a view for an fp32
        slot, else widened exactly or dequantized (``tiers/blockwise.py``) into ``out`` (fp32, at least
        ``length`` elements; its first ``length`` are used) or a new tensor.

        Raises:
            ValueError: the range is outside the slot, or does not start on a block of a quantized slot.
        """
        length = self._range(start, length)
        codes = self.view(buf)[start:start + length]
        if self.dtype == torch.float32 and not self.quantized:
            return codes
        dst = None if out is None else out[:length]
        if self.quantized:
            return blockwise.dequantize(codes, self._scales(buf, start, length), self.signed, out=dst)
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
