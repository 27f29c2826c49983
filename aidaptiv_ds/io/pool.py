"""A fixed region of host memory that swap buffers are carved from and given back to: the buffer pool.

[Note: why a pool] Where no heap is kept (a DRAM budget too small to hold a reusing heap, always at a
budget of 0: :func:`aidaptiv_ds.io.heap.return_freed_host_memory`), every swap buffer of every step
(parameter read-ahead, optimizer sub-group slices, gradient slices, write staging, the norm scratch)
was fresh memory: mapped, page-faulted in and zeroed by the kernel, then unmapped when freed. On the
148M fp32 Llama at budget 0 that is about 3.6 GB a step, 0.3-0.4 s of a 2.8-4.2 s step on a 2-core VM
(an unbounded experiment that reused buffers of equal size: 2.80 / 2.81 s against 3.13 / 4.24 s,
but 4.07 GiB peak RSS against 2.52). The pool keeps the reuse and bounds it: one region of
``capacity`` bytes, sized by the planner's working windows of those buffers (what the plan already
counts as host memory outside the budget: :func:`aidaptiv_ds.planner.auto.buffer_pool_bytes`), mapped
once, advised onto transparent huge pages, and carved into buffers at the lowest free range that fits (the
optimizer pipeline's slices at the highest: [Note: the pipeline's slices at the top]). The
host memory it holds is ``capacity``, whatever the policy inside; a request that does not fit (the
region is full or too fragmented) is served as before, by fresh memory, and counted
(:attr:`HostBufferPool.miss_bytes`).

[Note: when a buffer comes back] A buffer is a tensor over its own range of the region (a NumPy array
over that address, wrapped by ``torch.from_numpy``), so every view of it, every NumPy array or
memoryview taken of it and every I/O future that keeps it alive holds that array; the range is given
back when the array dies, which is when the last of them dies (a ``weakref.finalize`` on the array).
Nothing is ever handed out twice while anyone can still read or write it, and no caller has to give
buffers back. The finalizer only queues the range (it may run in any thread, in the middle of another
allocation); :meth:`HostBufferPool.take` merges the queue under the pool's lock. Each buffer also keeps
the pool alive, so the region outlives every buffer carved from it.

[Note: a miss gives the free pages back] Pages of the region stay resident once touched, free or not. A
miss is served by fresh memory, so while the pool's free ranges stayed resident the rank held both: the
region's touched pages and the fresh buffers beside them, more than the plan counts (a 93M bf16 Llama at
budget 0: 2.10 GiB peak against the plan's 1.74; 1.65 without a pool). So on a miss the pool gives its free
ranges' pages back to the OS (``madvise(MADV_DONTNEED)``; the range stays mapped and reads as zeros when
next handed out, content being undefined anyway): resident are then the buffers in use, the pool's and
the fresh ones, as without a pool. Where nothing misses, nothing is given back and the reuse is whole.
Released bytes are counted (:attr:`HostBufferPool.released_bytes`).

[Note: lean while a miss is alive] Releasing the free ranges at the miss was not enough in the optimizer
step after backward, where the pipeline's sub-group slices (3 x 320 MB on a 169M bf16 Llama with
2e7-element sub-groups) do not fit the region sized by backward's windows (0.90 GiB): buffers carved
before the miss died after it, their touched pages went back to the free list resident, and the fresh
buffers of the misses lived beside them. Sampled every 10 ms with ``mincore`` on the region (slow
``tests/test_plan_host_vs_rss.py`` config, 169M): the region 0.89 GiB resident with 0.33 GiB in use while
the step's misses had reached 1.07 GiB, peak RSS 2.75 GiB against the plan's 1.82. So a miss is served
by :meth:`HostBufferPool.fresh`, which counts it live until it dies, and while any is live a pool buffer
that dies gives its pages back at once (in its finalizer, before its range is back in the free list:
nothing can carve it meanwhile). Resident is then what is in use, the pool's and the fresh buffers', as
the plan's optimizer phase counts it; with no miss alive the reuse is whole again. Limits: a dead fresh
buffer leaves the count at the next merge (a buffer dying in between is still given back), and every miss
counts, also a long-lived one (a resident or cached slice at a budget above 0, where a pool is used only
when that budget cannot hold a heap): while it lives the pool gives back every buffer that dies, correct
but without reuse. Measured there since, and mended by carving the budget's units from the pool too
([Note: the budget's units in the pool]).

[Note: the budget's units in the pool] Where a DRAM budget above 0 cannot hold a reusing heap too, the
units the budget keeps (resident gradient slices opened every backward, cached optimizer and parameter
slices) are swap buffers like the others, so a region of the working windows alone was filled by them and
the rest of the step's buffers missed it. On the 2.70B fp32 Llama at a budget of 10 GB (clipping 1.0,
``launch/compare.py --params 2.7B --seq 128 --backends aidaptiv_auto --aidaptiv-extra '{"dram_budget":
10000000000}'``) the 4.26 GB region was full all step and 35-36 GB of buffers a step missed it; a miss was
alive all the time, so every pool buffer that died gave its pages back too ([Note: lean while a miss is
alive]): 46 s of system CPU in a 55 s step. The runtime therefore sizes the region as the windows plus the
budget (``Runtime.settle_host_memory_reuse``): the plan counts the budget beside the backward's windows as
host memory, so the region holds what the plan does, and the budget's units and the working buffers are
carved from it and reused step after step. Misses fell to 2-3 GB a step there (what the tier holds beyond
the plan's windows, and fragmentation); the given-back pages stayed high (44-54 GB a step, 51-53 s steps)
until a miss gave back only what it adds ([Note: give back what the misses add]). On the 148M fp32 Llama at
a budget of 700 MB holding the gradients: misses 493 MB -> 0 a step, system CPU 1.84 -> 0.52 s, step 3.17
-> 2.52 s (one run each, ``/tmp/perf/ab.sh``, the worker directly).

[Note: give back what the misses add] (2026-12-06; supersedes "all free ranges" and "every buffer" above.) The
rule above gave back every free page at a miss and every buffer dying while it lived, whatever the miss's size.
With the updates riding the forward (148M fp32 Llama, budget 0, a 1.93 GiB pool) a 470 MiB sub-group slice missed
for fragmentation, with 945 MiB in use and 1,029 MiB free in ranges of at most 241-435 MiB, about every second
step; the pool then gave back over 1 GiB, and the next step faulted it in again, 2 MiB page by page: 1-3.5 s of
system CPU in a 2.7-5 s step on this project's VM, whose host discards what the guest gives back. What the plan
needs is less: the region's resident pages plus the live misses within the capacity (the pool's capacity is what
the plan counts; ``planner/auto.py``, ``buffer_pool_bytes``). So the pool keeps a *clean set*, the ranges whose
pages are not resident (the whole region at the start, given back once; a carve takes out its range widened to
whole 2 MiB pages, which a touch faults in whole; a give-back puts its range in), always inside the free ranges.
A miss gives back resident free pages, from the region's top down, until the clean bytes cover the live misses;
a buffer that dies while they do not is given back in its finalizer as before; a carve that takes clean pages a
live miss relied on gives back others. A miss larger than the region still gives back every free page.
``tests/test_buffer_pool.py`` checks the clean set against ``mincore`` and the bound after every allocation.
Measured: at budget 0 (148M riding) the faults did not move (92,000-95,000 a step either way; what those bursts
fault in is mostly the heap, ``docs/profiling.md``), so it was not landed then. At a budget above 0, where the
budget's units share the region and a miss is alive for much of the step, it is what makes the region
reusable: 2.70B fp32 at 10 GB (the command of the note above, one run each): pages given back 44-54 -> 11-15
GB a step, system CPU 41-47 -> 19-20 s, steps 51-53 -> 39.6-43.3 s over two runs (54.4-55.3 s before either
change); with the carve's edge pages faulted in under the lock (the next note) 40.8-45.8 s over two runs.

[Note: a clean page stays clean] A range counted clean must not be mapped again behind the pool's back. Two ways
it could: (1) a carve shares a huge page with a free range, nothing of that page is mapped yet, and a miss gives
the free part back (a no-op) and counts it clean before the carve is touched; the touch then maps the whole 2 MiB
page, the "clean" part with it (found by review, reproduced with ``mincore``). So :meth:`HostBufferPool.take`
faults in a carve's first and last huge pages itself, under the lock, before anything can be given back; the
pages inside a carve share a huge page with no free range. (2) ``khugepaged`` may collapse a partly mapped 2 MiB
range of the region into a huge page (``max_ptes_none``); it scans slowly and was not seen in the tests, so the
clean set can be short of the truth by what it collapses until that range is carved again, which only costs a
weaker bound, never data.

[Note: the gathered parameters in the pool] Over one rank DeepSpeed's gathered parameters are their partitions'
swap buffers (``planner/auto.py``, [Note: the gathered parameters' partitions]), up to the larger of
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` plus two modules and a layer of them ([Note:
what bounds the gathered parameters]; 1e9 by default: most of a model below a few billion parameters stays
gathered from the forward into the backward), and over several ranks the partitions stay beside the gathered
copies. The plan counted them as DeepSpeed's working set over one rank, outside the region, and not at all over
several; carved from the region, they took the room of the step's other buffers. With the updates riding the
forward (10M fp32 Llama, ``tests/test_budget_in_pool.py``) 16-29 MB of optimizer slices a step missed; the
region now holds them too (:func:`aidaptiv_ds.planner.auto.buffer_pool_bytes`), and that run misses nothing.
2.70B fp32, clipping 1.0 (the command of [Note: the budget's units in the pool]; one run each, side by side on
an Intel Xeon 2-core VM, logs in ``docs/profiling.md``): at 10 GB the pool grows 13.28 -> 17.01 GiB, misses
1.6-2.0 GB -> 0 and pages given back 7.5-12.4 GB -> 0 a step, system CPU 25.3 -> 13.8 s, steps 55.9 / 59.1 ->
52.2 / 47.7 s; riding at ``auto``, misses 22-31 -> 4-5 GB a step, steps 77.1 / 72.2 -> 69.6 / 55.0 s. The
peak RSS rises with the pages the region keeps (16.60 -> 18.12 GiB at 10 GB, inside the plan's 18.63; riding
18.05 -> 19.97-20.31 GiB, 5.8-6.7% above its plan; with the carving of [Note: the lowest range first] the same,
within a run's spread). What still misses in the riding forward is fragmentation:
1.3-1.4 GB free in 54-63 ranges of at most 278-360 MB against 405 MB optimizer slices, the budget's
long-lived units (resident gradients, cached parameter copies) between them.

[Note: the lowest range first] A request is carved from the lowest free range that holds it (first fit by
address), no longer from the smallest (best fit). Pages stay resident once touched and nothing is given back
while nothing misses, so the host memory a pool costs is the pages its carves have ever touched; carving low
keeps them at the bottom of the region and its top untouched (clean), where :meth:`HostBufferPool._lean` gives
back from when a miss comes. Best fit took whichever range was smallest, also at the untouched top, so every
part of the region was touched within a few steps: once the pool held the gathered parameters' partitions (the
note above) and grew by them, the 148M fp32 Llama at budget 0, which never missed, peaked 0.52 GiB higher (3.51
against 2.99 GiB; ``launch/compare.py --params 150M --dtype fp32 --seq 256 --steps 6 --warmup 2 --repeats 2
--backends aidaptiv0``). First fit by address: 2.78 GiB, at the same speed (3.94-4.15 against 3.91-4.01 s a
step, two interleaved pairs); Wilson et al. ("Dynamic Storage Allocation: A Survey and Critical Review", 1995)
found address-ordered first fit and best fit about equal in fragmentation.

[Note: the pipeline's slices at the top] The optimizer pipeline's sub-group slices (master weights and moments
of one sub-group, the largest requests of a step: 405 MB on the 2.70B fp32 Llama) each live for one sub-group's
update, three or four at a time, while buffers that live longer are carved between them: the gradient slices
the budget keeps from the backward to the update, the updated parameters' copies the next forward reads and the
budget then caches, the parameters DeepSpeed keeps gathered. Carved low, each dead slice left a hole that the
longer-lived buffers carved while it lived had cut too small for the next slice: with the updates riding the
forward at 2.70B, 4-8 GB of slices a step missed a pool 92% in use, with 1.3-1.4 GB free in 54-63 ranges of at
most 278-360 MB. So a slice the plan does not keep resident is carved at the top end of the highest free range
that holds it (``take(high=True)``; :func:`aidaptiv_ds.io.buffers.alloc_aligned` ``pipeline``), everything
else low: the slices, of one size, recycle one another's ranges at the top, and the region's untouched middle
stays clean between the two ends. Segregating by lifetime and size is the classic answer to this kind of
fragmentation (Wilson et al. 1995, section 4; the size classes of jemalloc and of PyTorch's caching
allocator). ``tests/test_buffer_pool.py`` holds a sequence that misses when everything is carved low and does
not with the slices at the top. Measured (2.70B fp32, clipping 1.0, the updates riding the forward at budget
``auto``, the command of [Note: the budget's units in the pool] with ``{"step_rides_forward": true}``; one run
each, side by side on an Intel Xeon 2-core VM): misses 5.9-6.6 -> 2.2-3.0 GiB a step, pages given back 6.8-7.7
-> 3.0-4.5 GiB, system CPU 29-76 -> 19-27 s, steps 105.4 / 64.4 -> 52.8 / 57.4 s; peak RSS 20.01 -> 20.48 GiB
(step 1's backward, the first to touch the top; steps 2-3 within 0.3 GiB of each other). Only there: riding the
forward at a budget above 0 (:attr:`HostBufferPool.pipeline_at_top`, which the runtime sets), where the slices
are carved among the budget's long-lived units. Elsewhere nothing missed before, and carving at both ends
touched pages that carving low leaves untouched, the pool's free top: at budget 0 (148M fp32, the command of
[Note: the lowest range first]) peak RSS 3.42 against 2.74 GiB at the same speed (3.91-4.17 against 4.16-5.48 s,
one run of two repeats each); at 2.70B with 10 GB and the updates in ``step()``, 20.91 against 18.38 GiB (the
previous stop's run), no miss either way, 50.7 / 55.2 against 50.3 / 49.0 s.

Pinned host memory (``cudaHostAlloc`` on a GPU rank) is not pooled: :func:`alloc_aligned` asks the pool
only for unpinned buffers.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import threading
import weakref

import numpy as np
import torch

from .heap import glibc

#: Requests below this size are left to the C library's heap (small chunks are reused there).
POOL_MIN_BYTES = 1 << 20
#: Buffers are carved in multiples of this (page aligned for O_DIRECT, small against a partition).
POOL_GRANULE = 64 << 10
_HUGE_PAGE = 2 << 20
_MADV_DONTNEED = 4  # linux/mman.h


def _round_up(n: int, to: int) -> int:
    return -(-int(n) // to) * to


def _insert_merged(starts: list[int], lens: dict[int, int], off: int, n: int) -> None:
    """Insert the range ``[off, off + n)`` into the disjoint ranges ``starts`` (sorted offsets) / ``lens`` (offset
    -> bytes), merged with the range ending at ``off`` and the one starting at ``off + n``."""
    i = bisect.bisect_left(starts, off)
    if i > 0 and starts[i - 1] + lens[starts[i - 1]] == off:  # merge with the range before it
        i -= 1
        off = starts.pop(i)
        n += lens.pop(off)
    if i < len(starts) and starts[i] == off + n:  # and the one after it
        n += lens.pop(starts.pop(i))
    starts.insert(i, off)
    lens[off] = n


class HostBufferPool:
    """One region of ``capacity`` host bytes carved into page-aligned buffers (see the module's notes).

    Args:
        capacity: bytes of the region (rounded up to 2 MiB); at least one granule.
        granule: the carving unit, bytes (a multiple of 4096).
        pipeline_at_top: carve the requests :meth:`take` marks ``high`` at the region's top ([Note: the pipeline's
            slices at the top]); False: every request at the lowest free range that holds it.

    Attributes:
        capacity: the region's bytes (the host memory the pool holds once touched).
        in_use, peak_in_use: bytes handed out now / at most.
        hit_bytes, miss_bytes: bytes of requests served from the region / refused (the caller allocates
            fresh memory for those).
        released_bytes: bytes of free ranges whose pages were given back on a miss or as a buffer died while
            the misses alive were not covered ([Note: give back what the misses add]), or by
            :meth:`release_free`.
        clean_bytes: bytes of the region whose pages are not resident (never touched since the start, or given
            back), all of them free.
        miss_live_bytes: bytes of fresh buffers (:meth:`fresh`) alive now, as of the last merge.
        peak_live_bytes: the most bytes of swap buffers alive at once, the pool's and the misses', since
            :meth:`reset_peak_live`, taken at each allocation after the buffers returned so far are merged.

    Raises:
        ValueError: a capacity below one granule or a granule that is not a multiple of 4096.
    """

    def __init__(self, capacity: int, granule: int = POOL_GRANULE, pipeline_at_top: bool = True) -> None:
        if granule <= 0 or granule % 4096:
            raise ValueError(f"HostBufferPool granule {granule} must be a positive multiple of 4096 bytes")
        if int(capacity) < granule:
            raise ValueError(f"HostBufferPool capacity {capacity} is below one granule ({granule} bytes)")
        self.granule = int(granule)
        self.pipeline_at_top = bool(pipeline_at_top)
        self.capacity = _round_up(capacity, _HUGE_PAGE)
        self._region = torch.empty(self.capacity + _HUGE_PAGE, dtype=torch.uint8)  # its own mapping
        self._start = _round_up(self._region.data_ptr(), _HUGE_PAGE)
        from .buffers import advise_huge_pages  # buffers imports this module lazily; no cycle at import
        advise_huge_pages(self._region)
        self._free_starts: list[int] = [0]  # sorted offsets of the free ranges
        self._free_len: dict[int, int] = {0: self.capacity}
        self._returned: collections.deque = collections.deque()  # (offset, bytes) of dead buffers
        self._lock = threading.Lock()
        self.in_use = self.peak_in_use = 0
        self.hit_bytes = self.miss_bytes = self.released_bytes = 0
        # ranges of the region whose pages are not resident (never touched, or given back): always inside
        # free ranges; sorted starts and lengths ([Note: give back what the misses add])
        self._clean_starts: list[int] = []
        self._clean_len: dict[int, int] = {}
        self.clean_bytes = 0
        if self._dontneed(0, self.capacity):  # heap memory the C library reused may be resident: make it clean
            self._clean_add(0, self.capacity)
        self.live = 0  # buffers handed out and not yet returned
        self.retired = False  # replaced by a larger pool: nothing is carved any more, what dies is given back
        self.miss_live_bytes = 0  # fresh buffers of misses alive (decrements queued in _miss_returned)
        self.peak_live_bytes = 0  # the most bytes handed out and of live misses at once (reset_peak_live)
        self._miss_returned: collections.deque = collections.deque()

    # ------------------------------------------------------------------ carving
    def take(self, nbytes: int, high: bool = False) -> torch.Tensor | None:
        """A 1-D ``uint8`` tensor of at least ``nbytes`` bytes (a multiple of the granule), its first byte
        granule-aligned, content undefined; None when no free range is large enough (counted in
        :attr:`miss_bytes`: allocate fresh memory instead).

        By default it is carved at the start of the lowest free range that holds it ([Note: the lowest range
        first]); with ``high`` (a buffer of the step's pipeline that dies within the phase: an optimizer
        sub-group's slice) at the end of the highest one where the pool keeps the pipeline at the top
        (:attr:`pipeline_at_top`, [Note: the pipeline's slices at the top])."""
        n = _round_up(max(int(nbytes), 1), self.granule)
        high = high and self.pipeline_at_top
        with self._lock:
            self._merge_returned()
            # first fit by address: the lowest free range that holds n ([Note: the lowest range first]), or
            # the highest one for the pipeline's slices ([Note: the pipeline's slices at the top])
            starts = reversed(self._free_starts) if high else self._free_starts
            start = next((off for off in starts if self._free_len[off] >= n), None)
            if start is None:
                self.miss_bytes += int(nbytes)  # the caller's :meth:`fresh` gives back what it adds
                return None
            length = self._free_len.pop(start)
            # the carve's offset: a free range starts at a granule (it ends at one, or at the region's end)
            best = start + (length - n) // self.granule * self.granule if high else start
            # about to be touched, and with it the rest of its huge pages (the region is advised onto them)
            lo = best // _HUGE_PAGE * _HUGE_PAGE
            self._clean_remove(lo, min(_round_up(best + n, _HUGE_PAGE), self.capacity) - lo)
            i = bisect.bisect_left(self._free_starts, start)
            del self._free_starts[i]
            for rest, k in ((start, best - start), (best + n, start + length - best - n)):  # what is left, in order
                if k > 0:
                    self._free_starts.insert(i, rest)
                    self._free_len[rest] = k
                    i += 1
            self.in_use += n
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            self.peak_live_bytes = max(self.peak_live_bytes, self.in_use + self.miss_live_bytes)
            self.hit_bytes += int(nbytes)
            self.live += 1
            # Fault in the carve's first and last huge pages now: a free range sharing one of them must not be
            # given back and counted clean while the carve is untouched, since the carve's first touch would map
            # the whole 2 MiB page, that range included ([Note: a clean page stays clean]).
            for page in {lo, (best + n - 1) // _HUGE_PAGE * _HUGE_PAGE}:
                ctypes.memset(self._start + max(page, best), 0, 1)
            self._lean()  # the carve may have taken given-back pages a live miss relies on
        cbuf = (ctypes.c_char * n).from_address(self._start + best)
        cbuf._pool = self  # type: ignore[attr-defined]  # the region lives as long as any buffer carved from it
        arr = np.frombuffer(cbuf, dtype=np.uint8)  # type: ignore[call-overload]
        weakref.finalize(arr, self._give_back, best, n).atexit = False  # never at exit: live buffers stay intact
        return torch.from_numpy(arr)

    def _give_back(self, off: int, n: int) -> None:
        """Finalizer of a carved buffer (any thread, maybe inside :meth:`take` of this thread: no lock):
        queue its range, first giving its pages back when a miss is alive ([Note: lean while a miss is
        alive]; the range is in no free list yet, so nothing can carve it meanwhile)."""
        released = (self.retired or self.miss_live_bytes > self.clean_bytes) and self._dontneed(off, n)
        self._returned.append((off, n, n if released else 0))

    def _dontneed(self, off: int, n: int) -> bool:
        """Give the pages of ``[off, off + n)`` of the region back to the OS (``MADV_DONTNEED``); False
        where that is not possible (no glibc)."""
        try:
            return glibc().madvise(ctypes.c_void_p(self._start + off), ctypes.c_size_t(n), _MADV_DONTNEED) == 0
        except (OSError, AttributeError):
            return False

    def fresh(self, nbytes: int) -> torch.Tensor:
        """Fresh host memory for a request :meth:`take` refused: a 1-D ``uint8`` tensor of ``nbytes`` bytes
        from the C library's heap (content undefined), counted in :attr:`miss_live_bytes` until its last
        view dies; meanwhile dying pool buffers give their pages back ([Note: lean while a miss is alive]).
        The caller aligns it (:func:`aidaptiv_ds.io.buffers.alloc_aligned`)."""
        n = max(int(nbytes), 1)
        arr = np.empty(n, dtype=np.uint8)
        with self._lock:
            self._merge_returned()
            self.miss_live_bytes += n
            self.peak_live_bytes = max(self.peak_live_bytes, self.in_use + self.miss_live_bytes)
            self._lean()
        weakref.finalize(arr, self._miss_returned.append, n).atexit = False
        return torch.from_numpy(arr)

    def _resident_free_ranges(self, top_first: bool = False):
        """``(offset, bytes)`` of the free ranges' parts whose pages may be resident (lock held): free minus
        clean, whole granules."""
        out = []
        for off in self._free_starts:
            end, pos = off + self._free_len[off], off
            starts, lens = self._clean_starts, self._clean_len
            i = max(bisect.bisect_right(starts, pos) - 1, 0)
            while pos < end:
                while i < len(starts) and starts[i] + lens[starts[i]] <= pos:  # clean ranges behind pos
                    i += 1
                c = starts[i] if i < len(starts) else end
                if c > pos:  # resident from pos up to the next clean range (or the end)
                    out.append((pos, min(c, end) - pos))
                    pos = min(c, end)
                else:  # inside a clean range: skip it
                    pos = min(c + lens[c], end)
        return out[::-1] if top_first else out

    def _give_back_range(self, off: int, n: int) -> bool:
        """Give the pages of free ``[off, off + n)`` back and count them clean (lock held)."""
        if not self._dontneed(off, n):
            return False
        self._clean_add(off, n)
        self.released_bytes += n
        return True

    def _lean(self) -> None:
        """Give back resident free pages until the clean bytes cover the live misses (lock held;
        [Note: give back what the misses add]): from the top of the region down."""
        need = self.miss_live_bytes - self.clean_bytes
        if need <= 0:
            return
        for off, n in self._resident_free_ranges(top_first=True):
            k = min(n, _round_up(need, self.granule))
            if self._give_back_range(off + n - k, k):
                need -= k
            if need <= 0:
                return

    def _release_free(self) -> None:
        """Give the pages of every free range back to the OS (lock held)."""
        self._merge_returned()
        for off, n in self._resident_free_ranges():
            self._give_back_range(off, n)

    # ------------------------------------------------------------------ the clean set
    def _clean_add(self, off: int, n: int) -> None:
        """Mark ``[off, off + n)`` not resident (lock held), merged with its neighbours."""
        self.clean_bytes += n
        _insert_merged(self._clean_starts, self._clean_len, off, n)

    def _clean_remove(self, off: int, n: int) -> None:
        """Mark ``[off, off + n)`` as about to be touched (lock held): cut it out of the clean ranges."""
        end = off + n
        i = max(bisect.bisect_right(self._clean_starts, off) - 1, 0)
        while i < len(self._clean_starts):
            c = self._clean_starts[i]
            cend = c + self._clean_len[c]
            if c >= end:
                break
            if cend <= off:
                i += 1
                continue
            del self._clean_starts[i]
            del self._clean_len[c]
            self.clean_bytes -= cend - c
            for a, b in ((c, min(off, cend)), (max(end, c), cend)):  # what stays clean on either side
                if b > a:
                    self._clean_starts.insert(i, a)
                    self._clean_len[a] = b - a
                    self.clean_bytes += b - a
                    i += 1

    def _merge_returned(self) -> None:
        """Put the ranges of dead buffers back into the free list, merged with their neighbours (lock held)."""
        while self._miss_returned:
            self.miss_live_bytes -= self._miss_returned.popleft()
        while self._returned:
            off, n, released = self._returned.popleft()
            if released:  # given back in its finalizer: clean from here
                self.released_bytes += released
                self._clean_add(off, n)
            self.in_use -= n
            self.live -= 1
            _insert_merged(self._free_starts, self._free_len, off, n)

    def free_bytes(self) -> int:
        """Bytes of the region not handed out (after merging the buffers returned so far)."""
        with self._lock:
            self._merge_returned()
            return sum(self._free_len.values())

    def largest_free(self) -> int:
        """The largest request that fits now, bytes."""
        with self._lock:
            self._merge_returned()
            return max(self._free_len.values(), default=0)

    def contains(self, t: torch.Tensor) -> bool:
        """All bytes of tensor ``t`` lie inside the region."""
        p = t.data_ptr()
        return self._start <= p and p + t.numel() * t.element_size() <= self._start + self.capacity

    def release_free(self) -> int:
        """Give the pages of every free range back to the OS now (``MADV_DONTNEED``; the ranges stay mapped
        and read as zeros when next handed out); returns the bytes of the free ranges. For a one-time drop,
        e.g. the end of initialisation: touched free pages otherwise stay resident until a miss."""
        with self._lock:
            self._release_free()
            return sum(self._free_len.values())

    def retire(self) -> int:
        """This pool is replaced (a second engine's larger pool, ``Runtime.settle_host_memory_reuse``): give its
        free pages back now, and from here on every buffer of it that dies as well, since nothing will carve its
        ranges again (the budget's long-lived slices can keep the region alive for a long time). Returns the bytes
        of the free ranges."""
        self.retired = True
        return self.release_free()

    def reset_peak_live(self) -> int:
        """Restart :attr:`peak_live_bytes` from the bytes live now (pool and misses); returns the peak it had."""
        with self._lock:
            self._merge_returned()
            old, self.peak_live_bytes = self.peak_live_bytes, self.in_use + self.miss_live_bytes
            return old

    def counters(self) -> dict:
        """``{"capacity", "in_use", "peak_in_use", "hit_bytes", "miss_bytes", "released_bytes",
        "miss_live_bytes"}``, bytes."""
        with self._lock:
            self._merge_returned()
            return {"capacity": self.capacity, "in_use": self.in_use, "peak_in_use": self.peak_in_use,
                    "hit_bytes": self.hit_bytes, "miss_bytes": self.miss_bytes, "released_bytes": self.released_bytes,
                    "miss_live_bytes": self.miss_live_bytes}
