"""Time one AdamW tile eagerly (torch's ``adam``, what ``integration/host_step.py`` runs) against one fused loop
compiled by ``torch.compile``, with fp32 and bf16 moments, and count the elements where the compiled fp32 step
differs from torch's (docs/profiling.md, "A compiled, fused Adam tile").

    python launch/fused_adam_tile.py [--numel 2097152] [--rounds 15]

Needs a C++ compiler for inductor. The variants run interleaved, so each tile comes cold from DRAM as in a step.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch.optim.adam import adam

B1, B2, LR, WD, EPS = 0.9, 0.999, 1e-4, 0.01, 1e-8
KW = dict(amsgrad=False, has_complex=False, beta1=B1, beta2=B2, lr=LR, weight_decay=WD, eps=EPS, maximize=False,
          foreach=False, capturable=False, differentiable=False, fused=False, grad_scale=None, found_inf=None,
          decoupled_weight_decay=True)


@torch.compile(dynamic=True, fullgraph=True)
def _fused(p, g, m, v, step_size: float, bc2_sqrt: float):
    mf, vf = m.float(), v.float()
    p.mul_(1 - LR * WD)
    mf = mf.lerp(g, 1 - B1)
    vf = vf.mul(B2).addcmul(g, g, value=1 - B2)
    p.addcdiv_(mf, (vf.sqrt() / bc2_sqrt).add(EPS), value=-step_size)
    m.copy_(mf)
    v.copy_(vf)


def fused_step(p, g, m, v, step: int) -> None:
    _fused(p, g, m, v, LR / (1 - B1 ** step), math.sqrt(1 - B2 ** step))


def eager_step(p, g, m, v, step: int, wm=None, wv=None) -> None:
    if wm is None:
        adam([p], [g], [m], [v], [], [torch.tensor(float(step - 1))], **KW)
        return
    wm.copy_(m)
    wv.copy_(v)
    adam([p], [g], [wm], [wv], [], [torch.tensor(float(step - 1))], **KW)
    m.copy_(wm)
    v.copy_(wv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=2 << 20)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    torch.manual_seed(0)
    n = a.numel
    p, g, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    ref = [t.clone() for t in (p, g, m, v)]
    eager_step(*ref, 1)
    fused_step(p, g, m, v, 1)
    print("compiled fp32 step against torch's, elements that differ: "
          + ", ".join(f"{k} {(x != y).sum().item():,}" for k, x, y in zip(("param", "exp_avg", "exp_avg_sq"),
                                                                            (p, m, v), (ref[0], ref[2], ref[3]))))
    mb, vb, wm, wv = m.bfloat16(), v.bfloat16(), torch.empty(n), torch.empty(n)
    variants = {"eager fp32": lambda: eager_step(p, g, m, v, 5),
                "eager bf16 (widen, step, round)": lambda: eager_step(p, g, mb, vb, 5, wm, wv),
                "compiled fp32": lambda: fused_step(p, g, m, v, 5),
                "compiled bf16": lambda: fused_step(p, g, mb, vb, 5)}
    for fn in variants.values():
        fn()
    times = {k: [] for k in variants}
    for _ in range(a.rounds):
        for k, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    for k, ts in times.items():
        print(f"{k}: median {statistics.median(ts) * 1e3:.2f} ms per {n:,}-element tile")


if __name__ == "__main__":
    main()
