"""The job behind ``launch/generate.py``: greedy generation for a file of prompts, optionally with the
weights on the cache drives (ZeRO-Inference, ``--deepspeed``) and a prefix KV cache on a cache
drive (``--kv_cache_path``), with the time to first token of every prompt.

Output (``--json``)::

    {"prompts": [{"ttft_s", "output_ids", "kv_source": "computed" | "dram" | "drive",
                  "prefix_tokens_reused", "prompt_tokens", "blocks_written", "total_s",
                  "decode_tokens_per_s", "output_text"}, ...],
     "model", "dtype", "deepspeed", "kv_cache" (the store's counters), "zero_inference" (the plan),
     "bytes_written" / "bytes_read" (per tier: "cache" = ZeRO-Inference weights, "kv_cache")}

One process (``WORLD_SIZE`` 1): the prompts are generated one after another.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import torch


@dataclasses.dataclass
class GenerateArgs:
    """``launch/generate.py``'s flags (see its ``--help``)."""
    model_name_or_path: str
    prompt_file: str
    max_new_tokens: int = 64
    json: str | None = None
    kv_cache_path: str | None = None
    deepspeed: str | None = None
    dtype: str = "fp32"
    block_tokens: int = 64
    kv_dram_budget: str = "1GiB"
    kv_capacity: str = "auto"
    on_mismatch: str = "error"
    chat_template: str = "auto"
    cache_path: str | None = None
    dram_budget: str | None = None


def read_prompts(path: str) -> list[str]:
    """The ``"prompt"`` of every non-empty line of a JSONL file.

    Raises:
        ValueError: a line is not JSON or has no string ``"prompt"`` (naming the file and line).
        FileNotFoundError: no such file.
    """
    out = []
    with open(path) as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompt_file {path}, line {no}: not JSON ({e}). Fix: one {{\"prompt\": \"...\"}} "
                                 f"object per line") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise ValueError(f"--prompt_file {path}, line {no}: no string \"prompt\" field (found "
                                 f"{str(rec)[:80]}). Fix: one {{\"prompt\": \"...\"}} object per line")
            out.append(rec["prompt"])
    if not out:
        raise ValueError(f"--prompt_file {path}: no prompts")
    return out


def encode(tokenizer, prompt: str, chat_template: str) -> list[int]:
    """Token ids of ``prompt``: as the user message of the tokenizer's chat template (with the
    assistant's generation prompt) when ``chat_template`` is ``"yes"``, or ``"auto"`` and the tokenizer
    has one; else the plain encoding."""
    use = chat_template == "yes" or (chat_template == "auto" and getattr(tokenizer, "chat_template", None))
    if use:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def resolve_ds_config(path: str, dtype: str, cache_path: str | None, dram_budget: str | None) -> dict:
    """The DeepSpeed config of ``--deepspeed`` with its ``"auto"`` values filled for one inference
    process (micro batch 1, ``bf16.enabled`` from ``--dtype``) and ``--cache_path`` / ``--dram_budget``
    applied.

    Raises:
        ValueError: no such file, not JSON, or an optimizer in it (generation needs none).
    """
    from ..integration.config import load_ds_dict

    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed {path!r}: no such file")
    ds = json.loads(json.dumps(load_ds_dict(path)))
    if ds.get("optimizer"):
        raise ValueError(f"--deepspeed {path}: has an \"optimizer\" section; ZeRO-Inference builds none. Fix: use "
                         f"ds_configs/aidaptiv_inference.json, or remove the optimizer")
    for k in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
        if ds.get(k) == "auto":
            ds.pop(k)
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    bf16 = ds.setdefault("bf16", {})
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = dtype == "bf16"
    elif bool(bf16["enabled"]) != (dtype == "bf16"):
        raise ValueError(f"--deepspeed {path}: bf16.enabled is {bf16['enabled']} but --dtype is {dtype}. Fix: make "
                         f"them agree (or set bf16.enabled to \"auto\")")
    zero = ds.setdefault("zero_optimization", {})
    if cache_path:
        os.makedirs(cache_path, exist_ok=True)
        zero.setdefault("offload_param", {})["nvme_path"] = cache_path
        if isinstance(ds.get("aidaptiv"), dict):
            ds["aidaptiv"]["cache_paths"] = [cache_path]
    if dram_budget is not None and isinstance(ds.get("aidaptiv"), dict):
        ds["aidaptiv"]["dram_budget"] = dram_budget
    return ds


def _load(args: GenerateArgs):
    from ..checkpoint.hf_source import load_tokenizer, resolve_source

    src = resolve_source(args.model_name_or_path)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    tok = load_tokenizer(src)
    from transformers import AutoModelForCausalLM

    if not args.deepspeed:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.kwargs())
        model.eval()
        return model, tok, None, None, None
    from ..ports import ensure_env

    ensure_env()
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ValueError("launch/generate.py runs one process (WORLD_SIZE 1); start it without a launcher")
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    ds = resolve_ds_config(args.deepspeed, args.dtype, args.cache_path, args.dram_budget)
    keep = HfDeepSpeedConfig(ds)  # from_pretrained partitions under zero.Init (transformers keeps a weak ref)
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.kwargs())
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    engine.module.eval()
    return engine.module, tok, engine, keep, ds


