"""One rank's host working set besides the DRAM budget: the one calculation the planner and the runtime share.

The runtime (``integration/stage3.py``, when ``deepspeed.initialize`` has built DeepSpeed's sub-groups) and
the planner (``planner/plan.py``, from a model shape) describe the rank in the same two records and call
:func:`rank_working_set`:

* :class:`RankState`, the facts: the rank's optimizer sub-groups, gradient slices and parameter
  partitions (elements and element sizes), the extent alignment, whether fp32 parameters are read from
  their master slots. The runtime reads them off DeepSpeed's optimizer; the planner derives them from the
  model's tensors the way DeepSpeed would (:func:`~aidaptiv_ds.planner.auto.deepspeed_sub_group_numels`).
* :class:`RankPolicy`, the choices: CPU rank or accelerator, ``step_in_backward``, ``step_rides_forward``,
  fp16, hierarchical partitioning, the read-ahead window, DeepSpeed's own working set, the activations, the
  process baseline or allowance, the optimizer step's tile.

What comes back (:class:`RankWorkingSet`) is the figure the ``"auto"`` budget is cut by, the runtime's
in-backward and riding window (which :class:`~aidaptiv_ds.integration.backward_step.BackwardStepper`
enforces), the CPU rank's buffer pool, and the phases. The formulas are the module docstring of
:mod:`aidaptiv_ds.planner.auto`: :func:`~aidaptiv_ds.planner.auto.cpu_rank_working_set` on a CPU rank,
:func:`~aidaptiv_ds.planner.auto.host_working_set` beside an accelerator.

[Note: what each side knows] Only the inputs differ (``tests/test_working_set.py`` checks that a real
engine's records equal the planner's):

* the read-ahead window: the runtime's is the parameter swapper's (``Runtime.prefetch_bytes``, the
  ``prefetch_bytes`` setting), the planner's :func:`~aidaptiv_ds.planner.auto.auto_prefetch_bytes` of the
  same partition (the setting's default);
* DeepSpeed's working set: the runtime's from the optimizer's knobs, the planner's from the user's;
* the activations: 0 in the runtime (the sequence length is not known when the budget is cut: the safety
  margin holds them), the planner's estimate there;
* the staged partition beside an accelerator: the runtime's largest partition, the planner's partition of
  the largest slice (what one module fetch gathers; at least as large, so the plan is an upper bound there);
* the planner assumes what the runtime checks: parameters offloaded to the drives (fp32 ones read from their
  master slots), one parameter group in module order (HF Trainer's decay / no-decay groups pack the
  sub-groups in another order), no hierarchical partitioning.
"""
from __future__ import annotations

import dataclasses

import torch

from ..io.buffers import PAGE_BYTES, round_up
from ..tiers.unit import MOMENT_FORMATS, MomentFormat, optimizer_layout
from .auto import (
    CPU_RANK_BASELINE_BYTES,
    OPTIMIZER_PIPELINE_DEPTH,
    OPTIMIZER_TILE_NUMEL,
    RANK_OVERHEAD_BYTES,
    buffer_pool_bytes,
    cpu_rank_working_set,
    host_working_set,
    master_hold_bytes,
    norm_scratch_bytes,
    optimizer_scratch_bytes,
    rides_forward,
)

#: the store's I/O alignment (``store/store.py``'s default, a page; every extent is rounded up to it), bytes
DEFAULT_ALIGNMENT = PAGE_BYTES


