"""An aligned first-fit extent allocator over one logical byte space, with free, coalescing and reuse."""
from __future__ import annotations

import bisect

from ..errors import AidaptivError
from ..io.buffers import round_up


class OutOfSpace(AidaptivError):
    """The logical space has no free range of the requested size (the store turns this into a
    :class:`~aidaptiv_ds.io.errors.StorageFullError` that names the paths and the numbers)."""

    def __init__(self, nbytes: int, free_bytes: int, capacity: int | None) -> None:
        super().__init__(f"no free extent of {nbytes} bytes ({free_bytes} free of {capacity})")
        self.nbytes, self.free_bytes, self.capacity = nbytes, free_bytes, capacity


class ExtentAllocator:
    """First-fit allocation of ``alignment``-aligned ranges in ``[0, capacity)``.

    Free ranges are kept sorted by offset and merged with their neighbours on free, so the space
    does not fragment under alloc/free of equal sizes. Offsets and lengths are in bytes.

    Args:
        alignment: every offset and length is a multiple of this (the direct-I/O block, e.g. 4096).
        capacity: size of the space in bytes, or None for unbounded (the slabs grow on demand).
    """

    def __init__(self, alignment: int = 4096, capacity: int | None = None) -> None:
        self.alignment = alignment
        self.capacity = capacity
        self._free_starts: list[int] = []
        self._free_len: dict[int, int] = {}
        self.high_water = 0  # end of the highest range ever handed out

    @property
    def free_bytes_below_high_water(self) -> int:
        return sum(self._free_len.values())

    def allocated_bytes(self) -> int:
        return self.high_water - self.free_bytes_below_high_water

    def alloc(self, nbytes: int) -> int:
        """Return the offset of a free range of ``round_up(nbytes, alignment)`` bytes.

        Raises:
            OutOfSpace: when neither a free range nor the space above ``high_water`` fits.
        """
        n = round_up(max(nbytes, 1), self.alignment)
        for i, start in enumerate(self._free_starts):
            length = self._free_len[start]
            if length >= n:
                del self._free_len[start]
                self._free_starts.pop(i)
                if length > n:
                    self._insert_free(start + n, length - n)
                return start
        if self.capacity is not None and self.high_water + n > self.capacity:
            raise OutOfSpace(n, self.capacity - self.high_water + self.free_bytes_below_high_water, self.capacity)
        start = self.high_water
        self.high_water += n
        return start

    def reserve(self, offset: int, nbytes: int) -> None:
        """Mark ``[offset, offset + nbytes)`` as used (reopening a persisted index)."""
        n = round_up(max(nbytes, 1), self.alignment)
        end = offset + n
        if end > self.high_water:
            if offset > self.high_water:
                self._insert_free(self.high_water, offset - self.high_water)
            self.high_water = end
            return
        # carve it out of a free range
        i = bisect.bisect_right(self._free_starts, offset) - 1
        if i < 0:
            raise ValueError(f"range [{offset}, {end}) overlaps an allocated extent")
        start = self._free_starts[i]
        length = self._free_len[start]
        if start + length < end:
            raise ValueError(f"range [{offset}, {end}) overlaps an allocated extent")
        self._free_starts.pop(i)
        del self._free_len[start]
        if offset > start:
            self._insert_free(start, offset - start)
        if start + length > end:
            self._insert_free(end, start + length - end)

    def free(self, offset: int, nbytes: int) -> None:
        """Return ``[offset, offset + round_up(nbytes))`` to the free list, merging neighbours."""
        n = round_up(max(nbytes, 1), self.alignment)
        if offset + n == self.high_water:
            self.high_water = offset
            # the range below may now also sit at the top
            if self._free_starts:
                last = self._free_starts[-1]
                if last + self._free_len[last] == self.high_water:
                    self.high_water = last
                    self._free_starts.pop()
                    del self._free_len[last]
            return
        self._insert_free(offset, n)

    def _insert_free(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        # merge with the previous range
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_len[prev] == start:
                start, length = prev, length + self._free_len.pop(prev)
                self._free_starts.pop(i - 1)
                i -= 1
        # merge with the next range
        if i < len(self._free_starts) and start + length == self._free_starts[i]:
            nxt = self._free_starts.pop(i)
            length += self._free_len.pop(nxt)
        self._free_starts.insert(i, start)
        self._free_len[start] = length
