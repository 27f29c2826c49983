"""The parameter swapper's bookkeeping against DeepSpeed's contract (docs/deepspeed-seams.md §1.3-1.5),
in-process with fake ZeRO parameters: no engine, no ``zero.Init``, a real store on a temporary path.

A fake parameter carries what DeepSpeed 0.19.8 puts on one (``ds_id``, ``ds_numel``, ``ds_tensor``
with ``ds_numel`` and ``status``); the calls are made in the order DeepSpeed makes them.
"""
from __future__ import annotations

import pytest
import torch

from aidaptiv_ds.integration.config import parse_section
from aidaptiv_ds.integration.param_swapper import AidaptivParamSwapper, PartitionState
from aidaptiv_ds.integration.runtime import Runtime
from aidaptiv_ds.tiers import TieredUnit


@pytest.fixture
def status():
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
    return PartitionedParamStatus


@pytest.fixture
def swapper(tmp_path):
    cfg = parse_section({"enabled": True, "cache_paths": [str(tmp_path)], "dram_budget": 0, "run_name": "unit",
                         "io": {"direct": False}})
    rt = Runtime(cfg)
    sw = rt.param_swapper = AidaptivParamSwapper(rt)
    yield sw
    rt.close()


def _written(sw) -> int:
    return sum(sw.rt.store.bytes_written)


def make_param(sw, status, ds_id: int, values: torch.Tensor):
    """A first partition as ``partition_parameters.py:1820-1893`` makes it: ``get_buffer``, fill, ``AVAILABLE``,
    ``swap_out_and_release``."""
    p = torch.nn.Parameter(torch.empty(0, dtype=values.dtype), requires_grad=False)
    p.ds_id, p.ds_numel = ds_id, values.numel()
    buf = sw.get_buffer(p, values.numel())
    assert buf.numel() == values.numel() and buf.dtype == values.dtype
    buf.copy_(values)
    p.ds_tensor = buf
    p.ds_tensor.ds_numel = values.numel()
    p.ds_tensor.status = status.AVAILABLE
    sw.swap_out_and_release([p])
    return p


def test_first_partition_is_written_once_and_released_to_a_0_dim_placeholder(swapper, status):
    before = _written(swapper)
    p = make_param(swapper, status, 0, torch.arange(1000, dtype=torch.float32))
    assert p.ds_tensor.status == status.NOT_AVAILABLE and p.ds_tensor.data.dim() == 0
    assert _written(swapper) - before >= 4000


def test_sync_swap_in_with_duplicates_makes_every_partition_available(swapper, status):
    a = make_param(swapper, status, 0, torch.arange(1000, dtype=torch.float32))
    b = make_param(swapper, status, 1, -torch.arange(513, dtype=torch.float32))
    swapper.swap_in([a, b, b, a], async_op=False)  # the coordinator passes duplicates (§5)
    assert a.ds_tensor.status == b.ds_tensor.status == status.AVAILABLE
    assert torch.equal(a.ds_tensor.data, torch.arange(1000, dtype=torch.float32))
    assert torch.equal(b.ds_tensor.data, -torch.arange(513, dtype=torch.float32))


def test_async_swap_in_is_inflight_until_synchronize_reads(swapper, status):
    a = make_param(swapper, status, 0, torch.full((300,), 7, dtype=torch.bfloat16))
    swapper.swap_in([a], async_op=True)
    assert a.ds_tensor.status == status.INFLIGHT
    swapper.synchronize_reads()
    assert a.ds_tensor.status == status.AVAILABLE and torch.all(a.ds_tensor.data == 7)


def test_a_release_is_a_clean_drop(swapper, status):
    a = make_param(swapper, status, 0, torch.arange(4096, dtype=torch.float32))
    swapper.swap_in([a], async_op=False)
    written = _written(swapper)
    swapper.remove_partition_and_release_buffers([a])
    swapper.remove_partition_and_release_buffers([a])  # twice, and for a partition holding no buffer
    assert a.ds_tensor.status == status.NOT_AVAILABLE and a.ds_tensor.data.dim() == 0
    assert _written(swapper) == written  # nothing written
    swapper.swap_in([a], async_op=False)
    assert torch.equal(a.ds_tensor.data, torch.arange(4096, dtype=torch.float32))


