"""glibc's policy for large host allocations: keep freed blocks in the heap for reuse, or give them back to
the OS on free.

[Note: two policies]
glibc serves an allocation above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` region and unmaps it on free;
below it, from the heap, which returns its top to the OS only when more than ``M_TRIM_THRESHOLD`` is free
there. By default the mmap threshold adapts (128 KiB up to 32 MiB, raised to the size of each large block
freed). A rank picks one policy for the whole process (``io.reuse_host_memory``):

* *reuse* (:func:`reuse_freed_host_memory`): thresholds high, freed swap buffers stay for the next like
  allocation; the heap then holds the high-water mark of buffers live at once, which must fit in the DRAM
  budget (``Runtime.settle_host_memory_reuse``).
* *return* (:func:`return_freed_host_memory`, a DRAM budget of 0): thresholds fixed, every block of
  :data:`RETURN_MMAP_BYTES` or more is its own mapping and goes back on free, the heap's top is trimmed
  above :data:`RETURN_TRIM_BYTES`, and the runtime gives the whole free heap back after each backward and
  each step (``Runtime.end_of_step``), so what stays is bounded by the smaller blocks live within a phase.
  The price is a page fault on first use of each page of each large block.

[Note: the return threshold]
It was 1 MiB while our own swap buffers (a few MiB each) came from ``malloc``: in the heap their
interleaved lifetimes fragmented it (169M fp32 at budget 0: 0.6 GiB more in backward at glibc's adaptive
default). Since they come from the buffer pool (``io/pool.py``), what ``malloc`` serves is PyTorch's and
DeepSpeed's own: activations, ``matmul`` outputs, weight gradients of 2-8 MiB, the reduce's ``torch.cat``.
At 1 MiB each of those was a fresh mapping per use. At 32 MiB (glibc's own ceiling for its adaptive
threshold, ``DEFAULT_MMAP_THRESHOLD_MAX``) they are reused from the heap within a phase. Measured on the
148M fp32 Llama at budget 0, nine interleaved pairs (``launch/compare.py --backends aidaptiv0``, 6-7 steps,
2026-12-04): median step 3.26 s against 3.46 s at 1 MiB, 32 MiB faster in 6 of the 9 pairs (this VM's
step-to-step spread is 2.5-4.7 s, so no pair alone decides), peak RSS 3.07-3.16 against 2.94-3.02 GiB;
the planner's figure against the peak RSS of ``tests/test_plan_host_vs_rss.py`` (42M/93M/169M bf16):
-9% / +7% / +10% (with the buffer pool's fixes of the same day; the 42M point 1.48 against 1.61 GiB).

The tiled Adam step (``integration/host_step.py``) is one user of it: two 8 MiB temporaries per tile, about
20 tiles per sub-group of 40M fp32 elements. At 1 MiB each was a fresh mapping per tile: a 20M-element
AdamW step 89 ms against 37 ms with them in the heap (median of 20 interleaved pairs; the scoped raise of
the threshold around the tile loop that measured it is what the 32 MiB threshold made unnecessary).

Tried and not kept (2026-12-04): 1 GiB / 2 GiB - 1, so that DeepSpeed's bucket-sized reduce buffers
(``torch.cat`` of a bucket's gradients and gloo's reduce-scatter buffers, 80-100 MB each at 148M) come from
the heap too. Three interleaved pairs (148M fp32, ``--backends cpu,aidaptiv0``, 8 steps): 2.35 / 2.95 / 2.33 s
against 2.35 / 2.41 / 2.43 s at 32 MiB (CPU offload 2.00-2.09 s in all six runs), 68,700-71,900 page faults
and 0.33-0.40 s of system CPU per step against 69,100-72,600 and 0.31-0.35 s: no difference. The buckets
differ in size, and glibc's aligned allocations (PyTorch's ``posix_memalign``) take a few rounds of one size
to settle on a reused address, so within one backward they are fresh either way.

[Note: mallopt takes an int]
``mallopt(int param, int value)``: ctypes passes a Python int as a C ``int`` *masked* to 32 bits, so the
reuse policy's trim threshold of 4 GiB reached glibc as 0 until 2026-12-04 (a heap top trimmed whenever a
free left any of it free). Every value is now clamped to :data:`C_INT_MAX` and passed as ``ctypes.c_int``,
and the policy records what glibc got (``tests/test_heap_policy.py``: a freed 256 MiB block is reused under
the reuse policy; it was faulted in anew every time). On the 148M fp32 Llama at ``auto`` the fix did not
show: two interleaved pairs (``--backends cpu,aidaptiv_auto``, 8 steps) 2.05 / 2.17 s against 2.04 / 1.97 s
before (CPU offload 1.98-2.15 s in the same runs), 0.08-0.10 s of system CPU per step either way: the heap's
top there is rarely free.

Process-wide (``mallopt``), thread-safe; a no-op where the C library is not glibc (then every function here
returns False).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading

#: ``mallopt`` parameters (``malloc.h``)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: glibc's default ``M_TRIM_THRESHOLD`` (``malloc.c``, ``DEFAULT_TRIM_THRESHOLD``)
GLIBC_DEFAULT_TRIM_BYTES = 128 << 10
#: the largest value ``mallopt`` takes (its ``value`` is a C ``int``; [Note: mallopt takes an int])
C_INT_MAX = 2**31 - 1
#: the return policy's mmap threshold: blocks of this size or more are mapped and unmapped on their own
#: ([Note: the return threshold]; glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit)
RETURN_MMAP_BYTES = 32 << 20
#: the return policy's trim threshold: free heap top kept between trims (2 x the mmap threshold, as glibc's
#: adaptive policy sets it)
RETURN_TRIM_BYTES = 64 << 20


@functools.lru_cache(maxsize=1)
def glibc() -> ctypes.CDLL:
    """The C library (raises OSError where there is no ``libc.so.6``)."""
    return ctypes.CDLL("libc.so.6")


@dataclasses.dataclass(frozen=True)
class HeapPolicy:
    """The thresholds a policy set (bytes): ``kind`` is ``"reuse"`` or ``"return"``."""

    kind: str
    mmap_threshold: int
    trim_threshold: int


_lock = threading.Lock()
_policy: HeapPolicy | None = None  # None: glibc's own (adaptive) thresholds


def heap_policy() -> HeapPolicy | None:
    """The policy this process set last (None: none, glibc's adaptive default)."""
    return _policy


def c_int_bytes(value: int) -> int:
    """``value`` (bytes) clamped to what ``mallopt`` can take, ``0..C_INT_MAX`` ([Note: mallopt takes an int])."""
    return max(0, min(int(value), C_INT_MAX))


def _set_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    try:
        libc = glibc()
        return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(c_int_bytes(mmap_threshold)))) and \
            bool(libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(c_int_bytes(trim_threshold))))
    except (OSError, AttributeError):
        return False


