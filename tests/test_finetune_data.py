"""Dolly JSONL reading (errors name the line and field), the --category filter and the train/eval split."""
from __future__ import annotations

import json
import os

import pytest

from aidaptiv_ds.finetune.data import (DollyFormatError, DollyRecord, filter_category, read_dolly, split_train_eval,
                                       write_dolly)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: 151 records of databricks-dolly-15k, shipped with the repository (CC BY-SA 3.0: data/dolly/NOTICE)
DOLLY = os.path.join(REPO, "data", "dolly", "dolly_sample_151.jsonl")


def _write_lines(path, lines) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for ln in lines:
            f.write((ln if isinstance(ln, str) else json.dumps(ln)) + "\n")
    return str(path)


GOOD = {"instruction": "Say hi", "context": "", "response": "hi"}


def test_reads_records_in_order_skips_blank_lines_and_keeps_line_numbers(tmp_path):
    p = _write_lines(tmp_path / "d.jsonl", [GOOD, "", {**GOOD, "response": "hello", "category": "open_qa"}])
    recs = read_dolly(p)
    assert [r.response for r in recs] == ["hi", "hello"]
    assert [r.line for r in recs] == [1, 3]
    assert recs[0].category is None and recs[1].category == "open_qa"


@pytest.mark.parametrize("bad, needle", [
    ({"context": "", "response": "x"}, "missing field 'instruction'"),
    ({"instruction": "x", "response": "y"}, "missing field 'context'"),
    ({"instruction": "x", "context": ""}, "missing field 'response'"),
    ({"instruction": 3, "context": "", "response": "y"}, "field 'instruction' must be a string, got int"),
    ({"instruction": "x", "context": None, "response": "y"}, "field 'context' must be a string, got NoneType"),
    ({"instruction": "  ", "context": "", "response": "y"}, "field 'instruction' is empty"),
    ({"instruction": "x", "context": "", "response": ""}, "field 'response' is empty"),
    ({"instruction": "x", "context": "", "response": "y", "category": 5}, "field 'category' must be a string"),
    ([1, 2], "expected a JSON object"),
    ('{"instruction": "x", ', "not valid JSON"),
])
def test_bad_line_raises_naming_file_line_and_field(tmp_path, bad, needle):
    p = _write_lines(tmp_path / "d.jsonl", [GOOD, GOOD, bad])
    with pytest.raises(DollyFormatError) as e:
        read_dolly(p)
    assert f"{p}:3:" in str(e.value)
    assert needle in str(e.value)


def test_missing_and_empty_files_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data_path"):
        read_dolly(tmp_path / "nope.jsonl")
    p = _write_lines(tmp_path / "e.jsonl", ["", "  "])
    with pytest.raises(DollyFormatError, match="no records"):
        read_dolly(p)


def test_write_then_read_round_trips(tmp_path):
    recs = [DollyRecord("a", "ctx", "b", "cat"), DollyRecord("ü", "", "ß")]
    write_dolly(recs, tmp_path / "w.jsonl")
    back = read_dolly(tmp_path / "w.jsonl")
    assert [(r.instruction, r.context, r.response, r.category) for r in back] == \
        [(r.instruction, r.context, r.response, r.category) for r in recs]


def test_category_filter_keeps_matches_and_lists_categories_when_none_match():
    recs = [DollyRecord("a", "", "b", "open_qa"), DollyRecord("c", "", "d", "summarization"), DollyRecord("e", "", "f")]
    assert [r.instruction for r in filter_category(recs, "open_qa")] == ["a"]
    assert filter_category(recs, None) == recs
    with pytest.raises(ValueError, match="open_qa, summarization"):
        filter_category(recs, "brainstorming")
    with pytest.raises(ValueError, match="no record has a 'category' field"):
        filter_category([DollyRecord("a", "", "b")], "open_qa")


def _recs(n):
    return [DollyRecord(f"q{i}", "", f"a{i}") for i in range(n)]