@dataclasses.dataclass(frozen=True)
class RankState:
    """What one rank holds (module docstring).

    Attributes:
        subgroup_numels: elements of each of the rank's optimizer sub-groups, in DeepSpeed's order.
        grad_numels: elements of each sub-group's gradient slice (the gradient store's; every partition of
            the sub-group, ``grad_path.py`` ``_aidaptiv_grad_layout``).
        largest_partition_numel: elements of the rank's largest parameter partition.
        param_bytes: bytes of all the rank's parameter partitions.
        largest_subgroup_param_bytes: parameter bytes of the largest sub-group's partitions.
        staging_partition_bytes: the parameter partition the swapper stages beside an accelerator
            (the runtime: its largest partition; the planner: the partition of the largest slice).
        accum_elsize: bytes per element of the gradient accumulation dtype.
        state_elsize: bytes per element of the master weights (4: fp32).
        states: optimizer states per element (2 for Adam's moments; 0 for an optimizer without state).
        moments: how Adam's moments are stored (``optimizer_state.moments``: ``"bf16"``, ``"int8"``; None: as
            the master weights), a name of :data:`~aidaptiv_ds.tiers.unit.MOMENT_FORMATS`; the slices are laid
            out as ``tiers/unit.py`` lays them out (:meth:`opt_slice_bytes`).
        alignment: the store's extent alignment (bytes); slices are stored rounded up to it.
        alias: fp32 parameters are read from their master slots (``param_swapper.py``, the alias).
    """
    subgroup_numels: tuple[int, ...]
    grad_numels: tuple[int, ...]
    largest_partition_numel: int
    param_bytes: int
    largest_subgroup_param_bytes: int
    staging_partition_bytes: int
    accum_elsize: int
    state_elsize: int = 4
    states: int = 2
    alignment: int = DEFAULT_ALIGNMENT
    alias: bool = False
    moments: str | None = None

    @property
    def slots(self) -> int:
        """Slots of a sub-group's slice: the master weights and each optimizer state."""
        return 1 + self.states

    @property
    def moment_format(self) -> MomentFormat | None:
        """The moments' format (None: stored as the master weights)."""
        return None if self.moments is None else MOMENT_FORMATS[self.moments]

    @property
    def moment_bytes_per_param(self) -> float:
        """Bytes per element of the optimizer states together (8 for Adam's fp32 moments, 4 in bf16, 2.03 in
        int8 with the blocks' scales)."""
        fmt = self.moment_format
        return self.states * (self.state_elsize if fmt is None else fmt.bytes_per_element)

    def grad_slice_bytes(self) -> list[int]:
        """Each sub-group's gradient accumulation slice as stored (bytes, aligned)."""
        return [round_up(n * self.accum_elsize, self.alignment) for n in self.grad_numels]

    def opt_slice_bytes(self, numel: int) -> int:
        """A sub-group's optimizer slice of ``numel`` elements as stored (master + states, aligned; the slots are
        packed end to end, ``tiers/unit.py``)."""
        fmt = self.moment_format
        if fmt is None:
            return round_up(numel * self.state_elsize * self.slots, self.alignment)
        master = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[self.state_elsize]
        return round_up(optimizer_layout(numel, master, fmt, self.slots, self.states).prefix_bytes(), self.alignment)


@dataclasses.dataclass(frozen=True)
class RankPolicy:
    """The choices that shape a rank's working set (module docstring).

    Attributes:
        cpu_rank: the forward computes on the host (no accelerator): the working set is counted by phase.
        step_in_backward / step_rides_forward: the ``aidaptiv`` settings (True, False, ``"auto"``).
        fp16: the parameters are fp16 (its loss scaler keeps every update in ``step()``).
        hpz: DeepSpeed's hierarchical partitioning (``zero_hpz_partition_size`` > 1) is on: no riding.
        readahead_bytes: the parameter read-ahead window (CPU rank; at most ``param_bytes`` is used).
        deepspeed_bytes: DeepSpeed's own working set on a CPU rank
            (:func:`~aidaptiv_ds.planner.auto.deepspeed_cpu_rank_bytes`).
        live_partition_bytes: the partitions of the parameters DeepSpeed keeps gathered, in swap buffers while
            gathered (:func:`~aidaptiv_ds.planner.auto.live_partition_bytes`; CPU rank, parameters on the cache
            tier, else 0); gather_ranks: ranks of the parameters' partition group (over one the gathered
            parameters are those partitions, inside ``deepspeed_bytes``; over several they come beside it).
        activation_bytes: activations of one micro-batch (CPU rank).
        baseline_bytes: the CPU rank's process baseline; rank_overhead_bytes: the allowance beside an
            accelerator.
        step_tile_numel: elements per tile of the optimizer step (``integration/host_step.py``).
    """
    cpu_rank: bool
    step_in_backward: bool | str = "auto"
    step_rides_forward: bool | str = "auto"
    fp16: bool = False
    hpz: bool = False
    readahead_bytes: int = 0
    deepspeed_bytes: int = 0
    live_partition_bytes: int = 0
    gather_ranks: int = 1
    activation_bytes: int = 0
    baseline_bytes: int = CPU_RANK_BASELINE_BYTES
    rank_overhead_bytes: int = RANK_OVERHEAD_BYTES
    step_tile_numel: int = OPTIMIZER_TILE_NUMEL


