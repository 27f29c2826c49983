"""One training run of one fuzz case (:mod:`aidaptiv_ds.bench.fuzz`) with one backend, in its own process.

Run by :func:`aidaptiv_ds.bench.fuzz.run_case` (one process, or ``torch.distributed.run`` for two ranks)::

    python -m aidaptiv_ds.bench.fuzz_worker --case '<json>' --backend cpu|aidaptiv --cache DIR --out DIR

``cpu`` is the oracle: DeepSpeed's own offload to CPU of the same ZeRO-3 config (``offload_param`` and
``offload_optimizer`` on ``cpu``, or the optimizer alone where the case keeps parameters off the offload);
``aidaptiv`` is the same config with the case's offload on ``nvme`` and an ``"aidaptiv"`` section. Every
rank writes ``OUT/rank<R>.pt``: its per-micro-step losses, per-step gradient norms, and its fp32 master
partitions and Adam moments (concatenated in sub-group order, which is parameter order whatever the
sub-group size); rank 0 also the gathered parameters.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

for _k, _v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(_k, _v)
if "LOCAL_SIZE" not in os.environ:
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))

import torch  # noqa: E402

from .fuzz_models import LM_KINDS, batch, build  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def n_params(case: dict) -> int:
    """Parameters of the case's model (built on the meta device: no memory, no RNG use)."""
    with torch.device("meta"):
        m = build(case["model"], case["hidden"], case["layers"])
    seen, n = set(), 0
    for p in m.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def ds_config(case: dict, backend: str, cache: str) -> dict:
    """The DeepSpeed config of ``case`` for ``backend`` (see the module docstring); knobs the case leaves
    out stay out (DeepSpeed's defaults)."""
    ours = backend == "aidaptiv"
    zero = {"stage": 3, **case.get("zero", {})}
    offload = case.get("offload", "nvme")
    dev = "nvme" if ours else "cpu"
    param = {"nvme": dev, "param_cpu": "cpu", "param_none": None}[offload]
    if param is not None:
        zero["offload_param"] = {"device": param, **({"nvme_path": cache} if param == "nvme" else {})}
        if "max_in_cpu" in case:
            zero["offload_param"]["max_in_cpu"] = case["max_in_cpu"]
    zero["offload_optimizer"] = {"device": dev, **({"nvme_path": cache} if ours else {})}
    cfg = {
        "train_micro_batch_size_per_gpu": case.get("micro", 2),
        "gradient_accumulation_steps": case.get("ga", 1),
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": case.get("optimizer", "AdamW"),
                      "params": {"lr": case.get("lr", 1e-3), "torch_adam": True,
                                 **({"weight_decay": case["weight_decay"]} if "weight_decay" in case else {})}},
        "zero_optimization": zero,
    }
    if case.get("clip") is not None:
        cfg["gradient_clipping"] = case["clip"]
    if case.get("scheduler") == "WarmupLR":  # a learning rate that changes every step
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": case.get("lr", 1e-3),
                                                           "warmup_num_steps": 4}}
    if case.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    if ours:
        budget = case.get("budget", "0")
        if budget == "half":  # half the ZeRO-3 + Adam state of this rank (parameter, gradient, master, moments)
            elsize = 2 if case.get("dtype") == "bf16" else 4
            budget = n_params(case) * (elsize + 16) // 2 // case.get("world", 1)
        cfg["aidaptiv"] = {"cache_paths": [cache], "dram_budget": budget, **case.get("aidaptiv", {})}
    return cfg


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", required=True, help="the case as JSON")
    ap.add_argument("--backend", choices=["cpu", "aidaptiv"], required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=None, help="passed by the deepspeed launcher (unused)")
    a = ap.parse_args(argv)
    case = json.loads(a.case)
    os.makedirs(a.cache, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)

    from ..integration.blas_threads import pin_blas_threads
    from ..integration.state_readout import flat_optimizer_state
    pin_blas_threads()  # GEMMs on a fixed thread count in both backends (integration/blas_threads.py)
    cfg = ds_config(case, a.backend, a.cache)
    if a.backend == "aidaptiv":
        import aidaptiv_ds  # noqa: F401 - installs the hooks (also where the site hook is off)
    import deepspeed

    dtype = DTYPES[case.get("dtype", "fp32")]
    torch.manual_seed(case.get("seed", 0))
    keep = None
    if case.get("zinit"):
        if case["model"] in LM_KINDS[1:]:  # HF models: as HF does it (from_config under zero.Init)
            from transformers.integrations import HfDeepSpeedConfig
            keep = HfDeepSpeedConfig(cfg)  # noqa: F841 - alive while the model is built
            model = build(case["model"], case["hidden"], case["layers"]).to(dtype)
        else:
            # no dtype argument: zero.Init takes it from the config (given one, DeepSpeed 0.19.8 on a CPU
            # accelerator builds bf16 whatever was asked, partition_parameters.py:409)
            with deepspeed.zero.Init(config_dict_or_path=cfg):
                model = build(case["model"], case["hidden"], case["layers"], reference=a.backend == "cpu")
    else:
        model = build(case["model"], case["hidden"], case["layers"], reference=a.backend == "cpu").to(dtype)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = eng.global_rank
    losses, norms = [], []
    micro = 0
    for _ in range(case.get("steps", 3)):
        step_losses = []
        if case.get("layer_major") and a.backend == "aidaptiv":  # one optimizer step, layer-major
            xs = [batch(case["model"], case["hidden"], case.get("micro", 2), micro + i, rank, dtype)
                  for i in range(case.get("ga", 1))]
            micro += len(xs)
            eng.train_batch(iter(xs))
            step_losses = [float(x.float()) for x in eng.aidaptiv_losses]
        for _ in range(0 if case.get("layer_major") and a.backend == "aidaptiv" else case.get("ga", 1)):
            x = batch(case["model"], case["hidden"], case.get("micro", 2), micro, rank, dtype)
            micro += 1
            loss = eng(x)
            eng.backward(loss)
            eng.step()
            step_losses.append(float(loss.detach().float()))
        losses.append(step_losses)
        norm = eng.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else None)
    out = {"rank": rank, "world": eng.world_size, "losses": losses, "norms": norms,
           **flat_optimizer_state(eng.optimizer)}
    params = {}
    for name, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            if rank == 0:
                params[name] = p.detach().float().clone()
    if rank == 0:
        out["params"] = params
    if a.backend == "aidaptiv":
        from ..integration.runtime import current_runtime
        rt = current_runtime()
        out["plan"] = getattr(eng.optimizer, "aidaptiv_plan", None).as_dict() if rt is not None else None
        out["optimizer_steps"] = rt.counters()["optimizer_steps"] if rt is not None else None
    torch.save(out, os.path.join(a.out, f"rank{rank}.pt"))
    print(json.dumps({"rank": rank, "losses": losses, "norms": norms}), flush=True)


if __name__ == "__main__":
    from ..process_group import run_worker

    run_worker(lambda: main(sys.argv[1:]))  # no abort in finalization after the results (process_group.py)