def test_split_is_deterministic_disjoint_and_complete():
    recs = _recs(50)
    tr1, ev1 = split_train_eval(recs, 0.2, seed=7)
    tr2, ev2 = split_train_eval(recs, 0.2, seed=7)
    assert tr1 == tr2 and ev1 == ev2
    assert len(ev1) == 10 and len(tr1) == 40
    assert sorted(r.instruction for r in tr1 + ev1) == sorted(r.instruction for r in recs)
    _, ev3 = split_train_eval(recs, 0.2, seed=8)
    assert ev3 != ev1


def test_split_keeps_one_eval_record_and_rejects_bad_fractions():
    tr, ev = split_train_eval(_recs(3), 0.01, seed=0)
    assert len(ev) == 1 and len(tr) == 2
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="--eval_fraction"):
            split_train_eval(_recs(10), bad, seed=0)
    with pytest.raises(ValueError, match="leave 0 for training"):
        split_train_eval(_recs(1), 0.5, seed=0)


def test_shared_dolly_sample_parses():
    recs = read_dolly(DOLLY)
    assert len(recs) == 151
    assert sum(1 for r in recs if r.context) == 47


def _dataset_dir(tmp_path, n: int = 5) -> str:
    """A local directory laid out as the Hub repository databricks/databricks-dolly-15k (its one JSONL file),
    with a category on every record (the shipped sample has none)."""
    d = tmp_path / "databricks-dolly-15k"
    d.mkdir()
    with open(DOLLY, encoding="utf-8") as f, open(d / "databricks-dolly-15k.jsonl", "w", encoding="utf-8") as out:
        for i, line in zip(range(n), f):
            out.write(json.dumps({**json.loads(line), "category": ["open_qa", "closed_qa"][i % 2]}) + "\n")
    return str(d)


def test_a_dataset_directory_loads_through_the_datasets_library(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the datasets library (the test extra) is not installed")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    from aidaptiv_ds.finetune.data import load_records

    recs = load_records(_dataset_dir(tmp_path))
    want = read_dolly(DOLLY)[:5]
    assert [(r.instruction, r.context, r.response) for r in recs] == [(r.instruction, r.context, r.response)
                                                                      for r in want]
    assert [r.category for r in recs] == ["open_qa", "closed_qa"] * 2 + ["open_qa"]
    assert len(filter_category(recs, "closed_qa")) == 2
    assert load_records(DOLLY) == read_dolly(DOLLY)  # a file is read as JSONL, without datasets


def test_a_hub_id_goes_to_load_dataset_with_its_split(tmp_path, monkeypatch):
    """No network at test time: the Hub id is handed to ``datasets.load_dataset`` (replaced here by one that
    loads the local copy), with ``train`` or the split after the colon; a failed load names what to do."""
    datasets = pytest.importorskip("datasets", reason="the datasets library (the test extra) is not installed")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    from aidaptiv_ds.finetune import data

    local, calls = _dataset_dir(tmp_path), []
    real = datasets.load_dataset

    def hub(name, split):
        calls.append((name, split))
        if name != "databricks/databricks-dolly-15k":
            raise ConnectionError("no network")
        return real(local, split="train")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert len(data.load_records("databricks/databricks-dolly-15k")) == 5
    assert len(data.load_records("databricks/databricks-dolly-15k:train")) == 5
    assert calls == [("databricks/databricks-dolly-15k", "train")] * 2
    with pytest.raises(FileNotFoundError, match="needs the network the first time.*HF_DATASETS_OFFLINE=1"):
        data.load_records("someone/not-cached")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face dataset id"):
        data.load_records(str(tmp_path / "missing.jsonl"))


def test_a_dataset_row_that_is_not_a_dolly_record_is_named():
    from aidaptiv_ds.finetune.data import read_hf_dataset

    rows = [{"instruction": "a", "context": "", "response": "b"}, {"instruction": "a", "response": "b"}]
    with pytest.raises(DollyFormatError, match=r"org/ds\[test\]:2: missing field 'context'"):
        read_hf_dataset("org/ds:test", load_dataset=lambda name, split: rows)
    with pytest.raises(DollyFormatError, match="holds no records"):
        read_hf_dataset("org/ds", load_dataset=lambda name, split: [])
