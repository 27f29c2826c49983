"""Greedy generation for a file of prompts, with time to first token, a prefix KV cache on a cache
drive (``--kv_cache_path``) and the weights on the cache drives (ZeRO-Inference, ``--deepspeed``).

``--prompt_file`` holds one ``{"prompt": "..."}`` per line; prompts are generated one after
another, greedy. ``--json OUT`` gets ``{"prompts": [{"ttft_s", "output_ids", "kv_source":
"computed"|"dram"|"drive", "prefix_tokens_reused", ...}, ...], ...}``. Examples::

    python launch/generate.py --model_name_or_path $GGUF --prompt_file prompts.jsonl \\
        --kv_cache_path /mnt/cache0/kv --max_new_tokens 32 --json out.json
    python launch/generate.py --model_name_or_path $GGUF --prompt_file prompts.jsonl \\
        --deepspeed ds_configs/aidaptiv_inference.json --cache_path /mnt/cache0 --dram_budget 0 \\
        --kv_cache_path /mnt/cache0/kv --max_new_tokens 32 --json out.json

Run it again with the same ``--kv_cache_path``: prompts sharing a prefix with earlier ones load it
from the drive (``"kv_source": "drive"``). ``aidaptiv-ds kv-cache --cache DIR`` lists or clears it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# this checkout's package ahead of any installed copy (an editable install of another checkout included):
# what a launch script runs and measures is the code beside it
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import aidaptiv_ds  # noqa: E402,F401  (installs the aidaptiv_ds DeepSpeed hooks on import)
from aidaptiv_ds.cli.generate import GenerateArgs, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model_name_or_path", required=True, help="local HF model directory, a .gguf file, or a hub id")
    p.add_argument("--prompt_file", required=True, help='JSONL, one {"prompt": "..."} per line')
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--json", help="write the report (TTFT, output ids, KV source per prompt) here")
    p.add_argument("--kv_cache_path", help="directory of the prefix KV cache on a cache drive (created if missing)")
    p.add_argument("--deepspeed", help="ZeRO-Inference DeepSpeed config (e.g. ds_configs/aidaptiv_inference.json); "
                   "without it the model runs as loaded")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="model and KV dtype")
    p.add_argument("--block_tokens", type=int, default=64, help="tokens per KV block")
    p.add_argument("--kv_dram_budget", default="1GiB", help="host memory for KV blocks kept in DRAM")
    p.add_argument("--kv_capacity", default="auto", help="bytes of KV blocks on the drive (auto: a quarter of its "
                   "free space)")
    p.add_argument("--on_mismatch", choices=["error", "ignore"], default="error",
                   help="a KV cache directory of another model/dtype/tokenizer: refuse it, or ignore it (recompute)")
    p.add_argument("--chat_template", choices=["auto", "yes", "no"], default="auto",
                   help="wrap each prompt as the user message of the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--cache_path", help="ZeRO-Inference: the cache directory for the weights (sets nvme_path and "
                   "aidaptiv.cache_paths)")
    p.add_argument("--dram_budget", help="ZeRO-Inference: aidaptiv.dram_budget (0, 8GiB, auto)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        report = run(GenerateArgs(**vars(ns)))
    except (ValueError, FileNotFoundError) as e:  # bad input: the message names the field and the fix
        print(f"launch/generate.py: error: {e}", file=sys.stderr)
        return 2
    for i, r in enumerate(report["prompts"]):
        print(json.dumps({"prompt": i, "ttft_s": round(r["ttft_s"], 4), "kv_source": r["kv_source"],
                          "prefix_tokens_reused": r["prefix_tokens_reused"], "prompt_tokens": r["prompt_tokens"],
                          "output_text": r["output_text"][:80]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
