"""The host buffer pool (``aidaptiv_ds/io/pool.py``): buffers carved from one region never overlap while
alive, come back when their last view (or NumPy array, or I/O future) dies, merge with free neighbours,
and a request that does not fit is refused and counted (the caller takes fresh memory)."""
from __future__ import annotations

import gc
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aidaptiv_ds.io import buffers
from aidaptiv_ds.io.pool import POOL_GRANULE, POOL_MIN_BYTES, HostBufferPool

MiB = 1 << 20


@pytest.fixture
def pool():
    p = HostBufferPool(16 * MiB)
    prev = buffers.use_pool(p)
    yield p
    buffers.use_pool(prev)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_a_buffer_returns_when_its_last_view_dies(pool):
    x = buffers.alloc_aligned(3 * MiB)
    assert pool.contains(x) and x.data_ptr() % 4096 == 0 and x.numel() == 3 * MiB
    view, arr = x[100:200], x.numpy()
    ptr = x.data_ptr()
    del x
    assert pool.counters()["in_use"] == 3 * MiB  # the view and the NumPy array still hold it
    del view
    assert pool.counters()["in_use"] == 3 * MiB
    del arr
    assert pool.counters()["in_use"] == 0 and pool.free_bytes() == pool.capacity
    assert buffers.alloc_aligned(3 * MiB).data_ptr() == ptr  # the same range, reused


def test_zero_fill_of_reused_memory(pool):
    x = buffers.alloc_aligned(2 * MiB)
    x.fill_(0xAB)
    del x
    y = buffers.alloc_aligned(2 * MiB, dtype=torch.float32, zero=True)
    assert pool.contains(y) and y.dtype == torch.float32 and int(y.count_nonzero()) == 0


def test_small_and_pinned_requests_and_misses_bypass_the_pool(pool):
    small = buffers.alloc_aligned(POOL_MIN_BYTES - 4096)
    assert not pool.contains(small)
    big = buffers.alloc_aligned(pool.capacity + MiB)  # larger than the region: fresh memory
    assert not pool.contains(big) and big.numel() == pool.capacity + MiB
    assert pool.counters()["miss_bytes"] == pool.capacity + MiB
    odd = buffers.alloc_aligned(2 * MiB, alignment=2 * POOL_GRANULE)  # an alignment the granule cannot give
    assert not pool.contains(odd) and odd.data_ptr() % (2 * POOL_GRANULE) == 0


def test_free_neighbours_merge_so_a_large_request_fits_again(pool):
    parts = [buffers.alloc_aligned(4 * MiB) for _ in range(4)]
    assert all(pool.contains(p) for p in parts) and pool.largest_free() == 0
    del parts[1], parts[1]  # the second and third: adjacent ranges
    assert pool.largest_free() == 8 * MiB
    merged = buffers.alloc_aligned(8 * MiB)
    assert pool.contains(merged)


def test_buffers_freed_in_other_threads_come_back(pool):
    bufs = [buffers.alloc_aligned(MiB) for _ in range(8)]
    done = threading.Event()

    def drop(held):
        held.clear()
        done.set()

    t = threading.Thread(target=drop, args=(bufs,))
    t.start()
    t.join()
    assert done.is_set() and pool.free_bytes() == pool.capacity


def test_the_region_outlives_the_pool_object_while_buffers_live():
    p = HostBufferPool(4 * MiB)
    x = p.take(2 * MiB)
    x.fill_(7)
    del p
    gc.collect()
    assert int(x[0]) == 7 and int(x[-1]) == 7  # still mapped: the buffer keeps the pool and its region


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="granule"):
        HostBufferPool(4 * MiB, granule=1000)
    with pytest.raises(ValueError, match="capacity"):
        HostBufferPool(1000)


def _take_into(p: HostBufferPool, n: int, live: list, high: bool = False) -> None:
    buf = p.take(n, high=high)
    if buf is not None:
        buf.fill_(len(live) % 251)
        live.append(buf)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5 * MiB)), min_size=1, max_size=60))
