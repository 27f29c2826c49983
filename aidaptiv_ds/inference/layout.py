"""The shape of one KV block: every layer's keys and values of ``block_tokens`` consecutive tokens.

One block is one store extent, so loading a block is one large sequential read and storing it one
large sequential write (SmolLM2-135M in fp32 at 64 tokens: 30 layers x 2 x 3 heads x 64 tokens x 64
dims x 4 B = 2.9 MiB). Inside the payload the order is ``[layer][key, value][kv_head][token][dim]``,
so the keys (or values) of one layer are one contiguous ``[kv_heads, block_tokens, head_dim]`` array:
exactly the slice ``cache.layers[l].keys[0, :, t0:t0 + block_tokens, :]`` of a transformers cache
(``[batch, kv_heads, seq, head_dim]``, ``cache_utils.DynamicLayer``).

The layout is part of the cache header: a directory written with another layout is refused.
"""
from __future__ import annotations

import dataclasses

import torch

#: dtypes a block may hold, by their name in the header.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16 -> "bfloat16"``.

    Raises:
        ValueError: a dtype a KV cache cannot hold (not float32, bfloat16 or float16).
    """
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"KV cache dtype {dtype}: only {', '.join(DTYPES)} are supported. Fix: load the model in one "
                     f"of them (torch_dtype=...)")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What one block holds.

    Attributes:
        layers: decoder layers with a key/value cache (``num_hidden_layers``).
        kv_heads: key/value heads per layer (``num_key_value_heads``; grouped-query attention).
        head_dim: elements per head.
        dtype: element type name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        block_tokens: tokens per block (the hashing granularity: a prefix is reused in whole blocks).
        kv_format: what a row of keys (values) is: ``"transformers"`` (the token's key vector, as a
            transformers cache holds it; also vLLM's GPU backends, ``"vllm"``), or an engine's own packing
            that only the same engine reads back (``"vllm-cpu_attn/<isa>/<block>"``: vLLM's CPU backend,
            whose kernels may pack the rows per instruction set). A directory is reused only with the same.
    """
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    kv_format: str = "transformers"

    def __post_init__(self) -> None:
        for f in ("layers", "kv_heads", "head_dim", "block_tokens"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"KV cache layout: {f} is {v!r}; it must be a whole number >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"KV cache layout: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(self.kv_format, str) or not self.kv_format:
            raise ValueError(f"KV cache layout: kv_format {self.kv_format!r} must be a non-empty string")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def slab_numel(self) -> int:
        """Elements of one layer's keys (or values) in a block: ``kv_heads x block_tokens x head_dim``."""
        return self.kv_heads * self.block_tokens * self.head_dim

    @property
    def block_nbytes(self) -> int:
        """Payload bytes of one block: ``layers x 2 x kv_heads x block_tokens x head_dim x elsize``."""
        return self.layers * 2 * self.slab_numel * self.elsize

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype, block_tokens: int) -> KVLayout:
        """The layout of a transformers decoder config (``num_hidden_layers``, ``num_key_value_heads``,
        ``head_dim`` or ``hidden_size / num_attention_heads``).

        Raises:
            ValueError: the model has sliding-window or other non-full-attention layers (their cache
                keeps only a window of the prefix, so a block of the prefix is not reusable), or the
                config lacks the attention sizes.
        """
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = getattr(cfg, "layer_types", None)
        if types and any(t != "full_attention" for t in types):
            odd = sorted({t for t in types if t != "full_attention"})
            raise ValueError(f"KV cache: model {getattr(cfg, 'model_type', '?')} has {', '.join(odd)} layers; the prefix "
                             f"cache supports full-attention decoders only (every layer keeps the whole prefix)")
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            raise ValueError(f"KV cache: model {getattr(cfg, 'model_type', '?')} uses a sliding window of "
                             f"{cfg.sliding_window} tokens; the prefix cache supports full-attention decoders only")
        try:
            layers = int(cfg.num_hidden_layers)
            heads = int(cfg.num_attention_heads)
            kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        except AttributeError as e:
            raise ValueError(f"KV cache: the model config lacks the attention sizes ({e}); the prefix cache needs a "
                             f"decoder config with num_hidden_layers, num_attention_heads and hidden_size") from None
        return cls(layers, kv_heads, head_dim, dtype_name(dtype), int(block_tokens))

    # ------------------------------------------------------------------ packing
    def views(self, payload: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(keys, values)`` views ``[kv_heads, block_tokens, head_dim]`` into ``payload``
        (a uint8 tensor of at least :attr:`block_nbytes` bytes; no copy)."""
        flat = payload[: self.block_nbytes].view(self.torch_dtype)
        n = self.slab_numel
        shape = (self.kv_heads, self.block_tokens, self.head_dim)
        return [(flat[(2 * i) * n:(2 * i + 1) * n].view(shape), flat[(2 * i + 1) * n:(2 * i + 2) * n].view(shape))
                for i in range(self.layers)]

    def pack(self, payload: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> None:
        """Copy tokens ``[start, start + block_tokens)`` of per-layer ``(keys, values)`` (each
        ``[1, kv_heads, seq, head_dim]``) into ``payload``.

        Raises:
            ValueError: the tensors do not match the layout (layers, heads, head_dim, dtype, batch 1).
        """
        if len(kv) != self.layers:
            raise ValueError(f"KV cache: {len(kv)} cache layers, the layout has {self.layers}")
        end = start + self.block_tokens
        for (dk, dv), (k, v) in zip(self.views(payload), kv):
            for name, t in (("keys", k), ("values", v)):
                if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != self.kv_heads or t.shape[3] != self.head_dim \
                        or t.shape[2] < end or t.dtype != self.torch_dtype:
                    raise ValueError(f"KV cache: layer {name} of shape {tuple(t.shape)} ({t.dtype}) do not hold tokens "
                                     f"[{start}, {end}) of layout [1, {self.kv_heads}, seq, {self.head_dim}] "
                                     f"{self.dtype}")
            dk.copy_(k[0, :, start:end, :])
            dv.copy_(v[0, :, start:end, :])


#: the value of a layout field that a header written before the field existed stands for
LAYOUT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KVLayout) if f.default is not dataclasses.MISSING}
