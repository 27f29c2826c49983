"""Runtime defaults from the planner's arithmetic: the DRAM budget, what stays in DRAM, prefetch depth.

The same functions serve ``aidaptiv-ds plan`` (with the user's figures) and the runtime (with the
host's), so what the plan promises is what the runtime does:

* ``dram_budget: "auto"`` (:func:`resolve_dram_budget`, :func:`auto_dram_budget`): the budget is
  the host memory available now less a safety margin and less the host working set::

      margin = max(4 GiB, 10% of total host memory)          (MIN_FREE_BYTES, FREE_FRACTION)
      budget = max(available - margin - working_set, 0)      bytes, for the whole node
      per rank = budget // local ranks

  The margin leaves the page cache, the OS and other processes room so the kernel does not swap
  or OOM-kill a rank; 10% follows the common "keep 10% of RAM free" practice, and 4 GiB covers
  small hosts where 10% is too little for a CUDA driver and a data loader. Both are parameters.
* the host working set (:func:`host_working_set`): memory a rank needs besides the budget::

      per rank = overhead (3 GiB) + 2 x largest parameter slice partition (current + next read)
                 + 3 x largest optimizer sub-group x (4 B master + moment B + 4 B gradient)
                 + the gradient window (open accumulation slices, 2 x the largest sub-group's)

  The 3 sub-group buffers are the optimizer pipeline of design.md step 4 (read i+1, update i,
  write i-1); the 3 GiB overhead is an allowance for the torch/CUDA/DeepSpeed process itself;
  check it against the peak RSS that the metrics record and pass the measured figure.
* a CPU rank (:func:`cpu_rank_working_set`) has no CUDA context and holds what a GPU would hold, so
  its working set is measured by phase instead::

      per rank = baseline (0.8 GiB) + max(forward/backward, optimizer)
      forward/backward = read-ahead window + gradient window + DeepSpeed's working set + activations
                         + norm scratch (8 B x the largest gradient partition, :func:`norm_scratch_bytes`)
                         + master hold (one fp32 master slot, :func:`master_hold_bytes`; fp32 with
                           steps inside backward)
      optimizer        = the 3 largest sub-groups x (4 B master + moment B + 4 B gradient) per element
                         + step scratch (the tiled step's temporaries, :func:`optimizer_scratch_bytes`)

  Where optimizer steps may run inside backward, the backward phase also holds their window of
  sub-group slices (:func:`in_backward_window_bytes`: two slices, which the runtime enforces) and the
  step scratch, so the maximum is ``max(backward + two slices + step scratch, optimizer)``.
  The baseline is the measured RSS of a CPU rank once ``deepspeed.initialize`` has returned with all
  state offloaded (0.73 GiB here: interpreter, torch, DeepSpeed, transformers, the module objects).
  The phases do not stack: the read-ahead and DeepSpeed's gathered parameters and reduce buckets
  are released as backward ends, before the optimizer pipeline fills (measured on three fp32 Llama
  sizes, 42M-169M parameters, budget 0: the sum over-counts by 33-58 %). With the in-backward
  window counted, the maximum is within 15 % of the peak in bf16 (42M-169M: -14 % to +4 %,
  ``tests/test_plan_host_vs_rss.py``; 84M-590M: -3 % to +5 %) and 9-15 % above it in fp32 (84M-590M),
  where its maxima in 4-byte elements do not peak together (the ``planned`` row of
  ``launch/memory_sweep.py``).
* on CPU ranks also DeepSpeed's own working set (:func:`deepspeed_cpu_rank_bytes`), which a GPU
  would hold in VRAM: the gathered parameters DeepSpeed keeps live (the larger of
  ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` plus two modules and a layer held (a
  layer-major step's block, a recomputed layer's frozen parameters), at most the model:
  :func:`deepspeed_gathered_numel`) and its gradient reduce path: the ``reduce_bucket_size`` bucket and, while a
  bucket is reduced over several ranks, two transient copies of it (``reduce_scatter_coalesced``
  interleaves the bucket's partitions into a new flat tensor with ``torch.cat``, and gloo's
  reduce-scatter works on a buffer of its own; measured: a 1 GiB bucket raises the peak RSS by
  2.00 GiB, ``tests/test_auto_budget_cpu.py``), so ``REDUCE_PATH_COPIES`` = 3 buckets. A partition
  group of one rank skips that reduce-scatter (the identity there:
  :func:`aidaptiv_ds.integration.grad_path.single_rank_grad_partitions`), so it holds the bucket
  alone (:func:`reduce_path_copies`; ``tests/test_single_rank_reduce.py`` checks that no copy is made,
  the RSS was not probed separately). With DeepSpeed's
  defaults (1e9 and 5e8 elements) that is up to 10 GB in fp32, outside any budget of ours: the
  gathered parameters and the bucket left out, a 2.7B fp32 Llama at ``"auto"`` took an 8.8 GiB
  budget on this 23.5 GiB machine and ran out of memory in step 2 (peak RSS 20.7 GiB); with one
  bucket counted instead of three, it peaked 4-5 GiB above step 1 inside the reduce-scatter of
  step 2's backward.
* what stays in DRAM: :func:`aidaptiv_ds.planner.residency.plan_residency` (gradients, then
  parameters, then optimizer sub-groups), unchanged;
* prefetch (:func:`prefetch_bytes_from_budget`): the budget left after residency
  (``ResidencyPlan.cache_bytes``) holds clean parameter slices read ahead; depth = how many of
  the largest slice fit, at most ``n_slices - 1`` (reading further ahead than one pass is useless),
  and 0 when the parameters are resident anyway.
"""
from __future__ import annotations

