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
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor of a unit: ``numel`` elements of ``dtype`` at byte ``offset`` of the unit's bytes."""
    name: str
    dtype: torch.dtype
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes of the slot's elements (``numel x dtype.itemsize``)."""
        return self.numel * self.dtype.itemsize

    @property
    def end(self) -> int:
        """Byte offset one past the slot's last element."""
        return self.offset + self.nbytes

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """The slot as a flat tensor of ``dtype`` (shape ``(numel,)``) viewing ``buf`` (uint8, the unit's bytes
        from offset 0; at least :attr:`end` bytes). No copy.

        Raises:
            ValueError: ``buf`` is not uint8 or is shorter than the slot's end.
        """
        if buf.dtype != torch.uint8 or buf.numel() < self.end:
            raise ValueError(f"slot {self.name!r} needs a uint8 buffer of >= {self.end} bytes, got "
                             f"{buf.dtype} of {buf.numel()}")
        return buf[self.offset:self.end].view(self.dtype)


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """Where each slot of a unit of ``numel`` elements lies ([Note: packing]).

    Build one with :meth:`packed`; ``slots[0]`` is the first (for an optimizer sub-group, its master weights).
    """
    numel: int
    slots: tuple[Slot, ...]

    @classmethod
    def packed(cls, numel: int, specs: Sequence[tuple[str, torch.dtype]]) -> UnitLayout:
        """Slots named and typed by ``specs`` (in order), each of ``numel`` elements, packed end to end.

        Raises:
            ValueError: ``numel`` < 0 or two slots share a name.
        """
        if numel < 0:
            raise ValueError(f"a unit cannot hold {numel} elements")
        names = [n for n, _ in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"slot names repeat: {names}")
        slots, off = [], 0
        for name, dtype in specs:
            size = dtype.itemsize
            off = -(-off // size) * size
            slots.append(Slot(name, dtype, off, numel))
            off += numel * size
        return cls(numel, tuple(slots))

    def all_of(self, dtype: torch.dtype, k: int | None = None) -> bool:
        """The first ``k`` slots (all when None) are all ``dtype``: their bytes are one ``[k, numel]`` tensor of it."""
        return all(s.dtype == dtype for s in self.slots[:len(self.slots) if k is None else k])

    def prefix_bytes(self, k: int | None = None) -> int:
        """Bytes of the first ``k`` slots (all when None): where slot ``k - 1`` ends; 0 for ``k`` = 0."""
        k = len(self.slots) if k is None else k
        if not 0 <= k <= len(self.slots):
            raise ValueError(f"a unit of {len(self.slots)} slots has no prefix of {k}")
        return self.slots[k - 1].end if k else 0

    def widened(self, buf: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The first ``k`` slots as one ``[k, numel]`` tensor of ``dtype``: a view of ``buf`` when they are all
        ``dtype`` already, else a new tensor with each slot converted (exact for a wider ``dtype``)."""
        if self.all_of(dtype, k):
            return buf[:k * self.numel * dtype.itemsize].view(dtype).reshape(k, self.numel)
        out = torch.empty(k, self.numel, dtype=dtype)
        for j, s in enumerate(self.slots[:k]):
            out[j].copy_(s.view(buf))
        return out

    def fill(self, buf: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` (``[k, numel]``, any float dtype) into the first ``k`` slots of ``buf``, each converted
        to its slot's dtype (``Tensor.copy_``: round to nearest even when narrowing)."""
        for j, s in enumerate(self.slots[:rows.shape[0]]):
            s.view(buf).copy_(rows[j])
