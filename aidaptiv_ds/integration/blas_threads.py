"""Keep MKL's thread count fixed while aidaptiv_ds's I/O threads share the cores with the step.

[Note: why MKL's dynamic threading breaks the CPU-offload oracle]
PyTorch's x86 wheels do their float GEMMs in MKL and leave MKL's *dynamic* mode on (``mkl_set_dynamic``
is only switched off by ``torch.set_num_threads``, ``aten/src/ATen/ParallelOpenMP.cpp``). In dynamic mode
MKL may run a GEMM on fewer threads than ``torch.get_num_threads()`` when it sees the cores busy, and a
GEMM split over fewer threads sums its K dimension in another order: the result differs in the last bit.
DeepSpeed's CPU offload never has other work running during backward, so its GEMMs always get every
thread. Ours do not: the I/O workers' reads and write-backs (and the optimizer sub-groups stepped inside
backward) run while backward's weight-gradient GEMMs do, so on a loaded 2-core machine MKL sometimes
chose fewer threads, step 0's gradients differed in the last bit in a few percent of elements, and the
losses drifted 1e-6 from the oracle from step 1 on -- in about one run in eight, more often with the
reusing heap (faster I/O, more of it overlapping backward). Measured on the 40M Llama, fp32,
sub_group_size 4e6, ``io.reuse_host_memory: true``: 1 divergent run of 6 and 1 of 10 with MKL's default;
0 of 14 with ``MKL_DYNAMIC=FALSE``; 0 of 14 with ``MKL_CBWR=AVX512,STRICT``; the divergent run's
parameters after step 0 differed in scattered elements of every matrix, never a contiguous range
(``docs/profiling.md``). So the runtime switches dynamic mode off, as ``torch.set_num_threads`` would,
unless the user chose a mode with the ``MKL_DYNAMIC`` environment variable.

A fixed thread count is not all bit-reproducibility needs: MKL's default mode may also pick its kernel by
the inputs' memory alignment, so at 148M both DeepSpeed's CPU offload and aidaptiv_ds came out in one of
two last-bit variants from run to run. Strict reproducible mode (``MKL_CBWR=AUTO,STRICT``, read when MKL
starts) removes that; the runtime does not set it, since it changes the numbers against a user's own run
made with MKL's defaults, but ``launch/compare.py`` and the oracle tests run every backend with it
(``aidaptiv_ds/bench/runner.py`` ``REPRODUCIBLE_MKL``).
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("aidaptiv_ds")


def pin_blas_threads() -> bool:
    """Turn MKL's dynamic thread count off for this process (see the note above).

    Calls ``torch.set_num_threads(torch.get_num_threads())``, PyTorch's public way to do it, which
    keeps the intra-op thread count as it is. Does nothing without MKL or when ``MKL_DYNAMIC`` is set
    in the environment (the user's choice wins).

    Returns:
        True when dynamic mode was switched off here, False when left alone.
    """
    if not torch.backends.mkl.is_available():
        return False
    if "MKL_DYNAMIC" in os.environ:
        log.info("aidaptiv_ds: MKL_DYNAMIC=%s set in the environment; leaving MKL's dynamic threading as "
                 "set (with it on, results may differ in the last bit from DeepSpeed's CPU offload)",
                 os.environ["MKL_DYNAMIC"])
        return False
    try:
        torch.set_num_threads(torch.get_num_threads())
    except RuntimeError as exc:  # a native (non-OpenMP) intra-op pool refuses once parallel work has started
        log.info("aidaptiv_ds: could not pin MKL's thread count (%s); results may differ in the last bit from "
                 "DeepSpeed's CPU offload", exc)
        return False
    return True
