"""Held-out evaluation: the token-weighted mean cross-entropy over the response tokens of the eval split.

The same function scores the DeepSpeed engine during training and a saved HF directory afterwards
(:func:`reload_eval_loss`), so the two numbers can be compared: with the same dtype, batching and
kernels they are equal; with several training ranks the eval batches are sharded differently from
a single-process reload, so the float summation order (and the last bits) can differ.
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable

import torch
import torch.nn.functional as F

from . import distributed
from .template import IGNORE_INDEX, Example, collate, pad_token_id

EVAL_SPLIT_FILE = "eval_split.jsonl"
RUN_ARGS_FILE = "finetune_args.json"


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over labelled positions.

    Args:
        logits: [B, T, V] any float dtype (upcast to float32).
        labels: [B, T] int64, ``IGNORE_INDEX`` where no loss is taken.

    Returns:
        (sum of losses as a 0-dim float64 tensor, number of labelled target tokens).
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    total = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return total.double(), int((shift_labels != IGNORE_INDEX).sum())


def rank_batches(examples: list[Example], batch_size: int, rank: int, world: int) -> list[list[Example]]:
    """This rank's eval batches: examples ``rank::world``, in chunks of ``batch_size``.

    Every rank gets the same number of batches (ZeRO-3 forwards are collective); a rank that runs out
    gets a filler batch of one example with every label ``IGNORE_INDEX`` (it adds nothing to the loss).
    """
    shard = examples[rank::world]
    n_batches = math.ceil(math.ceil(len(examples) / world) / batch_size)
    filler = [Example(examples[0].input_ids, [IGNORE_INDEX] * len(examples[0].input_ids))]
    return [shard[i * batch_size:(i + 1) * batch_size] or filler for i in range(n_batches)]


@torch.no_grad()
def evaluate(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], examples: list[Example],
             batch_size: int, pad_id: int) -> dict:
    """Token-weighted mean loss over all ranks' shares of ``examples``.

    Args:
        forward: ``(input_ids [B,T] int64, attention_mask [B,T] int64) -> logits [B,T,V]``.
        examples: the whole eval split (identical on every rank).

    Returns:
        ``{"eval_loss": float, "eval_tokens": int}``.

    Raises:
        ValueError: ``examples`` is empty or holds no response token.
    """
    if not examples:
        raise ValueError("the eval split is empty (every eval record was dropped by --max_seq_length); "
                         "raise --max_seq_length or --eval_fraction")
    total, tokens = 0.0, 0
    for batch in rank_batches(examples, batch_size, distributed.rank(), distributed.world_size()):
        b = collate(batch, pad_id)
        if getattr(forward, "takes_labels", False):  # logits at the response positions only (hf_forward)
            logits, target = forward(b["input_ids"], b["attention_mask"], b["labels"])
            s, n = F.cross_entropy(logits.float(), target, reduction="sum").double(), int(target.numel())
        else:
            s, n = loss_sum(forward(b["input_ids"], b["attention_mask"]), b["labels"])
        total += float(s)
        tokens += n
    total, tokens = distributed.sum_floats([total, float(tokens)])
    if tokens == 0:
        raise ValueError("the eval split has no response token to score")
    return {"eval_loss": total / tokens, "eval_tokens": int(tokens)}


def response_logits_supported(model) -> bool:
    """The model's forward takes ``logits_to_keep`` and ``**kwargs`` reaching its loss (``shift_labels``):
    transformers' causal LMs since ``slice_logits_to_keep`` takes a boolean mask (transformers 5)."""
    import inspect

    try:
        from transformers.modeling_utils import slice_logits_to_keep  # noqa: F401
        sig = inspect.signature(model.forward)
    except (ImportError, TypeError, ValueError):
        return False
    return "logits_to_keep" in sig.parameters and any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) \
        and "bool" in (inspect.getdoc(slice_logits_to_keep) or "")


def hf_forward(model, response_logits_only: bool = False) -> Callable:
    """``forward`` for :func:`evaluate` from an HF causal LM (or a DeepSpeed engine wrapping one):
    ``(input_ids, attention_mask) -> logits [B, T, V]``; with ``response_logits_only``
    ``(input_ids, attention_mask, labels) -> (logits [n, V], targets [n])`` at the n positions that predict a
    labelled token (its ``takes_labels`` attribute is True; the model's boolean ``logits_to_keep``,
    [Note: logits at the response positions only] in ``finetune/loop.py``)."""
    def fwd(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def kept(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
        target = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        keep = target != IGNORE_INDEX
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep)
        return out.logits, target[keep]

    if response_logits_only:
        kept.takes_labels = True  # type: ignore[attr-defined]
        return kept
    return fwd


def reload_eval_loss(output_dir: str, dtype: str | torch.dtype = "auto") -> dict:
    """Reload a finished run's saved model and score it on the run's held-out split, in this process.

    Reads ``output_dir`` (the HF model directory the run saved), ``output_dir/eval_split.jsonl`` (the
    held-out records) and ``output_dir/finetune_args.json`` (``max_seq_length``, eval batch size),
    tokenizes with the saved tokenizer and evaluates single-process.

    Args:
        dtype: ``"auto"`` loads the saved dtype; pass ``torch.float32`` to score in fp32.

    Returns:
        ``{"eval_loss": float, "eval_tokens": int}``.

    Raises:
        FileNotFoundError: ``output_dir`` lacks one of the files above.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import read_dolly
    from .template import encode_records

    for name in ("config.json", EVAL_SPLIT_FILE, RUN_ARGS_FILE):
        if not os.path.isfile(os.path.join(output_dir, name)):
            raise FileNotFoundError(f"{output_dir}: no {name}; pass the --output_dir of a finished finetune run")
    with open(os.path.join(output_dir, RUN_ARGS_FILE), encoding="utf-8") as f:
        args = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = AutoModelForCausalLM.from_pretrained(output_dir, dtype=dtype)
    model.eval()
    split = encode_records(tokenizer, read_dolly(os.path.join(output_dir, EVAL_SPLIT_FILE)), args["max_seq_length"])
    kept = args.get("response_logits_only") is True and response_logits_supported(model)  # as the run scored it
    return evaluate(hf_forward(model, kept), split.examples, args["eval_batch_size"], pad_token_id(tokenizer))
