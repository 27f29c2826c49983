"""``dram_budget: "auto"`` on a CPU rank leaves room for DeepSpeed's own working set (gathered parameters up
to the larger of ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` plus two modules, a recomputed
layer's frozen parameters, the ``reduce_bucket_size`` gradient bucket and, over several ranks, the two copies of
it its reduce-scatter makes), which a GPU would hold in VRAM (aidaptiv_ds/planner/auto.py,
``deepspeed_cpu_rank_bytes``)."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from aidaptiv_ds.planner.auto import (CPU_REDUCE_BUCKET_NUMEL, REDUCE_PATH_COPIES, deepspeed_cpu_rank_bytes,
                                      deepspeed_gathered_numel, persistent_numel, reduce_path_copies)
from _engine import nvme_config, one_rank_env
from aidaptiv_ds.ports import free_port
from conftest import EXT_DIR


def test_the_formula_caps_live_parameters_at_the_model():
    # DeepSpeed's defaults on a 2.7B fp32 model, 2 ranks: 1e9 live elements (4 GB) + three 5e8-element buckets (6 GB)
    assert deepspeed_cpu_rank_bytes(10**9, 2_700_000_000, 4, 5 * 10**8, 4, partition_ranks=2) == 10 * 10**9
    # a model smaller than the live bound: all of it, once; a bucket smaller than the model: three of it
    assert deepspeed_cpu_rank_bytes(10**9, 1000, 2, 10, 2, partition_ranks=4) == 2000 + 3 * 10 * 2
    # a bucket larger than the model holds the model's gradients at most (torch.empty pages never touched)
    assert deepspeed_cpu_rank_bytes(10, 1000, 2, 10**6, 2, partition_ranks=2) == 20 + 3 * 1000 * 2
    # one rank: the reduce-scatter is skipped (integration/grad_path.py), the bucket is held alone
    assert deepspeed_cpu_rank_bytes(10**9, 1000, 2, 10, 2, partition_ranks=1) == 2000 + 10 * 2


def test_the_gathered_bound_is_the_larger_knob_plus_two_modules_at_most_the_model():
    assert deepspeed_gathered_numel(10**9, 10**9, 82 * 10**6, 2_700_000_000) == 10**9 + 164 * 10**6
    assert deepspeed_gathered_numel(10**5, 10**9, 500, 10**7) == 10**7  # the reuse distance keeps the whole model
    assert deepspeed_gathered_numel(10**5, 0, 500, 10**7) == 10**5 + 1000  # reuse 0: max_live bounds the prefetch
    assert deepspeed_gathered_numel(0, 0, 500, 10**7) == 1000
    persistent = persistent_numel([10, 500, 10**5, 10**5 + 1], 10**5)  # tensors at most the threshold
    assert persistent == 100_510 and deepspeed_gathered_numel(0, 0, 500, 10**7, persistent) == 1000 + 100_510


LOW = {"stage3_max_live_parameters": 2000, "stage3_max_reuse_distance": 2000}


def _gathered_peak_and_plan(tmp_path, monkeypatch, model, zero, step, accumulation: int = 1
                            ) -> tuple[int, int, int]:
    """Train ``model`` 3 optimizer steps over one rank (``step(engine, i)`` runs the i-th); returns the peak of the elements
    DeepSpeed holds gathered (the parameters whose ``ds_status`` is AVAILABLE after every fetch and release of
    its coordinator, after every hold and release of a layer-major step's block, and after every step: the trace
    is complete from step 2 on), the elements the runtime plans
    for them (its parameters' swap buffers over one rank) and the model's elements."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

    import aidaptiv_ds  # noqa: F401  (installs the hooks)
    from aidaptiv_ds.integration.train_batch import EnginePieces

    params: list = []
    peak = [0]

    def count() -> None:
        peak[0] = max(peak[0], sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE))

    for cls, name in ((C, "fetch_sub_module"), (C, "release_sub_module"), (EnginePieces, "hold"),
                      (EnginePieces, "unhold")):
        def counted(self, *a, _real=getattr(cls, name), **k):
            out = _real(self, *a, **k)
            count()
            return out
        monkeypatch.setattr(cls, name, counted)
    one_rank_env(monkeypatch)
    cfg = nvme_config(tmp_path / "cache", **zero)
    cfg["gradient_accumulation_steps"] = accumulation
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    params.extend(engine.module.parameters())
    try:
        for i in range(3):
            step(engine, i)
            count()
        share = engine.optimizer._aidaptiv_deepspeed_host_share(list(engine.module.parameters()))
        return peak[0], share.live_partition_bytes // 4, sum(p.ds_numel for p in engine.module.parameters())
    finally:
        rt = engine.optimizer._aidaptiv.rt
        engine.destroy()
        rt.close()


