"""The two changes to stock DeepSpeed that only the benchmark workers make, so backends compare fairly.

Both patch DeepSpeed's private names (``docs/deepspeed-surface.md``), so they live here; the
benchmarks (:mod:`aidaptiv_ds.bench.worker`, :mod:`aidaptiv_ds.bench.zero_inference`) call them.
Training and inference through aidaptiv_ds never do.
"""
from __future__ import annotations


def dedup_native_swap_in() -> None:
    """Make DeepSpeed's own ``AsyncPartitionedParameterSwapper.swap_in`` drop repeated parameters.

    DeepSpeed 0.19.8's NVMe prefetch (``partitioned_param_coordinator.py:667-690``) walks the trace
    without de-duplicating, so a parameter used at the end of the forward and again at the start of
    the backward (a Llama's ``lm_head``) can be passed twice, and its swapper then asserts
    ``param N already assigned swap buffer id M`` (``docs/deepspeed-seams.md`` §5). Keeping the first
    occurrence is what the call means; nothing else changes.
    """
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper as S

    orig = S.swap_in

    def swap_in(self, params, async_op=True, swap_in_buffers=None):
        seen, unique = set(), []
        for p in params:
            if p.ds_id not in seen:
                seen.add(p.ds_id)
                unique.append(p)
        return orig(self, unique, async_op=async_op, swap_in_buffers=swap_in_buffers)

    S.swap_in = swap_in


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed's CPU accelerator from JIT-loading its ``deepspeed_shm_comm`` op.

    Every DeepSpeed process on a CPU accelerator builds or loads that op (shared-memory collectives
    for several ranks on one host) when ``deepspeed.comm`` initialises, through the torch extensions
    cache: a first build takes minutes, and a stale lock left there by a killed build makes every
    later process wait forever. A single-rank run never uses it, so each backend skips it alike and
    launch-to-first-step measures the backends, not that cache.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