def test_swap_out_partitioned_params_carries_new_content_cast_to_the_partition_dtype(swapper, status):
    a = make_param(swapper, status, 0, torch.zeros(777, dtype=torch.bfloat16))
    master = torch.linspace(-3, 3, 777, dtype=torch.float32)
    written = _written(swapper)
    swapper.swap_out_partitioned_params([a], [master])  # the per-step parameter write (stage3.py:1289)
    swapper.synchronize_writes()
    swapper.rt.tier.wait_writes()  # the write is booked by the tier (the kept slice): counted once it completed
    # counted once the waits return, before anything else waits ([Note: callbacks before waiters] in io/futures.py:
    # a late-added callback once overtook the store's byte counter)
    assert _written(swapper) > written, _write_state(swapper, written)
    rec = swapper.record(0)
    assert rec.host is None or not rec.host.resident  # budget 0: the new bytes must reach the drive
    assert a.ds_tensor.status == status.NOT_AVAILABLE
    # the drive's bytes, read past the DRAM tier: the step's write is there
    fut, buf, skip = rec.loc.region.read(rec.loc.start, rec.loc.end)
    fut.wait()
    on_drive = buf[skip:skip + rec.loc.nbytes].view(torch.bfloat16)
    assert torch.equal(on_drive, master.to(torch.bfloat16)), _write_state(swapper, written)
    swapper.swap_in([a], async_op=False)
    assert torch.equal(a.ds_tensor.data, master.to(torch.bfloat16))


def _write_state(sw, written_before: int) -> str:
    """What a failed write check prints: the counters and every write the store, the region, the tier and the
    engine hold (the engine's own count against the store's tells a late count from a missing write)."""
    st, rec = sw.rt.store, sw.record(0)
    return (f"store bytes_written {st.bytes_written} (before the step's write: {written_before}); "
            f"aliased skipped {sw.aliased_skipped_bytes}; loc {rec.loc[1:]}; host {rec.host!r}; "
            f"region pending {[(f.done(), f.nbytes) for r in sw._regions.values() for f in r._pending]}; "
            f"tier writes {[(w.nbytes, w.future.done()) for w in sw.rt.tier._writes]}; "
            f"store writes in flight {[(w.start, w.end, w.future.done()) for w in st._writes_inflight]}; "
            f"engine {st.engine.stats() if hasattr(st.engine, 'stats') else None}")


def test_new_content_wins_over_a_read_in_flight(swapper, status):
    """A read of the old bytes still in flight is never published after the step's write (§1.5)."""
    a = make_param(swapper, status, 0, torch.zeros(2048, dtype=torch.float32))
    swapper.swap_in([a], async_op=True)  # prefetch of the old bytes
    swapper.swap_out_partitioned_params([a], [torch.ones(2048)])
    swapper.synchronize_reads()
    swapper.swap_in([a], async_op=False)
    assert a.ds_tensor.status == status.AVAILABLE and torch.all(a.ds_tensor.data == 1)


def test_reading_a_partition_never_written_is_refused(swapper, status):
    p = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    p.ds_id, p.ds_numel = 99, 10
    p.ds_tensor = torch.empty(0)
    p.ds_tensor.ds_numel, p.ds_tensor.status = 10, status.NOT_AVAILABLE
    with pytest.raises(RuntimeError, match="ds_id=99 was never swapped out"):
        swapper.swap_in([p], async_op=False)


def test_min_swap_bytes_keeps_small_partitions_out_of_the_store(tmp_path):
    cfg = parse_section({"enabled": True, "cache_paths": [str(tmp_path)], "dram_budget": 0, "run_name": "small",
                         "min_swap_bytes": 4096, "io": {"direct": False}})
    rt = Runtime(cfg)
    try:
        sw = AidaptivParamSwapper(rt)
        assert not sw.swappable_tensor(numel=1000) and sw.swappable_tensor(numel=1024)
    finally:
        rt.close()


