"""Shared helpers of the storage-core tests (io engine, store, aio adapter, bench).

Not a test module (leading underscore). Test files import it as ``import _storage_helpers`` (pytest
puts ``tests/`` on ``sys.path`` for rootdir-relative test modules without ``__init__.py``).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import torch

from aidaptiv_ds.ports import free_port  # noqa: F401 - the tests import it from here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def rand_tensor(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random CPU tensor of ``numel`` elements; every byte pattern is likely (NaN bit patterns too)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = dtype.itemsize
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, dtype-agnostic) of two contiguous tensors."""
    if a.numel() * a.element_size() != b.numel() * b.element_size():
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def make_dirs(root, n: int) -> list[str]:
    out = []
    for i in range(n):
        d = os.path.join(str(root), f"cache{i}")
        os.makedirs(d, exist_ok=True)
        out.append(d)
    return out


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("AIDAPTIV_FAULTS", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_child(code: str, timeout: float = 180, **env) -> dict:
    """Run ``code`` in a fresh interpreter; it must print one line ``RESULT <json>``. Returns the JSON.

    Raises AssertionError with the child's output when it fails or prints no result.
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=child_env(**env),
                       capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child failed (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])
