"""Fine-tune a causal LM on Dolly-format instructions with DeepSpeed ZeRO-3 (aidaptiv_ds when the config says so).

With no model/data flags it runs the embedded offline demo (a generated instruction set and a tiny
random-init Llama). Outputs in ``--output_dir``: ``metrics.jsonl`` (eval, per-step and summary
lines), the fine-tuned model as an HF directory (safetensors), ``eval_split.jsonl`` and
``finetune_args.json``.

Single process (no launcher; RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT get defaults)::

    python launch/finetune.py --deepspeed ds_configs/cpu_offload.json --output_dir output/demo
    python launch/finetune.py --model_name_or_path ../shared/data/models/stories260K/hf \\
        --data_path ../shared/data/dolly/dolly_sample_151.jsonl --deepspeed ds_configs/cpu_offload.json \\
        --output_dir output/stories --num_train_epochs 1 --max_seq_length 256 --per_device_train_batch_size 8

DeepSpeed launcher on this CPU-only machine (the CPU accelerator counts one device; the launcher
passes ``--local_rank``, which is accepted and ignored). ``--bind_cores_to_rank`` needs ``numactl``,
which is not installed here, so leave it out::

    deepspeed --num_gpus 1 launch/finetune.py --deepspeed ds_configs/cpu_offload.json --output_dir output/demo

On a GPU machine (one rank per GPU; bf16 follows the config, ``"auto"`` means on)::

    deepspeed --num_gpus 8 launch/finetune.py --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct \\
        --data_path dolly.jsonl --deepspeed ds_configs/aidaptiv_zero3.json --cache_path /mnt/cache0 \\
        --output_dir output/smollm2 --per_device_train_batch_size 8

``torchrun --nproc_per_node N launch/finetune.py ...`` works the same way.
"""
from __future__ import annotations

import argparse
import os
import sys

try:
    import aidaptiv_ds  # noqa: F401  (installs the aidaptiv_ds DeepSpeed hooks on import)
except ModuleNotFoundError:  # running from a source checkout that is not pip-installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import aidaptiv_ds  # noqa: F401

from aidaptiv_ds.finetune.job import FinetuneArgs, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "ds_configs", "aidaptiv_zero3.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model_name_or_path", help="local HF model directory, a .gguf file, or a hub id "
                   "(default: the embedded demo model)")
    p.add_argument("--data_path", help="Dolly-format JSONL (instruction, context, response[, category]) "
                   "(default: the embedded demo data)")
    p.add_argument("--category", help="train and evaluate only on records of this Dolly category")
    p.add_argument("--output_dir", default="output/finetune", help="metrics.jsonl and the fine-tuned HF model go here")
    p.add_argument("--deepspeed", default=DEFAULT_CONFIG, help="DeepSpeed JSON config")
    p.add_argument("--num_train_epochs", type=float, default=3.0)
    p.add_argument("--max_steps", type=int, default=-1, help="optimizer steps; > 0 overrides --num_train_epochs")
    p.add_argument("--max_seq_length", type=int, default=512, help="tokens per example (prompt + response)")
    p.add_argument("--per_device_train_batch_size", type=int, default=None,
                   help="micro-batch per rank (default: the config's number, 8 for \"auto\")")
    p.add_argument("--gradient_accumulation_steps", type=int, default=None,
                   help="micro-batches per optimizer step (default: the config's number, 1 for \"auto\")")
    p.add_argument("--learning_rate", type=float, default=None,
                   help="peak learning rate (default: the config's number, 5e-5 for \"auto\", 1e-3 for the demo)")
    p.add_argument("--eval_fraction", type=float, default=0.1, help="share of the records held out for eval")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--demo", action="store_true", help="run the embedded offline demo (also the default "
                   "when neither --model_name_or_path nor --data_path is given)")
    p.add_argument("--cache_path", action="append", metavar="DIR",
                   help="cache directory (repeatable): sets the config's nvme_path and aidaptiv.cache_paths")
    p.add_argument("--dram_budget", metavar="SIZE",
                   help="aidaptiv.dram_budget: host memory for resident and cached state (0, 8GiB, auto)")
    p.add_argument("--bf16", choices=["auto", "true", "false"], default="auto",
                   help="override bf16.enabled; auto keeps the config (its \"auto\": on with GPU bf16, off on CPU)")
    p.add_argument("--aio_handle", choices=["deepspeed", "aidaptiv"], default="deepspeed",
                   help="aio op for DeepSpeed's own nvme offload: its compiled async_io, or aidaptiv_ds's "
                   "pure-Python handle (no compiler, no libaio)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    fields = {k: v for k, v in vars(ns).items() if k != "local_rank"}
    run(FinetuneArgs(**fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
