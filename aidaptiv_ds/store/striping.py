"""Weighted RAID-0: how a logical byte range of the store maps onto the slabs of several cache paths.

The logical space is cut into stripe units of ``unit`` bytes. Units are dealt to paths by a
repeating *pattern* of ``len(pattern)`` slots in which path ``p`` appears ``counts[p]`` times,
``counts`` proportional to the paths' weights (their bandwidths), spread evenly by smooth weighted
round-robin (the nginx upstream algorithm). Logical unit ``k`` (row ``r = k // L``, slot
``s = k % L``) lives on path ``pattern[s]`` at physical unit ``r * counts[p] + occurrence(s)``:
consecutive units of one path are physically consecutive, so a long logical range is one
sequential transfer per path, all paths in parallel, and bytes per path follow the weights.
By default ``L`` is the shortest pattern (at most 256 slots) whose shares are within 1% of the
weights, relative to each path's own share: ``L = 3`` for equal weights on 3 paths, ``L = 6`` for
3:2:1 (a fixed ``L = 32`` gave 11/11/10 for equal weights, 6% off for the third path).
"""
from __future__ import annotations

import dataclasses


def apportion(weights: list[float], slots: int) -> list[int]:
    """Largest-remainder apportionment of ``slots`` among ``weights`` (all > 0 get at least one)."""
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"stripe weights must be >= 0 with a positive sum, got {weights}")
    total = float(sum(weights))
    raw = [w / total * slots for w in weights]
    counts = [int(x) for x in raw]
    for i, w in enumerate(weights):
        if w > 0 and counts[i] == 0:
            counts[i] = 1
    while sum(counts) > slots:
        i = max((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: counts[i] - raw[i])
        counts[i] -= 1
    order = sorted(range(len(weights)), key=lambda i: raw[i] - counts[i], reverse=True)
    j = 0
    while sum(counts) < slots:
        counts[order[j % len(order)]] += 1
        j += 1
    return counts


def choose_slots(weights: list[float], max_slots: int = 256, tolerance: float = 0.01) -> int:
    """Shortest pattern length whose apportioned shares are within ``tolerance`` of each path's
    weight share (relative to that share); the most accurate length up to ``max_slots`` otherwise."""
    total = float(sum(weights))
    best_err, best_len = float("inf"), max(len(weights), 1)
    for slots in range(max(len(weights), 1), max_slots + 1):
        counts = apportion(weights, slots)
        err = max((abs(c / slots - w / total) / (w / total) for c, w in zip(counts, weights, strict=True) if w > 0),
                  default=0.0)
        if err <= tolerance:
            return slots
        if err < best_err - 1e-12:
            best_err, best_len = err, slots
    return best_len


def smooth_pattern(counts: list[int]) -> list[int]:
    """Interleave path indices so path ``p`` appears ``counts[p]`` times, evenly spread."""
    total = sum(counts)
    current = [0] * len(counts)
    out = []
    for _ in range(total):
        for i, c in enumerate(counts):
            current[i] += c
        best = max(range(len(counts)), key=lambda i: current[i])
        current[best] -= total
        out.append(best)
    return out


@dataclasses.dataclass
class Run:
    """A physically contiguous range on one path: ``phys`` bytes into its slab, filled from the
    request-relative byte ranges ``parts`` = [(offset_in_request, length), ...] in order."""
    phys: int
    parts: list[tuple[int, int]]

    @property
    def length(self) -> int:
        return sum(n for _, n in self.parts)


class StripeLayout:
    """The weighted RAID-0 map of one segment over ``paths`` (indices into the store's path list).

    Args:
        paths: store path indices this segment uses.
        weights: one weight per entry of ``paths`` (e.g. GB/s); equal weights give plain RAID-0.
        unit: stripe unit in bytes (a multiple of the I/O alignment).
        slots: pattern length ``L``; None (default): :func:`choose_slots` (shares within 1% of the weights).
        phys_base: byte offset in each path's slab where this segment starts (default 0).
    """

    def __init__(self, paths: list[int], weights: list[float], unit: int, slots: int | None = None,
                 phys_base: dict[int, int] | None = None) -> None:
        if len(paths) != len(weights):
            raise ValueError("one weight per path")
        self.paths = list(paths)
        self.unit = int(unit)
        if len(paths) == 1:
            counts = [1]
        else:
            counts = apportion(list(weights), slots or choose_slots(list(weights)))
        self.counts = dict(zip(self.paths, counts, strict=True))
        local = smooth_pattern(counts)
        self.pattern = [self.paths[i] for i in local]
        seen: dict[int, int] = {}
        self.occurrence = []
        for p in self.pattern:
            self.occurrence.append(seen.get(p, 0))
            seen[p] = seen.get(p, 0) + 1
        self.phys_base = {p: (phys_base or {}).get(p, 0) for p in self.paths}

    def share(self, path: int) -> float:
        """Fraction of the segment's bytes that land on ``path``."""
        return self.counts.get(path, 0) / len(self.pattern)

    def map(self, logical: int, length: int) -> dict[int, list[Run]]:
        """Physical runs per path for segment-relative bytes ``[logical, logical + length)``."""
        out: dict[int, list[Run]] = {}
        if length <= 0:
            return out
        if len(self.pattern) == 1:
            p = self.pattern[0]
            return {p: [Run(self.phys_base[p] + logical, [(0, length)])]}
        u, L = self.unit, len(self.pattern)
        pos, end = logical, logical + length
        while pos < end:
            k, within = divmod(pos, u)
            take = min(u - within, end - pos)
            row, slot = divmod(k, L)
            p = self.pattern[slot]
            phys = self.phys_base[p] + (row * self.counts[p] + self.occurrence[slot]) * u + within
            runs = out.setdefault(p, [])
            part = (pos - logical, take)
            if runs and runs[-1].phys + runs[-1].length == phys:
                last = runs[-1].parts[-1]
                if last[0] + last[1] == part[0]:
                    runs[-1].parts[-1] = (last[0], last[1] + take)
                else:
                    runs[-1].parts.append(part)
            else:
                runs.append(Run(phys, [part]))
            pos += take
        return out

    def phys_size(self, logical_end: int) -> dict[int, int]:
        """Bytes each path's slab must hold (from its ``phys_base``) for segment bytes ``[0, logical_end)``."""
        if logical_end <= 0:
            return {p: 0 for p in self.paths}
        if len(self.pattern) == 1:
            return {self.pattern[0]: logical_end}
        u, L = self.unit, len(self.pattern)
        units = -(-logical_end // u)
        rows, rest = divmod(units, L)
        need = {p: rows * self.counts[p] * u for p in self.paths}
        for slot in range(rest):
            need[self.pattern[slot]] += u
        return need

    def logical_capacity(self, phys_caps: dict[int, int]) -> int:
        """Largest segment size (bytes, whole units) whose physical share fits ``phys_caps`` per path:
        whole rows, then the longest prefix of the next row that still fits."""
        if len(self.pattern) == 1:
            return phys_caps[self.pattern[0]]
        u = self.unit
        rows = min(phys_caps[p] // (self.counts[p] * u) for p in self.paths if self.counts[p])  # weight 0: unused
        used = {p: rows * self.counts[p] * u for p in self.paths}
        extra = 0
        for p in self.pattern:
            if used[p] + u > phys_caps[p]:
                break
            used[p] += u
            extra += 1
        return (rows * len(self.pattern) + extra) * u
