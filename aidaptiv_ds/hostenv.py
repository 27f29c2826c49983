"""Settings a training process needs before PyTorch allocates anything (this module imports no torch).

[Note: PyTorch's huge pages] PyTorch backs each CPU allocation of 2 MiB or more with transparent huge
pages (``madvise(MADV_HUGEPAGE)`` on a 2 MiB-aligned block) when ``THP_MEM_ALLOC_ENABLE=1`` is in the
environment at its first allocation (``c10/core/impl/alloc_cpu.cpp``: read once). A DRAM budget of 0
keeps no freed heap, so DeepSpeed's gathered parameters, gradient-norm copies and the optimizer's
temporaries are fresh memory every step and page-fault in 4 KiB at a time where the kernel's THP mode
is ``madvise``; aidaptiv_ds advises its own buffers itself (:func:`aidaptiv_ds.io.buffers.advise_huge_pages`).
Measured on the 148M fp32 Llama at budget 0 (README): 5.7-5.9 s per step with neither, 4.3-5.0 s with our
buffers advised, 4.1-4.2 s with ``THP_MEM_ALLOC_ENABLE=1`` as well, peak RSS unchanged. The package's
launchers (``python -m aidaptiv_ds.run``, ``launch/finetune.py``, the benchmark workers) set it unless the
environment already has it; a script started otherwise needs ``export THP_MEM_ALLOC_ENABLE=1``.
"""
from __future__ import annotations

import os

#: PyTorch's switch for huge-page CPU allocations.
TORCH_HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages(environ=None) -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` in ``environ`` (default ``os.environ``) unless it is set already.
    Returns whether it is ``1`` now. Effective only before PyTorch's first CPU allocation in the process
    that reads it (a child process started with ``environ`` always sees it)."""
    env = os.environ if environ is None else environ
    env.setdefault(TORCH_HUGE_PAGES_ENV, "1")
    return env.get(TORCH_HUGE_PAGES_ENV) == "1"
