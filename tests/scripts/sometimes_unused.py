"""Train a model whose parameters get no gradient on some steps, with one backend; dump the results.

The model: ``layers`` square linear layers, plus two that are used only sometimes:

* ``branch``: used on optimizer steps ``s`` with ``s % 3 == 1`` (a branch taken only sometimes);
* ``expert``: used only in the first micro-batch of a step (with gradient accumulation > 1 it gets a
  gradient in some micro-steps of a window and not in others: a mixture-of-experts expert no token was
  routed to in the later micro-batches).

Every rank makes the same choice (ZeRO-3 reduces a parameter's gradient collectively). With
``--mask`` the two layers are always used but their output is multiplied by 0.0 when "unused": they
then get an exact zero gradient (and every other gradient keeps its bits), which is the semantics
aidaptiv_ds defines for a parameter without a gradient, expressed so that any backend computes it.
Backends:
``torch`` (plain PyTorch AdamW, one process: the reference semantics, gradients zeroed with
``zero_grad(set_to_none=False)``), ``z3`` (DeepSpeed ZeRO-3 without offload), ``cpu`` (ZeRO-3 with
DeepSpeed's CPU offload), ``aidaptiv`` (ZeRO-3 NVMe offload on aidaptiv_ds)::

    python tests/scripts/sometimes_unused.py --backend aidaptiv --cache /tmp/x --out /tmp/x/r.pt --ga 2 --clip 1.0
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
os.environ.setdefault("MASTER_PORT", "29641")

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
H = 64


class Model(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(layers))
        self.branch = torch.nn.Linear(H, H)
        self.expert = torch.nn.Linear(H, H)

    mask = False

    def forward(self, x, use_branch: bool, use_expert: bool):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        for used, layer in ((use_branch, self.branch), (use_expert, self.expert)):
            if used:
                x = x + torch.tanh(layer(x))
            elif self.mask:  # used, contributing exactly nothing: an exact zero gradient
                x = x + 0.0 * torch.tanh(layer(x))
        return x.pow(2).mean()


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + 100 * step + 10 * micro + rank)
    return torch.randn(4, H, generator=g)


def ds_config(a) -> dict:
    off = {"z3": None, "cpu": "cpu", "aidaptiv": "nvme"}[a.backend]
    zero: dict = {"stage": 3, "sub_group_size": int(a.sub_group_size), "stage3_param_persistence_threshold": 0}
    if off:
        os.makedirs(a.cache, exist_ok=True)
        zero["offload_param"] = {"device": off, "pin_memory": False, **({"nvme_path": a.cache, "max_in_cpu": 0}
                                                                         if off == "nvme" else {})}
        zero["offload_optimizer"] = {"device": off, "pin_memory": False, **({"nvme_path": a.cache}
                                                                             if off == "nvme" else {})}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": a.ga, "steps_per_print": 10 ** 9,
           "gradient_clipping": a.clip, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.01, "torch_adam": True}}}
    if a.backend == "aidaptiv":
        cfg["aidaptiv"] = {"enabled": True, "cache_paths": [a.cache], "dram_budget": a.budget,
                           **json.loads(a.extra)}
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["torch", "z3", "cpu", "aidaptiv"], required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ga", type=int, default=1)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sub_group_size", type=float, default=1e9)
    ap.add_argument("--budget", default="0")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--cache", default="/tmp/aidaptiv_unused")
    ap.add_argument("--mask", action="store_true", help="multiply unused layers by 0 instead of skipping them")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = Model(a.layers)
    model.mask = a.mask
    losses = []
    if a.backend == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
        for step in range(a.steps):
            opt.zero_grad(set_to_none=False)  # no gradient this step = a zero gradient (never a stale one)
            for micro in range(a.ga):
                loss = model(batch(step, micro, 0), step % 3 == 1, micro == 0)
                (loss / a.ga).backward()
                losses.append(float(loss))
            if a.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            opt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save({"losses": losses, "params": params}, a.out)
        return
    if a.backend == "aidaptiv":
        import aidaptiv_ds  # noqa: F401
    import deepspeed
    eng, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config(a))
    rank = eng.global_rank
    for step in range(a.steps):
        for micro in range(a.ga):
            loss = eng(batch(step, micro, rank), step % 3 == 1, micro == 0)
            eng.backward(loss)
            eng.step()
            losses.append(float(loss))
    params = {}
    for n, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[n] = p.detach().float().clone()
    if rank == 0:
        torch.save({"losses": losses, "params": params}, a.out)


if __name__ == "__main__":
    from aidaptiv_ds.process_group import run_worker

    run_worker(main)  # no abort at exit with gloo (aidaptiv_ds/process_group.py)
