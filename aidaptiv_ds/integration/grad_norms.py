"""DeepSpeed's per-partition gradient norm (``_constant_buffered_norm2``, ``stage3.py:1960-1967``) with its
``get_norm_dtype()`` (fp64) copy in a reusable host scratch buffer instead of a fresh tensor per partition.

[Note: why a scratch]
At every accumulation boundary DeepSpeed takes the norm of each gradient partition as
``part.data.to(fp64).norm(2) ** 2.0`` per split of ``buffer_size`` elements, summed, ``** 0.5``. On a CPU
rank the ``.to(fp64)`` is a new host tensor twice the partition's fp32 size: 1.19 GB per step for a 148M
fp32 Llama, and at a DRAM budget of 0, where every large block was a fresh ``mmap`` (1 MiB or more when this
was measured; blocks below 1 GiB are kept in the heap within a phase since)
(:func:`aidaptiv_ds.io.heap.return_freed_host_memory`), each of them page-faults in (profiled: the
copies ran 6.2x slower than into mapped memory). :class:`NormScratch` copies into one buffer instead,
grown to the largest split it met (at most :data:`NORM_SCRATCH_MAX_NUMEL` elements; larger splits take
DeepSpeed's own path) and dropped at the end of each backward, so it lives in the backward phase only, where
the planner counts it (:func:`aidaptiv_ds.planner.auto.norm_scratch_bytes`).

[Note: bit-identity]
The arithmetic is DeepSpeed's: the same fp64 values (``copy_`` converts exactly as ``.to`` does), the same
``Tensor.norm(2)`` reduction over a contiguous fp64 tensor of the same length, the same ``** 2.0``, sum
order and ``** 0.5``. Probed identical on 1..30M elements at offsets 0/3/17; ``tests/test_grad_norms.py``
keeps the check against DeepSpeed's method itself.
"""
from __future__ import annotations

import torch

from ..io.buffers import alloc_aligned
from ..planner.auto import NORM_SCRATCH_MAX_NUMEL


class NormScratch:
    """One growing fp64 host buffer for the norms of host gradient partitions (module docstring)."""

    def __init__(self, max_numel: int = NORM_SCRATCH_MAX_NUMEL) -> None:
        self.max_numel = int(max_numel)
        self._buf: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes held now (0 after :meth:`release`)."""
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    def norm2(self, input: torch.Tensor, buffer_size: int, norm_dtype: torch.dtype) -> torch.Tensor | None:
        """DeepSpeed's ``_constant_buffered_norm2(input, buffer_size)`` for a CPU tensor, through the scratch.

        Args:
            input: a contiguous CPU floating-point tensor of a dtype other than ``norm_dtype`` (any shape).
            buffer_size: DeepSpeed's split length (elements).
            norm_dtype: DeepSpeed's ``get_norm_dtype()`` (fp64).

        Returns:
            The 0-d ``norm_dtype`` tensor DeepSpeed's method returns, or None where this path does not apply
            (not CPU, already ``norm_dtype``, not floating point, or a split above ``max_numel``): the caller
            takes DeepSpeed's own method.
        """
        if (input.device.type != "cpu" or input.dtype == norm_dtype or not input.is_floating_point()
                or input.numel() == 0):
            return None
        flat = input.view(-1)
        need = min(flat.numel(), int(buffer_size))
        if need > self.max_numel:
            return None
        if self._buf is None or self._buf.numel() < need or self._buf.dtype != norm_dtype:
            self._buf = None
            self._buf = alloc_aligned(need * norm_dtype.itemsize, dtype=norm_dtype)
        norm = None
        for part in flat.split(int(buffer_size)):
            s = self._buf[:part.numel()]
            s.copy_(part.data)
            sq = s.norm(2) ** 2.0
            norm = sq if norm is None else norm + sq
        return norm ** 0.5

    def release(self) -> None:
        """Give the buffer back (end of a backward, after a step)."""
        self._buf = None
