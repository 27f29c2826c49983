"""An in-process DeepSpeed engine of one rank on aidaptiv_ds, for tests that look inside it (``engine`` marker)."""
from __future__ import annotations

from aidaptiv_ds.ports import free_port


def one_rank_env(monkeypatch) -> None:
    """The launcher's environment of a single rank (``deepspeed.initialize`` reads it), on a free port."""
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)


def nvme_config(cache, *, micro_batch: int = 1, dram_budget=0, **zero) -> dict:
    """A ZeRO-3 config with parameters and optimizer state offloaded to ``cache`` (a directory, created) and
    aidaptiv_ds on it: torch AdamW, persistence threshold 0, 4096-element sub-groups; ``zero`` adds to or
    overrides ``zero_optimization``."""
    cache.mkdir(exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": str(cache)}
    return {"train_micro_batch_size_per_gpu": micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 3, "offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme,
                                  "stage3_param_persistence_threshold": 0, "sub_group_size": 4096, **zero},
            "aidaptiv": {"enabled": True, "cache_paths": [str(cache)], "dram_budget": dram_budget}}
