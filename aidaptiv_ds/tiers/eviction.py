"""Which cached slice to drop: furthest next use (Belady's MIN) from a recorded access order, LRU before.

Belady (1966), "A study of replacement algorithms for a virtual-storage computer": evicting the
item whose next use lies furthest in the future minimises misses for a known reference string.
ZeRO-3 training repeats the same parameter order every step (DeepSpeed's coordinator records it
in its first step, ``docs/deepspeed-seams.md`` §5), so the order is known from step 2 on and treated
as cyclic: an id not used again this step is next used at its first position of the next step.
The tier decides when a slice is released after use, so the slice just used competes too (MIN
with bypass: it never misses more than MIN); ties go to the least recently used. A policy may also rank
kinds of slices (:data:`TRAINING_KIND_RANK`: optimizer and gradient slices before parameter slices).
"""
from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar


class AccessOrder:
    """The cyclic future access order of ids (e.g. parameter ``ds_id``s) and the current position."""

    def __init__(self) -> None:
        self._positions: dict[Hashable, list[int]] = {}
        self.length = 0
        self.position = 0

    @property
    def known(self) -> bool:
        return self.length > 0

    def set_order(self, order: Sequence[Hashable]) -> None:
        """Record one period of the access sequence (position 0 = its first access)."""
        pos: dict[Hashable, list[int]] = {}
        for i, x in enumerate(order):
            pos.setdefault(x, []).append(i)
        self._positions, self.length, self.position = pos, len(order), 0

    def advance_to(self, position: int) -> None:
        """The access at index ``position`` (of the current period) is the next one to happen."""
        self.position = position

    def next_use(self, ids: Iterable[Hashable]) -> float:
        """Accesses from now until the first use of any of ``ids`` (``inf`` if none is ever used)."""
        best = float("inf")
        for x in ids:
            p = self._positions.get(x)
            if not p:
                continue
            i = bisect.bisect_left(p, self.position)
            d = (p[i] - self.position) if i < len(p) else (p[0] + self.length - self.position)
            best = min(best, d)
        return best


class Evictable(Protocol):
    """What the policy reads of a candidate: the ids it holds, when it was last used, what kind of unit it is."""
    @property
    def members(self) -> Sequence[Hashable]: ...

    @property
    def last_use(self) -> int: ...

    @property
    def kind(self) -> str: ...


#: [Note: ranking the kinds in training] The access order records parameter fetches only (DeepSpeed's trace of
#: the forward and backward), so an optimizer sub-group or a gradient slice has no next use in it: it is next
#: used in the next step's backward or optimizer phase, after every parameter fetch of the next forward. Once
#: the order is known such slices go first (rank 0), then parameter slices by Belady (rank 1). Before this rule
#: was written down, the same followed from their next use being "never" (``inf``); now a parameter slice no
#: longer in the order waits behind them too: a branch the model stopped using, or the parameters of another
#: engine on the same runtime (an eval engine beside the training one; the order is the last coordinator's).
#: A layer-major step's boundary activations (``"act"``, ``integration/activations.py``) are next used in this
#: step's backward: they rank above parameter slices, so they take what the budget leaves before the parameter
#: cache does (the planner's [Note: which DRAM the activations take]), the oldest first among themselves.
TRAINING_KIND_RANK: Mapping[str, int] = {"opt": 0, "grad": 0, "param": 1, "act": 2}


_S = TypeVar("_S", bound=Evictable)


class EvictionPolicy:
    """Pick victims among candidate slices: Belady when the order is known, else least recently used.

    A slice exposes ``members`` (ids it holds), ``last_use`` (a monotonic counter) and ``kind``.

    Args:
        order: the access order (shared with the prefetcher); a fresh, unknown one when not given.
        kind_rank: with the order known, slices of a lower rank are evicted before any of a higher rank, and
            Belady decides within a rank (kinds not listed rank 0). None: no ranking, Belady over all
            (:data:`TRAINING_KIND_RANK` is the training tier's, ``integration/runtime.py``).
    """

    def __init__(self, order: AccessOrder | None = None, kind_rank: Mapping[str, int] | None = None) -> None:
        self.order = order or AccessOrder()
        self.kind_rank = dict(kind_rank or {})

    def victim(self, candidates: list[_S]) -> _S:
        """The candidate to evict (one of ``candidates``).

        Raises:
            ValueError: ``candidates`` is empty.
        """
        if not candidates:
            raise ValueError("no eviction candidates")
        if self.order.known:
            rank = self.kind_rank
            return max(candidates, key=lambda s: (-rank.get(s.kind, 0), self.order.next_use(s.members), -s.last_use))
        return min(candidates, key=lambda s: s.last_use)
