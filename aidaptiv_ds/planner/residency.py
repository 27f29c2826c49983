"""Which training state stays in DRAM under a byte budget, and what that costs the drive per step.

Per optimizer step of ZeRO-3 with both offloads on the cache tier, every byte of state that does
not stay in DRAM is written once (DeepSpeed 0.19.8 writes all of it: 2 B bf16 parameter + 4 B
fp32 gradient + 12 B fp32 master weight and Adam moments = 18 B per parameter, see
``docs/deepspeed-seams.md`` Appendix A). Every byte kept in DRAM saves exactly one byte of writes per
step whatever it holds, so the choice is made on what else it saves:

1. **gradients** first: produced in backward and consumed by the optimizer in the same step, so
   keeping them costs no read-ahead and saves the write *and* the read back (4 B/param);
2. **parameters** next: each is read twice per step (forward and backward), so a resident
   parameter saves two reads per byte (2 B/param in bf16);
3. **optimizer sub-groups** (fp32 master + moments) last, whole sub-groups in step order.

What remains of the budget caches clean parameter slices (reads only, never writes).

When the parameters are fp32 like the master weights (no mixed precision), a parameter partition
*is* its master slot, byte for byte: it is read from the master extent and never written on its own
(``alias_params``), so per step 4 B/param fewer are written (DeepSpeed writes both). Only the
parameters of sub-groups kept in DRAM still need their own copy on the drive; keeping parameters
resident then saves reads only, so sub-groups come before parameters.

Gradients are one accumulation slice per optimizer sub-group (``integration/gradients.py``):
DeepSpeed 0.19.8's flat host gradient buffer is not allocated. They are taken in backward order
(the last sub-group's gradients are complete first), whole slices while they fit; a slice that
does not fit is written once and read back once per step (2 B/param in bf16 accumulation, 4 in
fp32). When the optimizer steps each sub-group inside the backward pass (``grads_transient``), a
gradient lives only until its sub-group is stepped: it needs no budget and is never written.

[Note: partial gradients between micro-batches] With gradient accumulation over ``grad_accum`` = k > 1
micro-batches, run micro-batch by micro-batch (DeepSpeed's order, and the runtime's unless the caller uses
``engine.train_batch``), each sub-group's gradient slice holds a partial sum from one micro-batch to the next:
a slice that is not kept in DRAM is written and read back k-1 times per step, whether or not the final sum is
then consumed inside backward. So at k > 1 the slices take the budget first even with steps inside backward,
and the bytes per step count ``(k-1) x`` the slices not kept (measured: ``tests/test_planner_schedule.py``,
the ledger of the runtime at GA 1/2/4). Before 2026-12-06 the plan ignored k: on a 2.70B fp32 Llama at the
``auto`` budget with GA 8 it kept 16 of 136 gradient slices and 16 optimizer sub-groups in DRAM and announced
10.3 B/param written per step; the run wrote 32.6.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StateSizes:
    """Bytes of training state of one rank (all in bytes).

    Attributes:
        param_bytes: low-precision parameter partitions (numel x 2 for bf16/fp16, x 4 for fp32).
        grad_bytes: gradient partitions (numel x the gradient-accumulation dtype's size: 4 fp32, 2 bf16).
        subgroup_bytes: per optimizer sub-group, fp32 master + optimizer state (numel x 12 for Adam).
        alias_params: the parameters are read from the master weights and not written on their own
            (fp32 parameters and fp32 master weights).
        subgroup_param_bytes: per sub-group, the bytes of its parameter partitions (for ``alias_params``).
        subgroup_grad_bytes: per sub-group, the bytes of its gradient slice (default: ``grad_bytes``
            split like ``subgroup_bytes``).
        grads_transient: each sub-group's gradient is consumed by its optimizer step inside the backward
            pass: it needs no DRAM budget and is never written.
        steps_in_backward: sub-groups not kept in DRAM are stepped inside the backward pass (whatever
            happens to their gradients); with ``alias_params`` such a step reads only the moments, its
            master weights coming from the parameters backward has read (``integration/optimizer_swapper.py``,
            [Note: master weights from the parameter reads]).
        param_resident_cap: most parameter bytes that may stay in DRAM (DeepSpeed's
            ``offload_param.max_in_cpu`` in bytes; None: no cap). The parameters are kept as one block, so
            they stay in DRAM only if all of them fit under it.
        grad_accum: micro-batches per optimizer step, accumulated micro-batch by micro-batch ([Note: partial
            gradients between micro-batches]).
        param_write_bytes: the parameter bytes a step writes (the trainable parameters' partitions: a frozen one,
            a LoRA run's base model, is written once and only read after); None: all of :attr:`param_bytes`.
    """
    param_bytes: int
    grad_bytes: int
    subgroup_bytes: list[int]
    alias_params: bool = False
    subgroup_param_bytes: list[int] = dataclasses.field(default_factory=list)
    subgroup_grad_bytes: list[int] = dataclasses.field(default_factory=list)
    grads_transient: bool = False
    steps_in_backward: bool = False
    param_resident_cap: int | None = None
    grad_accum: int = 1
    param_write_bytes: int | None = None

    @property
    def grads_stored(self) -> bool:
        """Gradient slices not kept in DRAM go to the drives: unless the step inside backward consumes each
        final gradient and there is no partial sum to keep between micro-batches ([Note: partial gradients
        between micro-batches])."""
        return not (self.grads_transient and self.grad_accum <= 1)

    def params_fit(self, left: int) -> bool:
        """The parameters can stay in DRAM with ``left`` bytes of budget (and under :attr:`param_resident_cap`)."""
        return self.param_bytes <= left and (self.param_resident_cap is None or self.param_bytes <= self.param_resident_cap)

    def grad_slices(self) -> list[int]:
        """Bytes of each sub-group's gradient slice (sums to ``grad_bytes``)."""
        if self.subgroup_grad_bytes:
            return list(self.subgroup_grad_bytes)
        total = sum(self.subgroup_bytes)
        if not total:
            return [self.grad_bytes] if self.grad_bytes else []
        out = [self.grad_bytes * b // total for b in self.subgroup_bytes]
        out[-1] += self.grad_bytes - sum(out)
        return out

    @property
    def optimizer_bytes(self) -> int:
        return sum(self.subgroup_bytes)

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclasses.dataclass
class ResidencyPlan:
    """What stays in DRAM, and the resulting writes per optimizer step.

    Attributes:
        budget: the DRAM budget in bytes this plan was made for.
        grads_resident: gradients of all sub-groups stay in DRAM (or are transient).
        resident_grad_subgroups: sub-groups whose gradient slice stays in DRAM.
        params_resident: all parameter partitions stay in DRAM (never read back or rewritten).
        resident_subgroups: indices of optimizer sub-groups kept in DRAM (never written per step).
        resident_bytes: bytes held by the above.
        cache_bytes: what is left of the budget for clean parameter slices.
        write_bytes_per_step: bytes written to the cache tier per optimizer step.
        read_bytes_per_step: bytes read per step, before clean-cache hits (params read twice).
        grad_bytes_per_step: of those, the gradient slices' bytes written (and as many read) per step: the
            partial sums between micro-batches and the final gradients not consumed inside backward.
    """
    budget: int
    grads_resident: bool
    resident_grad_subgroups: list[int]
    params_resident: bool
    resident_subgroups: list[int]
    resident_bytes: int
    cache_bytes: int
    write_bytes_per_step: int
    read_bytes_per_step: int
    grad_bytes_per_step: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_residency(sizes: StateSizes, budget: int) -> ResidencyPlan:
    """Fill ``budget`` bytes of DRAM in the order gradients, parameters, optimizer sub-groups (with
    ``alias_params``: gradients, sub-groups, parameters).

    Gradient slices are taken one by one in backward order (last sub-group first) while they fit
    (transient gradients take none, except those of sub-groups kept in DRAM, which are stepped after
    backward: their slice is charged with the sub-group); parameters as one block; sub-groups one by one in step order (a
    sub-group that does not fit is skipped and a later, smaller one may still fit). Bytes written per
    step = non-resident parameters (with ``alias_params``: only those of resident sub-groups) +
    the gradient slices' bytes (``grad_bytes_per_step``: ``(grad_accum - 1) x`` the non-resident slices, the
    partial sums, plus their final gradients unless consumed inside backward) + non-resident sub-groups; bytes read per step = 2 x the parameters
    unless they are resident (forward and backward; with ``alias_params`` from the master slots) +
    the gradient slices' bytes + non-resident sub-groups (with ``alias_params`` and
    ``steps_in_backward`` their moments only).
    """
    left = max(int(budget), 0)
    slices = sizes.grad_slices()
    grad_res: list[int] = []
    if sizes.grads_stored:  # partial sums or final gradients would go to the drives: slices first
        for i in reversed(range(len(slices))):
            if slices[i] <= left:
                grad_res.append(i)
                left -= slices[i]
        grad_res.sort()
    params = False
    if not sizes.alias_params:
        params = sizes.params_fit(left)
        if params:
            left -= sizes.param_bytes
    resident = []
    for i, b in enumerate(sizes.subgroup_bytes):
        # a sub-group kept in DRAM is stepped after backward, so with transient gradients its own
        # gradient slice stays in DRAM until then too
        cost = b + (slices[i] if not sizes.grads_stored and i < len(slices) else 0)
        if cost <= left:
            resident.append(i)
            left -= cost
    if not sizes.grads_stored:
        grad_res = [i for i in resident if i < len(slices)]
    if sizes.alias_params:
        params = sizes.params_fit(left)
        if params:
            left -= sizes.param_bytes
    opt_written = sum(b for i, b in enumerate(sizes.subgroup_bytes) if i not in resident)
    if params:
        p_w = 0
    elif sizes.alias_params:  # only parameters of sub-groups kept in DRAM have a copy of their own
        p_w = sum(sizes.subgroup_param_bytes[i] for i in resident)
    else:  # the trainable parameters: a frozen one is never written again
        p_w = sizes.param_bytes if sizes.param_write_bytes is None else min(sizes.param_write_bytes, sizes.param_bytes)
    # each slice not kept: its partial sum at every micro-batch boundary, and its final gradient unless the step
    # inside backward consumes it (a sub-group kept in DRAM is stepped after backward: its final slice is kept)
    nonres = [i for i in range(len(slices)) if i not in grad_res]
    g_w = (max(int(sizes.grad_accum), 1) - 1) * sum(slices[i] for i in nonres) + sum(
        slices[i] for i in nonres if not (sizes.grads_transient and i not in resident))
    # forward and backward each read every parameter not in DRAM: with alias_params from the fp32 master
    # slot (never written on its own), so reads follow the parameters' bytes, not their writes
    p_r = 0 if params else sizes.param_bytes
    # a step inside backward takes the fp32 master weights of an aliased sub-group from the parameters just read
    opt_read = opt_written
    if sizes.alias_params and sizes.steps_in_backward and not params:
        opt_read -= sum(b for i, b in enumerate(sizes.subgroup_param_bytes) if i not in resident)
    return ResidencyPlan(
        budget=int(budget), grads_resident=not sizes.grads_stored or len(grad_res) == len(slices),
        resident_grad_subgroups=grad_res,
        params_resident=params, resident_subgroups=resident,
        resident_bytes=max(int(budget), 0) - left, cache_bytes=left,
        write_bytes_per_step=p_w + g_w + opt_written,
        read_bytes_per_step=2 * p_r + g_w + opt_read,
        grad_bytes_per_step=g_w,
    )
