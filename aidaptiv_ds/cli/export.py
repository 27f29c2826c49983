"""``aidaptiv-ds export CKPT_DIR [CKPT_DIR ...] --output HF_DIR``: a checkpoint as a Hugging Face model directory.

Replaces DeepSpeed's ``zero_to_fp32`` (which cannot read NVMe-offload checkpoints, see
``docs/deepspeed-seams.md`` §6.3) for our layout: consolidated fp32 master weights, in fp32 or cast to
bf16/fp16, as safetensors shards plus the model config and tokenizer
(:func:`aidaptiv_ds.checkpoint.export.export_hf`). The tokenizer (and a config the checkpoint lacks) comes
from ``--source``, by default from the model the ``launch/finetune.py`` run started from.

A checkpoint saved in node-local parts (``checkpoint.use_node_local_storage``, or a save directory
per node) is exported from every node's directory, copied or mounted here and given on the command
line; a part that is missing is named with its node, ranks and the directory it was saved to
(:func:`aidaptiv_ds.checkpoint.parts.gather_parts`).
"""
from __future__ import annotations

import json
import os

import torch

from ..checkpoint.export import export_hf
from ..checkpoint.format import IncompleteCheckpointError, offer_complete
from ..checkpoint.parts import gather_parts, resolve_dirs
from ..units import parse_size

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def register(sub) -> None:
    p = sub.add_parser("export", help="write an HF model directory (safetensors) from an aidaptiv_ds checkpoint",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="+", help="the save_dir given to engine.save_checkpoint (or a tag directory in "
                   "it); for a checkpoint in node-local parts, every node's save_dir (copied or mounted here)")
    p.add_argument("--tag", help="checkpoint tag (default: the one named by SAVE_DIR/latest)")
    p.add_argument("--output", required=True, help="HF model directory to write")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="dtype of the exported weights")
    p.add_argument("--source", help="the model the run started from, to take the tokenizer (and a config the "
                   "checkpoint lacks) from: an HF directory, a .gguf file or a hub id (default: the "
                   "--model_name_or_path of the launch/finetune.py run the checkpoint belongs to, from its "
                   "finetune_args.json; 'none' exports the weights and config only)")
    p.add_argument("--shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    p.set_defaults(func=run)


RUN_ARGS = "finetune_args.json"


def run_model_source(tag_path: str) -> str | None:
    """The ``model_name_or_path`` of the ``launch/finetune.py`` run whose checkpoint ``tag_path`` is: its
    ``finetune_args.json`` sits in the output directory, the checkpoint's parent (``OUTPUT_DIR/checkpoint-N``)
    or grandparent (``.../checkpoint-N/global_stepN``). None when there is none."""
    d = os.path.abspath(tag_path)
    for _ in range(3):
        d = os.path.dirname(d) if _ else d
        f = os.path.join(d, RUN_ARGS)
        if os.path.isfile(f):
            try:
                with open(f, encoding="utf-8") as fh:
                    return json.load(fh).get("model_name_or_path") or None
            except (OSError, ValueError):
                return None
    return None


def write_tokenizer(source: str, out_dir: str) -> None:
    """Save the tokenizer of ``source`` (an HF directory, a ``.gguf`` file: from its metadata, or a hub id)
    into ``out_dir`` with ``save_pretrained``.

    Raises:
        RuntimeError / OSError: the tokenizer cannot be loaded (a hub id offline: the message says what to do).
    """
    from ..checkpoint.hf_source import load_tokenizer, resolve_source

    load_tokenizer(resolve_source(source)).save_pretrained(out_dir)


def run(args) -> int:
    dirs = args.checkpoint if isinstance(args.checkpoint, list) else [args.checkpoint]
    save_dirs, tag = resolve_dirs(dirs, args.tag)
    paths = gather_parts(save_dirs, tag)
    source, note = args.source, ""
    if source is None:
        source = run_model_source(paths[0])
        note = f" (tokenizer from the run's model {source})" if source else \
            " (no tokenizer: no --source given and no finetune_args.json next to the checkpoint)"
    elif source.lower() == "none":
        source = None
    source_dir = source if source and os.path.isdir(source) else None
    try:
        files = export_hf(paths if len(paths) > 1 else paths[0], args.output, _DTYPES[args.dtype],
                          source_dir=source_dir, shard_bytes=parse_size(args.shard_size, "--shard-size"))
    except IncompleteCheckpointError as e:
        save_dir, tag = os.path.split(os.path.normpath(paths[0]))
        if len(paths) > 1 or "lacks the state of ranks" in str(e):
            raise
        raise IncompleteCheckpointError(f"{e} {offer_complete(save_dir, tag)}") from None
    if source and source_dir is None:  # a .gguf file or a hub id: the tokenizer through transformers
        write_tokenizer(source, args.output)
    print(f"wrote {len(files)} safetensors file(s) ({args.dtype}) to {args.output}{note}")
    return 0
