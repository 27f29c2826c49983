"""Run ``tests/scripts/train_oracle.py`` in subprocesses and compare backends (shared by integration tests).

Not a test module. Each run is a fresh process (DeepSpeed keeps global state); results of the CPU
oracle are cached per argument list within a pytest session.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from aidaptiv_ds.ports import free_port  # noqa: F401 - the tests import it from here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "train_oracle.py")
SHARED = os.path.join(REPO, "..", "shared")
STORIES = os.path.join(SHARED, "data", "models", "stories260K", "hf")
#: why tests of the real model skip without it: where it comes from (it is not shipped with the repository)
STORIES_ABSENT = (f"real model not found at {os.path.normpath(STORIES)}: stories260K (Karpathy's llama2.c "
                  f"tinyllamas checkpoint, MIT) converted to HF, from the project's shared data next to the "
                  f"repository (../shared/data/models/stories260K, whose NOTICE names the source of the bytes); "
                  f"a clone without ../shared skips these tests")
_CACHE: dict[tuple, dict] = {}


def command(backend: str, args: list[str], workdir: str, env: dict | None = None) -> tuple[list[str], dict, str]:
    """``(argv, environment, result path)`` of one training run of ``backend`` in ``workdir`` (created);
    what :func:`run` starts, and what ``launch/gpu_check.py`` starts several of at once."""
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, f"{backend}.pt")
    e = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=REPO, AIDAPTIV_DS_NO_AUTOINSTALL="")
    e.update(env or {})
    cmd = [sys.executable, SCRIPT, "--backend", backend, "--cache", os.path.join(workdir, "cache"), "--out", out,
           *args]
    return cmd, e, out


def run(backend: str, args: list[str], workdir: str, env: dict | None = None, timeout: int = 600) -> dict:
    """Train with ``backend`` and return the result dict (losses, params, masters, io, ...).

    Raises:
        AssertionError: with the child's output tail when it fails.
    """
    cmd, e, out = command(backend, args, workdir, env)
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{backend} run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


def oracle(args: list[str], tmp_root: str) -> dict:
    """DeepSpeed's CPU-offload result for ``args`` (cached for the session)."""
    key = tuple(args)
    if key not in _CACHE:
        _CACHE[key] = run("cpu", args, os.path.join(tmp_root, f"cpu{len(_CACHE)}"))
    return _CACHE[key]


def cuda_oracle_args(dtype: str) -> list[str]:
    """The training arguments of the GPU oracle (``tests/gpu/test_cuda_oracle.py``, ``launch/gpu_check.py``):
    the small tied Llama, 6 optimizer steps of gradient accumulation 2, clipping at 1.0, sub-groups of
    2e5 elements (several, so half a budget keeps some in DRAM), eager attention and deterministic
    kernels (a CUDA run then repeats bit for bit)."""
    return ["--model", "llama", "--dtype", dtype, "--steps", "6", "--ga", "2", "--clip", "1.0",
            "--sub_group_size", "2e5", "--attn", "eager", "--deterministic"]


def llama_shape(hidden: int = 256, layers: int = 2):
    """The :class:`~aidaptiv_ds.bench.models.LlamaShape` of ``train_oracle.py --model llama`` (its
    ``llama_config``: vocabulary 512, MLP 2 x hidden + 24, 4 heads, 2 key/value heads, tied)."""
    from aidaptiv_ds.bench.models import LlamaShape

    return LlamaShape(hidden, 2 * hidden + 24, layers, 4, 2, vocab=512, tie=True, max_positions=128)


def half_state_budget(dtype: str, hidden: int = 256, layers: int = 2) -> int:
    """Half the ZeRO-3 + Adam training state of that Llama in bytes (parameter + fp32 gradient, master
    and two moments per parameter, :meth:`LlamaShape.state_bytes`): a DRAM budget that keeps part of
    the state in DRAM and sends the rest through the cache path."""
    return llama_shape(hidden, layers).state_bytes(dtype) // 2


