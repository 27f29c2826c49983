"""This rank's optimizer state of a ZeRO-3 engine, read out whole, for comparing two backends.

Works on DeepSpeed's own Stage-3 optimizer and on ours alike: a sub-group on the cache tier is
swapped in through DeepSpeed's own calls (``_optimizer_states_and_gradient_swap_in`` then
``_release_swap_buffers``), which our optimizer swapper implements. The fuzz worker
(:mod:`aidaptiv_ds.bench.fuzz_worker`) and ``tests/scripts/ds_api.py`` compare the result across
backends; nothing in training calls it.
"""
from __future__ import annotations

import torch


def flat_optimizer_state(opt) -> dict:
    """This rank's fp32 masters and Adam moments, each concatenated over the sub-groups in step order.

    Args:
        opt: the engine's ZeRO-3 optimizer (``engine.optimizer``), DeepSpeed's or ours.

    Returns:
        ``{"masters", "exp_avg", "exp_avg_sq"}``: 1-D fp32 tensors of the elements that hold a parameter's
        element (the padding of the last rank's partitions is left out: DeepSpeed leaves it
        uninitialised); a moment the optimizer does not keep is an empty tensor. Updates still riding
        the forward (:mod:`.step_pipeline`) are applied first.
    """
    import deepspeed.comm as dist

    getattr(opt, "_aidaptiv_drain", lambda: None)()  # updates still riding the forward (step_pipeline.py)
    masters, m1, m2, real = [], [], [], []
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        swapped = opt._swappable_optimizer_subgroup(i)
        if swapped:
            opt._optimizer_states_and_gradient_swap_in(i)
        masters.append(fp32.detach().float().clone())
        state = opt.optimizer.state.get(fp32, {})
        narrow = getattr(getattr(opt, "optimizer_swapper", None), "moment_slots", lambda i: {})(i)
        for out, key in ((m1, "exp_avg"), (m2, "exp_avg_sq")):
            if key in narrow:  # bf16 or int8 moments: decoded from their slot (tiers/unit.py)
                slot, buf = narrow[key]
                out.append(slot.read(buf).clone())
            elif key in state:
                out.append(state[key].detach().float().clone())
        if swapped:
            opt._release_swap_buffers(i)
        mask = torch.zeros(masters[-1].numel(), dtype=torch.bool)
        off = 0
        for p in opt.fp16_groups[i]:
            n = p.partition_numel()
            rank = dist.get_rank(group=opt._get_param_partition_group(p))
            mask[off:off + max(0, min(n, p.ds_numel - rank * n))] = True
            off += n
        real.append(mask)
    cat = lambda xs: torch.cat(xs) if xs else torch.empty(0)  # noqa: E731
    r = cat(real).bool()
    return {"masters": cat(masters)[r], "exp_avg": cat(m1)[r] if m1 else cat(m1),
            "exp_avg_sq": cat(m2)[r] if m2 else cat(m2)}
