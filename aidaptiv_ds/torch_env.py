"""PyTorch's huge pages for its own CPU allocations: a setting PyTorch reads once, at ``import torch``,
worth setting for runs whose freed host memory is not kept (a DRAM budget of 0). Importing this module
imports nothing heavy.

[Note: PyTorch's huge pages, and why aidaptiv_ds does not set them for you]
Without heap reuse (a budget of 0: :func:`aidaptiv_ds.io.heap.return_freed_host_memory`) every allocation
above the return policy's mmap threshold (1 MiB, then 32 MiB, 1 GiB since 2026-12-04), and every block of the
heap after the runtime's trim at each phase's end, is fresh memory that page-faults in, 4 KiB at a time: 13.4
ms to allocate and fill 64 MiB on this project's VM against 1.3 ms for memory already mapped. aidaptiv_ds
advises its own buffers to use transparent huge pages (:func:`aidaptiv_ds.io.buffers.advise_huge_pages`);
PyTorch does the same for every CPU allocation of 2 MiB or more when ``THP_MEM_ALLOC_ENABLE=1``
(``c10/core/impl/alloc_cpu.cpp``: 2 MiB alignment and ``madvise(MADV_HUGEPAGE)``): 5.2 ms for the same 64 MiB.
Measured at 148M fp32, budget 0 (``launch/compare.py``, 2026-12-04, two interleaved pairs): steps of 3.01 /
3.13 s with it against 4.44 / 3.36 s without, peak RSS 2.58-2.82 against 2.55-2.57 GiB. Measured again with the 1 GiB
threshold's predecessor, two interleaved pairs later that day (``THP_MEM_ALLOC_ENABLE=0`` against 1): 2.79 / 2.60
against 2.62 / 3.04 s, no difference either way, 4 KiB faults five times as many (``docs/profiling.md``).

Where the freed heap is kept (DeepSpeed's offload backends, and aidaptiv_ds at ``auto`` when the budget
holds the working windows) it does not pay and can cost: DeepSpeed's CPU offload, fp32, ran 2.39-2.46 s
in three of six runs with it against 1.67-1.76 s in every run without; aidaptiv_ds at ``auto`` 1.99 against
1.79 s (fp32) and 1.26 against 1.28 s (bf16). PyTorch reads the variable at its first allocation, during
``import torch``; setting it later does nothing (probed: still 15.9 ms for the 64 MiB), and the heap policy
is only known once the runtime has the plan, long after. So the runtime logs the advice where it applies
(:func:`huge_pages_advice`) and ``launch/compare.py`` sets it for the budget-0 backends only.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

#: the environment that turns PyTorch's huge pages on (see the note above)
TORCH_HUGE_PAGES_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def torch_huge_pages_env(base: Mapping[str, str]) -> dict[str, str]:
    """The entries of :data:`TORCH_HUGE_PAGES_ENV` that the environment ``base`` does not set already.

    Args:
        base: an environment (``os.environ`` or a child process's dict).

    Returns:
        A new dict, empty where ``base`` sets every key (the user's choice wins).
    """
    return {k: v for k, v in TORCH_HUGE_PAGES_ENV.items() if k not in base}


def torch_huge_pages_on(environ: Mapping[str, str] | None = None) -> bool:
    """True when PyTorch was started with its huge pages on (``THP_MEM_ALLOC_ENABLE`` truthy in ``environ``,
    default ``os.environ``: what this process's PyTorch read, unless the variable was changed since)."""
    env = os.environ if environ is None else environ
    return env.get("THP_MEM_ALLOC_ENABLE", "").strip().lower() in ("1", "true", "yes", "on")


def huge_pages_advice(heap_kept: bool, kernel_mode: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The one-line advice to start PyTorch with huge pages, or None where it does not apply.

    Args:
        heap_kept: whether this process keeps freed host memory for reuse (then huge pages do not pay).
        kernel_mode: the kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``; None unknown).
        environ: the environment PyTorch started with (default ``os.environ``).
    """
    if heap_kept or kernel_mode not in ("madvise", "always") or torch_huge_pages_on(environ):
        return None
    return ("aidaptiv_ds: this run returns freed host memory (DRAM budget below the working windows), so PyTorch's "
            "large temporaries page-fault in 4 KiB at a time; start the run with THP_MEM_ALLOC_ENABLE=1 in the "
            "environment for huge pages (148M fp32 at budget 0: 3.0-3.1 s per step against 3.4-4.4 s; "
            "aidaptiv_ds/torch_env.py)")


def kernel_huge_page_mode(sys_root: str = "/sys") -> str | None:
    """The kernel's transparent-huge-page mode (the bracketed word of
    ``/sys/kernel/mm/transparent_hugepage/enabled``), None where unreadable."""
    try:
        with open(os.path.join(sys_root, "kernel/mm/transparent_hugepage/enabled")) as f:
            text = f.read()
    except OSError:
        return None
    if "[" in text and "]" in text:
        return text[text.index("[") + 1:text.index("]")]
    return None
