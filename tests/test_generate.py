"""``launch/generate.py`` and ``aidaptiv-ds kv-cache``: a prompts file through the prefix KV cache, across a
process restart and with ZeRO-Inference weights on the cache path; the same output ids as plain generate."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _oracle import REPO, STORIES, free_port

pytestmark = [pytest.mark.subprocess,  # every test here starts a child process (tests/conftest.py)
              pytest.mark.skipif(not os.path.isdir(STORIES), reason=f"real model not found at {STORIES}")]
SCRIPT = os.path.join(REPO, "launch", "generate.py")


def prompt_file(path) -> str:
    words = "the cat sat on a mat and then one day a little girl named lily found a big red ball".split()
    ctx = " ".join(words[(i * 7) % len(words)] for i in range(120))
    with open(path, "w") as f:
        for q in ("Once upon a time", "The dog was happy", "Lily and Tom"):
            f.write(json.dumps({"prompt": ctx + " " + q}) + "\n")
    return str(path)


def generate(tmp_path, name, *args) -> dict:
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=REPO, MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, SCRIPT, "--model_name_or_path", STORIES, "--prompt_file",
                        prompt_file(tmp_path / "prompts.jsonl"), "--max_new_tokens", "12", "--block_tokens", "16",
                        "--json", str(out), *args], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{name}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(out.read_text())


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aidaptiv_ds.cli.main", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=300)


def test_generate_reuses_the_prefix_from_dram_then_from_the_drive_after_a_restart(tmp_path):
    kv = str(tmp_path / "kv")
    ref = generate(tmp_path, "plain")
    first = generate(tmp_path, "first", "--kv_cache_path", kv)
    second = generate(tmp_path, "second", "--kv_cache_path", kv)  # a new process: the cache is on the drive
    ids = [r["output_ids"] for r in ref["prompts"]]
    assert [r["output_ids"] for r in first["prompts"]] == ids == [r["output_ids"] for r in second["prompts"]]
    assert [r["kv_source"] for r in first["prompts"]] == ["computed", "dram", "dram"]
    assert [r["kv_source"] for r in second["prompts"]] == ["drive", "dram", "dram"]
    n = first["prompts"][0]["prompt_tokens"]
    shared = min(r["prompt_tokens"] for r in first["prompts"]) - 4  # the questions differ in the last tokens
    assert first["prompts"][1]["prefix_tokens_reused"] >= shared // 16 * 16 - 16
    assert second["prompts"][0]["prefix_tokens_reused"] == (n - 1) // 16 * 16
    assert all(r["ttft_s"] > 0 for r in first["prompts"])
    assert second["bytes_written"].get("kv_cache", 0) == 0  # every block was there: a hit writes nothing
    assert sum(r["blocks_written"] for r in second["prompts"]) == 0

    p = cli("kv-cache", "--cache", kv, "--json")
    assert p.returncode == 0, p.stderr
    (row,) = json.loads(p.stdout)
    assert row["blocks"] == first["kv_cache"]["blocks"] and row["dtype"] == "float32" and not row["live"]
    assert row["layout"]["block_tokens"] == 16 and row["ledger_bytes_written"] > 0
    p = cli("kv-cache", "--cache", kv)
    assert "blocks" in p.stdout and "stories260K" in p.stdout
    p = cli("gc", "--cache", kv, "--delete")
    assert "kv-cache" in p.stdout and os.path.isdir(row["dir"])  # gc keeps KV caches
    p = cli("kv-cache", "--cache", kv, "--clear")
    assert p.returncode == 0 and not os.path.exists(row["dir"])
    assert "no KV cache" in cli("kv-cache", "--cache", kv).stdout


def test_generate_with_zero_inference_weights_on_the_cache_path(tmp_path):
    ref = generate(tmp_path, "plain")
    got = generate(tmp_path, "zi", "--deepspeed", os.path.join(REPO, "ds_configs", "aidaptiv_inference.json"),
                   "--cache_path", str(tmp_path / "weights"), "--dram_budget", "0", "--kv_cache_path",
                   str(tmp_path / "kv"))
    assert [r["output_ids"] for r in got["prompts"]] == [r["output_ids"] for r in ref["prompts"]]
    assert got["aidaptiv"] and got["zero_inference"]["params_resident"] is False
    assert [r["kv_source"] for r in got["prompts"]] == ["computed", "dram", "dram"]


def test_bad_prompt_file_and_foreign_kv_cache_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    p = subprocess.run([sys.executable, SCRIPT, "--model_name_or_path", STORIES, "--prompt_file", str(bad)],
                       env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "line 2: no string \"prompt\" field" in p.stderr
    kv = str(tmp_path / "kv")
    generate(tmp_path, "fp32", "--kv_cache_path", kv)
    out = tmp_path / "bf16.json"
    p = subprocess.run([sys.executable, SCRIPT, "--model_name_or_path", STORIES, "--prompt_file",
                        str(tmp_path / "prompts.jsonl"), "--kv_cache_path", kv, "--dtype", "bf16", "--block_tokens",
                        "16", "--json", str(out)], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode != 0 and "dtype: written as float32, this run uses bfloat16" in p.stderr
    assert "aidaptiv-ds kv-cache --cache" in p.stderr
