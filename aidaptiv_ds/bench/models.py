"""Llama shapes for the comparison runs: presets by approximate size, exact parameter counts.

Every preset is a plain Llama (HF ``LlamaForCausalLM``): vocabulary 32000 (the Llama-2 tokenizer),
untied input and output embeddings, head dimension 64 (128 for the large one), SwiGLU MLP. The
parameter count is computed exactly from the shape (it matches ``sum(p.numel())`` of the HF model).
"""
from __future__ import annotations

import dataclasses

from ..units import GiB


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The shape of a Llama.

    Attributes:
        hidden: hidden size; intermediate: MLP width; layers: decoder blocks; heads: attention heads;
        kv_heads: key/value heads; vocab: vocabulary size; tie: tied input/output embeddings;
        max_positions: ``max_position_embeddings`` (must cover the sequence length).
    """
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 32000
    tie: bool = False
    max_positions: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_params(self) -> int:
        """Parameters of one decoder block (attention, MLP, two RMSNorm weights)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        return attn + 3 * h * self.intermediate + 2 * h

    def n_params(self) -> int:
        """Total parameters (embedding, blocks, final norm, untied LM head)."""
        emb = self.vocab * self.hidden
        return emb + self.layers * self.block_params() + self.hidden + (0 if self.tie else emb)

    def largest_tensor(self) -> int:
        """Elements of the largest single parameter (the embedding, or an MLP matrix if wider)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate, self.hidden * self.heads * self.head_dim)

    def state_bytes(self, dtype: str) -> int:
        """Bytes of the full training state with DeepSpeed ZeRO-3 + Adam: parameter (2 B bf16 / 4 B
        fp32) + fp32 master (4 B) + two fp32 moments (8 B) + fp32 gradient (4 B) per parameter."""
        return self.n_params() * ((2 if dtype == "bf16" else 4) + 4 + 8 + 4)

    def hf_config(self):
        """A ``transformers.LlamaConfig`` of this shape (no KV cache, SDPA attention)."""
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=self.max_positions,
                           tie_word_embeddings=self.tie, rms_norm_eps=1e-5, use_cache=False)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "n_params": self.n_params()}


#: Presets by approximate size (exact counts from :meth:`LlamaShape.n_params`).
PRESETS: dict[str, LlamaShape] = {
    "tiny": LlamaShape(64, 172, 2, 4, 2, vocab=512, max_positions=512),      # 0.16M, for smoke tests
    "20M": LlamaShape(256, 688, 4, 4, 4),                                   # 19.5M
    "40M": LlamaShape(384, 1024, 8, 6, 6),                                  # 38.7M
    "150M": LlamaShape(768, 2560, 12, 12, 12),                              # 148.3M
    "1.1B": LlamaShape(2048, 5632, 22, 32, 4),                              # 1.10B, TinyLlama-1.1B's shape (GQA)
    "2.7B": LlamaShape(2560, 6912, 32, 20, 20, max_positions=4096),         # 2.70B
}


def resolve_shape(params: str | None = None, hidden: int | None = None, layers: int | None = None,
                  intermediate: int | None = None, heads: int | None = None, kv_heads: int | None = None,
                  vocab: int | None = None, seq: int = 0) -> LlamaShape:
    """A preset (``params``) with any field overridden, or a shape from ``hidden``/``layers`` alone
    (intermediate ``8/3 x hidden`` rounded up to 64, head dimension 64, vocabulary 32000).

    Raises:
        ValueError: unknown preset, neither a preset nor hidden+layers, or an inconsistent shape.
    """
    if params is not None:
        if params not in PRESETS:
            raise ValueError(f"--params {params!r}: unknown preset; presets: {', '.join(PRESETS)} "
                             f"(or give --hidden and --layers)")
        base = PRESETS[params]
    elif hidden is not None and layers is not None:
        h = heads or max(hidden // 64, 1)
        base = LlamaShape(hidden, -(-hidden * 8 // 3 // 64) * 64, layers, h, h)
    else:
        raise ValueError("give --params PRESET, or --hidden and --layers")
    repl = {k: v for k, v in dict(hidden=hidden, layers=layers, intermediate=intermediate, heads=heads,
                                  kv_heads=kv_heads, vocab=vocab).items() if v is not None}
    if repl:
        base = dataclasses.replace(base, **repl)
    if base.hidden % base.heads or base.heads % base.kv_heads:
        raise ValueError(f"hidden {base.hidden} must be divisible by heads {base.heads}, and heads by kv_heads "
                         f"{base.kv_heads}")
    if seq > base.max_positions:
        base = dataclasses.replace(base, max_positions=seq)
    return base


def describe(shape: LlamaShape) -> str:
    """``"148.3M params (hidden 768, 12 layers, MLP 2560, vocab 32000)"``."""
    n = shape.n_params()
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return (f"{size} params (hidden {shape.hidden}, {shape.layers} layers, MLP {shape.intermediate}, "
            f"{shape.heads} heads, vocab {shape.vocab}{', tied' if shape.tie else ''})")


def state_vs_ram(shape: LlamaShape, dtype: str, ram_bytes: int) -> str:
    """``"training state 50.3 GiB = 2.10 x RAM (24.0 GiB)"``."""
    s = shape.state_bytes(dtype)
    return f"training state {s / GiB:.1f} GiB = {s / ram_bytes:.2f} x RAM ({ram_bytes / GiB:.1f} GiB)"
