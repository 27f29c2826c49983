"""On a partition group of one rank the gradient reduce-scatter is the identity, and our Stage-3 subclass
skips it (``integration/grad_path.py``, [Note: the reduce-scatter of one rank]): the partitions are the
gradients themselves, bit for bit what DeepSpeed's ``__avg_scatter_grads`` returns, without its two
bucket-sized copies. The whole-engine equality with DeepSpeed's CPU offload is ``tests/test_oracle.py``."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _engine import nvme_config, one_rank_env
from _oracle import REPO
from aidaptiv_ds.ports import free_port
from conftest import EXT_DIR

_AGAINST_DEEPSPEED = r"""
import itertools, types, torch
import deepspeed.comm as dist
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z3
from aidaptiv_ds.integration.grad_path import single_rank_grad_partitions
dist.init_distributed("gloo", rank=0, world_size=1, auto_mpi_discovery=False)
deepspeeds = Z3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads  # DeepSpeed's own, unbound

class Optimizer:  # what DeepSpeed's __avg_scatter_grads reads of its optimizer
    all2all_process_group = None
    def __init__(self, dtype, accum, postscale, predivide, averaging):
        self.dtype, self.gradient_accumulation_dtype = dtype, accum
        self.postscale_gradients, self.gradient_predivide_factor, self.averaging = postscale, predivide, averaging
    def _assert_same_partition_group(self, params): pass
    def _get_param_partition_group(self, param): return dist.get_world_group()
    def _gradient_averaging_world_size(self, params, n): return self.averaging

cases = 0
for dtype, comm, accum, postscale, predivide, averaging, sizes in itertools.product(
        (torch.float32, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32,), (True, False),
        (1.0, 3.0), (1, 2), ([1000], [7, 1000, 165], [[4, 33]])):
    g = torch.Generator().manual_seed(cases)
    grads = [torch.randn(*(s if isinstance(s, list) else [s]), generator=g).to(dtype) for s in sizes]
    opt = Optimizer(dtype, accum, postscale, predivide, averaging)
    theirs = deepspeeds(opt, [types.SimpleNamespace(grad=t.clone()) for t in grads], comm)
    ours = single_rank_grad_partitions([t.clone() for t in grads], model_dtype=dtype, communication_dtype=comm,
                                       accumulation_dtype=accum, postscale=postscale, predivide=predivide,
                                       averaging_world_size=averaging)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (dtype, comm, postscale, predivide, averaging, sizes)
    cases += 1
# nothing to convert or scale: the partitions are views of the gradients, nothing is copied
grads = [torch.randn(10, 3), torch.randn(5)]
parts = single_rank_grad_partitions(grads, model_dtype=torch.float32, communication_dtype=torch.float32,
                                    accumulation_dtype=torch.float32, postscale=True, predivide=1.0,
                                    averaging_world_size=1)
assert [p.data_ptr() for p in parts] == [g.data_ptr() for g in grads] and [p.shape for p in parts] == [(30,), (5,)]
print("cases", cases)
"""


@pytest.mark.subprocess
def test_single_rank_partitions_equal_deepspeeds_reduce_scatter():
    """DeepSpeed's own ``__avg_scatter_grads`` (gloo, one rank) against :func:`single_rank_grad_partitions` over
    model/communication dtypes, post-scaling, a pre-divide factor, expert averaging and buckets of one or
    several tensors (one tensor is DeepSpeed's no-copy special case): equal bits, dtypes and shapes."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TORCH_EXTENSIONS_DIR=EXT_DIR,
               PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", _AGAINST_DEEPSPEED], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) == 96  # every combination ran: 2 x 2 dtypes, 2 x 2 x 2 scalings, 3 buckets


@pytest.mark.engine
def test_engine_on_one_rank_never_calls_the_reduce_scatter(tmp_path, monkeypatch):
    """A one-rank engine on aidaptiv_ds trains with DeepSpeed's ``reduce_scatter_coalesced`` made to fail, over
    several buckets per backward (``reduce_bucket_size`` below the model), with a finite loss."""
    import deepspeed
    import deepspeed.runtime.zero.stage3 as ds_stage3

    import aidaptiv_ds  # noqa: F401  (installs the hooks)

    def refuse(*args, **kwargs):
        raise AssertionError("reduce_scatter_coalesced called on a partition group of one rank")

    monkeypatch.setattr(ds_stage3, "reduce_scatter_coalesced", refuse)
    one_rank_env(monkeypatch)
    cfg = nvme_config(tmp_path / "cache", micro_batch=2, reduce_bucket_size=5000)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    try:
        x = torch.randn(2, 64)
        losses = []
        for _ in range(2):
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]
    finally:
        rt = engine.optimizer._aidaptiv.rt
        engine.destroy()
        rt.close()  # one runtime per process: the next test's cache paths get a fresh one