def _step(loss_of):
    """One optimizer step of one micro-batch: ``engine.backward(loss_of(engine))``, ``engine.step()``."""
    def step(engine, i):
        engine.backward(loss_of(engine))
        engine.step()
    return step


@pytest.mark.engine
@pytest.mark.parametrize("zero", [{}, {"stage3_max_live_parameters": 2000}, LOW,
                                  {"stage3_max_live_parameters": 2000, "stage3_max_reuse_distance": 0},
                                  {**LOW, "stage3_param_persistence_threshold": 64}],
                         ids=["defaults", "max-live-low", "both-low", "reuse-0", "both-low-persistent-biases"])
def test_deepspeed_gathers_no_more_than_the_runtime_plans(tmp_path, monkeypatch, zero):
    """planner/auto.py [Note: what bounds the gathered parameters]: what DeepSpeed holds gathered over 3 steps of
    a stack of 8 Linear layers stays within what the runtime plans for it on one rank. With
    ``stage3_max_live_parameters`` lowered and the reuse distance left at 1e9, DeepSpeed keeps the whole model
    gathered into the backward: the bound of ``max_live`` alone, counted before, was short by 16x here.
    Persistent parameters (the biases, with the threshold at 64) stay gathered on top."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    peak, planned, numel = _gathered_peak_and_plan(tmp_path, monkeypatch, model, zero, _step(
        lambda engine: engine(torch.randn(1, 64)).square().mean()))
    assert 0 < peak <= planned <= numel, (peak, planned)
    if zero == {"stage3_max_live_parameters": 2000}:
        assert peak == numel  # the reuse distance (1e9) kept all of it, 16x max_live


class _Block(torch.nn.Module):
    """Six 64x64 Linear layers, the first five frozen (or none): a layer with frozen parameters."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.frozen = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(5))
        self.out = torch.nn.Linear(64, 64)
        for p in self.frozen.parameters():
            p.requires_grad_(not frozen)

    def forward(self, x):
        for f in self.frozen:
            x = torch.relu(f(x))
        return self.out(x)


class _Stack(torch.nn.Module):
    """8 blocks in a ``ModuleList`` (or a ``ModuleDict``), checkpointed one block (or ``segment`` blocks) at a
    time or not at all; no HF trunk."""

    def __init__(self, frozen: bool, checkpointing: bool, container: str = "list", segment: int = 1) -> None:
        super().__init__()
        blocks = [_Block(frozen) for _ in range(8)]
        self.layers = torch.nn.ModuleList(blocks) if container == "list" else \
            torch.nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})
        self.checkpointing, self.segment = checkpointing, segment

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        blocks = list(self.layers) if isinstance(self.layers, torch.nn.ModuleList) else list(self.layers.values())
        for i in range(0, len(blocks), self.segment):
            def run(y, seg=blocks[i:i + self.segment]):
                for b in seg:
                    y = b(y)
                return y
            x = checkpoint(run, x, use_reentrant=False) if self.checkpointing else run(x)
        return x


@pytest.mark.engine
@pytest.mark.parametrize("frozen,checkpointing,container,segment", [
    (True, True, "list", 1), (True, True, "dict", 1), (True, True, "list", 2), (True, False, "list", 1),
    (False, True, "list", 1)],
    ids=["frozen-checkpointed", "frozen-checkpointed-moduledict", "frozen-checkpointed-2-blocks", "frozen",
         "checkpointed"])