def test_live_buffers_never_overlap_and_bytes_add_up(ops):
    """Carves at either end (0: low, 1: high) and deaths (2) in any order: no two live buffers overlap, the
    counters add up, nothing is handed out twice."""
    p = HostBufferPool(16 * MiB)
    live: list[torch.Tensor] = []
    for op, n in ops:
        if op < 2 or not live:
            _take_into(p, n, live, high=op == 1)
        else:
            live.pop(n % len(live))
        spans = sorted(_span(b) for b in live)
        assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:]))
        assert all(p.contains(b) for b in live)
        c = p.counters()
        assert c["in_use"] == sum(b.numel() for b in live) and p.free_bytes() == p.capacity - c["in_use"]
    assert all(int(b.min()) == int(b.max()) for b in live)  # nothing handed out twice: each keeps its fill
    live.clear()
    assert p.free_bytes() == p.capacity


def test_the_runtime_makes_a_pool_only_where_no_heap_is_kept(monkeypatch):
    """``io.buffer_pool: "auto"``: a pool of the planned windows plus the DRAM budget where the heap is not
    kept; a second engine's plan adds its windows; ``false`` never; ``true`` also beside a kept heap."""
    from types import SimpleNamespace

    from aidaptiv_ds.integration import runtime as rt_mod

    monkeypatch.setattr(rt_mod, "cuda_pinning_available", lambda: False)
    prev = buffers.current_pool()

    def fake(pool, reuse, budget=0):
        return SimpleNamespace(cfg=SimpleNamespace(io=SimpleNamespace(reuse_host_memory=reuse, buffer_pool=pool)),
                               reuse_host_memory=reuse is True, rank=1, _huge_pages_advised=False, buffer_pool=None,
                               budget=budget)
    try:
        rt = fake("auto", "auto")
        rt_mod.Runtime.settle_host_memory_reuse(rt, heap_bytes=2, budget_free_bytes=1, pool_bytes=8 * MiB)
        assert rt.buffer_pool is not None and rt.buffer_pool.capacity == 8 * MiB
        assert buffers.current_pool() is rt.buffer_pool
        rt_mod.Runtime.settle_host_memory_reuse(rt, heap_bytes=2, budget_free_bytes=1, pool_bytes=4 * MiB)
        assert rt.buffer_pool.capacity == 12 * MiB and buffers.current_pool() is rt.buffer_pool
        assert not rt.buffer_pool.pipeline_at_top  # budget 0: every buffer carved low
        rt_mod.Runtime.settle_host_memory_reuse(rt, heap_bytes=2, budget_free_bytes=1, pool_bytes=4 * MiB, rides=True)
        assert rt.buffer_pool.capacity == 16 * MiB and not rt.buffer_pool.pipeline_at_top  # riding at budget 0 too
        budgeted = fake("auto", "auto", budget=6 * MiB)  # the budget's units are carved from the pool too
        rt_mod.Runtime.settle_host_memory_reuse(budgeted, heap_bytes=2, budget_free_bytes=1, pool_bytes=8 * MiB)
        assert budgeted.buffer_pool.capacity == 14 * MiB and not budgeted.buffer_pool.pipeline_at_top  # in step()
        first = budgeted.buffer_pool
        rt_mod.Runtime.settle_host_memory_reuse(budgeted, heap_bytes=2, budget_free_bytes=1, pool_bytes=4 * MiB,
                                                rides=True)
        assert budgeted.buffer_pool.capacity == 18 * MiB  # the budget once, each engine's windows
        assert budgeted.buffer_pool.pipeline_at_top  # riding at a budget above 0
        assert first.retired and not budgeted.buffer_pool.retired  # the first gives its pages back as they die
        off = fake(False, "auto")
        rt_mod.Runtime.settle_host_memory_reuse(off, heap_bytes=2, budget_free_bytes=1, pool_bytes=8 * MiB)
        assert off.buffer_pool is None
        kept = fake("auto", True)  # the heap is kept: no pool by "auto", one by true
        rt_mod.Runtime.settle_host_memory_reuse(kept, heap_bytes=2, budget_free_bytes=1, pool_bytes=8 * MiB)
        assert kept.buffer_pool is None
        forced = fake(True, True)
        rt_mod.Runtime.settle_host_memory_reuse(forced, heap_bytes=2, budget_free_bytes=1, pool_bytes=8 * MiB)
        assert forced.buffer_pool is not None
    finally:
        buffers.use_pool(prev)


