"""Export a checkpoint as a Hugging Face model directory (replaces ``zero_to_fp32`` for our layout).

Every parameter is consolidated from all ranks' partitions (:class:`CheckpointReader`), taken from
the fp32 master weights (frozen parameters from their saved partitions), cast to the requested
dtype and streamed into ``model-0000k-of-0000n.safetensors`` shards of at most ``shard_bytes``
with a ``model.safetensors.index.json`` when there is more than one. Peak memory is one parameter.
The model's ``config.json`` (saved in the checkpoint manifest when the model has an HF config) and,
when ``source_dir`` is given, its tokenizer and generation files are copied, so
``AutoModelForCausalLM.from_pretrained(out_dir)`` loads the result.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from ..io.atomic import AtomicFile, atomic_write
from .format import safetensors_header, split_into_shards
from .reader import CheckpointReader

#: Files copied from ``source_dir`` when present (tokenizer, chat template, generation defaults).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
              "merges.txt", "generation_config.json", "chat_template.jinja", "added_tokens.json")


def export_hf(tag_path: str | list[str], out_dir: str, dtype: torch.dtype = torch.float32, source_dir: str | None = None,
              shard_bytes: int = 5 << 30) -> list[str]:
    """Write ``out_dir`` as an HF model directory from the checkpoint tag directory ``tag_path``.

    Args:
        tag_path: ``<save_dir>/<tag>`` of a complete aidaptiv_ds checkpoint, or the tag directories of
            every node-local part of one (:func:`aidaptiv_ds.checkpoint.parts.gather_parts`).
        out_dir: the HF directory to create (existing files of the same names are replaced).
        dtype: dtype of the exported tensors (fp32 keeps the master weights exactly; bf16/fp16 cast).
        source_dir: an HF model directory to copy the config (if the checkpoint has none) and tokenizer from.
        shard_bytes: largest shard in bytes.

    Returns:
        The safetensors files written.

    Raises:
        IncompleteCheckpointError: the checkpoint's save did not finish.
        ValueError: the checkpoint is a PEFT model's (``base_model.model.*`` names): named, nothing written.
        FileWriteError: a shard could not be written whole (disk full, ...): named, never put in place.
        FileNotFoundError: no model config in the checkpoint and no ``source_dir`` with one.
    """
    reader = CheckpointReader(tag_path)
    peft = [n for n in reader.params if n.startswith("base_model.model.")]
    if peft and len(peft) == len(reader.params):
        adapters = sum(1 for n in peft if ".lora_" in n)
        raise ValueError(
            f"aidaptiv_ds: {tag_path} holds a PEFT model's parameters ({peft[0]}, ...; {adapters} LoRA tensors of "
            f"{len(peft)}): an HF model directory of them would not load with from_pretrained (the names are the "
            f"wrapper's, and a save with exclude_frozen_parameters leaves the base weights out). Fix: save the "
            f"adapter with the PeftModel's save_pretrained (HF Trainer's save_model does), or take the weights with "
            f"DeepSpeed's zero_to_fp32 (it reads this checkpoint) and load them into your PeftModel.")
    os.makedirs(out_dir, exist_ok=True)
    elsize = dtype.itemsize
    shards = split_into_shards(list(reader.params), lambda n: reader.params[n].numel * elsize, shard_bytes)
    dname = str(dtype).replace("torch.", "")
    files, weight_map, total = [], {}, 0
    for k, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        spec = [(n, dname, list(reader.params[n].shape), reader.params[n].numel * elsize) for n in names]
        header, offsets = safetensors_header(spec, {"format": "pt"}, align=8)
        path = os.path.join(out_dir, fname)
        size = offsets[-1] + reader.params[names[-1]].numel * elsize
        with AtomicFile(path, expected=size) as f:
            f.pwrite(header, 0)
            for n, off in zip(names, offsets):
                t = reader.full(n).to(dtype).contiguous()
                f.pwrite(memoryview(t.reshape(-1).view(torch.uint8).numpy()), off)
                weight_map[n] = fname
                total += t.numel() * elsize
        files.append(path)
    if len(shards) > 1:
        atomic_write(os.path.join(out_dir, "model.safetensors.index.json"),
                     json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode())
    config = reader.manifest.get("hf_config")
    if config is not None:
        config = dict(config, torch_dtype=dname, dtype=dname)
        atomic_write(os.path.join(out_dir, "config.json"), json.dumps(config, indent=1).encode())
    elif source_dir and os.path.isfile(os.path.join(source_dir, "config.json")):
        shutil.copy(os.path.join(source_dir, "config.json"), out_dir)
    else:
        raise FileNotFoundError(f"aidaptiv_ds: {tag_path} holds no model config and --source {source_dir!r} has no "
                                f"config.json. Fix: pass the original model directory as the source.")
    if source_dir:
        for name in SIDE_FILES:
            src = os.path.join(source_dir, name)
            if os.path.isfile(src):
                shutil.copy(src, out_dir)
    reader.close()
    return files
