"""pytest-benchmark of the prefetch path: a forward pass over Llama blocks at DRAM budget 0, each block's
swap-in with and without overlap with the previous block's compute (issue 15).

Run for numbers:  python -m pytest tests/bench/test_bench_prefetch.py -m benchmark --benchmark-enable
With the project's default ``--benchmark-disable`` every case runs once, at a smaller size, as a test.
Environment: ``AIDAPTIV_BENCH_DIR`` (cache directory, default pytest's tmp dir under /tmp).

One round is one pass over ``BLOCKS`` blocks (hidden 768, MLP 2560: 8.26M parameters, 33 MB in fp32,
as the 150M preset), through :class:`AidaptivParamSwapper` at budget 0, so every block is read from
the store in every pass; a block's compute is its seven matrix products on ``TOKENS`` tokens (the
compare tool's sequence of 256), the attention and MLP shapes of a Llama block:

* ``serial``: ``swap_in(block k, async_op=False)``, compute ``k``, release: the read and the compute add;
* ``overlap``: the reads of block ``k+1`` are started (:meth:`AidaptivParamSwapper.prefetch`, what the
  coordinator's prefetch calls) before block ``k`` computes, then ``swap_in(k+1)`` waits only for what
  is left: ideally ``max(io_only, compute_only)``;
* ``io_only``: the swap-ins and releases alone; ``compute_only``: the products on tensors in DRAM.

The prefetch path's overlap efficiency is ``overlap / max(io_only, compute_only)`` (1.0: fully hidden;
``serial`` shows the sum). Before timing, one pass of ``serial`` and ``overlap`` is recorded as a
timeline (:mod:`aidaptiv_ds.spans`): ``serial`` reads only on demand and never during compute,
``overlap`` only ahead and partly during compute; every block's bytes are checked in the first pass.
``extra_info`` holds bytes and tokens per pass.
"""
from __future__ import annotations

import pytest
import torch

from aidaptiv_ds import spans
from aidaptiv_ds.integration.param_swapper import AidaptivParamSwapper
from aidaptiv_ds.telemetry.timeline_trace import union_seconds

pytestmark = pytest.mark.benchmark

HIDDEN, MLP = 768, 2560
BLOCKS = 4
TOKENS = 256


def _status():
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
    return PartitionedParamStatus


def _shapes(h: int, m: int) -> list[tuple[int, int]]:
    """A Llama block's matrices: q, k, v, o (h x h), gate, up (m x h), down (h x m)."""
    return [(h, h)] * 4 + [(m, h), (m, h), (h, m)]


class _FakeParam:
    """What the parameter swapper reads from a DeepSpeed parameter: ``ds_id``, ``ds_tensor``, dtype."""

    def __init__(self, ds_id: int, numel: int, dtype: torch.dtype) -> None:
        self.ds_id, self.dtype = ds_id, dtype
        self.ds_tensor = torch.empty(0, dtype=dtype)
        self.ds_tensor.ds_numel = numel
        self.ds_tensor.status = _status().NOT_AVAILABLE

    def element_size(self) -> int:
        return self.ds_tensor.element_size()


def _make_blocks(sw: AidaptivParamSwapper, h: int, m: int):
    """Partition ``BLOCKS`` blocks through the swapper as DeepSpeed does at first partition; returns
    the blocks' parameters and a DRAM copy of every matrix."""
    S = _status()
    g = torch.Generator().manual_seed(0)
    blocks, truth, ds_id = [], {}, 0
    for _ in range(BLOCKS):
        params = []
        for rows, cols in _shapes(h, m):
            p = _FakeParam(ds_id, rows * cols, torch.float32)
            buf = sw.get_buffer(p, rows * cols)
            buf.copy_(torch.randn(rows * cols, generator=g) / cols ** 0.5)
            truth[ds_id] = buf.clone().view(rows, cols)
            p.ds_tensor.data = buf
            p.ds_tensor.status = S.AVAILABLE
            sw.swap_out_and_release([p])
            params.append(p)
            ds_id += 1
        blocks.append(params)
    sw.synchronize_writes()
    return blocks, truth


