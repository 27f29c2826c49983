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


@dataclasses.dataclass
class ModelSource:
    """Where a model comes from.

    Attributes:
        path: directory or hub id handed to ``from_pretrained``.
        gguf_file: file name inside ``path`` for a GGUF checkpoint, else None.
        kind: ``"local"``, ``"gguf"`` or ``"hub"``.
    """
    path: str
    gguf_file: str | None
    kind: str

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


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


def resolve_source(name_or_path: str) -> ModelSource:
    """Classify ``--model_name_or_path``.

    Raises:
        FileNotFoundError: a ``.gguf`` path or a path-like value (absolute, ``./``, ``../``, ``~``)
            that does not exist, or a directory without ``config.json``.
    """
    expanded = os.path.expanduser(name_or_path)
    if expanded.lower().endswith(".gguf"):
        if not os.path.isfile(expanded):
            raise FileNotFoundError(f"--model_name_or_path {name_or_path!r}: no such GGUF file")
        return ModelSource(os.path.dirname(os.path.abspath(expanded)), os.path.basename(expanded), "gguf")
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(f"--model_name_or_path {name_or_path!r}: the directory has no config.json; give an "
                                    f"HF model directory (config.json, *.safetensors, tokenizer files) or a .gguf file")
        return ModelSource(os.path.abspath(expanded), None, "local")
    if os.path.isabs(expanded) or name_or_path.startswith((".", "~")) or os.path.exists(expanded):
        raise FileNotFoundError(f"--model_name_or_path {name_or_path!r}: no such directory; give an HF model "
                                f"directory, a .gguf file or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct")
    return ModelSource(name_or_path, None, "hub")


def _hub_error(src: ModelSource, what: str, e: Exception) -> RuntimeError:
    return RuntimeError(f"--model_name_or_path {src.path!r}: not a local directory or .gguf file, and loading the "
                        f"{what} from the Hugging Face hub failed ({type(e).__name__}: {e}); without network, download "
                        f"the model elsewhere and pass its directory")


def load_tokenizer(src: ModelSource):
    """``AutoTokenizer.from_pretrained`` for the source (GGUF tokenizers come from the GGUF metadata)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src.path, **src.kwargs())
    except OSError as e:
        if src.kind == "hub":
            raise _hub_error(src, "tokenizer", e) from e
        raise


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
    """Number of distinct parameters (elements), also for ZeRO-3 partitioned ones (``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def gather_state_dict(model: torch.nn.Module, dtype: torch.dtype, rank: int) -> dict[str, torch.Tensor] | None:
    """Full state dict of a (possibly ZeRO-3 partitioned) model, on rank 0; None on other ranks.

    Every rank must call this (each parameter is gathered with the collective
    ``deepspeed.zero.GatheredParameters``, one at a time, so peak memory is one full parameter).
    Tensors are CPU copies in ``dtype`` (the run's parameter dtype); tied parameters appear under
    each of their names, as in ``model.state_dict()``; persistent buffers are included.
    """
    import deepspeed

    state_keys = set(model.state_dict().keys())
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            if rank == 0:
                out[name] = seen[id(p)]
            continue
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            if rank == 0:
                t = p.data.detach().to(device="cpu", dtype=dtype).clone()
                out[name] = seen[id(p)] = t
            else:
                seen[id(p)] = None
    if rank != 0:
        return None
    for name, b in model.named_buffers():
        if name in state_keys:
            out[name] = b.detach().to("cpu").clone()
    return out


def save_hf_model(model: torch.nn.Module, tokenizer, output_dir: str, dtype: torch.dtype, rank: int) -> str | None:
    """Write ``output_dir`` as an HF model directory: ``config.json``, ``model.safetensors``, tokenizer files.

    Collective: every rank calls it; rank 0 writes. The weights are gathered from the ZeRO-3
    partitions in ``dtype`` (bf16 or fp32 as the DeepSpeed config says) and the config records that
    dtype. ``AutoModelForCausalLM.from_pretrained(output_dir)`` reloads the result.

    Returns:
        ``output_dir`` on rank 0, None elsewhere.
    """
    state = gather_state_dict(model, dtype, rank)
    if rank != 0:
        return None
    os.makedirs(output_dir, exist_ok=True)
    model.config.dtype = dtype
    model.config.use_cache = True
    model.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    return output_dir
