"""Time an AdamW sub-group step in tiles: torch's eager ``adam`` per tile (what ``integration/host_step.py`` runs
with fp32 moments, and with bf16 or int8 moments and ``"fused_step": "off"``) against the fused tiles
(``tiers/fused_adam.py``, the default for bf16 and int8 moments), and count the elements where a compiled fp32
tile differs from torch's step (docs/profiling.md, "The fused bf16 tile lands" and "... and int8's").

    python launch/fused_adam_tile.py [--numel 20000000] [--tile 2097152] [--fused-tiles 2097152,524288] [--rounds 7]

Needs a C++ compiler for inductor. The variants run interleaved; a sub-group of 20M elements (320 MB of fp32
state) comes from DRAM as in a training step, a single tile (``--numel 2097152``) mostly from the caches.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.optim.adam import adam

from aidaptiv_ds.tiers import blockwise
from aidaptiv_ds.tiers.fused_adam import adam_kwargs, fused_tile, step_scalars

GROUP = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "maximize": False,
         "decoupled_weight_decay": True, "amsgrad": False}
KW = adam_kwargs(GROUP)


def compiled_fp32_mismatches(n: int = 2 << 20) -> dict:
    """Elements where the fused formulas compiled for fp32 moments differ from torch's eager step after one step
    ([Note: not torch's bits] in ``tiers/fused_adam.py``)."""
    def fp32_tile(p, g, m, v, s):
        grad = g * s[0] + p * s[1]
        mf = torch.lerp(m, grad, s[2])
        vf = v * s[3] + (s[4] * grad) * grad
        p.copy_(p * s[7] + (s[8] * mf) / (vf.sqrt() / s[5] + s[6]))
        m.copy_(mf)
        v.copy_(vf)
    kernel = torch.compile(fp32_tile, dynamic=True, fullgraph=True)
    torch.manual_seed(0)
    p, g, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    ref = [t.clone() for t in (p, g, m, v)]
    adam([ref[0]], [ref[1]], [ref[2]], [ref[3]], [], [torch.tensor(0.0)], **KW)
    with torch.no_grad():
        kernel(p, g, m, v, step_scalars(GROUP, 1))
    return {k: int((x != y).sum()) for k, x, y in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v),
                                                      (ref[0], ref[2], ref[3]), strict=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=20_000_000, help="elements of the sub-group")
    ap.add_argument("--tile", type=int, default=2 << 20, help="elements per tile (the step's TILE_NUMEL)")
    ap.add_argument("--fused-tiles", default="",
                    help="comma-separated tile sizes for the fused tiles (default: --tile); each one a variant")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    fused = fused_tile("bf16", "on")
    fused8 = fused_tile("int8", "on")
    print("compiled fp32 step against torch's, elements that differ:",
          ", ".join(f"{k} {v:,}" for k, v in compiled_fp32_mismatches().items()))
    torch.manual_seed(0)
    n, tile = a.numel, a.tile
    p, g = torch.randn(n), torch.randn(n) * 1e-3
    m, v = torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    mb, vb = m.bfloat16(), v.bfloat16()
    wm, wv = torch.empty(min(n, tile)), torch.empty(min(n, tile))
    n8 = n // blockwise.BLOCK * blockwise.BLOCK  # int8: whole blocks
    cm, sm = torch.empty(n8, dtype=torch.uint8), torch.empty(n8 // blockwise.BLOCK)
    cv, sv = torch.empty(n8, dtype=torch.uint8), torch.empty(n8 // blockwise.BLOCK)
    blockwise.quantize(m[:n8].clone(), cm, sm, True)
    blockwise.quantize(v[:n8].clone(), cv, sv, False)
    index = torch.empty(min(n, tile), dtype=torch.int32)

    def eager_fp32():
        for s in range(0, n, tile):
            adam([p[s:s + tile]], [g[s:s + tile]], [m[s:s + tile]], [v[s:s + tile]], [], [torch.tensor(4.0)], **KW)

    def eager_bf16():
        for s in range(0, n, tile):
            k = min(tile, n - s)
            x, y = wm[:k].copy_(mb[s:s + k]), wv[:k].copy_(vb[s:s + k])
            adam([p[s:s + k]], [g[s:s + k]], [x], [y], [], [torch.tensor(4.0)], **KW)
            mb[s:s + k].copy_(x)
            vb[s:s + k].copy_(y)

    def fused_bf16(tile=tile):
        sc = step_scalars(GROUP, 5)
        for s in range(0, n, tile):
            fused(p[s:s + tile], g[s:s + tile], mb[s:s + tile], vb[s:s + tile], sc)

    def eager_int8():
        blk = blockwise.BLOCK
        for s in range(0, n8, tile):
            k = min(tile, n8 - s)
            x = blockwise.dequantize(cm[s:s + k], sm[s // blk:(s + k) // blk], True, out=wm[:k], index=index)
            y = blockwise.dequantize(cv[s:s + k], sv[s // blk:(s + k) // blk], False, out=wv[:k], index=index)
            adam([p[s:s + k]], [g[s:s + k]], [x], [y], [], [torch.tensor(4.0)], **KW)
            blockwise.quantize(x, cm[s:s + k], sm[s // blk:(s + k) // blk], True, overwrite=True)
            blockwise.quantize(y, cv[s:s + k], sv[s // blk:(s + k) // blk], False, overwrite=True)

    def fused_int8(tile=tile):
        sc, blk = step_scalars(GROUP, 5), blockwise.BLOCK
        for s in range(0, n8, tile):
            k = min(tile, n8 - s)
            fused8(p[s:s + k], g[s:s + k], cm[s:s + k], sm[s // blk:(s + k) // blk], cv[s:s + k],
                   sv[s // blk:(s + k) // blk], sc)

    variants = {"eager, fp32 moments": eager_fp32, "eager, bf16 moments (widen, step, round)": eager_bf16,
                "eager, int8 moments (decode, step, encode)": eager_int8}
    for t in [int(x) for x in a.fused_tiles.split(",") if x] or [tile]:
        t = max(blockwise.BLOCK * 2, t // blockwise.BLOCK * blockwise.BLOCK)  # int8: whole blocks, two at least
        variants[f"fused, bf16 moments, tiles of {t:,}"] = lambda t=t: fused_bf16(t)
        variants[f"fused, int8 moments, tiles of {t:,}"] = lambda t=t: fused_int8(t)
    times: dict = {k: [] for k in variants}
    with torch.no_grad():
        for fn in variants.values():
            fn()
        for _ in range(a.rounds):
            for k, fn in variants.items():
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
    for k, ts in times.items():
        print(f"{k}: median {statistics.median(ts) * 1e3:.1f} ms per {n:,}-element sub-group "
              f"(eager tiles of {tile:,}; {a.rounds} rounds, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
