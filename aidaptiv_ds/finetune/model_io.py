"""Load the model and tokenizer to fine-tune, and save the fine-tuned model as an HF directory.

Sources (``--model_name_or_path``):

* a local HF directory (``config.json`` + ``*.safetensors``/``*.bin`` + tokenizer files);
* a ``.gguf`` file, loaded with ``from_pretrained(dir, gguf_file=name)``: transformers de-quantizes
  the weights into ordinary tensors of the requested dtype;
* a hub id (``org/name``), where the network allows.

Under ZeRO-3 an :class:`transformers.integrations.HfDeepSpeedConfig` is created before
``from_pretrained`` so transformers builds the model under ``deepspeed.zero.Init`` and loads the
weights straight into the partitions (GGUF checkpoints are loaded whole and partitioned by
``deepspeed.initialize``); the object is kept on :class:`LoadedModel` because transformers only
holds a weak reference to it.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from ..checkpoint.hf_source import ModelSource, _hub_error, load_tokenizer, resolve_source  # noqa: F401 (re-exported)


@dataclasses.dataclass
class LoadedModel:
    """A model ready for ``deepspeed.initialize``.

    Attributes:
        model: the ``PreTrainedModel`` (parameters partitioned already when loaded under zero.Init).
        tokenizer: its tokenizer.
        source: where it was loaded from.
        hf_ds_config: the ``HfDeepSpeedConfig`` that made ``from_pretrained`` use zero.Init, kept alive
            for the whole run (None without ZeRO-3).
    """
    model: torch.nn.Module
    tokenizer: object
    source: ModelSource
    hf_ds_config: object | None = None


def load_model(src: ModelSource, dtype: torch.dtype, ds_config: dict | None, zero3: bool,
               tokenizer=None) -> LoadedModel:
    """Load the model in ``dtype`` (and its tokenizer unless ``tokenizer`` is given).

    Args:
        ds_config: the resolved DeepSpeed config (needed when ``zero3``).
        zero3: build the model under zero.Init through ``HfDeepSpeedConfig``.

    Raises:
        RuntimeError: a hub id could not be loaded (message says what to do offline), or a GGUF
            checkpoint kept quantized blocks instead of trainable floating-point parameters.
    """
    from transformers import AutoModelForCausalLM

    hf_ds_config = None
    if zero3:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(src)
    try:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.kwargs())
    except OSError as e:
        if src.kind == "hub":
            raise _hub_error(src, "model", e) from e
        raise
    if src.kind == "gguf":
        bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != dtype})
        if bad:
            raise RuntimeError(f"--model_name_or_path {src.gguf_file}: transformers kept GGUF weights as {bad} instead "
                               f"of de-quantizing them to {dtype}; training needs floating-point parameters")
        # The weights are ordinary tensors now: forget the GGUF quantizer so the result saves as safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.config.use_cache = False
    return LoadedModel(model, tokenizer, src, hf_ds_config)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (elements), also for ZeRO-3 partitioned ones."""
    from ..integration.zero_params import full_numel

    return sum(full_numel(p) for p in model.parameters())


def _tensors_to_save(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_param)`` of what ``save_pretrained`` would write, in ``state_dict`` order:
    each parameter once under its first name (a tied parameter's later names are dropped, as HF does
    for ``_tied_weights_keys``; ``from_pretrained`` ties them again) and the persistent buffers."""
    keys = list(model.state_dict().keys())
    params = dict(model.named_parameters())  # remove_duplicate=True: a tied parameter under its first name
    buffers = dict(model.named_buffers())
    return [(k, params[k], True) if k in params else (k, buffers[k], False) for k in keys if k in params or k in buffers]


def _shape(t: torch.Tensor) -> list[int]:
    from ..integration.zero_params import full_shape

    return list(full_shape(t))


def save_hf_model(model: torch.nn.Module, tokenizer, output_dir: str, dtype: torch.dtype, rank: int,
                  shard_bytes: int = 5 << 30) -> str | None:
    """Write ``output_dir`` as an HF model directory: ``config.json``, ``model.safetensors`` (or
    ``model-0000k-of-0000n.safetensors`` shards of at most ``shard_bytes`` with an index), tokenizer files.

    Collective: every rank calls it; rank 0 writes. Streams one parameter at a time: each is gathered
    from its ZeRO-3 partitions (``deepspeed.zero.GatheredParameters``), cast to ``dtype`` (the run's
    parameter dtype) and written at its offset of the safetensors file whose header was written
    first (:func:`aidaptiv_ds.checkpoint.format.safetensors_header`, the layout ``aidaptiv-ds
    export`` writes), so rank 0 holds one full parameter at a time, never the whole model. Files are
    written under a temporary name, fsynced and renamed. The config records ``dtype``;
    ``AutoModelForCausalLM.from_pretrained(output_dir)`` reloads the result.

    Returns:
        ``output_dir`` on rank 0, None elsewhere.
    """
    import json

    import deepspeed

    from ..checkpoint.format import atomic_write, safetensors_header, split_into_shards
    from ..integration.zero_params import full_numel

    items = _tensors_to_save(model)
    elsize = dtype.itemsize
    dname = str(dtype).replace("torch.", "")

    def nbytes(t: torch.Tensor, is_param: bool) -> int:
        n = full_numel(t)
        return n * (elsize if is_param or t.is_floating_point() else t.element_size())

    shards = split_into_shards(items, lambda it: nbytes(it[1], it[2]), shard_bytes)
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        spec = [(name, dname if is_p or t.is_floating_point() else str(t.dtype).replace("torch.", ""), _shape(t),
                 nbytes(t, is_p)) for name, t, is_p in shard]
        header, offsets = safetensors_header(spec, {"format": "pt"}, align=8)
        path = os.path.join(output_dir, fname)
        f = open(path + ".tmp", "wb") if rank == 0 else None
        try:
            if f is not None:
                f.write(header)
            for (name, t, is_p), off, sp in zip(shard, offsets, spec):
                if is_p:
                    with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                        if f is not None:
                            _write_at(f, off, t.data.detach().to(device="cpu", dtype=dtype))
                elif f is not None:
                    b = t.detach().to("cpu")
                    _write_at(f, off, b.to(dtype) if b.is_floating_point() else b)
                weight_map[name] = fname
                total += sp[3]
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
        finally:
            if f is not None:
                f.close()
        if rank == 0:
            os.replace(path + ".tmp", path)
    if rank != 0:
        return None
    if len(shards) > 1:
        atomic_write(os.path.join(output_dir, "model.safetensors.index.json"),
                     json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode())
    model.config.dtype = dtype
    model.config.use_cache = True
    model.config.save_pretrained(output_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        gen.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def _write_at(f, offset: int, t: torch.Tensor) -> None:
    f.seek(offset)
    f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
