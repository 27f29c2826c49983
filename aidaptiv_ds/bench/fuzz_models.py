"""The model shapes of the differential fuzzer (:mod:`aidaptiv_ds.bench.fuzz`): what users train, small.

Each model takes one batch from :func:`batch` and returns a scalar loss. The kinds cover the ZeRO-3 paths
whose bookkeeping differs (DeepSpeed's coordinator, persistence, gradient hooks, the partition of tied
and frozen parameters):

* ``mlp``: ``Linear`` layers without biases (``x = tanh(layer(x)) * 2``, loss ``x.pow(2).mean()``);
* ``mlp_bias``: the same with biases (small persistent parameters at DeepSpeed's default threshold);
* ``mlp_twice``: one ``Linear`` called twice per forward (a module fetched twice, its gradient summed);
* ``mlp_unused``: a branch used on even micro-steps only (parameters without a gradient on some steps).
  Its reference is the same model with the branch used at a factor of 0.0 on the other steps
  (``masked``): DeepSpeed's offload reuses a skipped parameter's stale gradient and leaves a gradient
  received only before the window's last micro-step out of the step and the clipping norm (``docs/gradients.md``,
  "A parameter that gets no gradient"), where aidaptiv_ds gives the masked model's exact zero gradient;
* ``mlp_frozen``: the first layer frozen (``requires_grad=False``: not in the optimizer);
* ``mlp_ckpt``: ``mlp_bias`` with ``torch.utils.checkpoint`` (non-reentrant) around every layer;
* ``tied_lm``: an embedding, ``Linear`` blocks and a head tied to the embedding;
* ``llama``, ``gpt2``, ``qwen2``: HF ``transformers`` models from their configs at tiny size (GPT-2 and
  Qwen2 have biases; GPT-2 ties its head, Llama here does not); ``*_ckpt``: the same with HF's
  ``gradient_checkpointing_enable()`` (its default arguments, as HF ``Trainer`` calls it).
"""
from __future__ import annotations

import torch

VOCAB = 128
SEQ = 16
MLP_KINDS = ("mlp", "mlp_bias", "mlp_twice", "mlp_unused", "mlp_frozen", "mlp_ckpt")
LM_KINDS = ("tied_lm", "llama", "gpt2", "qwen2", "llama_ckpt", "gpt2_ckpt", "qwen2_ckpt")
KINDS = MLP_KINDS + LM_KINDS


class MLP(torch.nn.Module):
    """``layers`` square ``Linear`` layers of width ``hidden`` (see the module docstring for ``kind``)."""

    def __init__(self, hidden: int, layers: int, kind: str = "mlp", masked: bool = False) -> None:
        super().__init__()
        self.masked = masked
        bias = kind != "mlp"
        self.kind = kind
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=bias) for _ in range(layers))
        if kind == "mlp_unused":
            self.branch = torch.nn.Linear(hidden, hidden)
        if kind == "mlp_frozen":
            for p in self.layers[0].parameters():
                p.requires_grad = False
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_branch = self.kind == "mlp_unused" and self.calls % 2 == 0
        self.calls += 1
        for i, layer in enumerate(self.layers):
            if self.kind == "mlp_ckpt":
                x = torch.utils.checkpoint.checkpoint(lambda t, m=layer: torch.tanh(m(t)) * 2, x, use_reentrant=False)
            else:
                x = torch.tanh(layer(x)) * 2
            if self.kind == "mlp_twice" and i == 0:
                x = torch.tanh(layer(x)) * 2
        if use_branch:
            x = x + self.branch(x)
        elif self.kind == "mlp_unused" and self.masked:  # the reference: used, with an exact zero gradient
            x = x + 0.0 * self.branch(x)
        return x.float().pow(2).mean()


class TiedLM(torch.nn.Module):
    """Embedding, ``layers`` residual ``Linear`` blocks, a head tied to the embedding; next-token loss."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        logits = self.head(self.norm(x)).float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class HFLoss(torch.nn.Module):
    """An HF causal LM returning its loss (labels = inputs), so every kind has one call signature."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def hf_config(kind: str, hidden: int, layers: int):
    """The ``transformers`` config of an HF kind at tiny size (4 heads; eager attention, no KV cache)."""
    base = kind.removesuffix("_ckpt")
    common = dict(vocab_size=VOCAB, num_hidden_layers=layers, use_cache=False, attn_implementation="eager")
    if base == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden + 8, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                           rms_norm_eps=1e-5, **common)
    if base == "qwen2":
        from transformers import Qwen2Config
        return Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden + 8, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                           rms_norm_eps=1e-6, **common)
    if base == "gpt2":
        from transformers import GPT2Config
        common.pop("num_hidden_layers")
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, **common)
    raise ValueError(f"hf_config: {kind!r} is not an HF kind ({LM_KINDS[1:]})")


def build(kind: str, hidden: int, layers: int, reference: bool = False) -> torch.nn.Module:
    """A fresh model of ``kind`` (random initialisation from the current torch RNG state); ``reference``: the
    variant the oracle trains (differs only for ``mlp_unused``, see the module docstring).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind in MLP_KINDS:
        return MLP(hidden, layers, kind, masked=reference)
    if kind == "tied_lm":
        return TiedLM(hidden, layers)
    if kind in LM_KINDS:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_config(hf_config(kind, hidden, layers))
        if kind.endswith("_ckpt"):
            model.gradient_checkpointing_enable()
        return HFLoss(model)
    raise ValueError(f"fuzz model kind {kind!r} is not one of {KINDS}")


def batch(kind: str, hidden: int, micro: int, index: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``index``-th micro-batch of ``rank``: token ids ``(micro, SEQ)`` for a language model, else
    ``(micro, hidden)`` activations in ``dtype``; the same on every backend."""
    g = torch.Generator().manual_seed(7919 * index + 104729 * rank + 17)
    if kind in LM_KINDS:
        return torch.randint(0, VOCAB, (micro, SEQ), generator=g)
    return torch.randn(micro, hidden, generator=g).to(dtype)
