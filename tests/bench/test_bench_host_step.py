"""pytest-benchmark of the host-side compute of a step at DRAM budget 0 (not timed tests: nothing here
asserts a speed): one sub-group's Adam/AdamW step whole (torch's ``optimizer.step()``, DeepSpeed's call)
against tiled (:func:`aidaptiv_ds.integration.host_step.tiled_adam_step`), and DeepSpeed's per-partition
fp64 norm against the reused scratch (:class:`aidaptiv_ds.integration.grad_norms.NormScratch`), with
glibc's thresholds as budget 0 sets them (``io.heap.return_freed_host_memory``: blocks below 1 GiB are kept in
the heap within a phase; the runtime's trims at phase ends do not run between rounds here, so this measures the
steady state inside one backward).

Run for numbers:  python -m pytest tests/bench/test_bench_host_step.py -m benchmark --benchmark-enable
Environment: AIDAPTIV_BENCH_NUMEL (elements of the sub-group, default 20M; 1M when benchmarks are
disabled, a smoke run).
"""
from __future__ import annotations

import os

import pytest
import torch

from aidaptiv_ds.integration.grad_norms import NormScratch
from aidaptiv_ds.integration.host_step import tiled_adam_step
from aidaptiv_ds.io.heap import return_freed_host_memory

pytestmark = pytest.mark.benchmark


@pytest.fixture
def NUMEL(timing):
    if "AIDAPTIV_BENCH_NUMEL" in os.environ:
        return int(float(os.environ["AIDAPTIV_BENCH_NUMEL"]))
    return 20_000_000 if timing else 1_000_000


@pytest.fixture(scope="module", autouse=True)
def budget0_allocator():
    return_freed_host_memory()  # process-wide, as a budget-0 engine sets it


@pytest.mark.parametrize("how", ["whole", "tiled", "tiled_128k"])
def test_bench_adamw_step(benchmark, NUMEL, how):
    """``tiled``: the shipped tile size (``TILE_NUMEL``); ``tiled_128k``: the size it replaced (host_step.py
    [Note: the tile size]: this idle single-process benchmark favours it, the training step does not)."""
    p = torch.nn.Parameter(torch.randn(NUMEL))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(NUMEL)
    opt.step()  # state initialised, as in every step after the first
    tile = {"tiled": None, "tiled_128k": 1 << 17}.get(how)
    step = opt.step if how == "whole" else (lambda: tiled_adam_step(opt, opt.param_groups[0], p, tile))
    benchmark(step)
    benchmark.extra_info["elements_per_s"] = NUMEL / benchmark.stats.stats.mean if benchmark.stats else None


@pytest.mark.parametrize("how", ["deepspeed", "scratch"])
def test_bench_partition_norm(benchmark, NUMEL, how):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    ds = next(c for c in DeepSpeedZeroOptimizer_Stage3.__mro__ if c.__module__.startswith("deepspeed."))
    g = torch.randn(NUMEL // 5)
    scratch = NormScratch()
    one = (lambda: ds._constant_buffered_norm2(None, g)) if how == "deepspeed" else \
        (lambda: scratch.norm2(g, 250_000_000, torch.float64))
    benchmark(lambda: [one() for _ in range(5)])  # five partitions of one backward
