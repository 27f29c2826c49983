"""Train a tiny model two ZeRO-3 steps with a DeepSpeed config whose ``"aidaptiv"`` section is the only
mention of aidaptiv_ds: this script never imports it (issue 11.4; ``tests/test_site_hook.py``).

    python tests/scripts/no_import_train.py CACHE_DIR [--json CONFIG_FILE_TO_WRITE]

Prints one JSON line: which swapper and optimizer classes DeepSpeed ended up with, whether
aidaptiv_ds was imported (by the site hook) and the losses.
"""
import json
import os
import sys

for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(k, v)
os.environ.setdefault("MASTER_PORT", "29671")

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402

# one rank needs no shared-memory collectives: skip DeepSpeed's JIT build of that op (minutes, and a
# lock that a killed build leaves behind; aidaptiv_ds.integration.bench_patches.skip_shm_comm_build does the same)
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

cache = sys.argv[1]
os.makedirs(cache, exist_ok=True)
cfg = {
    "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                          "offload_param": {"device": "nvme", "nvme_path": cache, "max_in_cpu": 0, "pin_memory": False},
                          "offload_optimizer": {"device": "nvme", "nvme_path": cache, "pin_memory": False}},
    "aidaptiv": {"enabled": True, "cache_paths": [cache], "dram_budget": 0},
}
config = cfg
if "--json" in sys.argv:  # the config as a file, as the HF Trainer's --deepspeed passes it
    config = sys.argv[sys.argv.index("--json") + 1]
    with open(config, "w") as f:
        json.dump(cfg, f)
imported_before = "aidaptiv_ds" in sys.modules
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
eng, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
losses = []
for i in range(2):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(2, 64, generator=g)
    loss = eng(x).float().pow(2).mean()
    eng.backward(loss)
    eng.step()
    losses.append(float(loss))
print(json.dumps({"imported_before_initialize": imported_before, "imported": "aidaptiv_ds" in sys.modules,
                  "optimizer": type(eng.optimizer).__name__,
                  "optimizer_swapper": type(getattr(eng.optimizer, "optimizer_swapper", None)).__name__,
                  "param_swapper": type(getattr(next(model.parameters()), "nvme_swapper", None)).__name__,
                  "aidaptiv_file": getattr(sys.modules.get("aidaptiv_ds"), "__file__", None), "losses": losses}))
