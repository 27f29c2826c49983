"""What the CUDA tests share: the skip markers (with their reasons) and a stream delay that holds a
copy back long enough for the host to act while it is still pending.

Not a test module. Every test under ``tests/gpu/`` carries :data:`GPU` (the ``gpu`` marker and the
skip without CUDA); the hazard tests also carry :data:`ASYNC_COPIES`.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch


def no_cuda_reason() -> str | None:
    """Why these tests cannot run here, or None when a CUDA device is visible."""
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (f"no CUDA device: torch {torch.__version__} ({build}) sees none; these tests run on a GPU "
                f"machine (launch/gpu_check.sh OUTDIR runs them there)")
    return None


GPU = [pytest.mark.gpu, pytest.mark.skipif(no_cuda_reason() is not None, reason=no_cuda_reason() or "")]

ASYNC_COPIES = pytest.mark.skipif(
    os.environ.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"),
    reason="CUDA_LAUNCH_BLOCKING is set: every copy completes before the call returns, so a pending "
           "non-blocking copy cannot be observed; run with CUDA_LAUNCH_BLOCKING=0")


@functools.lru_cache(maxsize=1)
def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, measured with CUDA events."""
    torch.cuda._sleep(1_000_000)  # warm up (module load, clocks)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / max(start.elapsed_time(end), 1e-3)


def delay(stream: torch.cuda.Stream, ms: float = 300.0) -> None:
    """Queue ``ms`` milliseconds of GPU busy-wait on ``stream``: work queued behind it starts that much
    later, while the host runs on."""
    cycles = int(_cycles_per_ms() * ms)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


def fill_pattern(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill the bytes of contiguous host tensor ``t`` with a seeded random pattern (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    b = t.reshape(-1).view(torch.uint8)
    b.copy_(torch.randint(1, 256, (b.numel(),), dtype=torch.uint8, generator=g))
    return b.clone()
