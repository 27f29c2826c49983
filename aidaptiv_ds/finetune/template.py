"""Prompt template and tokenization: a Dolly record becomes token ids with the loss on the response only.

Two templates:

* **chat**: when the tokenizer has a chat template (e.g. SmolLM2-Instruct), the record becomes one
  user turn (``instruction``, then a blank line and ``context`` when there is one) and one assistant
  turn (``response``); the prompt is the conversation rendered with ``add_generation_prompt=True``
  and the response is the rest of the rendered conversation (the reply and its end-of-turn tokens).
* **plain**: otherwise ``### Instruction:`` / ``### Context:`` (omitted when empty) / ``### Response:``
  sections, the tokenizer's BOS token first and its EOS token after the response.

Labels are the input ids on response tokens and ``IGNORE_INDEX`` (-100) on prompt and padding
tokens; HF causal-LM models shift them by one internally, so the loss covers the response tokens only.
"""
from __future__ import annotations

import dataclasses

import torch

IGNORE_INDEX = -100

PLAIN_INSTRUCTION = "### Instruction:\n{instruction}\n\n"
PLAIN_CONTEXT = "### Context:\n{context}\n\n"
PLAIN_RESPONSE = "### Response:\n"


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized training example.

    Attributes:
        input_ids: token ids, prompt then response, at most ``max_seq_length`` long.
        labels: same length; ``IGNORE_INDEX`` on prompt tokens, the token id on response tokens.
    """
    input_ids: list[int]
    labels: list[int]

    @property
    def n_response_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


@dataclasses.dataclass
class EncodedSplit:
    """Tokenized records of one split.

    Attributes:
        examples: the kept examples, in record order.
        n_dropped: records dropped because the prompt alone fills ``max_seq_length`` (no response
            token would remain to train on).
        n_truncated: kept records whose response was cut at ``max_seq_length``.
    """
    examples: list[Example]
    n_dropped: int = 0
    n_truncated: int = 0


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer carries a chat template (the chat form of the prompt is used)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, record) -> tuple[str, str]:
    """Prompt text and response text of a record (see the module docstring for both templates).

    Raises:
        ValueError: the tokenizer's chat template does not render the generation prompt as a prefix of
            the full conversation, so the response tokens cannot be located.
    """
    if has_chat_template(tokenizer):
        user = record.instruction if not record.context else f"{record.instruction}\n\n{record.context}"
        messages = [{"role": "user", "content": user}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": record.response}],
                                             tokenize=False)
        if not full.startswith(prompt):
            raise ValueError("the tokenizer's chat template renders the generation prompt "
                             f"{prompt[-80:]!r} differently inside the full conversation {full[:160]!r}...; "
                             "the response tokens cannot be separated from the prompt. Remove "
                             "'chat_template' from the tokenizer config to use the plain template")
        return prompt, full[len(prompt):]
    prompt = PLAIN_INSTRUCTION.format(instruction=record.instruction)
    if record.context:
        prompt += PLAIN_CONTEXT.format(context=record.context)
    return prompt + PLAIN_RESPONSE, record.response


def encode_record(tokenizer, record, max_seq_length: int) -> tuple[Example | None, bool]:
    """Tokenize one record; returns ``(example, truncated)`` or ``(None, False)`` when it is dropped.

    Prompt and response are tokenized separately (``add_special_tokens=False``) so the boundary is
    exact; the plain template adds BOS before the prompt and EOS after the response when the tokenizer
    has them. A sequence longer than ``max_seq_length`` loses its response tail; a record whose prompt
    alone has ``max_seq_length`` tokens or more is dropped.

    Raises:
        ValueError: ``max_seq_length`` < 2 (names ``--max_seq_length``).
    """
    if max_seq_length < 2:
        raise ValueError(f"--max_seq_length {max_seq_length}: must be at least 2 (one prompt and one response token)")
    prompt, response = render(tokenizer, record)
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if not has_chat_template(tokenizer):
        if tokenizer.bos_token_id is not None:
            prompt_ids = [tokenizer.bos_token_id] + prompt_ids
        if tokenizer.eos_token_id is not None:
            response_ids = response_ids + [tokenizer.eos_token_id]
    if len(prompt_ids) >= max_seq_length:
        return None, False
    room = max_seq_length - len(prompt_ids)
    truncated = len(response_ids) > room
    response_ids = response_ids[:room]
    return Example(prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids), truncated


def encode_records(tokenizer, records, max_seq_length: int) -> EncodedSplit:
    """Tokenize records with :func:`encode_record`, counting dropped and truncated ones."""
    out = EncodedSplit([])
    for r in records:
        ex, truncated = encode_record(tokenizer, r, max_seq_length)
        if ex is None:
            out.n_dropped += 1
        else:
            out.examples.append(ex)
            out.n_truncated += int(truncated)
    return out


def pad_token_id(tokenizer) -> int:
    """Id used for padding: the tokenizer's pad token, else its EOS token, else 0 (padding is masked)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its longest example.

    Returns:
        ``input_ids`` [B, T] int64 (``pad_id`` on padding), ``attention_mask`` [B, T] int64 (1 on real
        tokens), ``labels`` [B, T] int64 (``IGNORE_INDEX`` on prompt and padding).
    """
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e.labels, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
