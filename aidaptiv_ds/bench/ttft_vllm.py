"""Time to first token in a vLLM server with the AidaptivConnector; behind ``launch/bench_ttft.py --engine vllm``.

Per context length ``N`` the prompt is the chat template around a system message of exactly ``N``
tokens of Dolly contexts (as :mod:`aidaptiv_ds.bench.ttft` builds them, decoded to text) and a
short question; greedy, 8 new tokens, streamed with the ``openai`` client; TTFT is the time from
sending the request to the first streamed token (HTTP, tokenization and scheduling included).
Every server is started with ``--enforce-eager``, with the same cores reserved for vLLM's scheduler
(``VLLM_CPU_NUM_OF_RESERVED_CPU``, ``reserved_cpus``; see [Note: the same cores for every server]), and
answers one short warm-up request first.

1. **no connector** (server A): per length, question 1 (``cold``: the whole prompt computed) and
   question 2 (``vllm_warm``: vLLM's in-memory prefix cache holds the context);
2. **connector, cold** (server B, empty cache directory): question 1 per length (``cold_connector``:
   computed, and its blocks copied out and written behind). Cold is asked ``repeats`` times per length
   on A and on B, each time with a context of its own (a different first line), and the median is
   reported: one request's TTFT on a shared 2-core machine varies by more than the 5% the connector's
   cold overhead is held to; the bytes the server's processes wrote
   (``/proc/PID/io`` ``write_bytes``) against the ledger's count for the cache, and the bytes written per
   stored token against the KV size per token;
3. **connector after a restart** (server C): question 2 per length (``restart``: the context's
   blocks loaded from the drive), then vLLM's own prefix cache is reset (``POST /reset_prefix_cache``,
   the dev-mode endpoint; the connector keeps its blocks) and question 3 (``evicted``: loaded again,
   from the connector's DRAM tier or the drive);
4. **requests/s under a mix** on servers C (connector) and D (no connector, also just restarted): the
   contexts of every length asked again with new questions (shared prefixes) interleaved with as many
   fresh contexts (prompts nobody has seen), four at a time.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import textwrap
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .ttft import QUESTIONS, context_ids, dolly_contexts
from .vllm_serve import Server, chat, ensure_model, kv_transfer_config

MORE = ("List two numbers that appear in the text above.", "Who or what is the text above about?",
        "Give the text above a title.")


def proc_write_bytes(pids: list[int]) -> int:
    """Sum of ``write_bytes`` in ``/proc/PID/io`` over ``pids`` (bytes sent to the block layer)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/io") as f:
                for line in f:
                    if line.startswith("write_bytes:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def ledger_bytes(kv_dir: str) -> int:
    """Bytes the endurance ledger booked for the KV cache under ``kv_dir`` (all hosts)."""
    total = 0
    for root, _, files in os.walk(kv_dir):
        if "ledger.json" in files:
            with open(os.path.join(root, "ledger.json")) as f:
                total += ((json.load(f).get("runs") or {}).get("prefix-kv") or {}).get("bytes_written", 0)
    return total


def connector_stats(kv_dir: str) -> dict:
    for root, _, files in os.walk(kv_dir):
        if "kv_connector_stats.json" in files:
            with open(os.path.join(root, "kv_connector_stats.json")) as f:
                return json.load(f)
    return {}


def run(spec: dict) -> dict:
    """The whole benchmark (see the module docstring); ``spec``: lengths, work (a directory), port, dolly."""
    from transformers import AutoTokenizer

    work = spec["work"]
    os.makedirs(work, exist_ok=True)
    model = ensure_model(spec.get("model_dir") or os.path.join(work, "smollm2-135m-instruct-bf16"))
    tok = AutoTokenizer.from_pretrained(model)
    lengths = [int(n) for n in spec["lengths"]]
    # the contexts of the lengths share their start (the padded Dolly text): a first line of its own per
    # length keeps vLLM's prefix cache from serving one length's blocks to the next (cold means cold)
    body = {n: tok.decode(context_ids(tok, spec["dolly"], n)) for n in lengths}
    ctx = {n: f"Document {n}.\n" + body[n] for n in lengths}
    repeats = max(1, int(spec.get("repeats", 3)))

    def variant(n, r):  # the context of cold sample r (r = 0: the one later asked again)
        return ctx[n] if r == 0 else f"Document {n}, copy {r}.\n" + body[n]
    fresh_src = dolly_contexts(spec["dolly"])[::-1]
    new = int(spec.get("max_new_tokens", 8))
    port = int(spec.get("port", 8123))
    kv_dir = os.path.join(work, "kv")
    os.makedirs(kv_dir, exist_ok=True)
    kv = kv_transfer_config([kv_dir], capacity=spec.get("capacity", "8GiB"), dram_budget=spec.get("dram_budget", "1GiB"))
    # [Note: the same cores for every server] vLLM's CPU platform reserves one core for its scheduler and,
    # when a KV transfer config is given, one more per rank "for nixl_connector" (vllm/utils/
    # ompmultiprocessing.py); on a 2-core machine that is every core, so it reserves none and the worker
    # computes on both, against one core without a connector: measured cold 2,048 tokens 4.31 s without,
    # 2.82 s with the connector. Every server here gets the same reservation, so the two differ only by
    # what the connector does.
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": str(int(spec.get("reserved_cpus", 1)))}
    out: dict = {"model": model, "lengths": lengths, "rows": {str(n): {} for n in lengths}}

    def msgs(n, q, r=0):
        return [{"role": "system", "content": variant(n, r)}, {"role": "user", "content": q}]

    def serve(name, with_kv):
        s = Server(model, port, os.path.join(work, f"{name}.log"), kv=kv if with_kv else None,
                   args=["--enforce-eager"], env=env)
        out.setdefault("start_s", {})[name] = s.wait_ready()
        chat(s.url, model, [{"role": "user", "content": "Hello!"}], max_tokens=2)  # warm-up
        return s

    def ask(s, n, q, key, repeat=1):
        got = [chat(s.url, model, msgs(n, q, r), max_tokens=new) for r in range(repeat)]
        ttft = [g["ttft_s"] for g in got]
        out["rows"][str(n)][key] = {"ttft_s": statistics.median(ttft), "samples_s": ttft,
                                    "prompt_tokens": got[0]["prompt_tokens"], "ids": got[0]["token_ids"]}
        print(json.dumps({"case": key, "context_tokens": n, "ttft_s": [round(t, 3) for t in ttft]}), file=sys.stderr,
              flush=True)

    s = serve("A_no_connector", False)
    try:
        for n in lengths:
            ask(s, n, QUESTIONS[0], "cold", repeats)
            ask(s, n, QUESTIONS[1], "vllm_warm")
    finally:
        s.stop()

    s = serve("B_connector_cold", True)
    try:
        pids = s.pids()
        w0, l0 = proc_write_bytes(pids), ledger_bytes(kv_dir)
        for n in lengths:
            ask(s, n, QUESTIONS[0], "cold_connector", repeats)
        t0 = time.time()  # the last saves are written behind: wait for their commit
        while connector_stats(kv_dir).get("connector", {}).get("blocks_written", -1) < \
                connector_stats(kv_dir).get("connector", {}).get("saves_requested", 0) and time.time() - t0 < 120:
            time.sleep(0.2)
        time.sleep(1.5)
        w1, l1 = proc_write_bytes(pids), ledger_bytes(kv_dir)
        st = connector_stats(kv_dir)
    finally:
        s.stop()
    store = st.get("store", {})
    out["writes"] = {"proc_write_bytes": w1 - w0, "ledger_bytes": l1 - l0, "blocks": store.get("blocks"),
                     "tokens_stored": store.get("tokens"), "bytes_on_drive": store.get("bytes_on_drive"),
                     "store_bytes_written": store.get("bytes_written")}

    s = serve("C_connector_restart", True)
    try:
        for n in lengths:
            ask(s, n, QUESTIONS[1], "restart")
        req = urllib.request.Request(s.url + "/reset_prefix_cache", method="POST")
        urllib.request.urlopen(req, timeout=60).read()
        for n in lengths:
            ask(s, n, QUESTIONS[2], "evicted")
        out["mix_connector"] = mix(s, model, ctx, fresh_src, tok, lengths, new, 0)
        out["connector_after"] = connector_stats(kv_dir)
    finally:
        s.stop()
    s = serve("D_no_connector_restart", False)
    try:
        out["mix_no_connector"] = mix(s, model, ctx, fresh_src, tok, lengths, new, 0)
    finally:
        s.stop()
    return out


def mix(s, model, ctx, fresh_src, tok, lengths, new, seed) -> dict:
    """Requests/s over shared-prefix and fresh requests, four at a time (see the module docstring)."""
    jobs = []
    for i, n in enumerate(lengths):
        jobs.append([{"role": "system", "content": ctx[n]}, {"role": "user", "content": MORE[i % len(MORE)]}])
        fresh = tok.decode(tok(" ".join(fresh_src[i * 3:(i + 1) * 3]), add_special_tokens=False)["input_ids"][:n])
        jobs.append([{"role": "system", "content": fresh + f" (variant {seed}-{i})"},
                     {"role": "user", "content": MORE[i % len(MORE)]}])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as ex:
        res = list(ex.map(lambda m: chat(s.url, model, m, max_tokens=new), jobs))
    wall = time.perf_counter() - t0
    return {"requests": len(jobs), "wall_s": wall, "requests_per_s": len(jobs) / wall,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in res)}