def test_one_rank_publishes_cached_partitions_only_within_the_prefetch_window(tmp_path, status):
    """Publishing pins a host slice (the tier evicts only unreferenced slices), so the partitions
    published ahead of DeepSpeed's fetch keep to ``prefetch_bytes`` even when the DRAM budget caches
    them all (the 2.7B fp32 run at ``auto`` pinned 10 GiB of cached parameters from step 2 on)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as Z

    mib = 1 << 20
    cfg = parse_section({"enabled": True, "cache_paths": [str(tmp_path)], "dram_budget": 64 * mib, "run_name": "pub",
                         "prefetch_bytes": 3 * mib, "io": {"direct": False}})
    rt = Runtime(cfg)
    try:
        sw = rt.param_swapper = AidaptivParamSwapper(rt)
        params = [make_param(sw, status, i, torch.full((mib // 4,), float(i))) for i in range(8)]
        for p in params:
            p.ds_status = Z.NOT_AVAILABLE
        sw.swap_in(params, async_op=False)  # forward of step 1: every partition read ...
        sw.remove_partition_and_release_buffers(params)  # ... released, and kept by the budget
        assert all(sw.record(p.ds_id).state is PartitionState.IN_DRAM for p in params)
        published = lambda: [p.ds_id for p in params if p.ds_tensor.status != status.NOT_AVAILABLE]  # noqa: E731

        queue = params + params[::-1]  # forward then backward order, duplicates as in DeepSpeed's queue
        sw.promote_ready(queue)
        assert published() == [0, 1, 2]  # 3 MiB: not the 8 MiB the budget holds
        sw.promote_ready(queue)
        assert published() == [0, 1, 2]  # published and not fetched yet: still the window's
        sw.synchronize_reads()  # DeepSpeed's fetch of module 0: partition AVAILABLE, parameter gathered
        params[0].ds_status = Z.AVAILABLE
        sw.promote_ready(queue[1:])
        assert published() == [0, 1, 2, 3]
        sw.remove_partition_and_release_buffers(params[:1])  # module 0 released
        params[0].ds_status = Z.NOT_AVAILABLE
        sw.promote_ready(queue[1:])
        assert published() == [1, 2, 3]
        assert torch.all(params[3].ds_tensor.data == 3)
    finally:
        rt.close()


def test_one_rank_publishes_a_partition_larger_than_the_window(tmp_path, status):
    """At least one partition is published, or DeepSpeed's all-gather prefetch could never run over it."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as Z

    cfg = parse_section({"enabled": True, "cache_paths": [str(tmp_path)], "dram_budget": 16 << 20, "run_name": "big",
                         "prefetch_bytes": 4096, "io": {"direct": False}})
    rt = Runtime(cfg)
    try:
        sw = rt.param_swapper = AidaptivParamSwapper(rt)
        params = [make_param(sw, status, i, torch.full((1 << 18,), float(i))) for i in range(2)]
        for p in params:
            p.ds_status = Z.NOT_AVAILABLE
        sw.swap_in(params, async_op=False)
        sw.remove_partition_and_release_buffers(params)
        sw.promote_ready(params)
        assert [p.ds_tensor.status for p in params] == [status.INFLIGHT, status.NOT_AVAILABLE]
    finally:
        rt.close()


def test_a_partition_record_walks_its_states(tmp_path, status):
    """[Note: partition states] of ``PartitionRecord``: ON_DRIVE -> PUBLISHED (swap_in) -> IN_DRAM
    (released, kept by the budget) -> ON_DRIVE (the tier evicts the slice); a written copy is IN_DRAM."""
    cfg = parse_section({"enabled": True, "cache_paths": [str(tmp_path)], "dram_budget": 1 << 20, "run_name": "st",
                         "io": {"direct": False}})
    rt = Runtime(cfg)
    try:
        sw = rt.param_swapper = AidaptivParamSwapper(rt)
        p = make_param(sw, status, 0, torch.arange(4096, dtype=torch.float32))
        rec = sw.record(0)
        assert rec.state is PartitionState.ON_DRIVE and rec.host is None and sw.holds(0) and not sw.holds(1)
        sw.swap_in([p], async_op=False)
        assert rec.state is PartitionState.PUBLISHED and rec.pinned is rec.host and rec.host.refs == 1
        sw.remove_partition_and_release_buffers([p])
        assert rec.state is PartitionState.IN_DRAM and rec.host.refs == 0
        rt.tier.evict(rec.host)
        assert rec.state is PartitionState.ON_DRIVE
        sw.swap_out_partitioned_params([p], [torch.ones(4096)])
        assert rec.state in (PartitionState.IN_DRAM, PartitionState.ON_DRIVE)  # the staging copy, kept or evicted
        sw.swap_in([p], async_op=False)
        assert torch.all(p.ds_tensor.data == 1)
    finally:
        rt.close()


