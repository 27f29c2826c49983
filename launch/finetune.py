"""Fine-tune a causal LM on Dolly-format instructions with DeepSpeed ZeRO-3 (aidaptiv_ds when the config says so).

The flags are :class:`aidaptiv_ds.finetune.job.FinetuneArgs` (HF ``TrainingArguments`` names, parsed by
``transformers.HfArgumentParser``; ``--help`` lists them). With no model/data flags it runs the embedded offline demo (a generated instruction set and a tiny
random-init Llama). Outputs in ``--output_dir``: ``metrics.jsonl`` (eval, per-step and summary
lines), the fine-tuned model as an HF directory (safetensors), ``checkpoint-N/`` directories
(``--save_steps``; resume with ``--resume_from_checkpoint PATH|latest``), ``eval_split.jsonl`` and
``finetune_args.json``.

Single process (no launcher; RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT get defaults)::

    python launch/finetune.py --deepspeed ds_configs/cpu_offload.json --output_dir output/demo
    python launch/finetune.py --model_name_or_path ../shared/data/models/stories260K/hf \\
        --data_path data/dolly/dolly_sample_151.jsonl --deepspeed ds_configs/cpu_offload.json \\
        --output_dir output/stories --num_train_epochs 1 --max_seq_length 256 --per_device_train_batch_size 8

DeepSpeed launcher on a CPU-only machine: ``--num_gpus N`` starts N ranks on DeepSpeed's CPU
accelerator (without it the launcher starts one rank per NUMA node that numactl reports, 1 without numactl, as here); it passes
``--local_rank``, which is accepted and ignored. ``--bind_cores_to_rank`` needs ``numactl``, which
is not installed here, so leave it out::

    deepspeed --num_gpus 2 launch/finetune.py --output_dir output/demo2 --max_steps 3

On a GPU machine (one rank per GPU; bf16 follows the config, ``"auto"`` means on)::

    deepspeed --num_gpus 8 launch/finetune.py --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct \\
        --data_path dolly.jsonl --deepspeed ds_configs/aidaptiv_zero3.json --cache_path /mnt/cache0 \\
        --output_dir output/smollm2 --per_device_train_batch_size 8

``torchrun --nproc_per_node N launch/finetune.py ...`` works the same way.
"""
from __future__ import annotations

import os
import sys

# this checkout's package ahead of any installed copy (an editable install of another checkout included):
# what a launch script runs and measures is the code beside it
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import aidaptiv_ds  # noqa: E402,F401  (installs the aidaptiv_ds DeepSpeed hooks on import)
from aidaptiv_ds.finetune.job import parse_args, run


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
