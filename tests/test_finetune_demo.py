"""The embedded demo: deterministic data with correct answers, an offline byte-level tokenizer, and a
tiny Llama whose weights carry transformers' init (not the zeros/garbage of a skipped init)."""
from __future__ import annotations

import math
import os
import re

import pytest
import torch

from aidaptiv_ds.finetune.data import read_dolly
from aidaptiv_ds.finetune.demo import build_model, build_tokenizer, generate_records, prepare_demo


def test_records_are_deterministic_per_seed():
    a, b, c = generate_records(200, seed=3), generate_records(200, seed=3), generate_records(200, seed=4)
    assert a == b
    assert a != c
    assert {r.category for r in a} == {"arithmetic", "reverse_words", "uppercase", "context_lookup"}
    with pytest.raises(ValueError, match="too small"):
        generate_records(3)


def test_every_demo_answer_is_correct():
    for r in generate_records(400, seed=0):
        if r.category == "arithmetic":
            x, y = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", r.instruction).groups())
            assert r.response == str(x + y)
        elif r.category == "reverse_words":
            words = r.instruction.split(": ", 1)[1].split()
            assert r.response.split() == words[::-1]
        elif r.category == "uppercase":
            assert r.response == r.instruction.rsplit(" ", 1)[1].upper()
        else:
            field = re.fullmatch(r"What is the (\w+) in the context\?", r.instruction).group(1)
            assert dict(kv.split(": ") for kv in r.context.split("; "))[field] == r.response


def test_byte_tokenizer_round_trips_any_text_one_token_per_byte():
    tok = build_tokenizer()
    text = "Héllo, wörld! 12 + 30 = 42 \n\t🙂"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert (len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (259, 0, 1, 2)


def test_model_init_is_deterministic_and_not_skipped():
    tok = build_tokenizer()
    a, b = build_model(tok, seed=0), build_model(tok, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    w = a.model.embed_tokens.weight.detach()
    assert 0.015 < float(w.std()) < 0.025          # normal(0, initializer_range=0.02)
    ids = torch.randint(0, len(tok), (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = float(a(input_ids=ids, labels=ids).loss)
    assert abs(loss - math.log(len(tok))) < 0.5   # near-uniform predictions, not the ~500 of a skipped init


def test_prepare_demo_writes_files_the_hf_loaders_read(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, data_path = prepare_demo(str(tmp_path), seed=0, n_records=40)
    assert [r.to_json() for r in read_dolly(data_path)] == [r.to_json() for r in generate_records(40, 0)]
    assert os.path.isfile(os.path.join(model_dir, "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok("abc", add_special_tokens=False)["input_ids"] == build_tokenizer()("abc", add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ref = build_model(build_tokenizer(), seed=0)
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), ref.state_dict().values()))
