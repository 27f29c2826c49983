"""Parameter counts and per-layer tensor shapes of decoder-only LMs, from an HF ``config.json``.

Supported ``model_type`` families (the tensor names are those of the HF ``...ForCausalLM`` state dict):

* **Llama-like**: ``llama``, ``mistral``, ``qwen2``, ``qwen3``. With hidden size ``h``, MLP size
  ``f``, ``a`` query heads and ``k`` key/value heads of ``d`` dims (``d = head_dim`` or ``h / a``),
  one decoder block holds ``q_proj [a*d, h]``, ``k_proj`` and ``v_proj [k*d, h]``, ``o_proj [h, a*d]``,
  ``gate_proj`` and ``up_proj [f, h]``, ``down_proj [h, f]`` and two RMSNorm weights ``[h]``::

      block = h*(a*d) + 2*h*(k*d) + (a*d)*h + 3*h*f + 2*h   (+ biases, + q_norm/k_norm [d] for qwen3)

  Biases: ``qwen2`` has q/k/v biases; ``llama``/``qwen3`` ``attention_bias`` adds q/k/v/o biases and
  ``llama`` ``mlp_bias`` adds gate/up/down biases; ``mistral`` has none.
* **GPT-NeoX** (``gpt_neox``, Pythia; the untied head is ``lm_head``, ``embed_out`` in older
  checkpoints): fused ``query_key_value [3h, h]``, ``dense [h, h]``, ``dense_h_to_4h [f, h]``,
  ``dense_4h_to_h [h, f]``, attention ones with a bias when ``attention_bias`` (default True; the
  MLP biases always), and two LayerNorms (weight + bias, ``2h`` each)::

      block = 3h^2 + h^2 + 2*h*f + (3h + h)*[attention_bias] + f + h + 4h

* **GPT-2** (``gpt2``): Conv1D weights stored ``[in, out]``: ``c_attn [h, 3h]``, ``attn.c_proj [h, h]``,
  ``c_fc [h, f]``, ``mlp.c_proj [f, h]``, all with biases, two LayerNorms; ``f = n_inner or 4h``;
  learned positions ``wpe [n_positions, h]``::

      block = 4h^2 + 2*h*f + 3h + h + f + h + 4h = 4h^2 + 2hf + 9h + f

Whole model = embeddings ``[V, h]`` (+ ``wpe`` for GPT-2) + ``L x block`` + final norm (``h``
for RMSNorm, ``2h`` for LayerNorm) + ``lm_head [V, h]`` unless ``tie_word_embeddings``. These are
exactly the tensors of the HF implementation (checked in ``tests/test_planner.py`` against
``transformers`` models built on the meta device and against the stories260K safetensors file).
Source: the HF ``transformers`` modeling files of each family (``modeling_llama.py``,
``modeling_qwen2.py``, ``modeling_qwen3.py``, ``modeling_mistral.py``, ``modeling_gpt_neox.py``,
``modeling_gpt2.py``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

from ..errors import AidaptivConfigError

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = LLAMA_LIKE + ("gpt_neox", "gpt2")


@dataclasses.dataclass(frozen=True)
class TensorShape:
    """One parameter tensor: its HF state-dict name and shape (elements per dimension)."""
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The parameter tensors of a decoder-only LM, grouped the way ZeRO-3 fetches them.

    Attributes:
        name: preset name or the config's path.
        model_type: HF ``model_type`` (one of :data:`SUPPORTED_MODEL_TYPES`).
        hidden_size: ``h``; intermediate_size: ``f``; num_layers: ``L``.
        num_heads: query heads ``a``; num_kv_heads: key/value heads ``k``; head_dim: ``d``.
        vocab_size: ``V``; max_position: longest sequence the config allows (tokens).
        tie_word_embeddings: the LM head shares the input embedding (no separate ``lm_head``).
        gated_mlp: SwiGLU MLP (three matrices) rather than a two-matrix MLP.
        embedding: tensors used before the first block (token and position embeddings).
        blocks: one list of tensors per decoder block (``L`` lists).
        final: tensors after the last block (final norm and, when untied, ``lm_head``).
    """
    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    tie_word_embeddings: bool
    gated_mlp: bool
    embedding: tuple[TensorShape, ...]
    blocks: tuple[tuple[TensorShape, ...], ...]
    final: tuple[TensorShape, ...]

    def tensors(self) -> list[TensorShape]:
        """Every parameter tensor once (tied weights counted once), in module order."""
        out = list(self.embedding)
        for b in self.blocks:
            out.extend(b)
        return out + list(self.final)

    @property
    def n_params(self) -> int:
        """Total parameters (elements), tied weights counted once."""
        return sum(t.numel for t in self.tensors())

    @property
    def block_params(self) -> list[int]:
        """Parameters of each decoder block (elements), in order."""
        return [sum(t.numel for t in b) for b in self.blocks]

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embeddings (elements; include the LM head when tied)."""
        return sum(t.numel for t in self.embedding)

    @property
    def final_params(self) -> int:
        return sum(t.numel for t in self.final)

    def slice_params(self) -> list[int]:
        """Parameters of each *slice* (elements): the embedding, each block, the final module group.

        A slice is what one ZeRO-3 module fetch gathers on the GPU (design.md, "Words").
        """
        return [self.embedding_params] + self.block_params + [self.final_params]

    @property
    def largest_slice_params(self) -> int:
        """Elements of the largest slice: the most a GPU holds gathered at once for one module."""
        return max(self.slice_params())

    @property
    def largest_param_numel(self) -> int:
        """Elements of the largest single parameter (a ZeRO-3 partition is one parameter's share)."""
        return max((t.numel for t in self.tensors()), default=0)

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection output: ``num_kv_heads x head_dim``."""
        return self.num_kv_heads * self.head_dim

    def as_dict(self) -> dict:
        """Summary without the tensor lists (JSON-ready)."""
        return {
            "name": self.name, "model_type": self.model_type, "n_params": self.n_params,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "max_position": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings, "gated_mlp": self.gated_mlp,
            "block_params": self.block_params[0] if self.blocks else 0,
            "embedding_params": self.embedding_params, "final_params": self.final_params,
            "largest_slice_params": self.largest_slice_params,
        }


def _get(cfg: dict, field: str, *names: str, default=None, source: str = "config"):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is not None:
        return default
    raise AidaptivConfigError(f"{source}: field {' / '.join(names)!r} ({field}) is missing; the config of a "
                     f"{cfg.get('model_type', '?')!r} model needs it. Fix: give the model's full HF config.json.")


def _llama_block(i: int, cfg: dict, h: int, f: int, a: int, k: int, d: int) -> tuple[TensorShape, ...]:
    mt = cfg["model_type"]
    p = f"model.layers.{i}."
    qkv_bias = mt == "qwen2" or (mt in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)))
    o_bias = mt in ("llama", "qwen3") and bool(cfg.get("attention_bias", False))
    mlp_bias = mt == "llama" and bool(cfg.get("mlp_bias", False))
    # HF's registration order (LlamaDecoderLayer: self_attn, mlp, then the two norms), which is the order
    # DeepSpeed packs the parameters into sub-groups (tests/test_working_set.py)
    t = []
    for proj, rows in (("q_proj", a * d), ("k_proj", k * d), ("v_proj", k * d)):
        t.append(TensorShape(p + f"self_attn.{proj}.weight", (rows, h)))
        if qkv_bias:
            t.append(TensorShape(p + f"self_attn.{proj}.bias", (rows,)))
    t.append(TensorShape(p + "self_attn.o_proj.weight", (h, a * d)))
    if o_bias:
        t.append(TensorShape(p + "self_attn.o_proj.bias", (h,)))
    if mt == "qwen3":
        t += [TensorShape(p + "self_attn.q_norm.weight", (d,)), TensorShape(p + "self_attn.k_norm.weight", (d,))]
    for proj, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
        t.append(TensorShape(p + f"mlp.{proj}.weight", shape))
        if mlp_bias:
            t.append(TensorShape(p + f"mlp.{proj}.bias", (shape[0],)))
    t += [TensorShape(p + "input_layernorm.weight", (h,)), TensorShape(p + "post_attention_layernorm.weight", (h,))]
    return tuple(t)


def _neox_block(i: int, cfg: dict, h: int, f: int) -> tuple[TensorShape, ...]:
    p = f"gpt_neox.layers.{i}."
    bias = bool(cfg.get("attention_bias", True))
    t = [TensorShape(p + "input_layernorm.weight", (h,)), TensorShape(p + "input_layernorm.bias", (h,)),
         TensorShape(p + "post_attention_layernorm.weight", (h,)),
         TensorShape(p + "post_attention_layernorm.bias", (h,)),
         TensorShape(p + "attention.query_key_value.weight", (3 * h, h))]
    if bias:
        t.append(TensorShape(p + "attention.query_key_value.bias", (3 * h,)))
    t.append(TensorShape(p + "attention.dense.weight", (h, h)))
    if bias:
        t.append(TensorShape(p + "attention.dense.bias", (h,)))
    t += [TensorShape(p + "mlp.dense_h_to_4h.weight", (f, h)), TensorShape(p + "mlp.dense_h_to_4h.bias", (f,)),
          TensorShape(p + "mlp.dense_4h_to_h.weight", (h, f)), TensorShape(p + "mlp.dense_4h_to_h.bias", (h,))]
    return tuple(t)


def _gpt2_block(i: int, h: int, f: int) -> tuple[TensorShape, ...]:
    p = f"transformer.h.{i}."
    return (TensorShape(p + "ln_1.weight", (h,)), TensorShape(p + "ln_1.bias", (h,)),
            TensorShape(p + "attn.c_attn.weight", (h, 3 * h)), TensorShape(p + "attn.c_attn.bias", (3 * h,)),
            TensorShape(p + "attn.c_proj.weight", (h, h)), TensorShape(p + "attn.c_proj.bias", (h,)),
            TensorShape(p + "ln_2.weight", (h,)), TensorShape(p + "ln_2.bias", (h,)),
            TensorShape(p + "mlp.c_fc.weight", (h, f)), TensorShape(p + "mlp.c_fc.bias", (f,)),
            TensorShape(p + "mlp.c_proj.weight", (f, h)), TensorShape(p + "mlp.c_proj.bias", (h,)))


def shape_from_config(cfg: dict, name: str = "config") -> ModelShape:
    """The :class:`ModelShape` of an HF config (the parsed ``config.json``).

    Raises:
        AidaptivConfigError: (a ``ValueError``) naming ``name``, the unsupported ``model_type`` and the
            supported ones, or a
            missing field.
    """
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise AidaptivConfigError(f"{name}: model_type {mt!r} is not supported by the planner; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}. Fix: give --params N (the parameter count) instead.")
    if mt == "gpt2":
        h = int(_get(cfg, "hidden size", "n_embd", "hidden_size", source=name))
        L = int(_get(cfg, "layers", "n_layer", "num_hidden_layers", source=name))
        a = int(_get(cfg, "heads", "n_head", "num_attention_heads", source=name))
        f = int(cfg.get("n_inner") or 4 * h)
        V = int(_get(cfg, "vocabulary", "vocab_size", source=name))
        P = int(_get(cfg, "positions", "n_positions", "max_position_embeddings", default=1024, source=name))
        tie = bool(cfg.get("tie_word_embeddings", True))
        emb: tuple[TensorShape, ...] = (TensorShape("transformer.wte.weight", (V, h)),
                                        TensorShape("transformer.wpe.weight", (P, h)))
        blocks = tuple(_gpt2_block(i, h, f) for i in range(L))
        final = [TensorShape("transformer.ln_f.weight", (h,)), TensorShape("transformer.ln_f.bias", (h,))]
        if not tie:
            final.append(TensorShape("lm_head.weight", (V, h)))
        return ModelShape(name, mt, h, f, L, a, a, h // a, V, P, tie, False, emb, blocks, tuple(final))

    h = int(_get(cfg, "hidden size", "hidden_size", source=name))
    L = int(_get(cfg, "layers", "num_hidden_layers", source=name))
    a = int(_get(cfg, "heads", "num_attention_heads", source=name))
    V = int(_get(cfg, "vocabulary", "vocab_size", source=name))
    P = int(cfg.get("max_position_embeddings") or 0)
    if mt == "gpt_neox":
        f = int(cfg.get("intermediate_size") or 4 * h)
        tie = bool(cfg.get("tie_word_embeddings", False))
        emb = (TensorShape("gpt_neox.embed_in.weight", (V, h)),)
        blocks = tuple(_neox_block(i, cfg, h, f) for i in range(L))
        final = [TensorShape("gpt_neox.final_layer_norm.weight", (h,)),
                 TensorShape("gpt_neox.final_layer_norm.bias", (h,))]
        if not tie:
            final.append(TensorShape("lm_head.weight", (V, h)))  # "embed_out.weight" in pre-v5 checkpoints
        return ModelShape(name, mt, h, f, L, a, a, h // a, V, P, tie, False, emb, blocks, tuple(final))

    f = int(_get(cfg, "MLP size", "intermediate_size", source=name))
    k = int(cfg.get("num_key_value_heads") or a)
    d = int(cfg.get("head_dim") or h // a)
    tie = bool(cfg.get("tie_word_embeddings", False))
    emb = (TensorShape("model.embed_tokens.weight", (V, h)),)
    blocks = tuple(_llama_block(i, cfg, h, f, a, k, d) for i in range(L))
    final = [TensorShape("model.norm.weight", (h,))]
    if not tie:
        final.append(TensorShape("lm_head.weight", (V, h)))
    return ModelShape(name, mt, h, f, L, a, k, d, V, P, tie, True, emb, blocks, tuple(final))


def _llama(h, f, L, a, k, V, P, tie=False, mt="llama", **extra) -> dict:
    return {"model_type": mt, "hidden_size": h, "intermediate_size": f, "num_hidden_layers": L,
            "num_attention_heads": a, "num_key_value_heads": k, "vocab_size": V, "max_position_embeddings": P,
            "tie_word_embeddings": tie, **extra}


PRESETS: dict[str, dict] = {
    # Meta Llama 3.1 (config.json of meta-llama/Llama-3.1-{8B,70B,405B})
    "llama-3.1-405b": _llama(16384, 53248, 126, 128, 8, 128256, 131072),
    "llama-3.1-70b": _llama(8192, 28672, 80, 64, 8, 128256, 131072),
    "llama-3.1-8b": _llama(4096, 14336, 32, 32, 8, 128256, 131072),
    # Meta Llama 2 (meta-llama/Llama-2-{7b,70b}-hf)
    "llama-2-70b": _llama(8192, 28672, 80, 64, 8, 32000, 4096),
    "llama-2-7b": _llama(4096, 11008, 32, 32, 32, 32000, 4096),
    # mistralai/Mistral-7B-v0.1, Qwen/Qwen2.5-7B
    "mistral-7b": _llama(4096, 14336, 32, 32, 8, 32000, 32768, mt="mistral"),
    "qwen2.5-7b": _llama(3584, 18944, 28, 28, 4, 152064, 131072, mt="qwen2"),
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": _llama(576, 1536, 30, 9, 3, 49152, 8192, tie=True),
    # karpathy tinyllamas stories260K (the HF conversion in shared/data/models/stories260K/hf)
    "stories260k": _llama(64, 172, 5, 8, 4, 512, 512, tie=True, head_dim=8),
    # EleutherAI/pythia-160m, openai-community/gpt2
    "pythia-160m": {"model_type": "gpt_neox", "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                    "num_attention_heads": 12, "vocab_size": 50304, "max_position_embeddings": 2048,
                    "tie_word_embeddings": False},
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
             "n_positions": 1024},
}


def preset_shape(name: str) -> ModelShape:
    """The shape of preset ``name`` (case-insensitive).

    Raises:
        AidaptivConfigError: (a ``ValueError``) naming the unknown preset and listing the known ones.
    """
    key = name.lower()
    if key not in PRESETS:
        raise AidaptivConfigError(f"--model: {name!r} is neither a preset nor an existing path; presets: "
                         f"{', '.join(sorted(PRESETS))}. Fix: give a preset name, a model directory or its "
                         f"config.json.")
    return shape_from_config(PRESETS[key], key)


def load_model_shape(spec: str) -> ModelShape:
    """The shape of a model given as a ``config.json`` path, a model directory or a preset name.

    Raises:
        AidaptivConfigError: (a ``ValueError``) the path has no ``config.json``, the JSON does not
            parse, or the name is unknown.
    """
    if os.path.isdir(spec):
        path = os.path.join(spec, "config.json")
        if not os.path.isfile(path):
            raise AidaptivConfigError(f"--model: directory {spec!r} has no config.json. Fix: give the HF model "
                                      f"directory (the one holding config.json) or the config file itself.")
    elif os.path.isfile(spec):
        path = spec
    else:
        return preset_shape(spec)
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise AidaptivConfigError(f"--model: cannot read {path!r} as an HF config.json ({e}). Fix: point at a valid "
                         f"config.json.") from e
    return shape_from_config(cfg, path)


def nearest_preset(n_params: float) -> ModelShape:
    """The preset whose parameter count is nearest to ``n_params`` on a log scale.

    Used for the per-layer shapes (activations, VRAM working set) when only ``--params N`` is known;
    the byte counts of the training state use ``n_params`` itself.
    """
    if n_params <= 0:
        raise AidaptivConfigError(f"--params: {n_params!r} must be a positive parameter count such as 405e9")
    shapes = [preset_shape(k) for k in PRESETS]
    return min(shapes, key=lambda s: abs(math.log(s.n_params / n_params)))
