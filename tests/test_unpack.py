"""``aidaptiv-ds unpack``: safetensors streamed into the store once; a run then starts from the store."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _oracle import REPO, STORIES, STORIES_ABSENT, run
from safetensors.torch import save_file

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

MiB = 1 << 20


def ds_config(path, cache, run_name, bf16=True):
    cfg = {"bf16": {"enabled": bf16}, "zero_optimization": {"stage": 3},
           "aidaptiv": {"cache_paths": [str(cache)], "run_name": run_name}}
    path.write_text(json.dumps(cfg))
    return str(path)


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aidaptiv_ds.cli.main", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=600)


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
def test_training_starts_from_the_unpacked_store(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    p = cli("unpack", STORIES, "--deepspeed", ds_config(tmp_path / "ds.json", cache, "stories-u"), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["tensors"] == 47 and out["bytes_written"] > 0 and out["raw_write_gbps"]
    ref = run("aidaptiv", ["--model", "stories", "--zinit", "--dtype", "bf16", "--steps", "4"], str(tmp_path / "ref"))
    args = ["--model", "stories_config", "--zinit", "--dtype", "bf16", "--steps", "4",
            "--extra", json.dumps({"run_name": "stories-u", "from_unpacked": True})]
    # the run reads the weights from the store: its --cache is the unpack's cache path
    first = run("aidaptiv", args, str(tmp_path), env={})
    assert first["losses"] == ref["losses"]
    again = run("aidaptiv", args, str(tmp_path), env={})  # the unpacked copy stays as it was
    assert again["losses"] == ref["losses"]


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
def test_world_size_mismatch_is_named(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    assert cli("unpack", STORIES, "--deepspeed", ds_config(tmp_path / "ds.json", cache, "u2"),
               "--world-size", "2").returncode == 0
    with pytest.raises(AssertionError, match="unpacked for world size 2, this run has 1"):
        run("aidaptiv", ["--model", "stories_config", "--zinit", "--dtype", "bf16", "--steps", "1",
                         "--extra", json.dumps({"run_name": "u2", "from_unpacked": True})], str(tmp_path))


def test_unpack_streams_one_tensor_at_a_time(tmp_path):
    """Peak RSS under twice the largest tensor plus a fixed margin (the interpreter and torch)."""
    model = tmp_path / "model"
    model.mkdir()
    big = 256 * MiB
    g = torch.Generator().manual_seed(0)
    for k in range(3):  # three shards: 3 x (256 MiB + small) on disk, one tensor in memory at a time
        save_file({f"layer{k}.weight": torch.randn(big // 4, generator=g), f"layer{k}.bias": torch.randn(1000)},
                  str(model / f"model-{k:05d}.safetensors"))
    cache = tmp_path / "cache"
    cache.mkdir()
    cfg = ds_config(tmp_path / "ds.json", cache, "big", bf16=False)
    rss = "import resource; print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    base = subprocess.run([sys.executable, "-c", f"import torch, safetensors, aidaptiv_ds.cli.main; {rss}"],
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True)
    baseline = int(base.stdout.split("RSS")[-1])
    code = (f"from aidaptiv_ds.cli.main import main; "
            f"main(['unpack', {str(model)!r}, '--deepspeed', {cfg!r}, '--world-size', '2', '--json']); {rss}")
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    peak = int(p.stdout.split("RSS")[-1])
    margin = baseline + 256 * MiB  # the interpreter + torch, and staging of one partition per rank
    print(f"unpack peak RSS {peak / MiB:.0f} MiB; largest tensor {big / MiB:.0f} MiB; baseline {baseline / MiB:.0f} MiB")
    assert peak < 2 * big + margin
    out = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    assert out["bytes_written"] >= 3 * big
