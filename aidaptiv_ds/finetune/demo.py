"""The embedded offline default: a generated instruction set and a tiny random-init Llama, no downloads.

:func:`prepare_demo` writes, deterministically for a seed,

* ``dolly_demo.jsonl``: Dolly-format records of four simple learnable tasks (categories
  ``arithmetic``, ``reverse_words``, ``uppercase``, ``context_lookup``);
* ``model/``: an HF directory with a byte-level BPE tokenizer (the 256 byte symbols, no merges, plus
  ``<pad>``, ``<s>``, ``</s>``; built with the ``tokenizers`` library) and a small ``LlamaForCausalLM``
  initialised by transformers' own weight init and saved as safetensors (fp32).

The fine-tuning job then loads both through the same code path as any user model and data. The model
is built and saved normally (not under ``deepspeed.zero.Init``, which would skip the HF weight init)
and ``from_pretrained`` later loads the initialised weights into the ZeRO-3 partitions.
"""
from __future__ import annotations

import os
import random

import torch

from .data import DollyRecord, write_dolly

DATA_FILE = "dolly_demo.jsonl"
MODEL_DIR = "model"
DEFAULT_RECORDS = 400

_WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "candle", "forest", "lemon",
          "rocket", "garden", "silver", "window", "planet", "orange", "bridge", "yellow", "market", "pencil",
          "winter", "summer", "castle", "dragon", "mirror", "violet", "jacket", "basket", "copper", "meadow"]
_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
_CITIES = ["Lima", "Oslo", "Kyoto", "Accra", "Quito", "Perth", "Riga", "Dakar", "Hanoi", "Turin"]
_COLORS = ["red", "blue", "green", "black", "white", "purple", "orange", "gray"]
_FIELDS = ("name", "city", "color")


def _arithmetic(rng: random.Random) -> DollyRecord:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return DollyRecord(f"What is {a} + {b}?", "", str(a + b), "arithmetic")


def _reverse_words(rng: random.Random) -> DollyRecord:
    words = rng.sample(_WORDS, rng.randint(3, 5))
    return DollyRecord(f"Reverse the order of these words: {' '.join(words)}", "", " ".join(reversed(words)),
                       "reverse_words")


def _uppercase(rng: random.Random) -> DollyRecord:
    word = rng.choice(_WORDS)
    return DollyRecord(f"Write this word in capital letters: {word}", "", word.upper(), "uppercase")


def _context_lookup(rng: random.Random) -> DollyRecord:
    values = {"name": rng.choice(_NAMES), "city": rng.choice(_CITIES), "color": rng.choice(_COLORS)}
    field = rng.choice(_FIELDS)
    context = "; ".join(f"{k}: {values[k]}" for k in _FIELDS)
    return DollyRecord(f"What is the {field} in the context?", context, values[field], "context_lookup")


TASKS = (_arithmetic, _reverse_words, _uppercase, _context_lookup)


def generate_records(n: int = DEFAULT_RECORDS, seed: int = 0) -> list[DollyRecord]:
    """``n`` demo records, tasks in rotation, contents drawn from ``random.Random(seed)``.

    Raises:
        ValueError: ``n`` < 4 (one record per task at least).
    """
    if n < len(TASKS):
        raise ValueError(f"demo dataset: n={n} is too small; use at least {len(TASKS)} records")
    rng = random.Random(seed)
    return [TASKS[i % len(TASKS)](rng) for i in range(n)]


def build_tokenizer():
    """Byte-level BPE tokenizer (259 tokens: ``<pad>``=0, ``<s>``=1, ``</s>``=2, then the 256 byte symbols)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_model(tokenizer, seed: int = 0, hidden_size: int = 128, num_layers: int = 2):
    """A small ``LlamaForCausalLM`` with HF's weight init under ``torch.manual_seed(seed)`` (global RNG untouched)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 3,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True, initializer_range=0.02,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def prepare_demo(workdir: str, seed: int = 0, n_records: int = DEFAULT_RECORDS) -> tuple[str, str]:
    """Write the demo data and model under ``workdir``; returns ``(model_dir, data_path)``.

    Overwrites earlier demo files there; the result depends only on ``seed`` and ``n_records``.
    """
    model_dir = os.path.join(workdir, MODEL_DIR)
    data_path = os.path.join(workdir, DATA_FILE)
    os.makedirs(model_dir, exist_ok=True)
    write_dolly(generate_records(n_records, seed), data_path)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(model_dir)
    build_model(tokenizer, seed).save_pretrained(model_dir, safe_serialization=True)
    return model_dir, data_path
