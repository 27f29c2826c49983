"""Dolly-format instruction data: read and validate it, filter by category, split train/eval.

A Dolly record is one JSON object per line with the string fields ``instruction`` (non-empty),
``context`` (may be empty) and ``response`` (non-empty), and optionally ``category`` (a string).
Other keys are ignored. Blank lines are skipped.

``--data_path`` (:func:`load_records`) is a JSONL file, or a Hugging Face Hub dataset id such as
``databricks/databricks-dolly-15k`` (or a local directory laid out as such a dataset repository),
loaded with the ``datasets`` library (``pip install datasets``): its ``train`` split, or the one named
after a colon (``databricks/databricks-dolly-15k:train``); ``datasets`` caches the download under
``HF_HOME``, so a later run needs no network. The repository ships 151 Dolly records with their licence
notice (``data/dolly/``, CC BY-SA 3.0, from databricks-dolly-15k).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random

from ..errors import AidaptivError

REQUIRED_FIELDS = ("instruction", "context", "response")


class DollyFormatError(AidaptivError, ValueError):
    """A line of a Dolly JSONL file is not a valid record; the message names the file, line and field."""


@dataclasses.dataclass(frozen=True)
class DollyRecord:
    """One instruction example.

    Attributes:
        instruction: what the user asks (non-empty).
        context: optional supporting text ("" when absent).
        response: the answer the model learns to produce (non-empty).
        category: Dolly task category (e.g. ``"open_qa"``) or None when the file has none.
        line: 1-based line number in the source file (0 for records built in memory).
    """
    instruction: str
    context: str
    response: str
    category: str | None = None
    line: int = 0

    def to_json(self) -> dict:
        """The record as a Dolly JSON object (``category`` only when set)."""
        d = {"instruction": self.instruction, "context": self.context, "response": self.response}
        if self.category is not None:
            d["category"] = self.category
        return d


def parse_record(obj: object, source: str, line: int) -> DollyRecord:
    """Validate one decoded JSON value as a Dolly record.

    Args:
        obj: the decoded JSON value of one line.
        source: the file name used in error messages.
        line: 1-based line number, kept on the record and named in error messages.

    Raises:
        DollyFormatError: the value is not an object, a required field is missing or not a string,
            ``instruction``/``response`` is empty, or ``category`` is present and not a string/null.
    """
    where = f"{source}:{line}"
    if not isinstance(obj, dict):
        raise DollyFormatError(f"{where}: expected a JSON object with fields {', '.join(REQUIRED_FIELDS)}, "
                               f"got {type(obj).__name__}")
    for field in REQUIRED_FIELDS:
        if field not in obj:
            raise DollyFormatError(f"{where}: missing field '{field}' (a Dolly record needs "
                                   f"{', '.join(REQUIRED_FIELDS)}; use \"\" for an empty context)")
        if not isinstance(obj[field], str):
            raise DollyFormatError(f"{where}: field '{field}' must be a string, got {type(obj[field]).__name__} "
                                   f"{obj[field]!r:.60}")
    for field in ("instruction", "response"):
        if not obj[field].strip():
            raise DollyFormatError(f"{where}: field '{field}' is empty; every record needs a non-empty {field}")
    category = obj.get("category")
    if category is not None and not isinstance(category, str):
        raise DollyFormatError(f"{where}: field 'category' must be a string or absent, got "
                               f"{type(category).__name__} {category!r:.60}")
    return DollyRecord(obj["instruction"], obj["context"], obj["response"], category, line)


def read_dolly(path: str | os.PathLike) -> list[DollyRecord]:
    """Read every record of a Dolly JSONL file, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names the ``--data_path`` flag).
        DollyFormatError: a line is not valid JSON or not a valid record (file, line and field named),
            or the file holds no record at all.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data_path {path!r}: no such file; give a Dolly-format JSONL file "
                                f"(one JSON object per line with instruction, context, response)")
    records: list[DollyRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DollyFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            records.append(parse_record(obj, path, lineno))
    if not records:
        raise DollyFormatError(f"{path}: the file holds no records")
    return records


def _looks_like_hub_id(path: str) -> bool:
    """``org/name`` (optionally ``:split``): two parts of the Hub's allowed characters, not a local path."""
    name = path.split(":", 1)[0]
    parts = name.split("/")
    ok = lambda p: bool(p) and all(c.isalnum() or c in "-_." for c in p) and not p.startswith(".")  # noqa: E731
    return len(parts) == 2 and all(ok(p) for p in parts) and not path.endswith((".jsonl", ".json"))


def read_hf_dataset(spec: str, load_dataset=None) -> list[DollyRecord]:
    """Records of a Hugging Face dataset (a Hub id, or a local directory laid out as a dataset repository),
    through ``datasets.load_dataset(name, split=split)``; ``spec`` is ``name`` or ``name:split`` (default
    split ``train``). Every row is checked as a Dolly record (its row number named in errors).

    ``load_dataset``: the loader to call (default ``datasets.load_dataset``; tests pass their own).

    Raises:
        ImportError: ``datasets`` is not installed (names the install command).
        FileNotFoundError: the dataset cannot be loaded: not on the Hub, or no network and not in the
            cache (the message says how to get it, or to give a JSONL file).
        DollyFormatError: a row is not a Dolly record, or the split is empty.
    """
    name, _, split = spec.partition(":")
    split = split or "train"
    if load_dataset is None:
        try:
            from datasets import load_dataset
        except ImportError as e:
            raise ImportError(f"--data_path {spec!r} is a Hugging Face dataset; loading it needs the datasets "
                              f"library: pip install datasets (or give a Dolly-format JSONL file)") from e
    try:
        ds = load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds (connection, not found, bad split)
        raise FileNotFoundError(
            f"--data_path {spec!r}: datasets.load_dataset({name!r}, split={split!r}) failed: {type(e).__name__}: "
            f"{str(e)[:300]}. It needs the network the first time (then the cache under HF_HOME, also with "
            f"HF_DATASETS_OFFLINE=1); or give a local copy: the dataset's directory, or a Dolly-format JSONL file "
            f"(data/dolly/dolly_sample_151.jsonl ships with the repository)") from e
    where = f"{name}[{split}]"
    records = [parse_record(dict(row), where, i) for i, row in enumerate(ds, start=1)]
    if not records:
        raise DollyFormatError(f"{where}: the split holds no records")
    return records


def load_records(data_path: str | os.PathLike) -> list[DollyRecord]:
    """The records of ``--data_path``: a JSONL file (:func:`read_dolly`), or a Hub dataset id or the local
    directory of a dataset (:func:`read_hf_dataset`).

    Raises:
        FileNotFoundError: neither an existing file or directory nor a Hub id (names the accepted forms).
        ImportError, DollyFormatError: see :func:`read_hf_dataset` and :func:`read_dolly`.
    """
    path = os.fspath(data_path)
    if os.path.isfile(path):
        return read_dolly(path)
    if os.path.isdir(path) or _looks_like_hub_id(path):
        return read_hf_dataset(path)
    raise FileNotFoundError(f"--data_path {path!r}: no such file or directory, and not a Hugging Face dataset id "
                            f"(org/name[:split], e.g. databricks/databricks-dolly-15k); give a Dolly-format JSONL "
                            f"file (one JSON object per line with instruction, context, response), a dataset id, or "
                            f"the directory of a downloaded dataset")


def write_dolly(records: list[DollyRecord], path: str | os.PathLike) -> None:
    """Write records as Dolly JSONL (UTF-8, one object per line, keys in Dolly order)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")


def filter_category(records: list[DollyRecord], category: str | None) -> list[DollyRecord]:
    """Keep the records whose ``category`` equals ``category`` (all records when it is None).

    Raises:
        ValueError: no record matches; the message lists the categories present (or says the file
            has no category field) so the ``--category`` flag can be fixed.
    """
    if category is None:
        return list(records)
    kept = [r for r in records if r.category == category]
    if not kept:
        present = sorted({r.category for r in records if r.category is not None})
        have = f"categories present: {', '.join(present)}" if present else "no record has a 'category' field"
        raise ValueError(f"--category {category!r}: no record matches ({have}); drop the flag or pick one of those")
    return kept


def split_train_eval(records: list[DollyRecord], eval_fraction: float,
                     seed: int) -> tuple[list[DollyRecord], list[DollyRecord]]:
    """Deterministic held-out split: shuffle with ``random.Random(seed)``, the first part is eval.

    The eval split holds ``max(1, round(len(records) * eval_fraction))`` records; both splits keep
    the shuffled order. The same records, fraction and seed always give the same split.

    Raises:
        ValueError: ``eval_fraction`` is not in (0, 1), or the records are too few to leave at least
            one example on each side (the message names ``--eval_fraction`` and the counts).
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"--eval_fraction {eval_fraction}: must be > 0 and < 1 (e.g. 0.1); the held-out split "
                         f"gives the eval loss before and after training")
    n = len(records)
    n_eval = max(1, round(n * eval_fraction))
    if n - n_eval < 1:
        raise ValueError(f"--eval_fraction {eval_fraction}: {n} record(s) leave {n - n_eval} for training; "
                         f"use more records or a smaller fraction")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [records[i] for i in order[n_eval:]], [records[i] for i in order[:n_eval]]