def _resident_bytes(t: torch.Tensor) -> int:
    """Resident bytes of the pages under ``t`` (``mincore``)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL("libc.so.6")
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    n = -(-(t.data_ptr() + t.numel() - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * mmap.PAGESIZE), vec) == 0
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def test_a_miss_gives_the_free_pages_back(pool):
    """io/pool.py [Note: a miss gives the free pages back]: a freed, touched range stays resident while the
    pool serves everything; a miss (fresh memory beside the region) returns its pages, the range reads as
    zeros when handed out again, and a second miss with nothing carved in between releases nothing more."""
    a = buffers.alloc_aligned(8 * MiB)
    a.fill_(0xFF)
    keep = buffers.alloc_aligned(4 * MiB)
    ptr = a.data_ptr()
    view = a[:8 * MiB]
    del a
    del view
    gc.collect()
    probe = torch.frombuffer((__import__("ctypes").c_char * (8 * MiB)).from_address(ptr), dtype=torch.uint8)
    assert _resident_bytes(probe) == 8 * MiB  # freed, but still resident: reuse without faults
    assert pool.counters()["released_bytes"] == 0
    big = buffers.alloc_aligned(pool.capacity)  # does not fit beside ``keep``: a miss
    assert not pool.contains(big)
    released = pool.counters()["released_bytes"]
    assert released >= 8 * MiB and _resident_bytes(probe) == 0
    again = buffers.alloc_aligned(pool.capacity)  # a second miss, nothing carved since: nothing more released
    assert not pool.contains(again) and pool.counters()["released_bytes"] == released
    b = buffers.alloc_aligned(8 * MiB)
    assert b.data_ptr() == ptr and int(b.count_nonzero()) == 0  # the given-back pages read as zeros
    assert pool.contains(keep)


def test_buffers_dying_while_a_miss_lives_give_their_pages_back(pool):
    """io/pool.py [Note: lean while a miss is alive]: while a fresh buffer of a miss lives, a pool buffer that
    dies gives its pages back at once (the region and the fresh memory are not both resident); once no
    miss lives, a dead buffer's pages stay for reuse again."""
    import ctypes

    def probe(ptr, n):
        return torch.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=torch.uint8)

    a = buffers.alloc_aligned(4 * MiB)
    a.fill_(1)
    pa = a.data_ptr()
    big = buffers.alloc_aligned(pool.capacity)  # does not fit beside ``a``: a miss, fresh memory
    assert not pool.contains(big)
    c = pool.counters()
    assert c["miss_live_bytes"] >= pool.capacity
    released = c["released_bytes"]
    assert _resident_bytes(probe(pa, 4 * MiB)) == 4 * MiB  # in use: resident
    del a
    gc.collect()
    assert _resident_bytes(probe(pa, 4 * MiB)) == 0  # died while the miss lives: given back at once
    assert pool.counters()["released_bytes"] == released + 4 * MiB
    del big
    gc.collect()
    assert pool.counters()["miss_live_bytes"] == 0
    d = buffers.alloc_aligned(4 * MiB)
    d.fill_(1)
    pd = d.data_ptr()
    del d
    gc.collect()
    assert _resident_bytes(probe(pd, 4 * MiB)) == 4 * MiB  # no miss alive: kept for reuse
    assert pool.counters()["released_bytes"] == released + 4 * MiB


