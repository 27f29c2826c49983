"""Train a small model a few ZeRO-3 steps with one offload backend and dump what the oracle compares.

Run in a fresh process per backend (DeepSpeed keeps global state)::

    python tests/scripts/train_oracle.py --backend aidaptiv --model llama --dtype fp32 --steps 5 \
        --cache /tmp/x --out /tmp/x/result.pt

Backends: ``cpu`` (DeepSpeed's offload to DRAM: the oracle), ``aidaptiv`` (our swappers through the
cache path), ``native`` (DeepSpeed's own NVMe swappers, with our pure-Python aio handle so nothing
is compiled). The output file holds the per-step losses, the final fp32 parameters (gathered) and
the per-step I/O counters.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29611")

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["cpu", "aidaptiv", "native"], required=True)
    ap.add_argument("--model", choices=["mlp", "llama", "stories", "unused"], default="llama")
    ap.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default="fp32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ga", type=int, default=1)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--budget", default="0")
    ap.add_argument("--sub_group_size", type=float, default=1e9)
    ap.add_argument("--cache", default="/tmp/aidaptiv_oracle")
    ap.add_argument("--cache_paths", default="", help="comma-separated aidaptiv cache paths (default: --cache)")
    ap.add_argument("--zinit", action="store_true", help="build the model under deepspeed.zero.Init")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--extra", default="{}", help="JSON merged into the aidaptiv section")
    ap.add_argument("--ckpt_dir", default="")
    ap.add_argument("--save_after", type=int, default=0, help="save a checkpoint after this many steps and stop")
    ap.add_argument("--save_at", default="", help="comma-separated steps after which to save and go on")
    ap.add_argument("--save_dir", default="", help="where to save (default: --ckpt_dir)")
    ap.add_argument("--save16", default="", help="after training, engine.save_16bit_model(DIR)")
    ap.add_argument("--resume", action="store_true", help="load the latest checkpoint of --ckpt_dir first")
    ap.add_argument("--no_optimizer_state", action="store_true", help="resume with load_optimizer_states=False")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def ds_config(a) -> dict:
    cache = a.cache
    os.makedirs(cache, exist_ok=True)
    dev = "cpu" if a.backend == "cpu" else "nvme"
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": a.ga,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": int(a.sub_group_size),
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
            "offload_param": {"device": dev, "nvme_path": cache, "max_in_cpu": 0, "pin_memory": False,
                              "buffer_count": 16, "buffer_size": 2e7},
            "offload_optimizer": {"device": dev, "nvme_path": cache, "pin_memory": False},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
        "wall_clock_breakdown": False,
    }
    if a.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif a.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if a.backend == "aidaptiv":
        paths = a.cache_paths.split(",") if a.cache_paths else [cache]
        for p in paths:
            os.makedirs(p, exist_ok=True)
        sec = {"enabled": True, "cache_paths": paths, "dram_budget": a.budget}
        sec.update(json.loads(a.extra))
        cfg["aidaptiv"] = sec
    return cfg


def dtype_of(a):
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[a.dtype]


class MLP(torch.nn.Module):
    def __init__(self, h, n, unused=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(h, h, bias=False) for _ in range(n))
        self.unused = torch.nn.Linear(h, h) if unused else None

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) * 2
        return x.float().pow(2).mean()


def llama_config(a):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=512, hidden_size=a.hidden, intermediate_size=a.hidden * 2 + 24,
                       num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, tie_word_embeddings=True, rms_norm_eps=1e-5)


def build(a, cfg):
    import deepspeed
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    torch.manual_seed(0)
    dt = dtype_of(a)
    keep = None
    if a.model == "stories":
        path = os.path.join(REPO, "..", "shared", "data", "models", "stories260K", "hf")
        if a.zinit:
            keep = HfDeepSpeedConfig(cfg)  # noqa: F841 - from_pretrained loads into zero.Init partitions
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dt)
    elif a.model == "llama":
        model = LlamaForCausalLM(llama_config(a)).to(dt)  # HF init runs (not under zero.Init)
        if a.zinit:  # convert an initialised model through zero.Init(module=...)
            with deepspeed.zero.Init(module=model, config_dict_or_path=cfg, dtype=dt):
                pass
    else:
        unused = a.model == "unused"
        if a.zinit:
            with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=dt):
                model = MLP(a.hidden, a.layers, unused)
        else:
            model = MLP(a.hidden, a.layers, unused).to(dt)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=cfg)
    eng._oracle_keep = keep
    return eng


def batch(a, i, rank, vocab=512):
    g = torch.Generator().manual_seed(1000 + 10 * i + rank)
    if a.model in ("llama", "stories"):
        return torch.randint(0, vocab, (a.micro, 24), generator=g)
    return torch.randn(a.micro, a.hidden, generator=g).to(dtype_of(a))


def main():
    a = parse()
    cfg = ds_config(a)
    if a.backend == "native" or not cfg.get("aidaptiv", {}).get("enabled", True):
        from aidaptiv_ds.io.aio_handle import register_with_deepspeed
        register_with_deepspeed()  # DeepSpeed's own swappers, on our pure-Python aio handle (no compile)
    import aidaptiv_ds  # noqa: F401 - installs the hooks
    import deepspeed
    from aidaptiv_ds.telemetry import counters

    eng = build(a, cfg)
    rank = eng.global_rank
    vocab = getattr(getattr(eng.module, "config", None), "vocab_size", 512)
    losses, io = [], []
    micro, first = 0, 0
    if a.resume:
        path, client = eng.load_checkpoint(a.ckpt_dir, load_optimizer_states=not a.no_optimizer_state)
        first = client["step"]
        micro = client["micro"]
    save_at = {int(x) for x in a.save_at.split(",") if x}
    for step in range(first, a.steps + (1 if a.save_after == a.steps else 0)):
        if step in save_at or (a.save_after and step == a.save_after):
            eng.save_checkpoint(a.save_dir or a.ckpt_dir, client_state={"step": step, "micro": micro})
            if step == a.save_after:
                break
        before = counters.snapshot()
        step_losses = []
        for _ in range(a.ga):
            x = batch(a, micro, rank, vocab)
            micro += 1
            out = eng(x, labels=x) if a.model in ("llama", "stories") else eng(x)
            loss = out.loss if hasattr(out, "loss") else out
            eng.backward(loss)
            eng.step()
            step_losses.append(float(loss.detach().float()))
        from aidaptiv_ds.integration.runtime import current_runtime
        if current_runtime() is not None:  # count every write of this step in this step
            current_runtime().flush()
        losses.append(step_losses)
        io.append(counters.delta(counters.snapshot(), before))
    if a.save16:
        eng.save_16bit_model(a.save16)
    params = {}
    for name, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[name] = p.detach().float().clone()
    masters = []
    opt = eng.optimizer
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        if opt._swappable_optimizer_subgroup(i):
            opt._optimizer_states_and_gradient_swap_in(i)
            masters.append(fp32.detach().clone())
            opt._release_swap_buffers(i)
        else:
            masters.append(fp32.detach().clone())
    nparams = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in eng.module.parameters())
    extra = {}
    if a.backend == "aidaptiv" and cfg["aidaptiv"].get("enabled", True):
        from aidaptiv_ds.integration.runtime import current_runtime
        rt = current_runtime()
        extra = {"plan": getattr(opt, "aidaptiv_plan", None).as_dict(), "budget": rt.budget,
                 "tier_evictions": rt.tier.evictions, "dirty_evictions": rt.tier.dirty_evictions,
                 "swapper": type(next(eng.module.parameters()).nvme_swapper).__name__,
                 "optimizer_swapper": type(opt.optimizer_swapper).__name__}
    else:
        extra = {"swapper": type(next(eng.module.parameters()).nvme_swapper).__name__,
                 "optimizer_swapper": type(opt.optimizer_swapper).__name__}
    if rank == 0:
        torch.save({"losses": losses, "params": params, "masters": masters, "io": io, "nparams": nparams,
                    "world": eng.world_size, **extra}, a.out)
    print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