def test_a_recomputed_layers_frozen_parameters_stay_gathered_and_are_planned(tmp_path, monkeypatch, frozen,
                                                                             checkpointing, container, segment):
    """[Note: what bounds the gathered parameters]: under activation checkpointing DeepSpeed keeps the frozen
    parameters a recompute gathers until the recomputed region's backward ends, so with frozen layers (a partly
    frozen fine-tune) a whole block is gathered (24,960 elements here; two of a segment of two), past the
    knobs-plus-two-modules bound (10,320); for a model without an HF trunk the runtime plans all frozen parameters
    on top, the regions a script checkpoints being unknown (blocks in a ModuleDict, segments: found by a review).
    Without checkpointing, or with nothing frozen, DeepSpeed stays within two modules."""
    torch.manual_seed(0)
    model = _Stack(frozen, checkpointing, container, segment)
    module = 64 * 64 + 64
    peak, planned, numel = _gathered_peak_and_plan(tmp_path, monkeypatch, model, LOW, _step(
        lambda engine: engine(torch.randn(1, 64, requires_grad=True)).square().mean()))
    assert 0 < peak <= planned <= numel, (peak, planned)
    knobs_and_two_modules = LOW["stage3_max_live_parameters"] + 2 * module
    if frozen and checkpointing:
        assert peak >= 6 * segment * module - module > knobs_and_two_modules, peak  # the recomputed region
    else:
        assert peak <= 2 * module, peak


@pytest.mark.engine
@pytest.mark.parametrize("layer_major", [True, False], ids=["layer-major", "micro-batch-major"])
def test_a_layer_major_steps_held_block_is_planned(tmp_path, monkeypatch, layer_major):
    """[Note: what bounds the gathered parameters]: a layer-major step (``engine.train_batch``, two micro-batches)
    holds each block of the trunk gathered outside DeepSpeed's coordinator, a whole layer of the 4-layer Llama
    (38,528 elements) against 19,408 by the knobs-plus-two-modules bound; the runtime plans the trunk's largest
    block on top for a model with a trunk. Micro-batch by micro-batch DeepSpeed stays within two modules."""
    from aidaptiv_ds.bench.fuzz_models import batch, build
    from aidaptiv_ds.integration.trunk import find_trunk

    torch.manual_seed(0)
    model = build("llama", 64, 4)
    layer = max(sum(p.numel() for p in b.parameters()) for b in find_trunk(model).blocks)
    module = max(p.numel() for p in model.parameters() if p.dim() == 2)  # the largest Linear (no biases)

    def step(engine, i):
        xs = [batch("llama", 64, 1, 2 * i + j, 0, torch.float32) for j in range(2)]
        if layer_major:
            engine.train_batch(iter(xs))
            return
        for x in xs:
            engine.backward(engine(x))
            engine.step()

    peak, planned, numel = _gathered_peak_and_plan(tmp_path, monkeypatch, model, LOW, step, accumulation=2)
    assert 0 < peak <= planned < numel, (peak, planned)
    if layer_major:
        assert peak == layer > LOW["stage3_max_live_parameters"] + 2 * module, (peak, layer, module)
    else:
        assert peak <= LOW["stage3_max_live_parameters"] + 2 * module, (peak, module)


def test_reduce_path_copies_by_partition_group():
    assert [reduce_path_copies(n) for n in (1, 2, 8)] == [1, REDUCE_PATH_COPIES, REDUCE_PATH_COPIES]
    with pytest.raises(ValueError, match="partition_ranks=0"):
        reduce_path_copies(0)


_REDUCE_PROBE = r"""
import os, sys, torch
import deepspeed.comm as dist
from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
dist.init_distributed("gloo", rank=0, world_size=1, auto_mpi_discovery=False)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
n = int(sys.argv[1])
bucket = torch.ones(n)                   # DeepSpeed's ipg bucket, filled by backward
grads = [bucket[i * (n // 4):(i + 1) * (n // 4)] for i in range(4)]   # the parameters' gradients: views of it
open("/proc/self/clear_refs", "w").write("5")  # peak RSS := RSS now
before = hwm()
out = reduce_scatter_coalesced(grads, dist.get_world_group())
print((hwm() - before) / (n * 4))
"""