import dataclasses
import math

from ..errors import AidaptivConfigError
from ..units import GiB, parse_size
from .residency import ResidencyPlan

MIN_FREE_BYTES = 4 * GiB
FREE_FRACTION = 0.10
RANK_OVERHEAD_BYTES = 3 * GiB
#: RSS of a CPU rank after ``deepspeed.initialize`` with every state offloaded (module docstring)
CPU_RANK_BASELINE_BYTES = int(0.8 * GiB)
#: RSS of a rank once torch, DeepSpeed and transformers are imported, before the model is built (measured
#: 0.41-0.42 GiB on a CPU rank, issue 34: the ``import`` phase of ``launch/memory_sweep.py``)
IMPORT_BASELINE_BYTES = int(0.45 * GiB)
OPTIMIZER_PIPELINE_DEPTH = 3
PARAM_STAGING_SLICES = 2
GRAD_BYTES_PER_PARAM = 4
#: reduce buckets live at once on a CPU rank while DeepSpeed reduces one (module docstring)
REDUCE_PATH_COPIES = 3
#: ``reduce_bucket_size`` (elements) a CPU rank runs with when the config leaves it out
#: (``integration/stage3.py``, ``auto_reduce_bucket_size``; DeepSpeed's own default is 5e8)
CPU_REDUCE_BUCKET_NUMEL = 20_000_000
MASTER_BYTES_PER_PARAM = 4


@dataclasses.dataclass
class DramBudget:
    """How a node's DRAM budget was derived (all in bytes).

    Attributes:
        host_bytes: memory the budget is cut from (MemAvailable for the runtime, DRAM size for a plan).
        margin_bytes: kept free for the OS, page cache and other processes.
        working_set_bytes: host working set of all local ranks (see :func:`host_working_set`).
        budget_bytes: what the DRAM tier may hold on this node (>= 0).
        local_ranks: ranks on the node that share it; per_rank_bytes: ``budget_bytes // local_ranks``.
    """
    host_bytes: int
    margin_bytes: int
    working_set_bytes: int
    budget_bytes: int
    local_ranks: int = 1

    @property
    def per_rank_bytes(self) -> int:
        return self.budget_bytes // max(self.local_ranks, 1)

    @property
    def shortfall_bytes(self) -> int:
        """Bytes missing for margin + working set (0 when the host can hold them)."""
        return max(self.margin_bytes + self.working_set_bytes - self.host_bytes, 0)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["per_rank_bytes"] = self.per_rank_bytes
        d["shortfall_bytes"] = self.shortfall_bytes
        return d


def safety_margin(total_host_bytes: int, min_free_bytes: int = MIN_FREE_BYTES,
                  free_fraction: float = FREE_FRACTION) -> int:
    """Bytes of host memory never given to the DRAM tier: ``max(min_free_bytes, free_fraction x total)``."""
    return max(int(min_free_bytes), int(free_fraction * total_host_bytes))


def explain_dram_budget(free_host_bytes: int, working_set_bytes: int = 0, *, total_host_bytes: int | None = None,
                        local_ranks: int = 1, min_free_bytes: int = MIN_FREE_BYTES,
                        free_fraction: float = FREE_FRACTION) -> DramBudget:
    """The :class:`DramBudget` of :func:`auto_dram_budget`, with its parts."""
    margin = safety_margin(total_host_bytes if total_host_bytes is not None else free_host_bytes,
                           min_free_bytes, free_fraction)
    budget = max(int(free_host_bytes) - margin - int(working_set_bytes), 0)
    return DramBudget(int(free_host_bytes), margin, int(working_set_bytes), budget, max(int(local_ranks), 1))


def auto_dram_budget(free_host_bytes: int, working_set_bytes: int = 0, *, total_host_bytes: int | None = None,
                     min_free_bytes: int = MIN_FREE_BYTES, free_fraction: float = FREE_FRACTION) -> int:
    """DRAM budget of a node in bytes: ``max(free - max(4 GiB, 10% of total) - working_set, 0)``.

    Args:
        free_host_bytes: host memory available (``MemAvailable`` of ``/proc/meminfo``), bytes.
        working_set_bytes: host memory the ranks need outside the budget (:func:`host_working_set`).
        total_host_bytes: host memory size the 10% refers to (default: ``free_host_bytes``).
        min_free_bytes / free_fraction: the safety margin's floor (bytes) and fraction.
    """
    return explain_dram_budget(free_host_bytes, working_set_bytes, total_host_bytes=total_host_bytes,
                               min_free_bytes=min_free_bytes, free_fraction=free_fraction).budget_bytes