def summarize(res: dict) -> list[dict]:
    rows = []
    for n in res["lengths"]:
        r = res["rows"][str(n)]
        row = {"context_tokens": n, "prompt_tokens": r["cold"]["prompt_tokens"]}
        for k in ("cold", "vllm_warm", "cold_connector", "restart", "evicted"):
            row[k + "_s"] = r[k]["ttft_s"]
        row["restart_vs_cold"] = row["restart_s"] / row["cold_s"]
        row["evicted_vs_cold"] = row["evicted_s"] / row["cold_s"]
        row["cold_overhead"] = row["cold_connector_s"] / row["cold_s"] - 1
        row["cold_ids_identical"] = r["cold"]["ids"] == r["cold_connector"]["ids"]
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| context tokens | cold s | vLLM prefix cache warm s | cold with connector s (overhead) | "
             "connector after restart s (x cold) | after vLLM's cache reset s (x cold) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context_tokens']} | {r['cold_s']:.3f} | {r['vllm_warm_s']:.3f} | {r['cold_connector_s']:.3f} "
                     f"({r['cold_overhead'] * 100:+.1f}%) | {r['restart_s']:.3f} ({r['restart_vs_cold']:.3f}x) | "
                     f"{r['evicted_s']:.3f} ({r['evicted_vs_cold']:.3f}x) |")
    return "\n".join(lines)


def plot(rows: list[dict], hf_rows: list[dict] | None, path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["context_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key, label, style in (("cold_s", "vLLM cold (computes)", "o-"),
                              ("cold_connector_s", "vLLM cold with the connector (computes, stores)", "s--"),
                              ("vllm_warm_s", "vLLM prefix cache warm (in memory)", "^-"),
                              ("restart_s", "connector after a server restart (drive)", "D-"),
                              ("evicted_s", "connector after vLLM's cache reset", "v-")):
        ax.plot(x, [r[key] for r in rows], style, label=label)
    if hf_rows:
        hx = [r["context_tokens"] for r in hf_rows]
        ax.plot(hx, [r["recompute_ttft_s"] for r in hf_rows], "o:", color="gray", label="HF generate (recompute)")
        ax.plot(hx, [r["warm_drive_ttft_s"] for r in hf_rows], "D:", color="black",
                label="HF generate, PrefixKVCache from the drive")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("context tokens (system message; plus chat template and question)")
    ax.set_ylabel("time to first token, s")
    ax.set_title(textwrap.fill(title, 100), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