def _compute(mats: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The block's products: attention projections, then the gated MLP (no softmax: the matrix work)."""
    q, k, v, o, gate, up, down = mats
    a = (x @ q.T) + (x @ k.T) + (x @ v.T)
    x = x + a @ o.T
    return x + (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _mats(params, h: int, m: int) -> list[torch.Tensor]:
    return [p.ds_tensor.data.view(r, c) for p, (r, c) in zip(params, _shapes(h, m), strict=True)]


@pytest.mark.parametrize("path", ["serial", "overlap", "io_only", "compute_only"])
def test_block_prefetch_overlap(benchmark, runtime, timing, path):
    h, m = (HIDDEN, MLP) if timing else (256, 688)
    tokens = TOKENS if timing else 64
    sw = AidaptivParamSwapper(runtime)
    blocks, truth = _make_blocks(sw, h, m)
    S = _status()
    x0 = torch.randn(tokens, h, generator=torch.Generator().manual_seed(1))
    block_bytes = sum(r * c for r, c in _shapes(h, m)) * 4
    window = sw.prefetch_window()
    assert window >= block_bytes, "the read-ahead window must hold a block for the overlap case"
    checked = {"passes": 0}

    def check(params):
        if checked["passes"] == 0:  # the first pass: the bytes of every block are the ones written
            assert all(p.ds_tensor.status == S.AVAILABLE and torch.equal(p.ds_tensor.data.view_as(truth[p.ds_id]),
                                                                         truth[p.ds_id]) for p in params)

    def compute(params, x):
        with spans.span("compute", lane="compute"):
            return _compute(_mats(params, h, m), x)

    def serial():
        x = x0
        for params in blocks:
            sw.swap_in(params, async_op=False)
            check(params)
            x = compute(params, x)
            sw.remove_partition_and_release_buffers(params)
        checked["passes"] += 1
        return x

    def overlap():
        x = x0
        sw.swap_in(blocks[0], async_op=False)
        for k, params in enumerate(blocks):
            if k + 1 < BLOCKS:  # block k+1's reads are in flight while block k computes
                sw.prefetch([p.ds_id for p in blocks[k + 1]], window)
            check(params)
            x = compute(params, x)
            sw.remove_partition_and_release_buffers(params)
            if k + 1 < BLOCKS:
                sw.swap_in(blocks[k + 1], async_op=False)
        checked["passes"] += 1
        return x

    def io_only():
        for params in blocks:
            sw.swap_in(params, async_op=False)
            check(params)
            sw.remove_partition_and_release_buffers(params)
        checked["passes"] += 1

    dram = [[truth[p.ds_id] for p in params] for params in blocks]

    def compute_only():
        x = x0
        for mats in dram:
            x = _compute(mats, x)
        return x

    fn = {"serial": serial, "overlap": overlap, "io_only": io_only, "compute_only": compute_only}[path]
    expected = compute_only()
    if path in ("serial", "overlap"):  # one recorded pass: where the reads ran, and the result
        rec = spans.start()
        try:
            got = fn()
        finally:
            spans.stop()
        assert torch.equal(got, expected)
        reads = [e for e in rec.events if e[2] == "read"]
        work = [(e[4], e[5]) for e in rec.events if e[1] == "compute"]
        assert sum(e[6]["bytes"] for e in reads) >= BLOCKS * block_bytes
        prios = {e[6]["priority"] for e in reads}
        during = union_seconds([(max(a, c), min(b, d)) for _, _, _, _, a, b, _ in reads for c, d in work
                                if min(b, d) > max(a, c)])
        if path == "serial":
            assert prios == {"demand"} and during == 0.0  # nothing read while computing
        else:
            # block 0 on demand, the rest issued ahead, before the compute before them (a read still queued
            # when its block's swap-in waits for it runs at demand priority: "issued" keeps what it was)
            ahead = sum(e[6]["bytes"] for e in reads if e[6].get("issued", e[6]["priority"]) == "prefetch")
            assert "prefetch" in prios and ahead >= (BLOCKS - 1) * block_bytes
        benchmark.extra_info["read_during_compute_s"] = during
    benchmark.group = "block swap-in with and without overlap (fp32, budget 0)"
    benchmark.extra_info.update(bytes_per_pass=BLOCKS * block_bytes if path != "compute_only" else 0,
                                blocks=BLOCKS, tokens=tokens, hidden=h, mlp=m)
    benchmark.pedantic(fn, rounds=5 if timing else 1, iterations=1, warmup_rounds=1)
    assert runtime.tier.held_bytes == 0  # budget 0: every release left DRAM
    if benchmark.stats is not None and path != "compute_only":
        benchmark.extra_info["gbps"] = BLOCKS * block_bytes / benchmark.stats.stats.median / 1e9
