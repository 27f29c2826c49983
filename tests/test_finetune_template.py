"""Prompt templates and masking: labels are -100 exactly on prompt and padding tokens.

The demo's byte-level tokenizer maps one UTF-8 byte to one token, so the expected token counts of
prompt and response follow from the rendered strings alone.
"""
from __future__ import annotations

import pytest
import torch

from aidaptiv_ds.finetune.data import DollyRecord
from aidaptiv_ds.finetune.demo import build_model, build_tokenizer
from aidaptiv_ds.finetune.evaluate import loss_sum
from aidaptiv_ds.finetune.template import (IGNORE_INDEX, Example, collate, encode_record, encode_records, pad_token_id,
                                           render)

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    t = build_tokenizer()
    t.chat_template = CHAT
    return t


REC = DollyRecord("Name the capital of Peru.", "Peru is in South America.", "Lima é")
REC_NO_CTX = DollyRecord("What is 2 + 3?", "", "5")


def test_plain_template_renders_sections_and_omits_empty_context(tok):
    prompt, response = render(tok, REC)
    assert prompt == ("### Instruction:\nName the capital of Peru.\n\n### Context:\nPeru is in South America.\n\n"
                      "### Response:\n")
    assert response == "Lima é"
    assert "### Context" not in render(tok, REC_NO_CTX)[0]


@pytest.mark.parametrize("rec", [REC, REC_NO_CTX])
def test_plain_labels_mask_exactly_the_prompt(tok, rec):
    prompt, response = render(tok, rec)
    ex, truncated = encode_record(tok, rec, 512)
    n_prompt = 1 + len(prompt.encode())          # BOS + one token per byte
    n_resp = len(response.encode()) + 1          # bytes + EOS
    assert not truncated
    assert len(ex.input_ids) == len(ex.labels) == n_prompt + n_resp
    assert ex.input_ids[0] == tok.bos_token_id and ex.input_ids[-1] == tok.eos_token_id
    assert ex.labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert ex.labels[n_prompt:] == ex.input_ids[n_prompt:]
    assert tok.decode(ex.input_ids[n_prompt:-1]) == response


def test_chat_template_is_used_and_masks_the_generation_prompt(chat_tok):
    prompt, response = render(chat_tok, REC)
    assert prompt == "<|user|>Name the capital of Peru.\n\nPeru is in South America.</s><|assistant|>"
    assert response == "Lima é</s>"
    ex, _ = encode_record(chat_tok, REC, 512)
    # "</s>" inside the text is the EOS special token (one id); everything else is one token per byte
    n_prompt = len(prompt.replace("</s>", "").encode()) + 1
    assert ex.labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert ex.labels[n_prompt:] == ex.input_ids[n_prompt:]
    assert ex.n_response_tokens == len("Lima é".encode()) + 1
    assert ex.input_ids[-1] == chat_tok.eos_token_id


def test_chat_template_that_does_not_prefix_the_conversation_is_rejected(tok):
    t = build_tokenizer()
    t.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                       "{% if add_generation_prompt %}<GEN>{% endif %}")
    with pytest.raises(ValueError, match="chat template"):
        render(t, REC)


def test_truncation_keeps_at_least_one_response_token_or_drops(tok):
    prompt, _ = render(tok, REC)
    n_prompt = 1 + len(prompt.encode())
    ex, truncated = encode_record(tok, REC, n_prompt + 3)
    assert truncated and len(ex.input_ids) == n_prompt + 3 and ex.n_response_tokens == 3
    ex, truncated = encode_record(tok, REC, n_prompt + 1)
    assert truncated and ex.n_response_tokens == 1
    assert encode_record(tok, REC, n_prompt) == (None, False)
    split = encode_records(tok, [REC, REC_NO_CTX, REC], n_prompt + 2)
    assert (len(split.examples), split.n_dropped, split.n_truncated) == (3, 0, 2)  # the short one fits
    split = encode_records(tok, [REC, REC_NO_CTX], n_prompt)
    assert (len(split.examples), split.n_dropped) == (1, 1)
    with pytest.raises(ValueError, match="--max_seq_length 1"):
        encode_record(tok, REC, 1)


def test_collate_right_pads_with_masked_labels(tok):
    a = Example([1, 5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 6, 7])
    b = Example([1, 9], [IGNORE_INDEX, 9])
    out = collate([a, b], pad_token_id(tok))
    assert out["input_ids"].tolist() == [[1, 5, 6, 7], [1, 9, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert out["labels"].tolist() == [[-100, -100, 6, 7], [-100, 9, -100, -100]]
    assert all(t.dtype == torch.long for t in out.values())


def test_train_loss_and_eval_loss_count_the_same_response_tokens(tok):
    """HF's loss with these labels (a mean) equals our eval loss_sum / token count on one batch."""
    model = build_model(tok, seed=0, hidden_size=32, num_layers=1).eval()
    split = encode_records(tok, [REC, REC_NO_CTX], 512)
    b = collate(split.examples, pad_token_id(tok))
    with torch.no_grad():
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
        s, n = loss_sum(out.logits, b["labels"])
    assert n == sum(e.n_response_tokens for e in split.examples)
    assert float(s) / n == pytest.approx(float(out.loss), rel=1e-6)