def differences(ref: dict, got: dict) -> list[str]:
    """What differs between two results, bit for bit: losses, gathered parameters (every name of
    either), fp32 master partitions; ``[]`` when identical. Each entry names the item and, for a
    tensor, the largest absolute difference."""
    out = []
    if got["losses"] != ref["losses"]:
        out.append(f"losses differ:\n oracle {ref['losses']}\n ours   {got['losses']}")
    names = sorted(set(ref["params"]) | set(got["params"]))
    for name in names:
        a, b = ref["params"].get(name), got["params"].get(name)
        if a is None or b is None:
            out.append(f"parameter {name} missing in {'the oracle' if a is None else 'ours'}")
        elif a.shape != b.shape:
            out.append(f"parameter {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
        elif not torch.equal(a, b):
            out.append(f"parameter {name} differs (max abs diff {(a - b).abs().max().item():.3e})")
    if len(ref["masters"]) != len(got["masters"]):
        out.append(f"{len(ref['masters'])} fp32 master partitions in the oracle, {len(got['masters'])} in ours")
    for i, (a, b) in enumerate(zip(ref["masters"], got["masters"], strict=False)):  # lengths: above
        if a.shape != b.shape or not torch.equal(a, b):
            out.append(f"fp32 master partition of sub-group {i} differs")
    return out


def assert_identical(ref: dict, got: dict) -> None:
    """Losses, gathered parameters and fp32 master partitions equal bit for bit."""
    diff = differences(ref, got)
    assert not diff, "\n".join(diff)


def assert_close_to_rounded_oracle(ref: dict, got: dict, lr: float, steps: int,
                                   model_dtype: torch.dtype = torch.float32, per_step: float = 0.01) -> None:
    """The fused tile's tolerance ([Note: not torch's bits] in ``tiers/fused_adam.py``): every fp32 master and
    gathered parameter within ``1e-6`` relative (two steps of ``model_dtype``: the model's rounding of masters
    that differ) plus ``per_step`` (1%) of ``lr`` per step of the rounded-moment oracle (a wrong formula moves a
    parameter by about ``lr`` per step), and every loss within 1e-4 relative."""
    tol = per_step * lr * steps
    for a, b in zip(ref["masters"], got["masters"], strict=True):
        assert ((a - b).abs() - 1e-6 * a.abs()).max().item() <= tol
    for name, a in ref["params"].items():
        rel = 1e-6 if model_dtype == torch.float32 else 2 * torch.finfo(model_dtype).eps  # masters apart round apart
        d = ((a.float() - got["params"][name].float()).abs() - rel * a.float().abs()).max().item()
        assert d <= tol, (name, d)
    for x, y in zip(ref["losses"], got["losses"], strict=True):  # each step's micro-batch losses
        assert all(abs(p - q) <= 1e-4 * abs(p) for p, q in zip(x, y, strict=True)), (ref["losses"], got["losses"])


def assert_resume_exact(args: list[str], tmp_path, save_after: int = 2) -> None:
    """Train ``args`` on our backend whole, and again saving a checkpoint after ``save_after`` steps and resuming
    from it in a new process: the resumed losses, parameters and fp32 masters equal the whole run's, bit for bit."""
    whole = run("aidaptiv", args, str(tmp_path / "whole"))
    ckpt = str(tmp_path / "ckpt")
    run("aidaptiv", args + ["--ckpt_dir", ckpt, "--save_after", str(save_after)], str(tmp_path / "first"))
    resumed = run("aidaptiv", args + ["--ckpt_dir", ckpt, "--resume"], str(tmp_path / "second"))
    assert resumed["losses"] == whole["losses"][save_after:]
    for name, t in whole["params"].items():
        assert torch.equal(t, resumed["params"][name]), name
    for a, b in zip(whole["masters"], resumed["masters"], strict=True):
        assert torch.equal(a, b)
    assert os.path.isdir(ckpt)


def written_per_param_per_step(res: dict, skip: int = 1) -> float:
    """Cache-tier bytes written per parameter per optimizer step, steps after the first ``skip``."""
    steps = res["io"][skip:]
    return sum(d["bytes_written"].get("cache", 0) for d in steps) / len(steps) / res["nparams"]


def proc_written_per_param_per_step(res: dict, skip: int = 1) -> float:
    """The same from ``/proc/self/io`` write_bytes (what reached the block layer)."""
    steps = res["io"][skip:]
    return sum(d["proc_write_bytes"] for d in steps) / len(steps) / res["nparams"]