def run(args: GenerateArgs) -> dict:
    """Generate every prompt of ``args.prompt_file`` and return (and write to ``args.json``) the report."""
    from ..telemetry import counters

    if args.dtype not in ("fp32", "bf16"):
        raise ValueError(f"--dtype {args.dtype!r}: use fp32 or bf16")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens {args.max_new_tokens}: must be >= 1")
    prompts = read_prompts(args.prompt_file)
    t_launch = time.perf_counter()
    model, tok, engine, _keep, ds = _load(args)
    kv = None
    if args.kv_cache_path:
        from ..inference import PrefixKVCache

        os.makedirs(args.kv_cache_path, exist_ok=True)
        kv = PrefixKVCache(args.kv_cache_path, model, tok, block_tokens=args.block_tokens,
                           capacity=args.kv_capacity, dram_budget=args.kv_dram_budget, on_mismatch=args.on_mismatch)
    setup_s = time.perf_counter() - t_launch
    eos = getattr(tok, "eos_token_id", None)
    gen_kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False,
                  "pad_token_id": getattr(tok, "pad_token_id", None) or eos or 0}
    before = counters.snapshot()
    rows = []
    try:
        for prompt in prompts:
            ids = encode(tok, prompt, args.chat_template)
            if kv is not None:
                r = kv.generate(model, ids, **gen_kwargs)
                out_ids, ttft, total = r.output_ids, r.ttft_s, r.total_s
                extra = {"kv_source": r.kv_source, "prefix_tokens_reused": r.prefix_tokens_reused,
                         "blocks_written": r.blocks_written, "kv_load_s": r.load_s}
            else:
                from ..inference.prefix_cache import FirstTokenClock

                clock = FirstTokenClock()
                t0 = time.perf_counter()
                x = torch.tensor([ids], dtype=torch.long)
                with torch.no_grad():
                    seq = model.generate(x, attention_mask=torch.ones_like(x), streamer=clock, **gen_kwargs)
                total = time.perf_counter() - t0
                ttft = (clock.first or time.perf_counter()) - t0
                out_ids = seq[0, len(ids):].tolist()
                extra = {"kv_source": "computed", "prefix_tokens_reused": 0, "blocks_written": 0}
            decode = (len(out_ids) - 1) / (total - ttft) if len(out_ids) > 1 and total > ttft else None
            rows.append({"ttft_s": ttft, "output_ids": out_ids, **extra, "prompt_tokens": len(ids), "total_s": total,
                         "decode_tokens_per_s": decode, "output_text": tok.decode(out_ids, skip_special_tokens=True)})
    finally:
        kv_stats = kv.stats().as_dict() if kv is not None else None
        after = counters.snapshot()
        if kv is not None:
            kv.close()
    d = counters.delta(after, before)
    plan = getattr(engine, "aidaptiv_inference", None) if engine is not None else None
    report = {"model": args.model_name_or_path, "dtype": args.dtype, "deepspeed": args.deepspeed,
              "aidaptiv": bool(ds and isinstance(ds.get("aidaptiv"), dict)), "kv_cache_path": args.kv_cache_path,
              "setup_s": setup_s, "prompts": rows, "kv_cache": kv_stats,
              "zero_inference": plan.as_dict() if plan is not None else None,
              "bytes_written": d["bytes_written"], "bytes_read": d["bytes_read"]}
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, args.json)
    return report
