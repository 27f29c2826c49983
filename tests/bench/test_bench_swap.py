"""pytest-benchmark suite of the swap hot paths: a transformer block's swap-in, the optimizer sub-group pipeline.

Run for numbers:  python -m pytest tests/bench/test_bench_swap.py -m benchmark --benchmark-enable
With the project's default ``--benchmark-disable`` every case runs once, at a smaller size, as a
test (each checks the bytes it moved). Environment: ``AIDAPTIV_BENCH_DIR`` (cache directory,
default pytest's tmp dir under /tmp).

* ``test_block_swap_in``: the partitions of one Llama block (hidden 768, MLP 2560: 8.26M
  parameters, as in the 150M preset) through :class:`AidaptivParamSwapper` at DRAM budget 0:
  ``swap_in(block, async_op=False)`` then the clean drop DeepSpeed does after use, cycling over
  4 blocks so every swap-in reads from the store; next to it ``region_read``, the same bytes as one
  :class:`PackedRegion` read: the difference is the swapper's own cost.
* ``test_optimizer_pipeline``: one optimizer pass over 4 sub-groups the way Stage 3 drives it
  (``swap_in_optimizer_state(i, async_parameter=i+1)``, AdamW on ``i``,
  ``swap_out_optimizer_state(i)``; the write-back of the last one waited for), through
  :class:`AidaptivOptimizerSwapper` at budget 0 with gradients on the cache tier; next to it
  ``io_only`` (the same extents read and written with the same overlap through the store, no Adam)
  and ``adam_only`` (AdamW on the same tensors in DRAM, no I/O): the pipeline's ideal is
  ``max(io_only, adam_only)``, its worst ``io_only + adam_only``.

``extra_info`` holds bytes moved and GB/s (1e9 bytes/s).
"""
from __future__ import annotations


import pytest
import torch

from aidaptiv_ds.integration.gradients import GradientStore
from aidaptiv_ds.integration.optimizer_swapper import AidaptivOptimizerSwapper, SwapperLinks
from aidaptiv_ds.integration.param_swapper import AidaptivParamSwapper
from aidaptiv_ds.io import alloc_aligned
from aidaptiv_ds.io.engine import READ_DEMAND, READ_PREFETCH, WRITE_BACK

pytestmark = pytest.mark.benchmark

HIDDEN, MLP = 768, 2560
BLOCKS = 4
GROUPS = 4


# ---------------------------------------------------------------------------- block swap-in
def _status():
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
    return PartitionedParamStatus


def _block_shapes(hidden: int, mlp: int) -> list[int]:
    """Element counts of a Llama block's parameters (q, k, v, o, gate, up, down, two norms)."""
    return [hidden * hidden] * 4 + [hidden * mlp] * 3 + [hidden, hidden]


class _FakeParam:
    """What the parameter swapper reads from a DeepSpeed parameter: ``ds_id``, ``ds_tensor``, dtype."""

    def __init__(self, ds_id: int, numel: int, dtype: torch.dtype) -> None:
        self.ds_id = ds_id
        self.dtype = dtype
        self.ds_tensor = torch.empty(0, dtype=dtype)
        self.ds_tensor.ds_numel = numel
        self.ds_tensor.status = _status().NOT_AVAILABLE

    def element_size(self) -> int:
        return self.ds_tensor.element_size()


def _make_blocks(sw: AidaptivParamSwapper, dtype: torch.dtype, hidden: int, mlp: int):
    """Partition ``BLOCKS`` blocks through the swapper as DeepSpeed does at first partition."""
    S = _status()
    g = torch.Generator().manual_seed(0)
    blocks, truth, ds_id = [], {}, 0
    for _ in range(BLOCKS):
        params = []
        for n in _block_shapes(hidden, mlp):
            p = _FakeParam(ds_id, n, dtype)
            buf = sw.get_buffer(p, n)
            buf.copy_(torch.randn(n, generator=g).to(dtype))
            truth[ds_id] = buf.clone()
            p.ds_tensor.data = buf
            p.ds_tensor.status = S.AVAILABLE
            sw.swap_out_and_release([p])
            params.append(p)
            ds_id += 1
        blocks.append(params)
    sw.synchronize_writes()
    return blocks, truth