def test_a_buffer_returned_after_a_release_is_given_back_at_the_next_miss(pool):
    """A range that comes back resident after a miss released the free ranges (no miss alive by then) is
    released by the next miss, although the merge that took it in ran inside that miss's own ``take``."""
    import ctypes
    keep = buffers.alloc_aligned(2 * MiB)  # so a request of the whole region misses throughout
    a = buffers.alloc_aligned(4 * MiB)
    a.fill_(1)
    pa = a.data_ptr()
    big = buffers.alloc_aligned(pool.capacity)  # a miss: the free ranges are given back
    assert not pool.contains(big)
    del big
    gc.collect()
    assert pool.counters()["miss_live_bytes"] == 0  # merged: no miss alive
    del a  # comes back resident (nothing to be lean for)
    gc.collect()
    probe = torch.frombuffer((ctypes.c_char * (4 * MiB)).from_address(pa), dtype=torch.uint8)
    assert _resident_bytes(probe) == 4 * MiB
    again = buffers.alloc_aligned(pool.capacity)  # the next miss
    assert not pool.contains(again) and pool.contains(keep)
    assert _resident_bytes(probe) == 0


def test_peak_live_counts_the_pools_buffers_and_the_misses_at_once(pool):
    """``peak_live_bytes``: the most swap-buffer bytes alive at once, carved or fresh (the bench worker's
    ``phase_peak_swap_buffer_bytes``), restarted by ``reset_peak_live``."""
    assert pool.reset_peak_live() == 0
    a = buffers.alloc_aligned(10 * MiB)
    b = buffers.alloc_aligned(10 * MiB)  # does not fit beside a: a fresh buffer
    assert pool.contains(a) and not pool.contains(b)
    assert pool.peak_live_bytes >= 20 * MiB
    del a, b
    gc.collect()
    assert pool.reset_peak_live() >= 20 * MiB
    assert pool.peak_live_bytes == 0  # nothing alive now
    c = buffers.alloc_aligned(2 * MiB)
    assert pool.peak_live_bytes == 2 * MiB
    del c