@dataclasses.dataclass(frozen=True)
class RankWorkingSet:
    """One rank's host working set besides the DRAM budget (bytes).

    Attributes:
        total: what the ``"auto"`` budget is cut by (the baseline or overhead included).
        overhead: the part of ``total`` that is the process itself (not aidaptiv_ds's buffers).
        grad_window: the gradient accumulation slices open at once (``GradientStore.window_bytes``).
        in_backward_window: bytes of optimizer slices steps inside backward or riding the forward may hold
            (on a CPU rank the larger of the two windows, 0 where neither runs; beside an accelerator the
            whole pipeline of :data:`~aidaptiv_ds.planner.auto.OPTIMIZER_PIPELINE_DEPTH` slices, always).
        largest_opt_slice: the largest sub-group's optimizer slice as stored (bytes).
        pool_bytes: the CPU rank's host buffer pool without the DRAM budget, which the runtime adds once it is
            cut (``Runtime.settle_host_memory_reuse``); 0 beside an accelerator.
        may_step_in_backward: steps may run inside backward (before the preflight's check for room).
        rides: updates not done in ``step()`` ride the next forward.
        master_hold: parameter bytes kept for a master slot while steps run inside backward
            (:func:`~aidaptiv_ds.planner.auto.master_hold_bytes`; 0 without the alias or such steps).
        phases: the CPU rank's phases (:func:`~aidaptiv_ds.planner.auto.cpu_rank_working_set`), else empty.
    """
    total: int
    overhead: int
    grad_window: int
    in_backward_window: int
    largest_opt_slice: int
    pool_bytes: int
    may_step_in_backward: bool
    rides: bool
    master_hold: int
    phases: dict[str, int]


def rank_working_set(state: RankState, policy: RankPolicy) -> RankWorkingSet:
    """The working set of one rank (module docstring); every figure in bytes. Sizes of 0 (an empty rank, an
    optimizer without state) give the process figure alone; nothing is raised."""
    numels = [int(n) for n in state.subgroup_numels]
    largest_sg = max(numels, default=0)
    grad_window = 2 * max(state.grad_slice_bytes(), default=0)
    largest_opt_slice = state.opt_slice_bytes(largest_sg)
    stateful = state.states > 0
    may_step = policy.step_in_backward is not False and not policy.fp16 and stateful
    rides = (rides_forward(policy.step_rides_forward, on_accelerator=not policy.cpu_rank)
             and not policy.fp16 and not policy.hpz and stateful)
    # parameter bytes kept for a master slot in backward ([Note: master weights from the parameter reads])
    master_hold = master_hold_bytes(largest_sg * state.state_elsize) if state.alias and may_step else 0
    moments = state.moment_bytes_per_param
    fmt = state.moment_format
    # moments widened per tile; a quantized tile also has its scaled values and code indices beside it
    narrow = 0 if moments >= state.state_elsize * state.states else state.states * (2 if fmt and fmt.block else 1)
    if policy.cpu_rank:  # what a GPU holds is host memory here, by phase
        # the swapped-in partitions of gathered parameters ([Note: the gathered parameters' partitions] in
        # planner/auto.py): over one rank the gathered parameters themselves, over several beside them
        beside = int(policy.live_partition_bytes) if policy.gather_ranks > 1 else 0
        phases = cpu_rank_working_set(
            readahead_bytes=min(int(policy.readahead_bytes), int(state.param_bytes)),
            grad_window_bytes=grad_window, deepspeed_bytes=policy.deepspeed_bytes,
            activation_bytes=policy.activation_bytes, subgroup_numels=numels, moment_bytes_per_param=moments,
            baseline_bytes=policy.baseline_bytes,
            in_backward_slice_bytes=largest_opt_slice if may_step else 0,
            norm_scratch=norm_scratch_bytes(state.largest_partition_numel), master_hold=master_hold,
            step_scratch=optimizer_scratch_bytes(policy.step_tile_numel, state.state_elsize, widened_states=narrow),
            ride_slice_bytes=largest_opt_slice if rides else 0,
            ride_param_bytes=state.largest_subgroup_param_bytes if state.alias else 0,
            partition_copy_bytes=beside)
        return RankWorkingSet(total=phases["total"], overhead=phases["baseline"], grad_window=grad_window,
                              in_backward_window=max(phases["in_backward"], phases["riding"]),
                              largest_opt_slice=largest_opt_slice,
                              pool_bytes=buffer_pool_bytes(phases, policy.deepspeed_bytes, policy.activation_bytes,
                                                           int(policy.live_partition_bytes) - beside),
                              may_step_in_backward=may_step, rides=rides, master_hold=master_hold,
                              phases=phases)
    total = host_working_set(largest_slice_partition_bytes=state.staging_partition_bytes,
                             largest_subgroup_numel=largest_sg, moment_bytes_per_param=moments, local_ranks=1,
                             rank_overhead_bytes=policy.rank_overhead_bytes, grad_window_bytes=grad_window,
                             master_hold_bytes=master_hold)
    # the host working set already sums the parameter staging and the whole optimizer pipeline
    return RankWorkingSet(total=total, overhead=policy.rank_overhead_bytes, grad_window=grad_window,
                          in_backward_window=OPTIMIZER_PIPELINE_DEPTH * largest_opt_slice,
                          largest_opt_slice=largest_opt_slice, pool_bytes=0,
                          may_step_in_backward=may_step, rides=rides, master_hold=master_hold,
                          phases={})