@pytest.mark.subprocess
def test_deepspeeds_cpu_reduce_path_holds_two_more_buckets(tmp_path):
    """The constant behind ``REDUCE_PATH_COPIES``: on a CPU rank DeepSpeed's ``reduce_scatter_coalesced`` (what
    ``__avg_scatter_grads`` calls for each full bucket over several ranks; one rank skips it,
    ``tests/test_single_rank_reduce.py``) raises the peak RSS by two buckets beyond the bucket itself (its ``torch.cat`` of the interleaved partitions, and gloo's reduce-scatter buffer). Measured with
    the kernel's peak-RSS counter reset just before the call, so it is a count of touched pages, not a timing."""
    import subprocess
    import sys
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TORCH_EXTENSIONS_DIR=EXT_DIR)
    n = 64 << 20  # a 256 MiB fp32 bucket: large against the allocator's noise
    out = subprocess.run([sys.executable, "-c", _REDUCE_PROBE, str(n)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    extra_buckets = float(out.stdout.strip().splitlines()[-1])
    assert extra_buckets == pytest.approx(REDUCE_PATH_COPIES - 1, abs=0.1)


@pytest.mark.engine
@pytest.mark.parametrize("max_live,bucket", [(10**9, 5 * 10**8), (4096, 4096), (10**9, None)],
                         ids=["defaults", "capped", "bucket-unset"])
def test_auto_budget_takes_deepspeeds_cpu_working_set_out(tmp_path, monkeypatch, max_live, bucket, caplog):
    """The budget is cut by exactly DeepSpeed's share; a bucket the config sets is kept, one it leaves out runs
    at ``CPU_REDUCE_BUCKET_NUMEL`` on a CPU rank (instead of DeepSpeed's 5e8), and the log says so."""
    import deepspeed

    import aidaptiv_ds  # noqa: F401  (installs the hooks)
    from aidaptiv_ds.integration import stage3

    seen = []
    real = stage3.auto_dram_budget
    monkeypatch.setattr(stage3, "auto_dram_budget", lambda working_set_bytes=0: seen.append(working_set_bytes)
                        or real(working_set_bytes=working_set_bytes))
    # our own windows out of the way (0), so what the budget is cut by is DeepSpeed's alone
    from aidaptiv_ds.planner import working_set

    monkeypatch.setattr(working_set, "cpu_rank_working_set",
                        lambda **kw: {"baseline": 0, "forward": 0, "backward": kw["deepspeed_bytes"], "optimizer": 0,
                                      "in_backward": 0, "riding": 0, "total": kw["deepspeed_bytes"]})
    one_rank_env(monkeypatch)
    cfg = nvme_config(tmp_path / "cache", dram_budget="auto", stage3_max_live_parameters=max_live,
                      **({} if bucket is None else {"reduce_bucket_size": bucket}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with caplog.at_level(logging.INFO, logger="aidaptiv_ds"):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    said = "reduce_bucket_size not set on a CPU rank" in caplog.text
    assert said == (bucket is None)
    if bucket is None:
        bucket = CPU_REDUCE_BUCKET_NUMEL
    try:
        assert engine.optimizer.reduce_bucket_size == bucket
        numel = sum(p.ds_numel for p in engine.module.parameters())
        mine, live, ranks = engine.optimizer._aidaptiv_deepspeed_host_share(list(engine.module.parameters()))
        # the reuse distance left at DeepSpeed's 1e9; a module is a Linear (64 x 64 + 64)
        gathered = deepspeed_gathered_numel(max_live, 10**9, 64 * 64 + 64, numel)
        assert gathered == numel  # the whole model, also with max_live 4096 ([Note: what bounds the gathered ...])
        assert mine == deepspeed_cpu_rank_bytes(gathered, numel, 4, bucket, 4, partition_ranks=1)
        # one rank: the gathered parameters are their partitions, our swap buffers, inside DeepSpeed's share
        assert ranks == 1 and live == gathered * 4
        assert mine == gathered * 4 + min(bucket, numel) * 4  # one rank: no reduce-scatter copies
        assert seen == [mine]  # nothing held in DRAM yet when the budget is cut: exactly DeepSpeed's share
    finally:
        rt = engine.optimizer._aidaptiv.rt
        engine.destroy()
        rt.close()  # one runtime per process: the next test's cache paths get a fresh one