def test_release_free_gives_the_touched_free_pages_back(pool):
    """``release_free`` (the runtime's ``release_host_memory``, end of initialisation): the pages of free ranges
    leave the process; buffers in use keep theirs and their bytes."""
    def resident(start: int, n: int) -> int:
        import ctypes
        import mmap

        page = mmap.PAGESIZE
        vec = (ctypes.c_ubyte * ((n + page - 1) // page))()
        assert ctypes.CDLL(None).mincore(ctypes.c_void_p(start), ctypes.c_size_t(n), vec) == 0
        return sum(v & 1 for v in vec) * page

    a = buffers.alloc_aligned(4 * MiB)
    b = buffers.alloc_aligned(4 * MiB)
    a.fill_(7)
    b.fill_(1)
    ptr = b.data_ptr()
    del b
    gc.collect()
    assert resident(ptr, 4 * MiB) == 4 * MiB  # a dead buffer's touched pages stay until given back
    assert pool.release_free() == pool.capacity - 4 * MiB
    assert resident(ptr, 4 * MiB) == 0 and int(a.min()) == 7 == int(a.max())


def _region_resident(p: HostBufferPool) -> int:
    import ctypes
    import mmap
    n = p.capacity // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    assert ctypes.CDLL("libc.so.6").mincore(ctypes.c_void_p(p._start), ctypes.c_size_t(p.capacity), vec) == 0
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def test_a_miss_gives_back_what_it_adds_not_every_free_page(pool):
    """io/pool.py [Note: give back what the misses add]: a miss the pool has room for in total but not in
    one range (fragmented) gives back about its own size of resident free pages, not all of them, and
    buffers dying while it lives keep their pages once that is covered; the region's resident pages plus
    the live misses stay within the capacity throughout."""
    bufs = [buffers.alloc_aligned(2 * MiB) for _ in range(8)]  # the whole 16 MiB region, touched
    for b in bufs:
        b.fill_(3)
    del bufs[::2]  # four 2 MiB holes: 8 MiB free, no range over 2 MiB
    gc.collect()
    assert _region_resident(pool) == 16 * MiB and pool.counters()["released_bytes"] == 0
    miss = buffers.alloc_aligned(3 * MiB)  # fits in total, not in one range: a miss
    assert not pool.contains(miss)
    live = pool.counters()["miss_live_bytes"]
    released = pool.counters()["released_bytes"]
    assert live <= released <= live + 2 * MiB  # about its own size (whole granules from whole ranges)
    assert _region_resident(pool) + live <= pool.capacity
    del bufs[0]  # dies while the miss lives: the miss is covered already, so its pages stay
    gc.collect()
    assert pool.counters()["released_bytes"] == released
    assert _region_resident(pool) + live <= pool.capacity
    reuse = buffers.alloc_aligned(2 * MiB)  # a resident range again, no fault
    assert pool.contains(reuse) and _region_resident(pool) + live <= pool.capacity


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6 * MiB)), min_size=1, max_size=50))
def test_clean_ranges_are_free_and_not_resident_and_misses_fit_beside_the_region(ops):
    """The pool's clean set (pages not resident) lies inside its free ranges, sums to ``clean_bytes``, and
    is what ``mincore`` says; after every allocation the region's resident pages plus the live misses fit
    in the capacity, or every free page is given back."""
    p = HostBufferPool(16 * MiB)
    prev = buffers.use_pool(p)
    live: list[torch.Tensor] = []
    try:
        for kind, n in ops:
            if kind == 2 and live:
                live.pop(n % len(live))
                gc.collect()
            else:
                b = buffers.alloc_aligned(n, pipeline=kind == 3)  # 3: a pipeline slice, carved high
                b.fill_(1)  # touch it
                live.append(b)
            c = p.counters()  # merges what was returned
            with p._lock:
                clean = [(s, p._clean_len[s]) for s in p._clean_starts]
                free = [(s, p._free_len[s]) for s in p._free_starts]
                resident_free = sum(k for _, k in p._resident_free_ranges())
            assert sum(k for _, k in clean) == p.clean_bytes
            assert all(any(f <= s and s + k <= f + fl for f, fl in free) for s, k in clean)
            resident = _region_resident(p)
            assert resident <= p.capacity - p.clean_bytes
            assert resident + c["miss_live_bytes"] <= p.capacity or resident_free == 0
            assert all(int(b.min()) == 1 for b in live)  # nothing live was given back (it would read zeros)
    finally:
        live.clear()
        buffers.use_pool(prev)



def test_a_free_range_sharing_an_untouched_carves_huge_page_is_not_counted_clean():
    """io/pool.py [Note: a clean page stays clean]: a miss that gives back the free part of a huge page whose
    carve is not touched yet must not count it clean, or the carve's first touch maps the whole 2 MiB page behind
    the pool's back (the clean set then overstates what is given back). Reproduced with ``mincore`` before the
    fix: 4 MiB resident with 1 MiB counted clean."""
    p = HostBufferPool(4 * MiB)
    a = p.take(2 * MiB)
    a.fill_(3)
    miss = p.fresh(1 * MiB)  # a live miss: the next carve's lean gives back 1 MiB from the region's top
    miss.fill_(1)
    b = p.take(64 << 10)  # the first 64 KiB of the second huge page; the rest of that page is free
    b.fill_(1)  # the caller's first touch
    assert _region_resident(p) <= p.capacity - p.clean_bytes, (_region_resident(p), p.clean_bytes)
    assert _region_resident(p) + p.counters()["miss_live_bytes"] <= p.capacity
    assert int(a.min()) == 3 and int(b.min()) == 1