@pytest.mark.parametrize("path", ["swapper", "region_read"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_swap_in(benchmark, runtime, timing, dtype, path):
    hidden, mlp = (HIDDEN, MLP) if timing else (256, 688)
    sw = AidaptivParamSwapper(runtime)
    blocks, truth = _make_blocks(sw, dtype, hidden, mlp)
    S = _status()
    nbytes = sum(n for n in _block_shapes(hidden, mlp)) * dtype.itemsize
    state = {"k": 0}
    seen: list[int] = []

    def swap_in_block():
        params = blocks[state["k"] % BLOCKS]
        state["k"] += 1
        sw.swap_in(params, async_op=False)
        seen.append(sum(p.ds_tensor.numel() for p in params if p.ds_tensor.status == S.AVAILABLE))
        ok = all(torch.equal(p.ds_tensor.data, truth[p.ds_id]) for p in params) if state["k"] <= BLOCKS else True
        sw.remove_partition_and_release_buffers(params)
        return ok

    region = next(iter(sw._regions.values()))
    loc0 = [sw.record(p.ds_id).loc for p in blocks[0]]
    start, end = min(x.start for x in loc0), max(x.end for x in loc0)

    def region_read():
        fut, buf, skip = region.read(start, end, priority=READ_DEMAND)
        fut.wait()
        return buf[skip:skip + end - start]

    benchmark.group = f"block swap-in {str(dtype).replace('torch.', '')}"
    benchmark.extra_info.update(bytes=nbytes, params=sum(_block_shapes(hidden, mlp)), budget=0)
    if path == "swapper":
        ok = benchmark.pedantic(swap_in_block, rounds=2 * BLOCKS, iterations=1, warmup_rounds=0)
        assert ok
        assert seen and all(n == sum(_block_shapes(hidden, mlp)) for n in seen)
        assert runtime.tier.held_bytes == 0  # budget 0: every clean drop leaves DRAM
    else:
        got = benchmark.pedantic(region_read, rounds=2 * BLOCKS, iterations=1, warmup_rounds=0)
        first = blocks[0][0]
        assert torch.equal(got[: sw.record(first.ds_id).loc.nbytes].view(dtype), truth[first.ds_id])
    if benchmark.stats is not None:
        benchmark.extra_info["gbps"] = nbytes / benchmark.stats.stats.median / 1e9


# ---------------------------------------------------------------------------- optimizer pipeline
def _groups(numel: int):
    g = torch.Generator().manual_seed(1)
    masters = [torch.randn(numel, generator=g) for _ in range(GROUPS)]
    grads = [torch.randn(numel, generator=g) * 1e-2 for _ in range(GROUPS)]
    return masters, grads


def _fp32_params(n: int) -> list[torch.nn.Parameter]:
    """Stage 3's flat fp32 placeholders (``ds_id`` = a sub-group's first and last parameter ids)."""
    out = []
    for i in range(n):
        p = torch.nn.Parameter(torch.empty(0))
        p.ds_id = f"{10 * i}_{10 * i + 9}"
        out.append(p)
    return out


def _reference(masters, grads, passes: int) -> list[torch.Tensor]:
    ps = [torch.nn.Parameter(m.clone()) for m in masters]
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0)
    for _ in range(passes):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


@pytest.mark.parametrize("path", ["swapper", "io_only", "adam_only"])
def test_optimizer_pipeline(benchmark, runtime, timing, path):
    numel = (1 << 20) if not timing else (4 << 20)
    masters, grads = _groups(numel)
    group_bytes = numel * 4 * 3  # master + exp_avg + exp_avg_sq, fp32
    benchmark.group = "optimizer sub-group pipeline"
    benchmark.extra_info.update(groups=GROUPS, numel=numel, bytes_read=GROUPS * (group_bytes + numel * 4),
                                bytes_written=GROUPS * group_bytes)
    passes = {"n": 0}

    if path == "swapper":
        params = _fp32_params(GROUPS)
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        # gradients through the tiers, as the Stage-3 subclass sets them up (budget 0: all written)
        sw = AidaptivOptimizerSwapper(runtime, opt, torch.float32, engine_id=0, links=SwapperLinks(
            gradients=GradientStore(runtime, 0, torch.float32, [numel] * GROUPS, [1] * GROUPS)))
        sw.initialize_parameters(params, masters)

        def store_grads():
            for p, g in zip(params, grads):
                sw.swap_out_gradients(p, [0], [g])
            runtime.tier.wait_writes()
            return (), {}

        def one_pass():
            for i, p in enumerate(params):
                sw.swap_in_optimizer_state(p, async_parameter=params[i + 1] if i + 1 < GROUPS else None)
                opt.step()
                sw.swap_out_optimizer_state(p, async_swap=True)
            runtime.tier.wait_writes()
            passes["n"] += 1

        benchmark.pedantic(one_pass, setup=store_grads, rounds=3, iterations=1, warmup_rounds=0)
        ref = _reference(masters, grads, passes["n"])
        for i, p in enumerate(params):
            sw.swap_in_optimizer_state(p)
            assert torch.equal(p.data, ref[i]), f"sub-group {i} differs from a plain AdamW after {passes['n']} passes"
            sw.release_swap_buffers(p)
        assert runtime.tier.held_bytes == 0
    elif path == "io_only":
        store = runtime.store
        span = group_bytes
        for i in range(GROUPS):
            store.allocate(f"g{i}", span)
            store.allocate(f"grad{i}", numel * 4)
        bufs = [alloc_aligned(span) for _ in range(GROUPS)]
        gbufs = [alloc_aligned(numel * 4) for _ in range(GROUPS)]
        for i in range(GROUPS):
            bufs[i][: numel * 4].view(torch.float32).copy_(masters[i])
            store.write(f"g{i}", bufs[i], 0, WRITE_BACK).wait()
            gbufs[i].view(torch.float32).copy_(grads[i])
            store.write(f"grad{i}", gbufs[i], 0, WRITE_BACK).wait()

        def io_pass():
            reads = {0: (store.read("g0", bufs[0], 0, READ_DEMAND), store.read("grad0", gbufs[0], 0, READ_DEMAND))}
            writes = []
            for i in range(GROUPS):
                if i + 1 < GROUPS:
                    reads[i + 1] = (store.read(f"g{i + 1}", bufs[i + 1], 0, READ_PREFETCH),
                                    store.read(f"grad{i + 1}", gbufs[i + 1], 0, READ_PREFETCH))
                for f in reads.pop(i):
                    f.wait()
                writes.append(store.write(f"g{i}", bufs[i], 0, WRITE_BACK))
            for f in writes:
                f.wait()
            passes["n"] += 1

        benchmark.pedantic(io_pass, rounds=3, iterations=1, warmup_rounds=0)
        assert torch.equal(bufs[0][: numel * 4].view(torch.float32), masters[0])
    else:
        ps = [torch.nn.Parameter(m.clone()) for m in masters]
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0)

        def adam_pass():
            for p, g in zip(ps, grads):
                p.grad = g
                opt.step()
                p.grad = None
            passes["n"] += 1

        benchmark.pedantic(adam_pass, rounds=3, iterations=1, warmup_rounds=0)
        ref = _reference(masters, grads, passes["n"])
        assert all(torch.equal(p.detach(), r) for p, r in zip(ps, ref))
    if benchmark.stats is not None:
        moved = GROUPS * (2 * group_bytes + numel * 4)
        benchmark.extra_info["gbps"] = moved / benchmark.stats.stats.median / 1e9