def test_reclaimable_bytes_counts_whole_holes_less_the_slack(swapper, status):
    """What the preflight may count as free once partitions leave our region (``alias_to_master``):
    the chunks no live partition uses, per hole in the store less ``slack``; nothing while any stays."""
    params = [make_param(swapper, status, i, torch.zeros(1 << 20)) for i in range(3)]  # 12 MiB of fp32
    region = next(iter(swapper._regions.values()))
    held = sum(n for _, n in region.chunk_extents(list(range(len(region._starts)))))
    ids = [p.ds_id for p in params]
    assert swapper.reclaimable_bytes([]) == 0
    assert swapper.reclaimable_bytes(ids) == held  # one hole: the chunks were allocated back to back
    assert swapper.reclaimable_bytes(ids, slack=1 << 20) == held - (1 << 20)
    assert swapper.reclaimable_bytes(ids[:2]) < held  # the last partition keeps its chunk


def test_a_read_ahead_slice_no_partition_reads_is_evicted_at_budget_0():
    """[Note: a slice no partition reads] (issue 34): the master copies a step leaves for the next forward are
    read-ahead working memory until used; when every partition detaches from one first (the next step gives them
    new copies), the tier's next budget check evicts it instead of keeping it for the rest of the run."""
    from aidaptiv_ds.integration.param_swapper import PartitionRecord, _Loc
    from aidaptiv_ds.tiers import HostTier, TieredUnit

    tier = HostTier(budget=0)
    loc = _Loc(None, 0, 256, torch.float32, 4)
    a, b = PartitionRecord(1, loc), PartitionRecord(2, loc)
    s = TieredUnit(("p", "r", 0, 0), torch.zeros(2048, dtype=torch.uint8), members=(1, 2), kind="param", prefetched=True)
    a.host = b.host = s
    tier.add(s)
    a.detach_host(tier)
    tier.enforce_budget()
    assert tier.held_bytes == 2048 and s.prefetched  # partition 2 will still read it
    b.detach_host(tier)
    tier.enforce_budget()
    assert tier.held_bytes == 0 and not s.prefetched


def test_synchronize_writes_waits_for_the_tiers_parameter_write_backs(swapper, status):
    """DeepSpeed's ``synchronize_writes`` means every partition write issued so far is below. A resident parameter
    slice edited in DRAM is written by the host tier (its flush, a dirty eviction), not by the swapper's regions: the
    call waits for those writes too, and only for the parameters' (issue 39)."""
    from aidaptiv_ds.io.futures import IOFuture

    class Write(IOFuture):  # a write in flight until someone waits for it (a waiter expedites it)
        def expedite(self, priority):
            if not self.done():
                self._chunk_done()

    a = make_param(swapper, status, 0, torch.zeros(1024, dtype=torch.float32))
    swapper.synchronize_writes()
    swapper.make_resident()
    tier = swapper.rt.tier
    (unit,) = [u for u in tier.slices() if u.kind == "param"]
    assert unit.resident
    swapper.swap_out_partitioned_params([a], [torch.ones(1024)])  # into the resident slice: marked dirty
    assert unit.dirty
    real, gates = unit.writeback, []

    def gated(u):
        real(u).wait()
        gates.append(Write(u.nbytes, 1))
        return gates[-1]

    unit.writeback = gated  # the owner's write function: the unit's own field, set before the tier decides
    other = tier.add(TieredUnit("other", torch.zeros(64, dtype=torch.uint8), kind="opt", dirty=True,
                                resident=True, writeback=lambda u: Write(u.nbytes, 1)))
    tier.write_back(unit)
    tier.write_back(other)
    assert len(gates) == 1 and not gates[0].done() and not other.writing.done()
    swapper.synchronize_writes()
    assert gates[0].done()  # the parameter's write is below
    assert not other.writing.done()  # an optimizer slice's write is not the swapper's to wait for
    tier.wait_writes()
    swapper.swap_in([a], async_op=False)
    assert torch.equal(a.ds_tensor.data, torch.ones(1024))