def test_a_retired_pool_gives_back_its_free_pages_and_each_buffer_that_dies():
    """A pool replaced by a larger one (a second engine) carves nothing any more: ``retire`` gives its free pages
    back, and each of its buffers that dies afterwards is given back too, while the live ones keep their bytes."""
    p = HostBufferPool(8 * MiB)
    keep, dies, freed = p.take(2 * MiB), p.take(2 * MiB), p.take(2 * MiB)
    for t in (keep, dies, freed):
        t.fill_(5)
    del t, freed
    gc.collect()
    assert _region_resident(p) >= 6 * MiB  # a dead buffer's touched pages stay while the pool is in use
    p.retire()
    assert _region_resident(p) <= 4 * MiB
    del dies
    gc.collect()
    assert _region_resident(p) <= 2 * MiB and int(keep.min()) == 5 == int(keep.max())


def test_a_carve_takes_the_lowest_free_range_so_untouched_pages_stay_untouched():
    """io/pool.py [Note: the lowest range first]: with nothing missing, nothing is given back, so the pool's host
    memory is the pages its carves ever touched. A request that fits both a touched free range low in the region
    and a smaller untouched one at its top goes to the touched one; best fit took the untouched one and touched it
    (the 148M Llama at budget 0 peaked 0.52 GiB higher with a larger pool)."""
    p = HostBufferPool(16 * MiB)
    a = p.take(10 * MiB)
    a.fill_(1)
    b = p.take(2 * MiB)  # free now: [12, 16) MiB, never touched
    b.fill_(1)
    del a  # free: [0, 10) MiB, touched, and the untouched [12, 16)
    gc.collect()
    before = _region_resident(p)
    c = p.take(4 * MiB)
    c.fill_(1)
    assert p.contains(c) and c.data_ptr() == p._start  # the lowest range
    assert _region_resident(p) == before  # no page touched that was not resident already
    assert p.clean_bytes >= 4 * MiB  # the top stays clean


def test_the_pipelines_slices_are_carved_at_the_top_apart_from_longer_lived_buffers():
    """io/pool.py [Note: the pipeline's slices at the top]: the optimizer pipeline's slices (one size, each dead
    within the phase) carved low between buffers that live longer leave holes each too small for the next slice;
    carved at the top, a dead slice's range is free whole for the next one. The same sequence of requests misses
    with every buffer carved low and does not with the slices high."""
    def misses(high: bool, at_top: bool = True) -> int:
        p = HostBufferPool(100 * MiB, pipeline_at_top=at_top)
        slices, kept = [], []
        slices.append(p.take(30 * MiB, high=high))
        kept.append(p.take(10 * MiB))  # a long-lived buffer carved while the slice lives (a cached copy)
        slices.append(p.take(30 * MiB, high=high))
        kept.append(p.take(10 * MiB))
        slices.pop(0)  # the first slice's update is done
        gc.collect()
        kept.append(p.take(10 * MiB))
        slices.append(p.take(30 * MiB, high=high))  # the third slice: 50 MiB free in all
        return int(p.miss_bytes) // MiB

    assert misses(high=False) == 30  # low: free are [10, 30) and [80, 100) MiB, neither holds 30
    assert misses(high=True) == 0
    assert misses(high=True, at_top=False) == 30  # a pool that keeps no pipeline at the top (budget 0) carves low
    p = HostBufferPool(16 * MiB)
    a, b = p.take(4 * MiB, high=True), p.take(2 * MiB)
    assert a.data_ptr() == p._start + 12 * MiB and b.data_ptr() == p._start  # the top end, the bottom end
    # a granule that does not divide the region: the high carve stays on a granule, the sliver above it free
    q = HostBufferPool(4 * MiB, granule=12288)  # 341.3 granules
    c = q.take(1, high=True)
    assert (c.data_ptr() - q._start) % 12288 == 0 and q.free_bytes() == q.capacity - 12288
    assert q.largest_free() == (q.capacity - 12288) // 12288 * 12288

