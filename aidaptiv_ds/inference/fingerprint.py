"""What a KV cache directory was written for: model, dtype, tokenizer (the cache header's fingerprint).

Keys and values are a function of the weights, the compute dtype and the token ids; the token ids
a text becomes depend on the tokenizer. A cache written under any other combination holds wrong
bytes for this one, so the header records all three and :func:`mismatches` names every field that
differs (the store then refuses or ignores the directory, it never reads a block of it).

* **model**: BLAKE2b of the architecture (the config without bookkeeping keys: name, dtype,
  transformers version, ``use_cache``, private ``_...`` keys such as the attention implementation) and of a sample of every parameter: its name, shape, dtype and
  the values at 64 evenly spaced positions (plus the first 16). Any fine-tune changes those values,
  so two checkpoints of one architecture get different digests; hashing every weight would cost a
  full pass over the model at each start. ``model_id`` (e.g. a commit hash) is added when given.
  ZeRO-3 partitioned parameters are gathered one at a time (``deepspeed.zero.GatheredParameters``,
  see :func:`aidaptiv_ds.integration.inference.full_parameter`).
* **dtype**: the dtype of the cached keys and values (the model's compute dtype).
* **tokenizer**: BLAKE2b of the tokenizer's full serialisation (``backend_tokenizer.to_str()``:
  vocabulary, merges, normalizer, pre-tokenizer, added tokens) where it has one, else of its
  vocabulary and special tokens; and its class name.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

#: config keys that do not change what the model computes
_VOLATILE = {"_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache",
             "_attn_implementation_autoset", "_commit_hash", "architectures"}
SAMPLES = 64


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """The identity a cache directory is bound to (stored in its header).

    Attributes:
        model: digest of the architecture and sampled weights (hex).
        dtype: KV dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        tokenizer: digest of the tokenizer (hex), or ``"none"`` when the cache is used with token ids only.
        model_name: where the model came from (shown in messages; not compared).
        tokenizer_class: the tokenizer's class name (shown in messages; not compared).
    """
    model: str
    dtype: str
    tokenizer: str
    model_name: str = ""
    tokenizer_class: str = ""

    COMPARED = ("model", "dtype", "tokenizer")

    def digest(self) -> str:
        """One digest of the compared fields (the root of every block hash chain)."""
        return hashlib.blake2b("|".join(getattr(self, f) for f in self.COMPARED).encode(), digest_size=16).hexdigest()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Fingerprint:
        return cls(**{f.name: str(d.get(f.name, "")) for f in dataclasses.fields(cls)})


def mismatches(stored: Fingerprint, current: Fingerprint) -> list[str]:
    """One line per compared field that differs: ``"model: <stored> (from <name>) vs <current>"``."""
    out = []
    for f in Fingerprint.COMPARED:
        a, b = getattr(stored, f), getattr(current, f)
        if a != b:
            if f == "model":
                out.append(f"model: written for {stored.model_name or '?'} (digest {a[:16]}), this is "
                           f"{current.model_name or '?'} (digest {b[:16]})")
            elif f == "tokenizer":
                out.append(f"tokenizer: written with {stored.tokenizer_class or '?'} (digest {a[:16]}), this is "
                           f"{current.tokenizer_class or '?'} (digest {b[:16]})")
            else:
                out.append(f"{f}: written as {a}, this run uses {b}")
    return out


def _config_json(config) -> str:
    if config is None:
        return "{}"
    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    d = {k: v for k, v in d.items() if k not in _VOLATILE and not k.startswith("_")}
    return json.dumps(d, sort_keys=True, default=str)


def _sample(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return b""
    spread = torch.linspace(0, n - 1, SAMPLES, dtype=torch.float64).round().long().clamp_(0, n - 1)  # fp64: exact
    idx = torch.unique(torch.cat([torch.arange(min(n, 16)), spread]))
    return flat[idx].to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def model_digest(model: torch.nn.Module, model_id: str | None = None, read_parameter=None) -> str:
    """Digest of ``model``'s architecture and sampled weights (see the module docstring).

    Args:
        model: a transformers ``PreTrainedModel`` (or any module with a ``config``).
        model_id: an extra identity string (a revision, a checkpoint hash), hashed in when given.
        read_parameter: ``fn(param) -> context manager`` that makes ``param.data`` the full tensor
            inside it (ZeRO-3 gathers); default: the parameter as it is.
    """
    import contextlib

    from ..integration.zero_params import full_shape

    h = hashlib.blake2b(digest_size=16)
    h.update(_config_json(getattr(model, "config", None)).encode())
    if model_id:
        h.update(b"|id|" + str(model_id).encode())
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        shape = tuple(full_shape(p))
        h.update(f"|{name}|{shape}|{p.dtype}|".encode())
        ctx = read_parameter(p) if read_parameter is not None else contextlib.nullcontext()
        with ctx:
            h.update(_sample(p.data))
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> tuple[str, str]:
    """``(digest, class name)`` of a transformers tokenizer; ``("none", "")`` for None."""
    if tokenizer is None:
        return "none", ""
    h = hashlib.blake2b(digest_size=16)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items()), default=str).encode())
    special = getattr(tokenizer, "special_tokens_map", {}) or {}
    h.update(json.dumps(special, sort_keys=True, default=str).encode())
    return h.hexdigest(), type(tokenizer).__name__


def fingerprint(model: torch.nn.Module, tokenizer, dtype: torch.dtype, model_id: str | None = None,
                read_parameter=None) -> Fingerprint:
    """The :class:`Fingerprint` of ``model`` in ``dtype`` with ``tokenizer`` (None: token ids only)."""
    from .layout import dtype_name

    tok, tok_cls = tokenizer_digest(tokenizer)
    name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__)
    return Fingerprint(model_digest(model, model_id, read_parameter), dtype_name(dtype), tok, name, tok_cls)
