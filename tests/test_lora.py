"""PEFT LoRA under ZeRO-3, as users fine-tune with it: a frozen base model (its parameters offloaded, in no
optimizer sub-group), LoRA adapters trained, activation checkpointing, gradient accumulation 2 and every knob
the config leaves out at DeepSpeed's default (clipping 1.0, ``sub_group_size``, the persistence threshold).
aidaptiv_ds trains exactly like DeepSpeed's CPU offload, and a checkpoint saved, loaded into a new engine
and trained on goes on as if never stopped."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _oracle import REPO, STORIES, STORIES_ABSENT, free_port

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

SCRIPT = os.path.join(REPO, "tests", "scripts", "lora_train.py")


def lora_run(cfg: dict, tmp_path, name: str, mode: str) -> dict:
    """``tests/scripts/lora_train.py`` in a child process on ``cfg``; its RESULT."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / name
    out.mkdir()
    # MKL alignment-independent in both runs (aidaptiv_ds/bench/runner.py REPRODUCIBLE_MKL)
    env = dict(os.environ, PYTHONPATH=REPO, MASTER_PORT=str(free_port()), MKL_DYNAMIC="FALSE",
               MKL_CBWR="AUTO,STRICT")
    p = subprocess.run([sys.executable, SCRIPT, STORIES, str(path), str(out), mode], env=env, capture_output=True,
                       text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-5000:]
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
def test_lora_trains_and_resumes_like_deepspeeds_cpu_offload(tmp_path):
    pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
    cache = tmp_path / "cache"
    cache.mkdir()
    nvme = {"device": "nvme", "nvme_path": str(cache)}
    common = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    ours = {**common, "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme},
            "aidaptiv": {"enabled": True, "cache_paths": [str(cache)], "dram_budget": 0}}
    ref = {**common, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                           "offload_optimizer": {"device": "cpu"}}}
    got, want = lora_run(ours, tmp_path, "ours", "straight"), lora_run(ref, tmp_path, "cpu", "straight")
    assert got["optimizer_swapper"] == "AidaptivOptimizerSwapper"
    assert len(got["losses"]) == 12 and got["losses"] == want["losses"]
    assert got["eval"] == want["eval"] and got["sums"] == want["sums"]
    assert len(got["sums"]) == 1 + 5 * 2 * 2  # the frozen base tensor; A and B of q and v in 5 layers
    assert got["losses"][-1] < got["losses"][0]  # the adapters learn
    resumed = lora_run(ours, tmp_path, "ours_resumed", "resume")
    assert resumed["losses"] == got["losses"] and resumed["eval"] == got["eval"] and resumed["sums"] == got["sums"]
