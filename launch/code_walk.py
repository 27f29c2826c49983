"""How a training step walks through the package: calls crossing integration/ <-> tiers/, and callbacks the
tiers make while holding their lock (issue 39's "walk of an optimizer sub-group's step").

Trains a small fp32 Llama-shaped stack of Linear layers (one rank, DRAM budget 0, DeepSpeed's NVMe offload with
the ``"aidaptiv"`` section) for two steps, then records the third step with ``sys.setprofile``:

* **edges down**: distinct (caller, callee) function pairs where code in ``aidaptiv_ds/integration`` calls into
  ``aidaptiv_ds/tiers``; **edges up**: the other way (a tier calling an owner back: ``on_drop``, a write-back);
* **calls up under the lock**: how many of the up-calls ran while a ``HostTier``'s lock was held;
* for one parameter swap-in (``AidaptivParamSwapper.swap_in``): the distinct files and the deepest stack below it.

Run from a checkout (the numbers describe that checkout's code)::

    python launch/code_walk.py --json walk.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _pkg(filename: str) -> str | None:
    """``integration``, ``tiers``, ... for a file of the package under ``REPO``; None elsewhere."""
    root = os.path.join(REPO, "aidaptiv_ds") + os.sep
    if not filename.startswith(root):
        return None
    rest = filename[len(root):]
    return rest.split(os.sep)[0] if os.sep in rest else rest.removesuffix(".py")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch/code_walk.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args(argv)
    from aidaptiv_ds.ports import free_port
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        os.environ.setdefault(k, v)
    import deepspeed
    import torch

    import aidaptiv_ds  # noqa: F401  (installs the hooks)
    from aidaptiv_ds.tiers.host_tier import HostTier

    cache = tempfile.mkdtemp(prefix="aidaptiv_walk_")
    nvme = {"device": "nvme", "nvme_path": cache}
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme,
                                 "stage3_param_persistence_threshold": 0, "sub_group_size": 100_000},
           "aidaptiv": {"enabled": True, "cache_paths": [cache], "dram_budget": 0}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(a.layers)])
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step():
        loss = eng(torch.randn(2, 256)).pow(2).mean()
        eng.backward(loss)
        eng.step()

    for _ in range(2):
        step()
    from aidaptiv_ds.integration.runtime import current_runtime
    tiers: list[HostTier] = [current_runtime().tier]
    down: set = set()
    up: set = set()
    up_calls = up_locked = 0
    swap_in_files: set = set()
    swap_in_depth = 0
    inside: list[int] = []  # stack depths where a swap_in frame started

    def depth(frame) -> int:
        d = 0
        while frame is not None:
            d += 1
            frame = frame.f_back
        return d

    def prof(frame, event, arg):
        nonlocal up_calls, up_locked, swap_in_depth
        if event != "call":
            if event == "return" and inside and frame.f_code.co_name == "swap_in" and depth(frame) == inside[-1]:
                inside.pop()
            return
        callee = _pkg(frame.f_code.co_filename)
        caller_frame = frame.f_back
        caller = _pkg(caller_frame.f_code.co_filename) if caller_frame is not None else None
        name = (frame.f_code.co_filename, frame.f_code.co_name)
        if frame.f_code.co_name == "swap_in" and frame.f_code.co_filename.endswith("param_swapper.py"):
            inside.append(depth(frame))
        if inside and callee is not None:
            swap_in_files.add(os.path.relpath(frame.f_code.co_filename, REPO))
            swap_in_depth = max(swap_in_depth, depth(frame) - inside[0])
        if caller == "integration" and callee == "tiers":
            down.add((caller_frame.f_code.co_name, name[1]))
        elif caller == "tiers" and callee == "integration":
            up.add((caller_frame.f_code.co_name, name[1]))
            up_calls += 1
            if any(t._lock._is_owned() for t in tiers):
                up_locked += 1

    sys.setprofile(prof)
    try:
        step()
    finally:
        sys.setprofile(None)
    out = {"edges_down": sorted(f"{a} -> {b}" for a, b in down), "edges_up": sorted(f"{a} -> {b}" for a, b in up),
           "n_edges_down": len(down), "n_edges_up": len(up), "calls_up": up_calls, "calls_up_under_tier_lock": up_locked,
           "swap_in_files": sorted(swap_in_files), "swap_in_max_depth": swap_in_depth}
    print(json.dumps({k: v for k, v in out.items() if not k.startswith("edges")}, indent=1))
    print("down:", "; ".join(out["edges_down"]))
    print("up:", "; ".join(out["edges_up"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    eng.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
