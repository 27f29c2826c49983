"""PEFT LoRA under ZeRO-3, as users fine-tune with it: a frozen base model (its parameters offloaded, in no
optimizer sub-group), LoRA adapters trained, activation checkpointing, gradient accumulation 2 and every knob
the config leaves out at DeepSpeed's default (clipping 1.0, ``sub_group_size``, the persistence threshold).
aidaptiv_ds trains exactly like DeepSpeed's CPU offload, a checkpoint saved, loaded into a new engine
and trained on goes on as if never stopped (on aidaptiv_ds, and on DeepSpeed's CPU offload), and DeepSpeed's
``zero_to_fp32`` (its function in a process that
imports only DeepSpeed, and the script DeepSpeed copies beside the save) reads our checkpoint as it reads
DeepSpeed's own: the same frozen, trainable and tied weights, bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
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
    # ours trains 3 steps, saves, loads into a new engine and trains 3 more: every micro-batch's loss, the eval and
    # the weights equal DeepSpeed's CPU offload trained 6 steps straight
    got, want = lora_run(ours, tmp_path, "ours_resumed", "resume"), lora_run(ref, tmp_path, "cpu", "straight")
    assert got["optimizer_swapper"] == "AidaptivOptimizerSwapper"
    assert len(got["losses"]) == 12 and got["losses"] == want["losses"]
    assert got["eval"] == want["eval"] and got["sums"] == want["sums"]
    assert len(got["sums"]) == 1 + 5 * 2 * 2  # the frozen base tensor; A and B of q and v in 5 layers
    assert got["losses"][-1] < got["losses"][0]  # the adapters learn
    assert got["continued"] == got["losses"][6:]  # the engine that saved trains on unchanged by its save
    lora_run(ref, tmp_path, "cpu_resumed", "resume")  # DeepSpeed's own checkpoint of the same step
    # DeepSpeed's CPU offload resumes from our checkpoint (its .pt files refer to our masters and moments) and
    # trains on exactly as we do (before, it loaded the masters and zero moments without a word)
    back = lora_run(ref, tmp_path, "cpu_from_ours", "from:" + str(tmp_path / "ours_resumed" / "ckpt"))
    assert back["losses"] == got["losses"][6:] and back["eval"] == got["eval"] and back["sums"] == got["sums"]
    ours_sd = _zero_to_fp32(tmp_path / "ours_resumed" / "ckpt", tmp_path / "ours_fp32.pt")
    ref_sd = _zero_to_fp32(tmp_path / "cpu_resumed" / "ckpt", tmp_path / "cpu_fp32.pt")
    assert sorted(ours_sd) == sorted(ref_sd) and len(ours_sd) == 68  # 47 frozen, 20 adapters, the tied LM head
    for k, v in ref_sd.items():
        assert ours_sd[k].dtype == v.dtype and torch.equal(ours_sd[k], v), k
    script = tmp_path / "ours_resumed" / "ckpt" / "zero_to_fp32.py"  # DeepSpeed's copy, run as users run it
    # its default output (its --safe_serialization refuses the tied LM head, on DeepSpeed's own checkpoint too)
    p = subprocess.run([sys.executable, str(script), str(script.parent), str(tmp_path / "ours_out")],
                       env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    exported = torch.load(str(tmp_path / "ours_out" / "pytorch_model.bin"), weights_only=True)
    assert sorted(exported) == sorted(ref_sd) and all(torch.equal(exported[k], ref_sd[k]) for k in ref_sd)


def _zero_to_fp32(ckpt, out) -> dict:
    """DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` of ``ckpt`` in a child process that imports only
    DeepSpeed (aidaptiv_ds importable, not imported), saved to ``out`` and loaded here."""
    code = ("import sys, torch\n"
            "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n"
            "assert 'aidaptiv_ds' not in sys.modules\n"
            "torch.save(get_fp32_state_dict_from_zero_checkpoint(sys.argv[1]), sys.argv[2])\n")
    p = subprocess.run([sys.executable, "-c", code, str(ckpt), str(out)], env=dict(os.environ, PYTHONPATH=REPO),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(str(out), weights_only=True)
