"""The norm scratch (:mod:`aidaptiv_ds.integration.grad_norms`) gives DeepSpeed's per-partition gradient norm,
bit for bit, from one reused buffer."""
from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.utils import get_norm_dtype

from aidaptiv_ds.integration.grad_norms import NormScratch


def _deepspeed(t, buffer_size):
    """DeepSpeed's own method (the class may be our subclass where the package is installed)."""
    cls = next(c for c in DeepSpeedZeroOptimizer_Stage3.__mro__ if c.__module__.startswith("deepspeed."))
    return cls._constant_buffered_norm2(None, t, buffer_size)  # self is unused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scratch_norm_is_deepspeeds(dtype):
    scratch = NormScratch()
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3_000_017, generator=g).to(dtype)
    for n, off, split in [(1, 0, 250_000_000), (1000, 3, 250_000_000), (2_999_000, 17, 250_000_000),
                          (1_000_003, 5, 65_536), (77, 0, 10)]:
        t = base[off:off + n]
        got = scratch.norm2(t, split, get_norm_dtype())
        assert got is not None and got.dtype == torch.float64
        assert torch.equal(got, _deepspeed(t, split)), (n, off, split)
    assert scratch.nbytes >= 2_999_000 * 8  # grew to the largest split, then reused
    scratch.release()
    assert scratch.nbytes == 0


def test_scratch_steps_aside():
    scratch = NormScratch(max_numel=100)
    assert scratch.norm2(torch.ones(101), 250_000_000, torch.float64) is None  # above the cap
    assert scratch.norm2(torch.ones(10, dtype=torch.float64), 250_000_000, torch.float64) is None
    assert scratch.norm2(torch.ones(10, dtype=torch.int32), 250_000_000, torch.float64) is None
    assert torch.equal(scratch.norm2(torch.ones(101), 100, torch.float64), _deepspeed(torch.ones(101), 100))
    assert scratch.nbytes == 0 or scratch.nbytes >= 800