def _apply(policy: HeapPolicy) -> bool:
    global _policy
    policy = HeapPolicy(policy.kind, c_int_bytes(policy.mmap_threshold), c_int_bytes(policy.trim_threshold))
    with _lock:
        ok = _set_thresholds(policy.mmap_threshold, policy.trim_threshold)
        if ok:
            _policy = policy
        return ok


def reuse_freed_host_memory(threshold: int = 1 << 30) -> bool:
    """Keep freed large host buffers in the process heap for reuse: ``M_MMAP_THRESHOLD`` = ``threshold``
    bytes, ``M_TRIM_THRESHOLD`` = 4 x that, both at most :data:`C_INT_MAX` ([Note: two policies],
    [Note: mallopt takes an int]).

    Every swap-in or write-back buffer of every step otherwise page-faults all of its pages again; in the
    heap the next allocation of a like size reuses them (the same reason PyTorch recommends
    jemalloc/tcmalloc for CPU training). Measured here: 40 x (allocate 64 MiB + fill) 2.83 s -> 1.81 s.
    Process-wide; False where the C library is not glibc.
    """
    return _apply(HeapPolicy("reuse", int(threshold), 4 * int(threshold)))


def return_freed_host_memory(threshold: int = RETURN_MMAP_BYTES, trim_threshold: int = RETURN_TRIM_BYTES) -> bool:
    """Serve every host allocation of at least ``threshold`` bytes with its own ``mmap`` and unmap it on
    free, and trim the heap's top above ``trim_threshold`` bytes ([Note: two policies]; setting either
    turns off glibc's adaptive thresholds, so both are set; values above :data:`C_INT_MAX` are clamped). The
    runtime trims the rest of the free heap after each backward and step (:func:`release_free_host_memory`).

    Fixed where glibc's default adapts: glibc raises its mmap threshold to the size of each large block
    freed, so which blocks stay in the heap depends on what was freed before. The default thresholds and
    what they cost and save are in [Note: the return threshold]. The price of a mapping of its own is page
    faults on first use of each page. Process-wide; False where the C library is not glibc.
    """
    return _apply(HeapPolicy("return", int(threshold), int(trim_threshold)))


def release_free_host_memory() -> bool:
    """Give the free pages of the process heap back to the OS (glibc ``malloc_trim(0)``).

    With :func:`reuse_freed_host_memory` freed buffers stay in the heap; after a one-time drop of
    many of them (the DRAM budget shrinking once the working set is known) this returns their
    pages, so a large allocation that follows (DeepSpeed's flat gradient buffer, served by a fresh
    ``mmap``) does not come on top of them. Costs page faults on the next use of those pages only.
    Returns False where the C library is not glibc.
    """
    try:
        glibc().malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def current_thresholds() -> tuple[int, int] | None:
    """``(mmap threshold, trim threshold)`` this module last asked of ``mallopt`` (bytes; None: glibc's own,
    adaptive). glibc has no call to read them back."""
    pol = _policy
    return None if pol is None else (pol.mmap_threshold, pol.trim_threshold)
