"""Helpers of the end-to-end tests of launch/finetune.py: each run in a fresh interpreter (DeepSpeed keeps
global state), with the repository on PYTHONPATH and no launcher variables inherited."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AIDAPTIV_CFG = os.path.join(REPO, "ds_configs", "aidaptiv_zero3.json")


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        e.pop(k, None)
    e.update(extra)
    return e


def run(cmd: list[str], timeout: float = 600, check: bool = True, **extra_env) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=REPO, env=env(**extra_env), capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, f"{' '.join(cmd)} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def finetune(*args: str, timeout: float = 600, check: bool = True, **extra_env) -> subprocess.CompletedProcess:
    return run([sys.executable, os.path.join("launch", "finetune.py"), *args], timeout, check, **extra_env)


def lines(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(ln) for ln in f]


def step_lines(out_dir) -> list[dict]:
    return [ln for ln in lines(out_dir) if "loss" in ln and "eval_loss" not in ln and not ln.get("summary")]


def summary(out_dir) -> dict:
    s = [ln for ln in lines(out_dir) if ln.get("summary")]
    assert len(s) == 1, s
    return s[0]


def free_port() -> int:
    """A rendezvous port below the kernel's ephemeral range (:func:`aidaptiv_ds.ports.free_port`)."""
    from aidaptiv_ds.ports import free_port as below_ephemeral

    return below_ephemeral()


def deepspeed_cli() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.isfile(exe):
        exe = shutil.which("deepspeed")
    if not exe:
        pytest.skip("the deepspeed launcher script is not installed next to this python")
    return exe


def torchrun_cli() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.isfile(exe):
        exe = shutil.which("torchrun")
    if not exe:
        pytest.skip("torchrun is not installed next to this python")
    return exe
