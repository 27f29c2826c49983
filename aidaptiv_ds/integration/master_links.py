"""Which parameter partition fills which optimizer sub-group's master slot, and how far each fill is (issue 39).

In fp32 a sub-group's parameters are read from its master slot, so backward has just read the master weights the
step inside backward needs ([Note: master weights from the parameter reads] in ``optimizer_swapper.py``). One
relation says where: partition ``ds_id``'s bytes are ``nbytes`` bytes of sub-group G's master slot at byte
``offset``. A :class:`MasterLink` is one such fact with its fill state; :class:`MasterLinks` holds every link of one
optimizer swapper, by partition and by sub-group, and counts the parameter buffers kept alive for unfilled slots
against the hold limit. No DeepSpeed here: the swapper translates DeepSpeed's calls into these.

[Note: a link's fill]
    NONE     nothing to do: the slot's bytes came (copied from a parameter slice, read with the slot) or are not
             wanted now
    WAITING  the sub-group's slice exists and waits for the first ``waiting`` bytes (a parameter slice leaving
             DRAM brings them, ``MasterLinks.take``; else ``wait_slice`` reads them on demand)
    HELD     the sub-group has no slice yet: a dropped parameter slice's bytes (``held``, a view of the parameter
             swapper's own buffer, no copy) are kept until the slice is created, within the hold limit
    NONE -wait-> WAITING -filled/forget-> NONE;  NONE -hold-> HELD -unhold-> NONE
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

import torch


class Fill(enum.Enum):
    """How far a link's bytes are from its master slot ([Note: a link's fill])."""
    NONE = "none"
    WAITING = "waiting"
    HELD = "held"


@dataclasses.dataclass(eq=False)
class MasterLink:
    """Partition ``ds_id``'s first ``nbytes`` bytes are sub-group ``group``'s master slot at byte ``offset``.

    Attributes:
        group: the sub-group's record (the optimizer swapper's ``_Group``).
        waiting: bytes the sub-group's slice waits for (> 0: WAITING).
        held: the uint8 bytes kept for the slot (not None: HELD).
    """
    ds_id: int
    group: object
    offset: int
    nbytes: int
    waiting: int = 0
    held: torch.Tensor | None = None

    @property
    def fill(self) -> Fill:
        """The link's :class:`Fill`, from ``waiting`` and ``held`` (never both)."""
        return Fill.WAITING if self.waiting else Fill.HELD if self.held is not None else Fill.NONE


class MasterLinks:
    """Every :class:`MasterLink` of one optimizer swapper, and the parameter buffers kept for them.

    Args:
        hold_limit: most bytes of parameter buffers kept alive for HELD links (whole buffers, each counted once
            however many partitions it holds; the planner's ``master_hold_bytes``).
    """

    def __init__(self, hold_limit: int = 0) -> None:
        self.hold_limit = int(hold_limit)
        self._by_part: dict[int, MasterLink] = {}
        self._by_group: dict[int, tuple[MasterLink, ...]] = {}  # id(group) -> its links, in slot order
        self._storages: dict[int, list[int]] = {}  # a kept buffer's storage address -> [bytes, links holding it]

    def set(self, group, entries: Iterable[tuple[int, int, int]]) -> tuple[MasterLink, ...]:
        """``entries``: ``(ds_id, byte offset, bytes)`` of the partitions read from ``group``'s master slot;
        replaces ``group``'s links (the kept buffers of the old ones are let go).

        Raises:
            RuntimeError: ``group``'s slice still waits for bytes of its old links (they would never come).
        """
        if self.waiting(group):
            raise RuntimeError(f"master links replaced while the sub-group's slice waits for partitions "
                               f"{[k.ds_id for k in self.waiting(group)]} ([Note: a link's fill])")
        self.release(group)
        for old in self.of(group):
            if self._by_part.get(old.ds_id) is old:
                del self._by_part[old.ds_id]
        links = tuple(MasterLink(int(d), group, int(o), int(n)) for d, o, n in entries)
        self._by_group[id(group)] = links
        for link in links:
            self._by_part[link.ds_id] = link
        return links

    def of(self, group) -> tuple[MasterLink, ...]:
        """``group``'s links, in slot order (empty when its parameters are not read from its master slot)."""
        return self._by_group.get(id(group), ())

    def get(self, ds_id: int) -> MasterLink | None:
        """The link of partition ``ds_id``, if it is read from a master slot."""
        return self._by_part.get(ds_id)

    # ---------------------------------------------------------------- WAITING
    def wait(self, link: MasterLink, n: int) -> None:
        """The sub-group's slice waits for the link's first ``n`` bytes."""
        if link.fill is not Fill.NONE:
            raise RuntimeError(f"partition {link.ds_id}: wait from {link.fill.value} ([Note: a link's fill])")
        if n <= 0:
            raise ValueError(f"partition {link.ds_id}: a wait for {n} bytes")
        link.waiting = int(n)

    def waiting(self, group) -> list[MasterLink]:
        """``group``'s links whose bytes its slice still waits for."""
        return [link for link in self.of(group) if link.fill is Fill.WAITING]

    def filled(self, link: MasterLink) -> None:
        """A WAITING link's bytes are in the slot now (or no longer wanted: the slice left)."""
        link.waiting = 0

    def forget_waiting(self, group) -> None:
        for link in self.waiting(group):
            self.filled(link)

    # ---------------------------------------------------------------- HELD
    def hold(self, link: MasterLink, src: torch.Tensor) -> bool:
        """Keep ``src`` (the partition's uint8 bytes, a view of a parameter buffer) for the link's slot; False (and
        nothing kept) when its buffer would pass the hold limit or the link is not NONE."""
        if link.fill is not Fill.NONE:
            return False
        storage = src.untyped_storage()
        key = storage.data_ptr()
        extra = 0 if key in self._storages else storage.nbytes()
        if self.held_bytes() + extra > self.hold_limit:
            return False
        self._storages.setdefault(key, [storage.nbytes(), 0])[1] += 1
        link.held = src
        return True

    def unhold(self, link: MasterLink) -> torch.Tensor:
        """Let go of a HELD link's bytes (returned, for a last copy)."""
        src = link.held
        if src is None:
            raise RuntimeError(f"partition {link.ds_id}: unhold from {link.fill.value} ([Note: a link's fill])")
        link.held = None
        key = src.untyped_storage().data_ptr()
        entry = self._storages[key]
        entry[1] -= 1
        if not entry[1]:
            del self._storages[key]
        return src

    def release(self, group=None) -> None:
        """Let go of every kept buffer held for ``group`` (every sub-group's when None)."""
        groups = self._by_group.values() if group is None else (self.of(group),)
        for links in groups:
            for link in links:
                if link.fill is Fill.HELD:
                    self.unhold(link)

    def held(self, group) -> list[MasterLink]:
        """``group``'s HELD links."""
        return [link for link in self.of(group) if link.fill is Fill.HELD]

    def held_bytes(self) -> int:
        """Host bytes of parameter buffers kept alive for master slots now (whole buffers, each once)."""
        return sum(n for n, _ in self._storages.values())
