"""``dram_budget: "auto"`` on a CPU rank leaves room for DeepSpeed's own working set (gathered parameters up
to ``stage3_max_live_parameters``, the ``reduce_bucket_size`` gradient bucket), which a GPU would hold in VRAM
(aidaptiv_ds/planner/auto.py, ``deepspeed_cpu_rank_bytes``)."""
from __future__ import annotations

import pytest
import torch

from aidaptiv_ds.planner.auto import deepspeed_cpu_rank_bytes
from aidaptiv_ds.ports import free_port


def test_the_formula_caps_live_parameters_at_the_model():
    # DeepSpeed's defaults on a 2.7B fp32 model: 1e9 live elements (4 GB) + a 5e8-element fp32 bucket (2 GB)
    assert deepspeed_cpu_rank_bytes(10**9, 2_700_000_000, 4, 5 * 10**8, 4) == 6 * 10**9
    # a model smaller than the live bound: all of it, once
    assert deepspeed_cpu_rank_bytes(10**9, 1000, 2, 10, 2) == 2020


@pytest.mark.engine
@pytest.mark.parametrize("max_live,bucket", [(10**9, 5 * 10**8), (4096, 4096)], ids=["defaults", "capped"])
def test_auto_budget_takes_deepspeeds_cpu_working_set_out(tmp_path, monkeypatch, max_live, bucket):
    import deepspeed

    import aidaptiv_ds  # noqa: F401  (installs the hooks)
    from aidaptiv_ds.integration import stage3

    seen = []
    real = stage3.auto_dram_budget
    monkeypatch.setattr(stage3, "auto_dram_budget", lambda working_set_bytes=0: seen.append(working_set_bytes)
                        or real(working_set_bytes=working_set_bytes))
    # our own working set out of the way (0), so what the budget is cut by is DeepSpeed's alone
    monkeypatch.setattr(stage3, "host_working_set", lambda **_kw: 0)
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "cache"
    cache.mkdir()
    nvme = {"device": "nvme", "nvme_path": str(cache)}
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme,
                                 "stage3_param_persistence_threshold": 0, "sub_group_size": 4096,
                                 "stage3_max_live_parameters": max_live, "reduce_bucket_size": bucket},
           "aidaptiv": {"enabled": True, "cache_paths": [str(cache)], "dram_budget": "auto"}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    try:
        numel = sum(p.ds_numel for p in engine.module.parameters())
        mine = engine.optimizer._aidaptiv_deepspeed_cpu_bytes(list(engine.module.parameters()))
        assert mine == deepspeed_cpu_rank_bytes(max_live, numel, 4, bucket, 4)
        assert mine == (numel * 4 + bucket * 4 if max_live >= numel else max_live * 4 + bucket * 4)
        assert seen == [mine]  # nothing held in DRAM yet when the budget is cut: exactly DeepSpeed's share
    finally:
        rt = engine.optimizer._aidaptiv_rt
        engine.destroy()
        rt.close()  # one runtime per process: the next test's cache paths get a fresh one