def resolve_dram_budget(value: str | int | float, working_set_bytes: int = 0, *, local_ranks: int = 1,
                        field: str = "aidaptiv.dram_budget", meminfo: dict | None = None) -> DramBudget:
    """The node's DRAM budget from a config value: ``"auto"`` or a size (``"48GiB"``, ``5e10``).

    ``"auto"`` reads ``/proc/meminfo`` (or ``meminfo``: ``{"total_bytes", "available_bytes"}``) and
    applies :func:`explain_dram_budget`. Every rank of a node computes the same node budget and uses
    ``per_rank_bytes`` of it.

    Raises:
        AidaptivConfigError: (a ``ValueError``) naming ``field`` and the value, when it is neither
            ``"auto"`` nor a size, or when
            ``"auto"`` finds no ``/proc/meminfo``.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        if meminfo is None:
            from ..telemetry.sysinfo import host_memory
            meminfo = host_memory()
        if not meminfo.get("available_bytes"):
            raise AidaptivConfigError(f"{field}: 'auto' needs /proc/meminfo (MemAvailable), which this system does not "
                             f"expose. Fix: give a size such as '48GiB'.")
        return explain_dram_budget(meminfo["available_bytes"], working_set_bytes,
                                   total_host_bytes=meminfo.get("total_bytes"), local_ranks=local_ranks)
    n = parse_size(value, field)
    return DramBudget(host_bytes=n, margin_bytes=0, working_set_bytes=int(working_set_bytes), budget_bytes=n,
                      local_ranks=max(int(local_ranks), 1))


def host_working_set(largest_slice_partition_bytes: int, largest_subgroup_numel: int,
                     moment_bytes_per_param: int | float,
                     local_ranks: int = 1, rank_overhead_bytes: int = RANK_OVERHEAD_BYTES,
                     grad_window_bytes: int = 0, master_hold_bytes: int = 0) -> int:
    """Host memory (bytes) the local ranks need besides the DRAM budget (formula in the module docstring).

    Args:
        largest_slice_partition_bytes: one rank's partition of the largest parameter slice (bytes).
        largest_subgroup_numel: elements of the largest optimizer sub-group of a rank.
        moment_bytes_per_param: optimizer state bytes per element (8 for Adam's two fp32 moments).
        local_ranks: ranks on the node; rank_overhead_bytes: per-rank process allowance.
        grad_window_bytes: gradient accumulation slices open at once in backward
            (:class:`aidaptiv_ds.integration.gradients.GradientStore` ``window_bytes``).
        master_hold_bytes: parameter bytes kept for a master slot inside backward (:func:`master_hold_bytes`).
    """
    per_sg = math.ceil(largest_subgroup_numel
                       * (MASTER_BYTES_PER_PARAM + moment_bytes_per_param + GRAD_BYTES_PER_PARAM))
    per_rank = (rank_overhead_bytes + PARAM_STAGING_SLICES * largest_slice_partition_bytes
                + OPTIMIZER_PIPELINE_DEPTH * per_sg + int(grad_window_bytes) + int(master_hold_bytes))
    return int(local_ranks) * int(per_rank)


#: the read-ahead window's floor (``prefetch_bytes: "auto"``; about 0.1 s of reads at this project's drive rates)
def rides_forward(setting: bool | str, *, on_accelerator: bool) -> bool:
    """Whether the optimizer updates not done in ``step()`` ride the next forward.

    Args:
        setting: the ``aidaptiv.step_rides_forward`` value: True, False or ``"auto"``.
        on_accelerator: the forward computes on an accelerator (not a CPU rank).

    Returns:
        True for ``True``; for ``"auto"`` only on an accelerator, where the update's arithmetic runs
        on host cores the forward leaves idle (on a CPU rank it would take the forward's own cores:
        ``[Note: riding on CPU ranks]`` in ``integration/step_pipeline.py``); False otherwise. The
        runtime (``integration/stage3.py``) and the planner ask this one function.
    """
    return setting is True or (setting == "auto" and on_accelerator)


PREFETCH_FLOOR_BYTES = 256 << 20


def auto_prefetch_bytes(largest_slice_bytes: int) -> int:
    """The read-ahead window of ``prefetch_bytes: "auto"``, bytes: ``max(2 x largest_slice_bytes, 256 MiB)``
    (the current and the next fetch at least). One formula for the runtime (``Runtime.prefetch_bytes``)
    and the planner."""
    return int(max(2 * int(largest_slice_bytes), PREFETCH_FLOOR_BYTES))


#: sub-group slices the steps inside backward may hold: the one written back and the next one read
IN_BACKWARD_SLICES = 2


def in_backward_window_bytes(largest_slice_bytes: int) -> int:
    """Optimizer sub-group slices (bytes) that steps inside backward may hold in working memory at once:
    ``2 x largest_slice_bytes`` (the sub-group written back and the next one read); 0 when
    ``largest_slice_bytes`` is 0 (no step runs inside backward).

    Steps inside backward (:mod:`aidaptiv_ds.integration.backward_step`) run the optimizer pipeline
    *during* the backward phase, beside the read-ahead, the gradient window, DeepSpeed's buckets and the
    activations. Left unbounded the pipeline held three sub-groups' slices there (read ahead, stepping,
    written back), so a CPU rank peaked at backward + optimizer instead of their maximum (590M bf16,
    budget 0, no clipping: 2.69 GiB against 1.69 planned). Bounded by this window, the backward phase
    holds ``backward + window`` (what :func:`cpu_rank_working_set` counts). Two slices, not one: with
    one, the next sub-group's state is read only once the last one is written, and the backward pass
    waits for both (148M fp32 Llama, budget 0, no clipping: 1.4 s of I/O wait per step against 0.3
    unbounded). Not more where the optimizer phase would leave room (``optimizer - backward``): the
    runtime does not know the activations when it sets the window, and a window that filled that room
    put the step-1 peak 0.1 GiB higher at 590M-843M bf16. The runtime waits for write-backs to make room
    before it reads the next sub-group's state (``BackwardStepper.inflight_limit``).

    Args:
        largest_slice_bytes: host bytes of the largest sub-group's slice (fp32 master + state slots).
    """
    return max(int(largest_slice_bytes), 0) * IN_BACKWARD_SLICES


#: the largest split (elements) of a gradient partition whose fp64 norm copy goes to the reused scratch
#: (:class:`aidaptiv_ds.integration.grad_norms.NormScratch`): 256 MiB of fp64
NORM_SCRATCH_MAX_NUMEL = 1 << 25
#: DeepSpeed's split of ``_constant_buffered_norm2`` (``stage3.py:1960``, ``buffer_size``)
DEEPSPEED_NORM_SPLIT_NUMEL = 250_000_000


def master_hold_bytes(largest_master_slot_bytes: int) -> int:
    """Host bytes of parameter slices backward may keep alive for a sub-group's master slot until the
    sub-group's slice is read (fp32 parameters read from their master slots, steps inside backward):
    one master slot, ``largest_master_slot_bytes`` (4 B x the largest sub-group's elements in fp32).
    The runtime keeps no more (``MasterLinks.hold_limit``, ``integration/master_links.py``; [Note: master weights from
    the parameter reads] in ``integration/optimizer_swapper.py``); what does not fit is read again.

    Args:
        largest_master_slot_bytes: bytes of the largest sub-group's master weights.
    """
    return max(int(largest_master_slot_bytes), 0)


#: elements per tile of the host optimizer step (``integration/host_step.py``: 8 MiB of fp32)
OPTIMIZER_TILE_NUMEL = 1 << 21
#: tile-sized temporaries a tiled Adam/AdamW step may hold at once: the negated gradient (``maximize``),
#: the weight-decayed gradient (Adam's ``weight_decay``), ``exp_avg_sq.sqrt()`` and its division
#: (``torch/optim/adam.py``, ``_single_tensor_adam``)
OPTIMIZER_TILE_TEMPORARIES = 4
#: freed temporaries, in tiles, the heap keeps between tiles for the next tile to reuse
OPTIMIZER_KEPT_TILES = 4


def optimizer_scratch_bytes(tile_numel: int = OPTIMIZER_TILE_NUMEL, elem_bytes: int = 4,
                            widened_states: int = 0) -> int:
    """Host bytes the tiled optimizer step may take beside its sub-group's slice:
    :data:`OPTIMIZER_TILE_TEMPORARIES` live tile temporaries plus the freed ones the heap keeps between tiles
    (:data:`OPTIMIZER_KEPT_TILES`; ``integration/host_step.py`` [Note: the tiles' temporaries]): 8 x
    ``tile_numel`` x ``elem_bytes``, 64 MiB for the default fp32 tile; with moments stored narrower than the
    master weights, each tile's ``widened_states`` moments widened to fp32, twice (live and kept by the heap)
    ([Note: narrow moments] there). In whichever phase a step runs (inside backward or after).

    Args:
        tile_numel: elements per tile; elem_bytes: bytes per element (4: fp32 master weights).
        widened_states: moments widened per tile (2 for Adam's bf16 moments; 0 when they are fp32).
    """
    tile = max(int(tile_numel), 0) * int(elem_bytes)
    return (OPTIMIZER_TILE_TEMPORARIES + OPTIMIZER_KEPT_TILES + 2 * max(int(widened_states), 0)) * tile


def norm_scratch_bytes(largest_partition_numel: int) -> int:
    """Host bytes of the norm scratch in the backward phase of a CPU rank: 8 x the largest split of the
    rank's largest gradient partition (``min(numel, 250M)``), or 0 above :data:`NORM_SCRATCH_MAX_NUMEL`,
    where DeepSpeed's own fresh copy is taken instead (``integration/grad_norms.py``).

    Args:
        largest_partition_numel: elements of the rank's largest parameter partition.
    """
    need = min(max(int(largest_partition_numel), 0), DEEPSPEED_NORM_SPLIT_NUMEL)
    return 8 * need if need <= NORM_SCRATCH_MAX_NUMEL else 0


def process_phases(*, steps_bytes: int, baseline_bytes: int, largest_tensor_bytes: int,
                   largest_partition_bytes: int, largest_subgroup_numel: int, slot_bytes_per_param: int | float,
                   import_bytes: int = IMPORT_BASELINE_BYTES, tensor_on_host: bool = True) -> dict:
    """A rank's host memory (bytes) in each phase of the process, and the peak over them (issue 34):

    * ``construction``, the model built under ``deepspeed.zero.Init`` (``from_pretrained`` with ZeRO-3 too):
      each parameter is created whole (on the host for a CPU rank: ``tensor_on_host``), its partition is
      copied into the parameter swapper's buffer and staged once for its write (``param_swapper.py``
      ``get_buffer``, ``swap_out_and_release``), so ``import + largest tensor + 2 x its partition``;
    * ``initialization`` (``deepspeed.initialize``): sub-group by sub-group, DeepSpeed's fp32 buffer of the
      sub-group (``stage3.py`` ``_create_fp32_partitions``) and its zeroed gradient buffer of the largest
      sub-group (``initialize_optimizer_states``), our slice of the sub-group (master weights and state
      slots) and the partitions read for it: ``baseline + largest sub-group x (8 + slot bytes) + 2 x the
      largest partition``;
    * ``steps``: ``steps_bytes`` (the training steps' figure, e.g. :func:`cpu_rank_working_set` ``total``).

    Returns ``{"construction", "initialization", "steps", "peak"}`` (``peak`` the largest).

    Args:
        steps_bytes: host memory of the training steps besides the budget, baseline included.
        baseline_bytes: the rank once ``deepspeed.initialize`` returned (interpreter, libraries, modules).
        largest_tensor_bytes / largest_partition_bytes: the largest parameter whole / its partition per rank.
        largest_subgroup_numel: elements of the largest optimizer sub-group of the rank.
        slot_bytes_per_param: host bytes per element of a sub-group's slice (4 B master + moment bytes).
        import_bytes: the rank with torch, DeepSpeed and transformers imported (:data:`IMPORT_BASELINE_BYTES`).
        tensor_on_host: the whole parameter is created in host memory (a CPU rank); on a GPU it is VRAM.
    """
    construction = int(import_bytes) + (int(largest_tensor_bytes) if tensor_on_host else 0) \
        + 2 * int(largest_partition_bytes)
    initialization = int(baseline_bytes) + math.ceil(int(largest_subgroup_numel) * (2 * MASTER_BYTES_PER_PARAM
                                                                                  + slot_bytes_per_param)) \
        + 2 * int(largest_partition_bytes)
    steps = int(steps_bytes)
    return {"construction": construction, "initialization": initialization, "steps": steps,
            "peak": max(construction, initialization, steps)}


def deepspeed_sub_group_numels(partition_numels: list[int], sub_group_size: int) -> list[int]:
    """Elements of each optimizer sub-group DeepSpeed 0.19.8 makes of one rank's parameter partitions
    (``stage3.py`` ``_create_fp16_sub_groups``): partitions in parameter order are added to a sub-group
    until it holds ``sub_group_size`` elements or more, so a sub-group can reach ``sub_group_size +``
    the largest partition ``- 1`` (a 2e7-element sub-group of a Llama with hidden 2048 and an MLP of 5504:
    up to 2.6e7 elements). All of them one sub-group when ``sub_group_size`` covers them.

    Args:
        partition_numels: each parameter's partition on the rank, ``ceil(numel / dp)``, in parameter order.
        sub_group_size: ``zero_optimization.sub_group_size`` (elements).
    """
    parts = [int(n) for n in partition_numels]
    if not parts or int(sub_group_size) >= sum(parts):
        return [sum(parts)] if parts else []
    out, cur = [], 0
    for n in parts:
        cur += n
        if cur >= int(sub_group_size):
            out.append(cur)
            cur = 0
    if cur:
        out.append(cur)
    return out


def cpu_rank_working_set(*, readahead_bytes: int, grad_window_bytes: int, deepspeed_bytes: int,
                         activation_bytes: int, subgroup_numels: list[int], moment_bytes_per_param: int | float,
                         baseline_bytes: int = CPU_RANK_BASELINE_BYTES, in_backward_slice_bytes: int = 0,
                         norm_scratch: int = 0, master_hold: int = 0, step_scratch: int = 0,
                         ride_slice_bytes: int = 0, ride_param_bytes: int = 0,
                         partition_copy_bytes: int = 0) -> dict:
    """Host memory (bytes) one CPU rank needs besides the DRAM budget, by phase (module docstring).

    Args:
        readahead_bytes: the parameter read-ahead window (``Runtime.prefetch_bytes``: at least 256 MiB).
        grad_window_bytes: gradient accumulation slices open at once (2 x the largest sub-group's slice).
        deepspeed_bytes: DeepSpeed's own ZeRO-3 working set on a CPU rank (:func:`deepspeed_cpu_rank_bytes`).
        activation_bytes: activations of one micro-batch (0 where the sequence length is not known yet).
        subgroup_numels: elements of each of the rank's optimizer sub-groups (the pipeline holds the 3 largest).
        moment_bytes_per_param: optimizer state bytes per element (8 for Adam's two fp32 moments).
        baseline_bytes: the process itself (:data:`CPU_RANK_BASELINE_BYTES`).
        in_backward_slice_bytes: the largest sub-group's host slice when steps may run inside backward
            (0 when they cannot): the backward phase then also holds :func:`in_backward_window_bytes`.
        norm_scratch: the gradient-norm scratch of the backward phase (:func:`norm_scratch_bytes`).
        master_hold: parameter bytes kept for a master slot in the backward phase (:func:`master_hold_bytes`).
        step_scratch: the optimizer step's temporaries (:func:`optimizer_scratch_bytes`), in the optimizer
            phase and, with steps inside backward, in the backward phase.
        ride_slice_bytes: the largest sub-group's host slice when updates may ride the next forward
            (``integration/step_pipeline.py``; 0 when they cannot): the forward phase then holds the same
            two-slice window (:func:`in_backward_window_bytes`) and the step's temporaries beside the
            read-ahead, DeepSpeed's working set and the activations.
        ride_param_bytes: with ``ride_slice_bytes``, the largest sub-group's fp32 parameter bytes kept in DRAM
            for the forward after its update (``step_pipeline.py``, [Note: the updated parameters stay for the
            forward]; 0 where parameters are not read from their master slots).
        partition_copy_bytes: the partitions of DeepSpeed's gathered parameters held beside the gathered copies
            (:func:`live_partition_bytes` over several ranks; 0 over one, where they are the gathered
            parameters), in the forward and backward phases.

    Returns:
        ``{"baseline", "forward", "backward", "optimizer", "in_backward", "riding", "step_scratch", "total"}``,
        bytes; ``backward`` includes the ``in_backward`` window, ``forward`` the ``riding`` one;
        ``total = baseline + max(forward, backward, optimizer)``.
    """
    backward = (int(readahead_bytes) + int(grad_window_bytes) + int(deepspeed_bytes) + int(activation_bytes)
                + int(norm_scratch) + int(master_hold) + int(partition_copy_bytes))
    in_flight = sorted((int(n) for n in subgroup_numels), reverse=True)[:OPTIMIZER_PIPELINE_DEPTH]
    optimizer = math.ceil(sum(in_flight) * (MASTER_BYTES_PER_PARAM + moment_bytes_per_param + GRAD_BYTES_PER_PARAM))
    window = in_backward_window_bytes(in_backward_slice_bytes)
    scratch = int(step_scratch)
    optimizer += scratch
    backward += window + (scratch if window else 0)
    riding = in_backward_window_bytes(ride_slice_bytes) + (int(ride_param_bytes) if ride_slice_bytes else 0)
    forward = (int(readahead_bytes) + int(deepspeed_bytes) + int(activation_bytes) + riding
               + (scratch if riding else 0) + int(partition_copy_bytes))
    return {"baseline": int(baseline_bytes), "forward": forward, "backward": backward, "optimizer": optimizer,
            "in_backward": window, "riding": riding, "step_scratch": scratch,
            "total": int(baseline_bytes) + max(forward, backward, optimizer)}


def buffer_pool_bytes(phases: dict, deepspeed_bytes: int, activation_bytes: int = 0,
                      gathered_partition_bytes: int = 0) -> int:
    """The host buffer pool of a CPU rank (:mod:`aidaptiv_ds.io.pool`), bytes: the part of the planned
    working set that is aidaptiv_ds's own swap buffers in the backward phase, ``backward - DeepSpeed's working
    set - activations`` of :func:`cpu_rank_working_set` (read-ahead, gradient window, in-backward window,
    norm scratch, master hold, the partitions held beside DeepSpeed's gathered copies), plus
    ``gathered_partition_bytes``: the part of DeepSpeed's working set that is swap buffers (over one rank its
    gathered parameters are their partitions, [Note: the gathered parameters' partitions]). The runtime adds
    the DRAM budget, whose units are swap buffers too (``io/pool.py``, [Note: the budget's units in the pool]).
    Buffers beyond it are fresh memory, freed after use.

    [Note: why the backward's windows] Pages of the pool stay resident once touched, whichever phase touched
    them, so the pool must fit beside DeepSpeed's working set and the activations in backward. In the
    optimizer step (nothing else there) the plan's ``total`` holds it as well, since ``total >= baseline +
    backward``; where the optimizer pipeline needs more, the excess misses and is fresh memory, and a miss
    gives the pool's free pages back (``io/pool.py``, [Note: a miss gives the free pages back]), so
    resident stays what is in use. Sized by the larger of the two phases before (the optimizer pipeline of
    three sub-groups, with clipping on), the pool's pages from the optimizer step stayed resident through
    the next backward, on top of DeepSpeed's working set: a 93M bf16 Llama at budget 0 peaked at 2.10 GiB
    against the plan's 1.74 (1.65 without a pool; ``tests/test_plan_host_vs_rss.py``).

    Args:
        phases: the dict :func:`cpu_rank_working_set` returned.
        deepspeed_bytes, activation_bytes: what went into its ``backward`` that is not ours (torch's own
            allocations: DeepSpeed's gathered parameters and buckets, the activations).
        gathered_partition_bytes: the part of ``deepspeed_bytes`` that is swap buffers (at most all of it).
    """
    scratch = int(phases.get("step_scratch", 0))  # torch's temporaries, from the heap, not the pool
    ours = int(phases["backward"]) - int(deepspeed_bytes) - int(activation_bytes) - (
        scratch if phases.get("in_backward") else 0)
    return max(ours, 0) + min(int(gathered_partition_bytes), int(deepspeed_bytes))


#: Optimizer sub-groups in flight at once (read i+1, update i, write back i-1), bytes per element each
#: (fp32 master 4 + Adam moments 8 + gradient 4): what :func:`auto_sub_group_numel` sizes within 5% of memory.
PIPELINE_SUBGROUPS, PIPELINE_BYTES_PER_ELEMENT = 3, 16


def auto_sub_group_numel(model_numel: int, ranks: int, available_bytes_per_rank: int) -> int:
    """``sub_group_size`` (elements) the runtime uses where the config leaves it out
    (``integration/stage3.py``, ``auto_sub_group_size``): at least 4 sub-groups per rank, the 3 in flight within 5%
    of the rank's available host memory, between 1e6 elements (12 MB extents: large sequential I/O) and DeepSpeed's
    1e9. DeepSpeed's own default (1e9) makes a model of less than a billion parameters per rank one sub-group, whose
    read, update and write-back cannot overlap.

    Args:
        model_numel: parameters of the model; ranks: ranks its partitions spread over;
        available_bytes_per_rank: host memory available to one rank (bytes; 0: unknown, no memory bound).
    """
    per_rank = -(-int(model_numel) // max(int(ranks), 1))
    by_memory = int(0.05 * available_bytes_per_rank) // (PIPELINE_SUBGROUPS * PIPELINE_BYTES_PER_ELEMENT) \
        if available_bytes_per_rank else 10 ** 9
    return int(max(min(10 ** 9, by_memory, per_rank // 4), 10 ** 6))


def deepspeed_gathered_numel(max_live_numel: int, max_reuse_numel: int, largest_module_numel: int,
                             model_numel: int, persistent_numel: int = 0, held_layer_numel: int = 0) -> int:
    """Elements DeepSpeed holds gathered at once, at most: ``min(model, max(max_live, max_reuse) + 2 x largest
    module + persistent + a held layer)``.

    [Note: what bounds the gathered parameters] ``stage3_max_live_parameters`` bounds only the prefetch: a module
    call prefetches up to ``min(max_live - available, prefetch bucket)`` more elements
    (``partitioned_param_coordinator.py:453``), so prefetching ends past ``max_live`` by at most the last
    parameter it took. Releases do not look at it: a module's parameters are kept gathered when they are used
    again within ``stage3_max_reuse_distance`` elements of the trace (``__params_to_release``, ``:634-664``),
    which holds at most that distance plus the module straddling its end. The module being fetched on demand
    adds its own parameters to either. So what is gathered is bounded by the larger of the two knobs plus two
    modules, and by the model. Measured with DeepSpeed's CPU offload on the 10M fp32 Llama of the tests (hidden
    512, 4 layers, its largest module 536,576 elements; the coordinator's ``__n_available_params`` after every
    fetch and release, 3 steps): both knobs at DeepSpeed's 1e9, 9,851,392 (the whole model); ``max_live`` 1e5
    with the reuse distance left at 1e9, 9,851,392 as well, 98x the 1e5 the planner counted before; both at 1e5,
    537,088 (a module and a norm). DeepSpeed's advice for host or device memory, lowering
    ``stage3_max_live_parameters``, saves nothing unless ``stage3_max_reuse_distance`` goes down with it.
    Persistent parameters (each at most ``stage3_param_persistence_threshold`` elements, 1e5 by default) are
    gathered after every step and never released (``stage3.py:2840``, coordinator ``:640``): they come on top
    (a Llama's norms: 0.27M elements at 7B; a small model's every tensor). With frozen parameters and activation
    checkpointing, the frozen parameters a layer's recompute gathers are attributed to the module whose backward
    ran the recompute and stay gathered until that backward ends (coordinator ``:389-394``,
    ``update_recompute_parameters``): a layer's frozen parameters, not a module's, come on top. Measured (a stack
    of 8 blocks of six 64x64 Linear layers, five of them frozen, each block under non-reentrant
    ``torch.utils.checkpoint``; both knobs 2000): 24,960 elements gathered (a whole block) against 10,320 by the
    bound without it, 4,160 without checkpointing and 8,320 with checkpointing and nothing frozen
    (``tests/test_auto_budget_cpu.py``). A layer-major step (``engine.train_batch``) holds each block of the
    trunk gathered while the micro-batches pass it (``integration/train_batch.py``), outside the coordinator's
    count: measured on a 4-layer Llama (both knobs 2000 or 0), a whole layer (38,528 elements) against 19,408 by
    the bound without it (17,408 with knobs 0; micro-batch by micro-batch 8,768). So the bound adds what is held
    (:func:`aidaptiv_ds.integration.trunk.held_layer_numel`): for a model with a trunk (an HF decoder, whose runs
    may be layer-major and whose blocks HF checkpoints one at a time) its largest block whole, which covers a
    block's frozen parameters too (the engine cannot tell at initialisation whether a run is layer-major; the
    over-count of a run micro-batch by micro-batch is one layer less two modules, nothing where the knobs already
    cover the model, DeepSpeed's defaults below 1e9 parameters); for a model without one all its frozen
    parameters, since the region a script checkpoints is not known (a review found a ``ModuleDict`` of blocks
    keeping a block gathered and ``checkpoint_sequential``-style segments of two blocks keeping two).

    Args:
        max_live_numel: ``stage3_max_live_parameters`` (elements).
        max_reuse_numel: ``stage3_max_reuse_distance`` (elements).
        largest_module_numel: elements of the module with the most parameters of its own (what one fetch
            gathers; the largest parameter tensor of a model of linear layers).
        model_numel: parameters of the model.
        persistent_numel: elements of the persistent parameters (``ds_persist``).
        held_layer_numel: elements of one layer gathered outside the coordinator's bound: a layer-major step's
            held block, or a recomputed layer's frozen parameters
            (:func:`aidaptiv_ds.integration.trunk.held_layer_numel`; 0 for neither).
    """
    bound = max(int(max_live_numel), int(max_reuse_numel), 0) + 2 * max(int(largest_module_numel), 0) + max(
        int(persistent_numel), 0) + max(int(held_layer_numel), 0)
    return max(min(bound, int(model_numel)), 0)


def persistent_numel(tensor_numels, threshold: int) -> int:
    """Elements of the parameters DeepSpeed keeps persistent: each tensor of at most ``threshold`` elements
    (``stage3_param_persistence_threshold``; ``mark_persistent_parameters``, ``parameter_offload.py:317-329``,
    with ``model_persistence_threshold`` left at its unbounded default)."""
    return sum(int(n) for n in tensor_numels if int(n) <= int(threshold))


def deepspeed_cpu_rank_bytes(gathered_numel: int, model_numel: int, param_bytes_per_elem: int,
                             reduce_bucket_numel: int, grad_bytes_per_elem: int, *, partition_ranks: int) -> int:
    """Host bytes of DeepSpeed's own ZeRO-3 working set on a CPU rank (module docstring).

    Args:
        gathered_numel: elements DeepSpeed holds gathered at once (:func:`deepspeed_gathered_numel`).
        model_numel: parameters of the model (no more than the model can be live).
        param_bytes_per_elem: bytes of a gathered parameter element (the model dtype).
        reduce_bucket_numel: ``reduce_bucket_size`` (elements of the gradient bucket, ``stage3.py:387``).
        grad_bytes_per_elem: bytes of a bucket element (the gradient dtype).
        partition_ranks: ranks of the gradients' partition group (the data-parallel size).

    Returns:
        ``min(gathered, model) x param bytes + reduce_path_copies(partition_ranks) x min(reduce_bucket, model)
        x grad bytes`` (a bucket never holds more than the model's gradients).

    [Note: reuse distance 0 is no smaller bound] ``stage3_max_reuse_distance: 0`` releases each parameter after
    its module, but it does not bound what is gathered at once: from step 2 on (a complete trace) every module
    call, also of a module without parameters of its own, prefetches up to ``min(max_live - available, prefetch
    bucket)`` more (``partitioned_param_coordinator.py:453``), so the look-ahead grows to ``max_live``, and
    parameters prefetched past a backward use stay gathered until it (``:470-472``, ``:650``). A bound of the
    running module plus the prefetch bucket was tried (10298a0) and taken back: a simulation of DeepSpeed's
    coordinator on the 4.05B Llama trace held 1.09e9 elements at step 2 against that bound's 2.5e8, and the
    4.05B run it planned peaked 4% above its plan.
    """
    return (min(int(gathered_numel), int(model_numel)) * int(param_bytes_per_elem)
            + reduce_path_copies(partition_ranks) * min(int(reduce_bucket_numel), int(model_numel))
            * int(grad_bytes_per_elem))


def live_partition_bytes(gathered_numel: int, model_numel: int, param_bytes_per_elem: int, *,
                         partition_ranks: int) -> int:
    """Host bytes of the parameter partitions swapped in for the parameters DeepSpeed keeps gathered on a CPU
    rank whose parameters are offloaded to the cache tier: ``ceil(min(gathered, model) / partition_ranks) x
    param bytes``.

    [Note: the gathered parameters' partitions] A gather first swaps each parameter's partition into a host
    buffer of the parameter swapper (``Init._ensure_availability_of_partitioned_params``), and that buffer stays
    the partition (``ds_tensor``) until DeepSpeed releases the parameter
    (``partition_parameters.py:1806-1809``, ``remove_partition_and_release_buffers``). Over one rank the gather
    is skipped (``all_gather_coalesced``: ``_no_gather_coalesced`` where every partition group has one rank) and
    the gathered parameter *is* the partition: :func:`deepspeed_cpu_rank_bytes` counts those bytes as
    DeepSpeed's, but they are swap buffers, carved from the buffer pool. Over several ranks the partitions are
    held beside the gathered copies, host memory of their own. Measured on the 10M fp32 Llama of
    ``tests/test_budget_in_pool.py`` with the updates riding the forward: swap buffers of live partitions
    (38 MiB, nearly the whole model: DeepSpeed's ``stage3_max_live_parameters`` and
    ``stage3_max_reuse_distance`` of 1e9 keep what the backward uses again) filled the pool beside the
    budget's units, so 16-29 MB of optimizer slices a step missed it; a pool 40 MB larger missed nothing.

    Args:
        gathered_numel: elements DeepSpeed holds gathered at once (:func:`deepspeed_gathered_numel`).
        model_numel: parameters of the model.
        param_bytes_per_elem: bytes of a partition element (the model dtype).
        partition_ranks: ranks of the parameters' partition group (the data-parallel size).

    Raises:
        ValueError: ``partition_ranks`` below 1.
    """
    if int(partition_ranks) < 1:
        raise ValueError(f"partition_ranks {partition_ranks} must be at least 1")
    live = max(min(int(gathered_numel), int(model_numel)), 0)
    return -(-live // int(partition_ranks)) * int(param_bytes_per_elem)


def reduce_path_copies(partition_ranks: int) -> int:
    """Gradient buckets a CPU rank holds at once while one is reduced (module docstring): the bucket and,
    over a partition group of several ranks, the two copies DeepSpeed's reduce-scatter makes
    (``REDUCE_PATH_COPIES``); over one rank the bucket alone, the reduce-scatter being skipped.

    Raises:
        ValueError: ``partition_ranks`` below 1.
    """
    if int(partition_ranks) < 1:
        raise ValueError(f"partition_ranks={partition_ranks!r}: a partition group has at least one rank")
    return 1 if int(partition_ranks) == 1 else REDUCE_PATH_COPIES


@dataclasses.dataclass
class PrefetchPlan:
    """Read-ahead of parameter slices into the DRAM tier.

    Attributes:
        depth: slices read ahead of the one in use (0: nothing to prefetch from the cache tier).
        bytes: DRAM bytes the read-ahead occupies (``depth x slice_bytes``).
        slice_bytes: bytes of the largest slice partition the depth was sized with.
    """
    depth: int
    bytes: int
    slice_bytes: int


def prefetch_bytes_from_budget(residency: ResidencyPlan, slice_bytes: int, n_slices: int,
                               max_depth: int | None = None) -> PrefetchPlan:
    """Prefetch depth and bytes from what the budget has left after residency.

    ``depth = min(residency.cache_bytes // slice_bytes, n_slices - 1, max_depth)``; 0 when the
    parameters are resident (nothing is read from the cache tier) or ``slice_bytes`` is 0.
    """
    if residency.params_resident or slice_bytes <= 0 or n_slices <= 1:
        return PrefetchPlan(0, 0, int(slice_bytes))
    depth = min(residency.cache_bytes // slice_bytes, n_slices - 1)
    if max_depth is not None:
        depth = min(depth, int(max_depth))
    depth = max(int(depth), 0)
    return PrefetchPlan(depth, depth * int(slice_bytes), int(slice_bytes))


