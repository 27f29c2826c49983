"""glibc's policy for large host allocations: keep freed blocks in the heap for reuse, or keep them only
within a phase and give them back to the OS at its end.

[Note: two policies]
glibc serves an allocation above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` region and unmaps it on free;
below it, from the heap, which returns its top to the OS only when more than ``M_TRIM_THRESHOLD`` is free
there. By default the mmap threshold adapts (128 KiB up to 32 MiB, raised to the size of each large block
freed). A rank picks one policy for the whole process (``io.reuse_host_memory``):

* *reuse* (:func:`reuse_freed_host_memory`): thresholds high, freed swap buffers stay for the next like
  allocation; the heap then holds the high-water mark of buffers live at once, which must fit in the DRAM
  budget (``Runtime.settle_host_memory_reuse``).
* *return* (:func:`return_freed_host_memory`, a DRAM budget of 0): freed blocks are kept within a phase
  (only blocks of :data:`RETURN_MMAP_BYTES` or more are mappings of their own, the heap's top is trimmed
  on ``free`` only above :data:`RETURN_TRIM_BYTES`) and the runtime gives the whole free heap back after
  each backward and each step (``Runtime.end_of_step``), so what stays between phases is the live blocks.
  The price is a page fault on the first use of each page in each phase.

[Note: the return threshold]
What ``malloc`` serves at a budget of 0 is PyTorch's and DeepSpeed's own memory (our swap buffers come from
the buffer pool, ``io/pool.py``): activations, ``matmul`` outputs, weight gradients, over several ranks once
per reduce bucket DeepSpeed's flat ``torch.cat`` of the bucket's gradients and gloo's reduce-scatter buffers
(80-100 MB each on the 148M Llama; one rank skips them, ``integration/grad_path.py``), and the gathered
embedding and head (98 MB each there). A block above the mmap
threshold is a fresh mapping per use, page-faulted in and zeroed by the kernel, and unmapped on free; a free
heap top above the trim threshold goes back at the next ``free``. The trim threshold is the largest ``mallopt``
takes (2 GiB - 1): what a phase freed in the heap goes back when it ends, where the runtime trims the whole
free heap (``Runtime.end_of_step``, after each backward and each step). The mmap threshold is 16 MiB
(:data:`RETURN_MMAP_BYTES`): blocks below it (activations of a sequence, the tiled optimizer step's 8 MiB
temporaries, ``integration/host_step.py``) are reused from the heap within a phase; larger ones (gathered
weights and their gradients, DeepSpeed's reduce buckets, the embedding) are their own mappings, given back
when freed.

[Note: why 16 MiB, not 1 GiB] From 2026-12-04 the mmap threshold was 1 GiB, so every block stayed in the heap
until the phase ended. Blocks of many sizes with small long-lived allocations between them fragment a heap
that is trimmed only at phase ends: what it held free grew with the layers a phase went through, and with it
the peak. Measured (issue 34; one rank, budget 0, fp32 Llama hidden 2048, seq 32, clipping 1.0, built under
``zero.Init``, ``launch/memory_sweep.py``, ``mallinfo2`` and ``/proc/self/smaps`` sampled beside the RSS):
at 640M parameters the heap held 0.6-0.9 GiB of free chunks at the peak of step 1's backward and grew by
0.36 GiB through ``deepspeed.initialize``; peak RSS 2.65 GiB and 1.46 GiB in initialisation at 1 GiB against
2.24 and 0.95 GiB at 16 MiB (same commit, back to back; step time 20.6 against 17.1 s at load 7-8, within this
VM's spread). The heap then stays at 0.15-0.25 GiB through every phase.

Measured on the 148M fp32 Llama at budget 0 (``launch/compare.py --backends cpu,aidaptiv0``, 8 steps, three
interleaved pairs each time, CPU offload in every run), at two times of day on this VM, whose host discards
the pages a guest gives back (free page reporting: ``docs/profiling.md``):

* when giving pages back was expensive: 2.38 / 2.49 / 2.36 s per step at 1 GiB against 2.59 / 2.53 / 3.02 s
  at 32 MiB, system CPU 0.35-0.39 s against 0.59-0.93 s per step, peak RSS 3.29-3.39 against 3.06-3.13 GiB;
* when it was cheap: 2.35 / 2.95 / 2.33 s against 2.35 / 2.41 / 2.43 s, system CPU 0.33-0.40 against
  0.31-0.35 s: no difference.

The planner's figure against the peak RSS of the slow ``tests/test_plan_host_vs_rss.py`` (42M/93M/169M bf16)
at 1 GiB: -2% / +10% / +9%.

History: 1 MiB while our own swap buffers (a few MiB each) came from ``malloc``: in the heap their
interleaved lifetimes fragmented it (169M fp32 at budget 0: 0.6 GiB more in backward at glibc's adaptive
default). 32 MiB (glibc's own ceiling for its adaptive threshold) once they came from the pool, which kept the
weight gradients and the tiled Adam's 8 MiB temporaries in the heap: median step 3.26 s against 3.46 s at
1 MiB (nine interleaved pairs), peak RSS 3.07-3.16 against 2.94-3.02 GiB, plan against RSS -9% / +7% / +10%.
The tiled Adam's two 8 MiB temporaries per tile were fresh mappings at 1 MiB: a 20M-element AdamW step 89 ms
against 37 ms with them in the heap (median of 20 interleaved pairs).

Not the same as keeping the heap whole (no trims at phase ends): that took the step further, to 1.10-1.15x
CPU offload, but what it kept grew with the model (``docs/profiling.md``).

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
#: ([Note: the return threshold], [Note: why 16 MiB, not 1 GiB])
RETURN_MMAP_BYTES = 16 << 20
#: the return policy's trim threshold: the free heap top is given back by the runtime's trims at phase ends,
#: not by ``free`` ([Note: the return threshold])
RETURN_TRIM_BYTES = C_INT_MAX


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


def _apply(policy: HeapPolicy) -> bool:
    """Ask glibc for ``policy``'s thresholds, clamped to what ``mallopt`` takes; record what it got."""
    global _policy
    policy = HeapPolicy(policy.kind, c_int_bytes(policy.mmap_threshold), c_int_bytes(policy.trim_threshold))
    with _lock:
        try:
            libc = glibc()
            ok = bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(policy.mmap_threshold))) and \
                bool(libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(policy.trim_threshold)))
        except (OSError, AttributeError):
            ok = False
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
    """Serve host allocations of at least ``threshold`` bytes with their own ``mmap`` (unmapped on free) and
    trim the heap's top on ``free`` above ``trim_threshold`` bytes; below those, freed memory stays in the heap
    until the runtime gives the whole free heap back after each backward and step
    (:func:`release_free_host_memory`) ([Note: two policies]; setting either turns off glibc's adaptive
    thresholds, so both are set; values above :data:`C_INT_MAX` are clamped).

    Fixed where glibc's default adapts: glibc raises its mmap threshold to the size of each large block
    freed, so which blocks stay in the heap depends on what was freed before. The default thresholds and
    what they cost and save are in [Note: the return threshold]. Process-wide; False where the C library is
    not glibc.
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
