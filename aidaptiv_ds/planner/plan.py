"""The capacity plan: where every byte of a ZeRO-3 fine-tuning run lives, what a step costs the drives.

Pure functions from a :class:`PlanInput` to a :class:`CapacityPlan`; nothing here touches the
machine. All sizes are bytes, times seconds, bandwidths GB/s (10^9 bytes per second), FLOP/s per GPU.
Formulas and their sources, in the order :func:`make_plan` applies them:

1. **Training state per parameter** (DeepSpeed ZeRO-3 with both offloads, measured on 0.19.8 in
   ``docs/deepspeed-seams.md`` Appendix A): 2 B bf16/fp16 parameter (4 B for fp32) + 4 B fp32
   gradient + 4 B fp32 master weight + optimizer moments (8 B for Adam/AdamW: two fp32 moments;
   4 B for Lion, SGD with momentum, Adagrad) = **18 B/param** for bf16 + AdamW. These are also the
   bytes DeepSpeed's own NVMe offload writes per parameter per step. Each rank holds the partition
   ``ceil(N / dp)`` of every tensor; its optimizer state is cut into sub-groups of
   ``sub_group_size`` elements (DeepSpeed default 1e9).
2. **Activations per GPU** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
   Transformer Models", sec. 4.1, eq. 1: ``s*b*h*(34 + 5*a*s/h)`` bytes per layer for 16-bit
   activations, GPT MLP ``f = 4h``, with dropout), generalised term by term to GQA, SwiGLU and
   no dropout (s: sequence, b: micro-batch, h: hidden, f: MLP width, a: heads, kv: k/v width)::

       norms      4*s*b*h                              (inputs of the two norms)
       attention  2*s*b*h + 2*s*b*(h + 2*kv)           (QKV input; Q, K, V)
                  + 2*s*b*h                            (output-projection input)
                  + 2*a*s^2*b (softmax output)         without flash attention, or
                  + 4*a*s*b   (log-sum-exp, fp32)      with flash attention (Dao et al. 2022)
                  + s*b*h + 3*a*s^2*b                  with dropout (masks, dropout output)
       MLP        2*s*b*h + 6*s*b*f  (SwiGLU: gate, up, down inputs)  or  2*s*b*h + 4*s*b*f
                  + s*b*h                              with dropout

   With ``f = 4h``, dropout and no flash attention this is exactly Korthikanti's 34 + 5as/h.
   With full activation checkpointing (their "full recomputation") a GPU stores each layer's
   input, ``2*s*b*h`` per layer, plus one layer's activations while it is recomputed. Logits add
   ``s*b*V*(2 + 4)`` (bf16 logits and the fp32 copy HF's loss takes). Activations stay on the GPU.
3. **VRAM working set per GPU**: ZeRO-3 gathers one slice (a transformer block, the embedding or
   the head) at a time; ``2 x`` the largest slice in the parameter dtype (the slice in use and the
   one prefetched) + its gradients in that dtype before reduce-scatter (``1 x``) + a reduce bucket of
   ``h^2`` 16-bit elements (the HF "auto" ``reduce_bucket_size``) + activations + 2 GiB for the CUDA
   context, cuBLAS workspaces and allocator slack (an allowance).
4. **Host**: margin, working set and the DRAM budget from :mod:`aidaptiv_ds.planner.auto`; what
   stays in DRAM from :func:`aidaptiv_ds.planner.residency.plan_residency` on one rank's state and
   budget (``budget // local ranks``); everything else is on the cache tier.
5. **Bytes per optimizer step** (per node = per rank x local ranks): the micro-batch-major schedule of
   :mod:`aidaptiv_ds.planner.schedule` (what the runtime does today) on the residency plan's bytes:
   written = ``ResidencyPlan.write_bytes_per_step`` plus the gradient slices the budget does not hold,
   written back after each micro-batch but the last (``(k-1) x``, measured); read = the parameters not in
   DRAM ``2 x`` per micro-batch (forward and backward), those gradient slices read back ``(k-1) x``,
   the optimizer state, the final gradients when the optimizer reads them after backward. The best
   case also subtracts one backward re-read per micro-batch for the parameter bytes the budget's
   leftover and the read-ahead window keep (design.md step 2). Layer-major beside it: item 10.
6. **Per drive**: bytes follow the store's weighted striping (``StripeLayout.share``) with
   weight = the drive's mean of read and write GB/s; the usable capacity is the striped logical
   capacity (``StripeLayout.logical_capacity``) of each drive's capacity less the store's reserve
   ``min(1 GiB, 2%)`` (``SlabStore._phys_caps``).
7. **Step time lower bound** = ``max(compute, max over drives of reads (best case) / read GB/s,
   max over drives of writes / write GB/s)``. Compute = training FLOPs / (dp x FLOP/s per GPU) with
   Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", sec. 2.1): ``6*N`` FLOPs per
   token plus ``6*L*s*d_attn`` for attention (forward ``2N + 2*L*s*d_attn``, backward twice
   that), ``N`` without embedding lookups; activation checkpointing adds one forward (``8N``).
8. **Endurance** (:func:`aidaptiv_ds.store.ledger.projection`, JEDEC JESD218 ratings): bytes per
   day = writes per step x steps per day (at the lower-bound step time unless a measured one is
   given, so DWPD is an upper bound); DWPD = bytes per day / capacity; rated TBW = capacity x
   rated DWPD x 365 x warranty years; days to rated TBW = rated TBW / bytes per day.
9. **Rule of thumb** (Phison aiDAPTIV+): about 20 B/param for full fine-tuning incl. activations and
   overheads (405B ~ 8 TB); reported next to our exact total for comparison.
10. **Gradient-accumulation schedules** (:func:`schedule_report`, formulas in
   :mod:`aidaptiv_ds.planner.schedule`): bytes read and written by the drives per optimizer step for
   micro-batch-major and layer-major (GreedySnake, arXiv 2512.17570) at ``grad_accum`` micro-batches, the
   layer-major boundary activations and where they live (DRAM within the budget the residency plan leaves
   free, the drives beyond it), host-device bytes, FLOPs, and a step-time estimate for each
   (``max`` and ``sum`` of drive, link and compute time). The verdict is unchanged by them.

Verdict: fits when (a) every GPU holds its working set, (b) the DRAM holds margin + working set
(and an explicit budget, when given), (c) the cache drives hold the non-resident state. For each
failing check the plan names the smallest single change that passes it (settings before hardware).
"""
from __future__ import annotations

import dataclasses
import math

from ..errors import AidaptivConfigError
from ..jsonsafe import finite
from ..store.ledger import SECONDS_PER_DAY, EnduranceRating, projection
from ..store.striping import StripeLayout
from ..tiers.unit import MOMENT_FORMATS
from ..units import GiB, format_bytes
from .auto import (
    CPU_RANK_BASELINE_BYTES,
    CPU_REDUCE_BUCKET_NUMEL,
    FREE_FRACTION,
    MASTER_BYTES_PER_PARAM,
    MIN_FREE_BYTES,
    RANK_OVERHEAD_BYTES,
    DramBudget,
    auto_prefetch_bytes,
    auto_sub_group_numel,
    deepspeed_cpu_rank_bytes,
    deepspeed_gathered_numel,
    deepspeed_sub_group_numels,
    explain_dram_budget,
    live_partition_bytes,
    persistent_numel,
    prefetch_bytes_from_budget,
    process_phases,
)
from .model_size import ModelShape
from .residency import ResidencyPlan, StateSizes, plan_residency
from .schedule import (
    DEFAULT_GPU,
    DEFAULT_MFU,
    DEFAULT_PCIE,
    GPU_PEAK_TFLOPS,
    LAYER_MAJOR,
    MICRO_BATCH_MAJOR,
    PCIE_PRESETS_GBPS,
    SCHEDULE_CHOICES,
    SCHEDULES,
    RankTraffic,
    Rates,
    schedule_cost,
)
from .working_set import RankPolicy, RankState, rank_working_set

PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: ``zero_optimization.offload_param.device`` values a plan takes (:attr:`PlanInput.offload_param`)
OFFLOAD_PARAM_DEVICES = ("nvme", "cpu", "none")
MOMENT_BYTES = {"adamw": 8, "adam": 8, "lion": 4, "sgd": 4, "adagrad": 4}
#: bytes per element of one optimizer state on the tiers, per ``aidaptiv.optimizer_state.moments`` (int8: the
#: code and its share of the block's fp32 scale, ``tiers/blockwise.py``)
MOMENT_ELEMENT_BYTES = {k: f.bytes_per_element for k, f in MOMENT_FORMATS.items()}
RULE_OF_THUMB_BYTES_PER_PARAM = 20
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
#: DeepSpeed 0.19.8's default of ``stage3_max_live_parameters`` (elements)
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000
#: DeepSpeed 0.19.8's default of ``stage3_max_reuse_distance`` (elements)
DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000
#: DeepSpeed 0.19.8's default of ``stage3_param_persistence_threshold`` (elements)
DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD = 100_000
VRAM_OVERHEAD_BYTES = 2 * GiB
STRIPE_UNIT = 1 << 20
DEFAULT_READ_GBPS = 7.0
DEFAULT_WRITE_GBPS = 6.0
GPU_SIZES_GB = (24, 32, 40, 48, 80, 96, 141, 192, 288)


def store_reserve(capacity: int) -> int:
    """Bytes the slab store leaves free on a drive: ``min(1 GiB, 2% of capacity)`` (``SlabStore._phys_caps``)."""
    return min(GiB, capacity // 50)


@dataclasses.dataclass
class CacheDrive:
    """One cache drive (one cache path) of a node.

    Attributes:
        capacity: bytes of the drive (or the filesystem of the path).
        path: the cache path, when known.
        read_gbps / write_gbps: sequential GB/s (``bench-io`` or the data sheet).
        rated_dwpd / warranty_years: endurance rating from the data sheet.
        free: bytes free on the path's filesystem now (None: the whole capacity is available).
    """
    capacity: int
    path: str | None = None
    read_gbps: float = DEFAULT_READ_GBPS
    write_gbps: float = DEFAULT_WRITE_GBPS
    rated_dwpd: float = EnduranceRating.rated_dwpd
    warranty_years: float = EnduranceRating.warranty_years
    free: int | None = None

    @property
    def weight(self) -> float:
        """Stripe weight: mean of read and write GB/s."""
        return (self.read_gbps + self.write_gbps) / 2

    @property
    def usable(self) -> int:
        """Bytes the store may fill: ``min(capacity, free) - min(1 GiB, 2% of capacity)``."""
        room = self.capacity if self.free is None else min(self.capacity, self.free)
        return max(room - store_reserve(self.capacity), 0)


@dataclasses.dataclass
class PlanInput:
    """What the user knows about the run and the machine (sizes in bytes).

    Attributes:
        shape: the model's tensors (per-layer shapes drive activations and the VRAM working set).
        n_params: parameter count; None: ``shape.n_params`` (exact).
        gpus: GPUs per node (with ``cpu_ranks``: ranks per node); nodes: nodes (data-parallel size
            ``dp = gpus x nodes``).
        vram: bytes per GPU (unused with ``cpu_ranks``); dram: bytes of host memory per node.
        drives: the cache drives of each node.
        dram_budget: explicit DRAM budget per node (None: automatic, see :mod:`.auto`).
        micro_batch / seq_len / grad_accum: per-GPU micro-batch (sequences), tokens per sequence,
            micro-batches per optimizer step.
        dtype: parameter dtype (``bf16``, ``fp16``, ``fp32``); optimizer: one of :data:`MOMENT_BYTES`.
        moments: the optimizer states' format on the tiers (``aidaptiv.optimizer_state.moments``: ``fp32``, or
            for Adam/AdamW ``bf16`` (half of :data:`MOMENT_BYTES`) or ``int8`` (block-quantized, 1.016 B each).
        activation_checkpointing / flash_attention / dropout: see the module docstring, item 2.
        logits_tokens: tokens per micro-batch whose logits the LM head computes (default ``micro_batch x
            seq_len``; fewer where the loss takes logits at the response positions only, the fine-tuning job's
            default: ``finetune/loop.py``); on CPU ranks logits and the loss are host memory.
        sub_group_size: optimizer sub-group in elements (DeepSpeed ``sub_group_size``); None: left out of the
            config, planned as the runtime picks it then (:attr:`sub_group_numel`).
        gpu_flops: peak FLOP/s per GPU for the compute bound (None: no compute bound).
        dataset_tokens / epochs: for writes per epoch and per run (None: not computed).
        step_time_s: a measured step time for the endurance pace (None: the lower bound).
        rank_overhead / vram_overhead: allowances (bytes) per GPU rank in DRAM and per GPU.
        cpu_rank_baseline: a CPU rank's process baseline (bytes, measured: :data:`CPU_RANK_BASELINE_BYTES`).
        max_live_parameters / max_reuse_distance / reduce_bucket_size: DeepSpeed's ``stage3_max_live_parameters``,
            ``stage3_max_reuse_distance`` and ``reduce_bucket_size`` (elements), host memory on CPU ranks (the
            gathered parameters: :func:`~aidaptiv_ds.planner.auto.deepspeed_gathered_numel`); defaults:
            DeepSpeed's 1e9 and 1e9, and the 2e7-element bucket a CPU rank runs with when the config leaves it
            out.
        param_persistence_threshold: DeepSpeed's ``stage3_param_persistence_threshold`` (elements): tensors of
            at most this many elements stay gathered (default DeepSpeed's 1e5).
        cpu_ranks: the ranks compute on the CPU (DeepSpeed's CPU accelerator; ``gpus`` then counts
            ranks): what a GPU would hold (gathered parameters, reduce buckets, activations) is host
            memory too; there is no VRAM check (see :func:`cpu_rank_host_bytes`).
        gradient_clipping: DeepSpeed's ``gradient_clipping`` (0: off). With clipping on, a step run
            inside backward must keep its gradients until the norm is known (they are stored like
            after backward); off, they are consumed at once and never written.
        step_in_backward: the ``aidaptiv.step_in_backward`` setting (``"auto"``, True, False): with
            ``"auto"`` or True (and not fp16) the optimizer steps inside backward, which needs a second
            copy of the non-resident optimizer state on the drives; ``"auto"`` falls back to stepping
            after backward when the drives lack that room, as the runtime's preflight does.
        step_rides_forward: the ``aidaptiv.step_rides_forward`` setting: True counts the riding window on
            a CPU rank (``"auto"`` and False keep the updates inside ``step()`` there).
        schedule: which gradient-accumulation schedules :attr:`CapacityPlan.schedules` shows: one of
            :data:`~aidaptiv_ds.planner.schedule.SCHEDULE_CHOICES` (``"both"``: side by side).
        link_gbps: host-device GB/s per direction per GPU for the schedules' estimate (None: the
            :data:`~aidaptiv_ds.planner.schedule.DEFAULT_PCIE` preset).
        gpu_mfu: the fraction of ``gpu_flops`` (or of the default GPU's peak) training sustains, for the
            schedules' compute estimate.
        trainable_params: the parameters the optimizer updates (LoRA: the adapters' count, printed by PEFT's
            ``print_trainable_parameters``), counted in ``n_params``; the rest are frozen: their partitions are read
            each step and written once, and they have no gradient, master weight or moment. None (or the whole
            count): all of them. The adapters' partitions are planned in sub-groups of at most ``sub_group_size``
            (DeepSpeed fills its sub-groups with whole tensors, many small adapters: the same to within one
            adapter per sub-group); their largest partition, which sizes the gradient norm's scratch, as at most
            a sub-group.
        offload_param: ``zero_optimization.offload_param.device``: ``"nvme"`` (aidaptiv_ds swaps the parameter
            partitions through the tiers), ``"cpu"`` (DeepSpeed keeps them in host memory: none of the drives'
            bytes, and every rank's partitions are host memory beside the budget) or ``"none"`` (DeepSpeed keeps
            them on the device: VRAM, or host memory on CPU ranks); the optimizer state is ours either way
            (``integration/stage3.py``: the same split).
        assumed: names of inputs that were defaulted rather than given (reported).
    """
    shape: ModelShape
    gpus: int
    vram: int
    dram: int
    drives: list[CacheDrive]
    n_params: int | None = None
    nodes: int = 1
    dram_budget: int | None = None
    micro_batch: int = 1
    seq_len: int = 4096
    grad_accum: int = 1
    dtype: str = "bf16"
    optimizer: str = "adamw"
    moments: str = "fp32"
    activation_checkpointing: bool = True
    flash_attention: bool = True
    dropout: bool = False
    sub_group_size: int | None = DEFAULT_SUB_GROUP_SIZE
    gpu_flops: float | None = None
    dataset_tokens: int | None = None
    epochs: float = 1.0
    step_time_s: float | None = None
    rank_overhead: int = RANK_OVERHEAD_BYTES
    cpu_rank_baseline: int = CPU_RANK_BASELINE_BYTES
    max_live_parameters: int = DEEPSPEED_MAX_LIVE_PARAMETERS
    max_reuse_distance: int = DEEPSPEED_MAX_REUSE_DISTANCE
    param_persistence_threshold: int = DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD
    reduce_bucket_size: int = CPU_REDUCE_BUCKET_NUMEL
    vram_overhead: int = VRAM_OVERHEAD_BYTES
    shape_source: str = "exact"
    cpu_ranks: bool = False
    gradient_clipping: float = 0.0
    step_in_backward: bool | str = "auto"
    step_rides_forward: bool | str = "auto"
    logits_tokens: int | None = None
    schedule: str = "both"
    link_gbps: float | None = None
    gpu_mfu: float = DEFAULT_MFU
    offload_param: str = "nvme"
    trainable_params: int | None = None
    assumed: list[str] = dataclasses.field(default_factory=list)

    @property
    def params(self) -> int:
        return int(self.n_params if self.n_params is not None else self.shape.n_params)

    @property
    def moment_bytes(self) -> int | float:
        """Bytes per parameter of the optimizer states on the tiers (:data:`MOMENT_BYTES`, halved for bf16
        moments, 2.03 for Adam's int8 moments with their scales)."""
        b = MOMENT_BYTES[self.optimizer] * MOMENT_ELEMENT_BYTES.get(self.moments, 4) / 4
        return int(b) if b == int(b) else b

    @property
    def dp(self) -> int:
        return self.gpus * self.nodes

    @property
    def trainable(self) -> int:
        """Parameters the optimizer updates (:attr:`trainable_params`, all where None)."""
        return self.params if self.trainable_params is None else min(int(self.trainable_params), self.params)

    @property
    def params_swapped(self) -> bool:
        """The parameter partitions go through aidaptiv_ds's tiers (``offload_param`` on ``nvme``)."""
        return self.offload_param == "nvme"

    @property
    def param_partition_bytes(self) -> int:
        """One rank's parameter partitions, ``ceil(N / dp)`` elements in the parameter dtype (bytes)."""
        return -(-self.params // max(self.dp, 1)) * PARAM_BYTES.get(self.dtype, 2)

    @property
    def deepspeed_param_host_bytes(self) -> int:
        """Host bytes of one rank's parameter partitions that DeepSpeed keeps there itself (``offload_param``
        ``"cpu"``, or ``"none"`` on CPU ranks); 0 when they are ours or on a GPU."""
        on_host = self.offload_param == "cpu" or (self.offload_param == "none" and self.cpu_ranks)
        return self.param_partition_bytes if on_host else 0

    @property
    def sub_group_numel(self) -> int:
        """The sub-group the run uses (elements): ``sub_group_size`` as given, else (None) what the runtime picks
        where the config leaves it out, from the parameters over the ranks and a rank's share of ``dram``
        (:func:`~aidaptiv_ds.planner.auto.auto_sub_group_numel`; the runtime takes the host's available memory,
        this the node's total: the pick grows with the DRAM a re-planned change adds)."""
        if self.sub_group_size is not None:
            return int(self.sub_group_size)
        return auto_sub_group_numel(self.params, self.dp, self.dram // max(self.gpus, 1))

    def validate(self) -> None:
        """Raises AidaptivConfigError (a ``ValueError``) naming the flag, the value and the fix for inputs
        that make no plan."""
        checks = [("--gpus", self.gpus, self.gpus >= 1, "give at least 1 GPU"),
                  ("--nodes", self.nodes, self.nodes >= 1, "give at least 1 node"),
                  ("--vram", self.vram, self.cpu_ranks or self.vram > 0, "give the memory of one GPU, e.g. 96GB"),
                  ("--dram", self.dram, self.dram > 0, "give the host memory of one node, e.g. 512GB"),
                  ("--cache", len(self.drives), len(self.drives) >= 1, "give at least one cache drive, e.g. 8TB"),
                  ("--micro-batch", self.micro_batch, self.micro_batch >= 1, "give 1 or more"),
                  ("--seq-len", self.seq_len, self.seq_len >= 1, "give 1 or more tokens"),
                  ("--grad-accum", self.grad_accum, self.grad_accum >= 1, "give 1 or more"),
                  ("--dtype", self.dtype, self.dtype in PARAM_BYTES, f"use one of {', '.join(PARAM_BYTES)}"),
                  ("--optimizer", self.optimizer, self.optimizer in MOMENT_BYTES,
                   f"use one of {', '.join(MOMENT_BYTES)}"),
                  ("--moments", self.moments, self.moments == "fp32" or (self.moments in MOMENT_FORMATS
                                                                           and self.optimizer in ("adam", "adamw")),
                   "use fp32, or bf16 or int8 with --optimizer adam or adamw"),
                  ("--sub-group-size", self.sub_group_size, self.sub_group_numel >= 1, "give 1 or more elements"),
                  ("--params", self.params, self.params >= 1, "give a positive parameter count such as 405e9"),
                  ("--schedule", self.schedule, self.schedule in SCHEDULE_CHOICES,
                   f"use one of {', '.join(SCHEDULE_CHOICES)}"),
                  ("--pcie-gbps", self.link_gbps, self.link_gbps is None or self.link_gbps > 0,
                   f"give positive GB/s or a preset ({', '.join(PCIE_PRESETS_GBPS)})"),
                  ("--mfu", self.gpu_mfu, 0 < self.gpu_mfu <= 1, "give a fraction in (0, 1], e.g. 0.5"),
                  ("--trainable-params", self.trainable_params,
                   self.trainable_params is None or 1 <= self.trainable_params <= self.params,
                   "give the trainable parameter count, from 1 to the model's (PEFT's print_trainable_parameters)"),
                  ("--offload-param", self.offload_param, self.offload_param in OFFLOAD_PARAM_DEVICES,
                   f"use one of {', '.join(OFFLOAD_PARAM_DEVICES)}")]
        groups = -(-self.params // max(self.dp, 1)) // max(self.sub_group_numel, 1)
        checks.append(("--sub-group-size", self.sub_group_size, groups <= 1_000_000,
                       "give at most a million sub-groups per rank, e.g. 1e9 elements (DeepSpeed's default)"))
        for d in self.drives:
            checks.append(("--cache", d.capacity, d.capacity > 0, "give each drive a capacity such as 2TB"))
            checks.append(("--cache read=/write=", (d.read_gbps, d.write_gbps), d.read_gbps > 0 and d.write_gbps > 0,
                           "give positive GB/s"))
        for flag, value, ok, fix in checks:
            if not ok:
                raise AidaptivConfigError(f"{flag}: {value!r} does not make a plan; fix: {fix}")


def even_sub_groups(numel: int, sub_group_size: int) -> list[int]:
    """``numel`` elements cut into sub-groups of ``sub_group_size`` and the rest (elements each)."""
    full, rest = divmod(int(numel), int(sub_group_size))
    return [int(sub_group_size)] * full + ([rest] if rest else [])


def state_sizes_for_rank(n_params: int, dp: int, param_bytes: int, moment_bytes: int | float,
                         sub_group_size: int, cpu_ranks: bool = False, trainable: int | None = None) -> StateSizes:
    """One rank's :class:`StateSizes`: its partition ``ceil(N / dp)`` in bytes per tensor kind.

    ``param_bytes`` per element for parameters and for gradients (DeepSpeed accumulates gradients in
    the model dtype unless ``data_types.grad_accum_dtype`` says otherwise, ``engine.py:1799-1810``),
    ``4 + moment_bytes`` per element for each optimizer sub-group of at most ``sub_group_size``
    elements (item 1 of the module docstring); one gradient slice per sub-group. fp32 parameters
    (``param_bytes`` 4) are read from the fp32 master weights, not written on their own
    (``StateSizes.alias_params``). ``cpu_ranks`` changes nothing here (kept for the callers). ``trainable``: the
    parameters the optimizer updates (None: all); only they have gradients and optimizer sub-groups, and only their
    partitions are written each step (a frozen one is written once and only read after).
    """
    numel = -(-int(n_params) // int(dp))
    t_numel = numel if trainable is None else -(-min(int(trainable), int(n_params)) // int(dp))
    groups = even_sub_groups(t_numel, int(sub_group_size))
    per = MASTER_BYTES_PER_PARAM + moment_bytes
    return StateSizes(param_bytes=numel * param_bytes, grad_bytes=t_numel * param_bytes,
                      subgroup_bytes=[math.ceil(g * per) for g in groups],
                      alias_params=param_bytes == MASTER_BYTES_PER_PARAM,
                      subgroup_param_bytes=[g * param_bytes for g in groups],
                      subgroup_grad_bytes=[g * param_bytes for g in groups],
                      param_write_bytes=None if trainable is None else t_numel * param_bytes)


def layer_activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, flash_attention: bool = True,
                           dropout: bool = False) -> int:
    """Bytes of activations one decoder layer keeps for backward (module docstring, item 2)."""
    s, b, h, f, a, kv = seq_len, micro_batch, shape.hidden_size, shape.intermediate_size, shape.num_heads, \
        shape.kv_dim
    sbh = s * b * h
    attn = 2 * sbh + 2 * s * b * (h + 2 * kv) + 2 * sbh
    attn += 4 * a * s * b if flash_attention else 2 * a * s * s * b
    mlp = 2 * sbh + (6 if shape.gated_mlp else 4) * s * b * f
    extra = 0
    if dropout:
        extra = sbh + sbh + (0 if flash_attention else 3 * a * s * s * b)
    return 4 * sbh + attn + mlp + extra


def activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, checkpointing: bool = True,
                     flash_attention: bool = True, dropout: bool = False) -> dict:
    """Activation bytes on one GPU for one micro-batch: ``{"layers", "logits", "total"}``.

    With ``checkpointing``: ``L x 2*s*b*h`` (layer inputs) + one layer's activations; without:
    ``L x`` :func:`layer_activation_bytes`. Logits: ``s*b*V*(2 + 4)``.
    """
    one = layer_activation_bytes(shape, seq_len, micro_batch, flash_attention, dropout)
    L = shape.num_layers
    layers = L * 2 * seq_len * micro_batch * shape.hidden_size + one if checkpointing else L * one
    logits = seq_len * micro_batch * shape.vocab_size * (2 + 4)
    return {"per_layer": one, "layers": layers, "logits": logits, "total": layers + logits}


#: host bytes per logit element of a CPU rank's training step besides the logits in the model dtype: the
#: loss's fp32 ``log_softmax``, and in backward its gradient and the logits' (fp32, measured: an fp32 LM head
#: and cross-entropy over 2048 x 49152 logits peak at 4.05 x the logits' bytes)
CPU_LOSS_BYTES_PER_LOGIT = 3 * 4


def cpu_activation_bytes(inp: PlanInput, act: dict) -> dict:
    """The activations of one micro-batch on a CPU rank (host memory): :func:`activation_bytes` counts 16-bit
    activations (a GPU's), a CPU rank keeps them in the model dtype (fp32: twice); its logits are those of
    ``logits_tokens`` tokens in the model dtype plus the loss's fp32 copies (:data:`CPU_LOSS_BYTES_PER_LOGIT`).
    Returns the dict of :func:`activation_bytes` with ``layers``, ``logits`` and ``total`` replaced."""
    pb = PARAM_BYTES[inp.dtype]
    layers = act["layers"] * pb // 2
    tokens = inp.logits_tokens if inp.logits_tokens is not None else inp.seq_len * inp.micro_batch
    logits = int(tokens) * inp.shape.vocab_size * (pb + CPU_LOSS_BYTES_PER_LOGIT)
    return {**act, "layers": layers, "logits": logits, "total": layers + logits}


def layer_major_cpu_activation_bytes(inp: PlanInput, act: dict) -> dict:
    """The activations a CPU rank holds outside the DRAM budget while ``engine.train_batch`` runs the
    ``grad_accum`` = k micro-batches of a step layer-major (``integration/layer_major.py``), from
    :func:`cpu_activation_bytes` of one micro-batch ``act``; ``x`` = ``micro_batch x seq_len x hidden x`` the
    parameter dtype's bytes (one block's input):

    * ``block``: one block's activations while it runs (forward) or is recomputed (backward), in the model
      dtype, as micro-batch-major with activation checkpointing holds them;
    * ``logits``: one micro-batch's logits and loss (each micro-batch's backward down to the trunk runs as soon
      as its loss is there, and frees them);
    * ``handed``: ``2k x``: each micro-batch's first-block input (with the embedding's graph, until the code
      before the trunk runs its backward) and the gradient handed from block to block;
    * ``boundary_window``: ``2k x``: the kept inputs of the block being recomputed and of the one read ahead.
      The other boundary activations are slices of the DRAM tier (inside the budget) or on the drives
      (:attr:`~aidaptiv_ds.planner.schedule.StepBytes.boundary`).

    Returns ``{"block", "logits", "handed", "boundary_window", "total"}`` (bytes).
    """
    x = inp.micro_batch * inp.seq_len * inp.shape.hidden_size * PARAM_BYTES[inp.dtype]
    k = max(1, int(inp.grad_accum))
    block = act["per_layer"] * PARAM_BYTES[inp.dtype] // 2  # activation_bytes counts 16-bit activations
    out = {"block": block, "logits": act["logits"], "handed": 2 * k * x, "boundary_window": 2 * k * x}
    return {**out, "total": sum(out.values())}


def training_flops_per_token(shape: ModelShape, n_params: int, seq_len: int, checkpointing: bool) -> float:
    """Training FLOPs per token (Kaplan et al. 2020, module docstring item 7).

    ``(6 or 8) x (N_matmul + L*s*d_attn)``, with ``N_matmul`` = ``n_params`` less the embedding
    lookups (scaled by the shape's fraction when ``n_params`` is not the shape's own count).
    """
    lookup = sum(t.numel for t in shape.embedding)
    if shape.tie_word_embeddings:
        lookup -= shape.vocab_size * shape.hidden_size  # the tied matrix is also the LM head matmul
    frac = 1 - lookup / shape.n_params
    d_attn = shape.num_heads * shape.head_dim
    mult = 8 if checkpointing else 6
    return mult * (n_params * frac + shape.num_layers * seq_len * d_attn)


@dataclasses.dataclass
class DrivePlan:
    """One cache drive of a node: its share of the state and of each step's I/O, and its endurance.

    Bytes, seconds, and the :func:`~aidaptiv_ds.store.ledger.projection` dict under ``endurance``.
    ``read_bytes_per_step`` counts the reads that find their bytes still in DRAM (the read-ahead's and the budget's
    hits) as not read, as ``read_time_s`` and the plan's per-step ``read_bytes_best`` do; the plan's per-step
    ``read_bytes`` is the figure where none hits.
    """
    path: str | None
    capacity: int
    usable: int
    share: float
    state_bytes: int
    read_bytes_per_step: int
    write_bytes_per_step: int
    read_time_s: float
    write_time_s: float
    read_gbps: float
    write_gbps: float
    writes_per_epoch: int | None
    writes_per_run: int | None
    run_tbw_fraction: float | None
    endurance: dict


@dataclasses.dataclass
class Verdict:
    """Fits or not; each problem with the smallest single change that solves it.

    Attributes:
        fits: every check passes.
        checks: check name (``"vram"``, ``"dram"``, ``"cache"``) -> True when it passes.
        problems: one sentence per failing check, with the numbers.
        changes: one fix per failing check (the smallest single change that passes that check;
            ``None`` when no single change tried does).
        fits_after_changes: the plan re-made with all ``changes`` applied fits (True), still does not
            (False), or some check has no change (None); see :func:`_fixes`.
    """
    fits: bool
    checks: dict
    problems: list[str]
    changes: list[str | None]
    fits_after_changes: bool | None = None

    @property
    def smallest_change(self) -> str | None:
        found = [c for c in self.changes if c]
        return " and ".join(found) if found else None


@dataclasses.dataclass
class CapacityPlan:
    """The plan of :func:`make_plan` (bytes, seconds). ``as_dict()`` gives the JSON of ``plan --json``.

    Attributes:
        inputs: the inputs as given (drives listed), with ``assumed`` naming defaulted ones.
        model: :meth:`ModelShape.as_dict` plus ``n_params`` and ``shape_source``.
        n_params / dp / local_ranks: parameters; data-parallel size; ranks per node.
        bytes_per_param: ``total_state_bytes / n_params``.
        state_bytes_per_param: parameter + gradient + master + moments bytes per parameter (18 for bf16/AdamW).
        total_state_bytes: training state of all ranks + activations of all GPUs.
        rule_of_thumb_bytes: 20 B x n_params (Phison aiDAPTIV+), for comparison.
        tiers: component -> {"vram", "dram", "cache"} bytes for the whole job.
        vram_per_gpu: the working set of one GPU by part, and ``"total"``.
        dram: :class:`~aidaptiv_ds.planner.auto.DramBudget` as a dict (per node).
        residency: one rank's :class:`~aidaptiv_ds.planner.residency.ResidencyPlan` as a dict.
        prefetch: depth and bytes of parameter read-ahead per rank.
        per_step: per node: bytes written, read, read (best case), tokens per step; ``write_bytes_if_clipped``: a step
            inside backward the clipping norm redoes; ``read_bytes_after_backward``: the steps after backward that
            follow a clipped one (the kept gradients read back: HF's default clipping 1.0 clips much of a run).
        step_time: ``{"compute_s", "io_read_s", "io_write_s", "lower_bound_s", "bound_by", "pace_s"}``.
        cpu_rank_host: with ``cpu_ranks``, one rank's :func:`cpu_rank_host_bytes` (else None).
        rank_host: one rank's host memory besides the DRAM budget in each phase of the process
            (:func:`~aidaptiv_ds.planner.auto.process_phases`: ``construction``, ``initialization``, ``steps``)
            and ``peak``, their maximum: what the DRAM check counts per rank.
        schedules: the gradient-accumulation schedules of :func:`schedule_report` (``inputs.schedule`` says
            which are shown).
        drives: one :class:`DrivePlan` per drive of a node.
        epoch: steps per epoch, epochs, run days (None without ``dataset_tokens``).
        verdict: :class:`Verdict`.
        wear: :func:`~aidaptiv_ds.planner.wear.assess_wear`: the drives' pace against their rated DWPD and
            what brings it within the rating (None for a plan made with ``wear=False``).
    """
    inputs: dict
    model: dict
    n_params: int
    dp: int
    local_ranks: int
    bytes_per_param: float
    state_bytes_per_param: int | float
    total_state_bytes: int
    rule_of_thumb_bytes: int
    tiers: dict
    vram_per_gpu: dict
    dram: dict
    residency: dict
    prefetch: dict
    per_step: dict
    step_time: dict
    drives: list[DrivePlan]
    epoch: dict
    verdict: Verdict
    cpu_rank_host: dict | None = None
    rank_host: dict | None = None
    wear: dict | None = None
    schedules: dict | None = None

    @property
    def fits(self) -> bool:
        return self.verdict.fits

    def as_dict(self) -> dict:
        """JSON-ready dict; infinite values (no writes: never reaches TBW) become ``None``."""
        d = dataclasses.asdict(self)
        d["fits"] = self.fits
        d["verdict"]["smallest_change"] = self.verdict.smallest_change
        return finite(d)


def _dec(n: float) -> str:
    return format_bytes(n, decimal=True)


def _layout(drives: list[CacheDrive]) -> StripeLayout:
    return StripeLayout(list(range(len(drives))), [d.weight for d in drives], STRIPE_UNIT)


def usable_cache_bytes(drives: list[CacheDrive]) -> int:
    """Bytes the store can hold striped over ``drives`` (module docstring, item 6)."""
    lay = _layout(drives)
    return lay.logical_capacity({i: d.usable // STRIPE_UNIT * STRIPE_UNIT for i, d in enumerate(drives)})


def _host_and_budget(inp: PlanInput, sizes: StateSizes, activations: int) -> tuple:
    """One rank's host working set besides the budget and the DRAM budget it leaves, under ``inp``'s policy:
    ``(cpu_rank_host or None, gpu_host or None, ws, DramBudget)``; ``ws`` is the node's (all local ranks)."""
    ranks, dp, pb, mb = inp.gpus, inp.dp, PARAM_BYTES[inp.dtype], inp.moment_bytes
    gpu_host = None
    if inp.cpu_ranks:  # the "GPU" working set is host memory outside the budget (integration/stage3.py: the same)
        cpu = cpu_rank_host_bytes(inp, sizes, activations)
        ws = cpu["total"] * ranks
    else:
        cpu = None
        # one calculation with the runtime's (planner/working_set.py): the staging partitions, the optimizer
        # pipeline, the gradient window (two sub-groups' accumulation slices) and the master hold
        state = rank_state(inp)
        steps = rank_working_set(state, rank_policy(inp)).total
        largest_sg = max(state.subgroup_numels, default=0)
        largest_param = _largest_param_numel(inp)
        gpu_host = process_phases(steps_bytes=steps, baseline_bytes=inp.rank_overhead, import_bytes=inp.rank_overhead,
                                  largest_tensor_bytes=largest_param * pb,
                                  largest_partition_bytes=-(-largest_param // dp) * pb,
                                  largest_subgroup_numel=largest_sg, slot_bytes_per_param=MASTER_BYTES_PER_PARAM + mb,
                                  tensor_on_host=False)
        ws = gpu_host["peak"] * ranks
    ws += inp.deepspeed_param_host_bytes * ranks  # held before the runtime reads MemAvailable: outside its budget
    auto = explain_dram_budget(inp.dram, ws, total_host_bytes=inp.dram, local_ranks=ranks)
    if inp.dram_budget is not None:
        return cpu, gpu_host, ws, DramBudget(inp.dram, auto.margin_bytes, ws, int(inp.dram_budget), ranks)
    return cpu, gpu_host, ws, auto


def _core(inp: PlanInput) -> dict:
    """The numbers of the three checks (shared by :func:`make_plan` and the change search)."""
    shape, N, dp, ranks = inp.shape, inp.params, inp.dp, inp.gpus
    pb, mb = PARAM_BYTES[inp.dtype], inp.moment_bytes
    sizes = state_sizes_for_rank(N, dp, pb, mb, inp.sub_group_numel, cpu_ranks=inp.cpu_ranks,
                                 trainable=inp.trainable_params)
    if not inp.params_swapped:  # DeepSpeed's partitions (offload_param cpu/none): none of the tiers' bytes, as the
        sizes.param_bytes, sizes.param_write_bytes, sizes.alias_params = 0, 0, False  # runtime's StateSizes
    slice_numel = shape.largest_slice_params
    if inp.n_params is not None and shape.n_params:
        slice_numel = int(slice_numel * N / shape.n_params)
    slice_part = -(-slice_numel // dp) * pb
    act = activation_bytes(shape, inp.seq_len, inp.micro_batch, inp.activation_checkpointing, inp.flash_attention,
                           inp.dropout)
    if inp.cpu_ranks:
        act = cpu_activation_bytes(inp, act)
    vram = {"gathered_params": 2 * slice_numel * pb, "slice_gradients": slice_numel * pb,
            "reduce_bucket": shape.hidden_size ** 2 * 2, "activations": act["total"],
            "overhead": inp.vram_overhead,
            "param_partitions": inp.param_partition_bytes if inp.offload_param == "none" and not inp.cpu_ranks else 0}
    vram["total"] = sum(vram.values())
    resolved = inp  # the input under the path the steps take (step_in_backward resolved below)
    cpu, gpu_host, ws, dram = _host_and_budget(resolved, sizes, act["total"])
    # steps inside backward (integration/stage3.py: the same choice, from the same record, and the same preflight)
    speculate = rank_working_set(rank_state(inp), rank_policy(inp)).may_step_in_backward
    usable = usable_cache_bytes(inp.drives)
    while True:
        sizes.grads_transient = speculate and not inp.gradient_clipping > 0
        sizes.steps_in_backward = speculate
        sizes.grad_accum = inp.grad_accum  # micro-batch-major, as the runtime plans it
        res = plan_residency(sizes, dram.per_rank_bytes)
        shadows = sum(b for i, b in enumerate(sizes.subgroup_bytes) if i not in res.resident_subgroups) \
            if speculate else 0
        nonres_rank = sizes.total - res.resident_bytes + shadows
        if not sizes.grads_stored:  # consumed by the step inside backward: never stored
            slices = sizes.grad_slices()
            nonres_rank -= sum(b for i, b in enumerate(slices) if i not in res.resident_grad_subgroups)
        if not speculate or inp.step_in_backward is True or nonres_rank * ranks <= usable:
            break
        speculate = False
        # the runtime cuts its budget again without the in-backward window ([Note: the budget follows the resolved
        # path], integration/stage3.py)
        resolved = dataclasses.replace(inp, step_in_backward=False)
        cpu, gpu_host, ws, dram = _host_and_budget(resolved, sizes, act["total"])
    return {"sizes": sizes, "slice_numel": slice_numel, "slice_part": slice_part, "dram": dram, "res": res,
            "act": act, "vram": vram, "cache_need": nonres_rank * ranks, "cache_usable": usable,
            "step_in_backward": speculate, "resolved": resolved, "shadow_bytes": shadows * ranks,
            "cpu_rank": cpu, "rank_host_phases": cpu if inp.cpu_ranks else gpu_host,
            "dram_need": dram.margin_bytes + ws + (dram.budget_bytes if inp.dram_budget is not None else 0)}


def _shape_scale(inp: PlanInput) -> float:
    """``n_params / shape`` when ``--params`` overrides the count, else 1."""
    return inp.params / inp.shape.n_params if inp.n_params is not None and inp.shape.n_params else 1.0


def _largest_param_numel(inp: PlanInput) -> int:
    """Elements of the model's largest parameter (scaled by ``n_params / shape`` when ``--params`` overrides the
    count), at least 1."""
    return max(int(max(inp.shape.largest_param_numel, 1) * _shape_scale(inp)), 1)


def grad_accum_bytes(dtype: str) -> int:
    """Bytes per element of DeepSpeed 0.19.8's gradient accumulation dtype, which our gradient store keeps
    (:class:`~aidaptiv_ds.integration.gradients.GradientStore`): the parameter dtype's for bf16/fp16, 4 for
    fp32 (``data_types.grad_accum_dtype`` unset)."""
    return PARAM_BYTES[dtype]


def rank_sub_group_numels(inp: PlanInput) -> list[int]:
    """One rank's optimizer sub-groups (elements) as DeepSpeed makes them from the model's parameters in
    module order (:func:`~aidaptiv_ds.planner.auto.deepspeed_sub_group_numels`): each partition
    ``ceil(numel / dp)``, every tensor scaled by ``n_params / shape`` when ``--params`` overrides the count."""
    if inp.trainable < inp.params:  # the adapters: their count in sub-groups of at most sub_group_size
        return even_sub_groups(-(-inp.trainable // inp.dp), inp.sub_group_numel)
    return deepspeed_sub_group_numels(_partition_numels(inp), inp.sub_group_numel)


def _partition_numels(inp: PlanInput) -> list[int]:
    """Each parameter's partition on a rank, ``ceil(numel / dp)`` elements in module order, every tensor scaled by
    ``n_params / shape`` when ``--params`` overrides the count (frozen ones too)."""
    scale = inp.params / inp.shape.n_params if inp.shape.n_params else 1.0
    return [-(-max(int(t.numel * scale), 1) // inp.dp) for t in inp.shape.tensors()]


def cpu_rank_host_bytes(inp: PlanInput, sizes: StateSizes, activations: int) -> dict:
    """Host bytes one CPU rank needs besides the DRAM budget (``--cpu-ranks``), as the runtime counts them
    for ``dram_budget: "auto"`` (``integration/stage3.py``): :func:`~aidaptiv_ds.planner.auto.cpu_rank_working_set`
    with the runtime's read-ahead window (``max(4 x the largest parameter partition, 256 MiB)``, at most
    the rank's parameter partitions: a small model's read-ahead cannot fill it), its
    gradient window (two sub-groups' accumulation slices), DeepSpeed's own working set from its knobs
    (:func:`~aidaptiv_ds.planner.auto.deepspeed_cpu_rank_bytes`: ``--max-live-parameters``,
    ``--reduce-bucket-size``; the reduce-scatter's two bucket copies only with ``dp`` > 1), the activations of
    one micro-batch, and like the runtime the optimizer step's tile scratch and, for fp32 parameters with
    steps inside backward, one master slot of parameter bytes kept from backward's reads. DeepSpeed's flat host gradient
    buffer (``stage3.py:786-800``) is not allocated on our backend: gradients live in the tiers like the
    rest of the state (:mod:`aidaptiv_ds.integration.grad_path`).

    Keys: ``baseline``, ``backward``, ``optimizer``, ``deepspeed``, ``activations``, ``readahead``, ``total``.
    """
    dp = inp.dp
    pb = PARAM_BYTES[inp.dtype]
    state = rank_state(inp)
    policy = cpu_rank_policy(inp, state, activations)
    ds, readahead = policy.deepspeed_bytes, policy.readahead_bytes
    ws = rank_working_set(state, policy)
    parts = ws.phases
    largest_param = _largest_param_numel(inp)
    largest_sg = max(state.subgroup_numels, default=0)
    phases = process_phases(steps_bytes=parts["total"], baseline_bytes=inp.cpu_rank_baseline,
                            largest_tensor_bytes=largest_param * pb,
                            largest_partition_bytes=-(-largest_param // dp) * pb, largest_subgroup_numel=largest_sg,
                            slot_bytes_per_param=MASTER_BYTES_PER_PARAM + inp.moment_bytes)
    return {**parts, "steps": parts["total"], "construction": phases["construction"],
            "initialization": phases["initialization"], "total": phases["peak"], "deepspeed": ds,
            "activations": int(activations), "readahead": min(readahead, state.param_bytes)}


def rank_state(inp: PlanInput) -> RankState:
    """One rank's state as DeepSpeed would build it from the model (:class:`~aidaptiv_ds.planner.working_set.RankState`,
    the record the runtime fills from DeepSpeed's optimizer): DeepSpeed's sub-groups, each partition
    ``ceil(numel / dp)`` (tensors scaled by ``n_params / shape`` when ``--params`` overrides the count),
    fp32 master weights and ``MOMENT_BYTES / 4`` optimizer states, fp32 parameters read from their master slots."""
    shape, N, dp = inp.shape, inp.params, inp.dp
    pb = PARAM_BYTES[inp.dtype]
    scale = N / shape.n_params if inp.n_params is not None and shape.n_params else 1.0
    largest_param = _largest_param_numel(inp)
    numels = tuple(rank_sub_group_numels(inp))  # DeepSpeed's: up to sub_group_size + a partition
    slice_numel = int(shape.largest_slice_params * scale)
    ours = inp.params_swapped  # no parameter swapper: nothing staged, no fp32 parameter read from a master slot
    largest_part = -(-largest_param // dp)  # of a trainable parameter (the adapters: at most a sub-group of them)
    if inp.trainable < N:
        largest_part = min(largest_part, max(numels, default=0))
    all_parts = sum(_partition_numels(inp)) if inp.trainable < N else sum(numels)
    return RankState(subgroup_numels=numels, grad_numels=numels, largest_partition_numel=largest_part,
                     param_bytes=all_parts * pb, largest_subgroup_param_bytes=max(numels, default=0) * pb,
                     staging_partition_bytes=-(-slice_numel // dp) * pb if ours else 0,
                     accum_elsize=grad_accum_bytes(inp.dtype),
                     state_elsize=MASTER_BYTES_PER_PARAM, states=MOMENT_BYTES[inp.optimizer] // MASTER_BYTES_PER_PARAM,
                     alias=ours and inp.dtype == "fp32", moments=None if inp.moments == "fp32" else inp.moments)


def shape_gathered_numel(shape: ModelShape | None, model_numel: int, *, max_live_numel: int, max_reuse_numel: int,
                         persistence_threshold: int, scale: float = 1.0) -> int:
    """Elements DeepSpeed keeps gathered on a rank of a model of ``shape``
    (:func:`~aidaptiv_ds.planner.auto.deepspeed_gathered_numel`): a module being its largest parameter tensor, the
    tensors of at most ``persistence_threshold`` elements persistent, and its largest block held (a decoder has a
    trunk, so its runs may be layer-major: :func:`aidaptiv_ds.integration.trunk.held_layer_numel`, as the runtime
    counts it); with no shape known, a module may be the whole model and nothing is counted persistent or held. A
    built model is counted from its module tree instead (``integration/zero_params.py``, as the runtime does).

    Args:
        shape: the model's :class:`~aidaptiv_ds.planner.model_size.ModelShape`, or None.
        model_numel: parameters of the model.
        max_live_numel / max_reuse_numel / persistence_threshold: ``stage3_max_live_parameters``,
            ``stage3_max_reuse_distance``, ``stage3_param_persistence_threshold`` (elements).
        scale: the factor ``--params`` scales the shape's tensors by (the largest tensor and block; persistent
            tensors stay as the shape has them).
    """
    if shape is None:
        return deepspeed_gathered_numel(max_live_numel, max_reuse_numel, model_numel, model_numel)
    largest = max(int(max(shape.largest_param_numel, 1) * scale), 1)
    block = int(max((sum(t.numel for t in b) for b in shape.blocks), default=0) * scale)
    persistent = persistent_numel((t.numel for t in shape.tensors()), persistence_threshold)
    return deepspeed_gathered_numel(max_live_numel, max_reuse_numel, largest, model_numel, persistent, block)


def cpu_rank_policy(inp: PlanInput, state: RankState, activations: int) -> RankPolicy:
    """A CPU rank's :class:`~aidaptiv_ds.planner.working_set.RankPolicy` as the runtime fills it: the read-ahead
    window the parameter swapper asks for (2 x the largest partition, ``prefetch_bytes: "auto"``; none, and no
    pooled partitions, where DeepSpeed keeps the parameters: ``offload_param`` cpu or none), DeepSpeed's
    working set from ``--max-live-parameters``, ``--max-reuse-distance``, ``--param-persistence-threshold`` and
    ``--reduce-bucket-size`` (a module being the largest parameter tensor), and ``activations`` (bytes)."""
    pb = PARAM_BYTES[inp.dtype]
    gathered = shape_gathered_numel(inp.shape, inp.params, max_live_numel=inp.max_live_parameters,
                                    max_reuse_numel=inp.max_reuse_distance,
                                    persistence_threshold=inp.param_persistence_threshold, scale=_shape_scale(inp))
    ds = deepspeed_cpu_rank_bytes(gathered, inp.params, pb, inp.reduce_bucket_size,
                                  grad_accum_bytes(inp.dtype), partition_ranks=inp.dp)
    ours = inp.params_swapped  # the read-ahead and the pooled partitions are our parameter swapper's
    live = live_partition_bytes(gathered, inp.params, pb, partition_ranks=inp.dp) if ours else 0
    largest_part = -(-_largest_param_numel(inp) // inp.dp)  # of any parameter the swapper reads, frozen ones too
    return rank_policy(inp, readahead_bytes=auto_prefetch_bytes(2 * largest_part * pb) if ours else 0,
                       deepspeed_bytes=ds, live_partition_bytes=live, gather_ranks=inp.dp,
                       activation_bytes=activations)


def rank_policy(inp: PlanInput, **inputs) -> RankPolicy:
    """The plan's :class:`~aidaptiv_ds.planner.working_set.RankPolicy`: the user's settings and ``inputs``
    (``readahead_bytes``, ``deepspeed_bytes``, ``activation_bytes``)."""
    return RankPolicy(cpu_rank=inp.cpu_ranks, step_in_backward=inp.step_in_backward,
                      step_rides_forward=inp.step_rides_forward, fp16=inp.dtype == "fp16",
                      baseline_bytes=inp.cpu_rank_baseline, rank_overhead_bytes=inp.rank_overhead, **inputs)


def _checks(inp: PlanInput, c: dict) -> dict:
    return {"vram": inp.cpu_ranks or c["vram"]["total"] <= inp.vram, "dram": c["dram_need"] <= inp.dram,
            "cache": c["cache_need"] <= c["cache_usable"]}


def _passes(inp: PlanInput, check: str) -> bool:
    return _checks(inp, _core(inp))[check]


def _smallest_change(inp: PlanInput, check: str) -> tuple[str, PlanInput] | None:
    """The smallest change, settings before hardware, that makes ``check`` pass: its description and
    the changed input (or None).

    vram: activation checkpointing, flash attention, then halving the micro-batch (cumulative, the
    gradient accumulation grows to keep the batch), then the next GPU size, then shorter sequences;
    dram: smaller optimizer sub-groups, a lower explicit budget; on CPU ranks (activations and gathered
    slices are host memory there) the activation settings of vram; then more DRAM (64 GB steps);
    cache: more (empty) drives like the last one.
    """
    r = dataclasses.replace

    def activation_settings(inp: PlanInput, check: str):
        cur, done = inp, list[str]()
        if not cur.activation_checkpointing:
            cur, done = r(cur, activation_checkpointing=True), done + ["enable activation checkpointing"]
            if _passes(cur, check):
                return " and ".join(done), cur
        if not cur.flash_attention:
            cur, done = r(cur, flash_attention=True), done + ["use flash attention (attn_implementation='sdpa')"]
            if _passes(cur, check):
                return " and ".join(done), cur
        mb = cur.micro_batch // 2
        while mb >= 1:
            ga = cur.grad_accum * max(cur.micro_batch // mb, 1)
            nxt = r(cur, micro_batch=mb, grad_accum=ga)
            if _passes(nxt, check):
                return " and ".join(done + [f"reduce micro-batch to {mb} (gradient accumulation {ga} keeps the "
                                            f"batch)"]), nxt
            mb //= 2
        return None, r(cur, micro_batch=1, grad_accum=cur.grad_accum * cur.micro_batch), done

    def shorter_sequences(cur: PlanInput, done: list, check: str):
        sl = cur.seq_len // 2
        while sl >= 256:
            if _passes(r(cur, seq_len=sl), check):
                return " and ".join(done + ([] if inp.micro_batch == 1 else ["reduce micro-batch to 1"])
                                    + [f"shorten sequences to {sl} tokens"]), r(cur, seq_len=sl)
            sl //= 2
        return None

    if check == "vram":
        found = activation_settings(inp, check)
        if len(found) == 2:
            return found
        _, cur, done = found
        for gb in GPU_SIZES_GB:
            if gb * 10**9 > inp.vram and _passes(r(inp, vram=gb * 10**9), check):
                return f"use GPUs with {gb} GB or more", r(inp, vram=gb * 10**9)
        return shorter_sequences(cur, done, check)
    if check == "dram":
        sg = inp.sub_group_numel // 2
        while sg >= 10**7:
            if inp.dram_budget is None and _passes(r(inp, sub_group_size=sg), check):
                return f"reduce sub_group_size to {sg:.0e} elements", r(inp, sub_group_size=sg)
            sg //= 2
        if inp.dram_budget is not None:
            fit = inp.dram - _core(r(inp, dram_budget=0))["dram_need"]
            if fit >= 0:
                return f"lower the DRAM budget to {_dec(fit)} or less (or use 'auto')", r(inp, dram_budget=fit)
        if inp.cpu_ranks:  # activations are host memory: the activation settings, on top of the smallest sub-groups
            base, pre = inp, []
            if inp.dram_budget is None and inp.sub_group_numel > 10**7:
                base, pre = r(inp, sub_group_size=10**7), ["reduce sub_group_size to 1e+07 elements"]
            found = activation_settings(base, check)
            if len(found) == 2:
                return " and ".join(pre + [found[0]]), found[1]
            seq = shorter_sequences(found[1], found[2], check)
            if seq:
                return " and ".join(pre + [seq[0]]), seq[1]
        step = 64 * 10**9
        need = _core(inp)["dram_need"]
        more = -(-need // step) * step
        return f"use {_dec(more)} of DRAM or more", r(inp, dram=more)
    # cache
    d0 = inp.drives[-1]
    for k in range(1, 65):
        more = r(inp, drives=inp.drives + [dataclasses.replace(d0, path=None, free=None)] * k)
        if _passes(more, check):
            return (f"add {k} cache drive{'s' if k > 1 else ''} of {_dec(d0.capacity)} "
                    f"({len(inp.drives) + k} in all)"), more
    return None


def _fixes(inp: PlanInput, checks: dict) -> tuple[list[str | None], bool | None]:
    """One change per failing check (in the order vram, dram, cache), and whether the plan re-made
    with all of them applied together fits (None when some check has no change).

    [Note: re-planning.] Each change is searched for its own check, but they interact (a smaller
    micro-batch lowers the DRAM need on CPU ranks; more DRAM raises the auto budget and so what stays
    off the drives), so the plan is made again with every change applied; a check that fails then
    gets a further change on top, at most three rounds, and only a combination that was re-planned
    and fits is reported as fitting.
    """
    changes: list[str | None] = []
    cur = inp
    for name in ("vram", "dram", "cache"):
        if checks[name]:
            continue
        found = _smallest_change(cur, name)
        changes.append(found[0] if found else None)
        if found:
            cur = found[1]
    if any(c is None for c in changes):
        return changes, None
    for _ in range(3):
        after = _checks(cur, _core(cur))
        if all(after.values()):
            return changes, True
        for name in ("vram", "dram", "cache"):
            if after[name]:
                continue
            found = _smallest_change(cur, name)
            if not found:
                return changes, False
            changes[-1] = f"{changes[-1]}, then {found[0]}" if changes else found[0]
            cur = found[1]
    return changes, all(_checks(cur, _core(cur)).values())


def rank_traffic(inp: PlanInput, c: dict) -> RankTraffic:
    """One rank's :class:`~aidaptiv_ds.planner.schedule.RankTraffic` (the schedules' inputs, bytes and FLOPs)
    from the plan's core numbers (``_core``: the state sizes and the residency plan the runtime makes).

    Where each term comes from: ``P`` = the rank's parameter partitions unless the residency plan keeps them
    in DRAM (``ResidencyPlan.params_resident``); ``G`` = the gradient slices (``StateSizes.grad_slices``) not
    in ``resident_grad_subgroups``; ``Gf`` = ``G`` unless the gradients are consumed inside backward
    (``grads_transient``); ``Gr`` = ``Gf`` unless the optimizer steps inside backward (which uses the DRAM
    copy: the stories260K ledger reads 14.0 B/param/step in bf16 with clipping on as with it off);
    ``O`` = the sub-groups not in ``resident_subgroups``; ``Pw`` and ``Or`` = the residency plan's bytes
    written and read per step less the gradient and optimizer terms (so ``Or`` keeps its fp32
    master-weight credit); ``F`` = ``ResidencyPlan.cache_bytes``; ``W`` = the runtime's read-ahead window
    (``auto_prefetch_bytes`` of the largest slice partition); ``a`` = ``micro_batch x seq_len x hidden x``
    the parameter dtype's bytes ``x`` blocks (the activation dtype is the parameters'); ``Pp`` =
    :attr:`PlanInput.param_partition_bytes` (every rank's partitions cross the link wherever the host keeps them:
    the drives or, with ``offload_param`` cpu, DeepSpeed's host memory; 0 with ``offload_param`` none, where they
    stay on the GPU); ``Gp`` = ``StateSizes.grad_bytes``; FLOPs per micro-batch = :func:`training_flops_per_token` x
    ``micro_batch x seq_len`` (layer-major with checkpointing always: it recomputes each block's forward).
    """
    sizes: StateSizes = c["sizes"]
    res: ResidencyPlan = c["res"]
    shape = inp.shape
    params = 0 if res.params_resident else sizes.param_bytes
    grads = sum(b for i, b in enumerate(sizes.grad_slices()) if i not in res.resident_grad_subgroups)
    grad_final = 0 if sizes.grads_transient else grads
    opt = sum(b for i, b in enumerate(sizes.subgroup_bytes) if i not in res.resident_subgroups)
    # the residency plan's bytes count the gradients at the plan's grad_accum; the schedules add their own
    tokens = inp.micro_batch * inp.seq_len
    return RankTraffic(
        grad_accum=inp.grad_accum, param_read=params,
        param_write=res.write_bytes_per_step - res.grad_bytes_per_step - opt,
        grad_slices=grads, grad_final_write=grad_final, grad_final_read=0 if sizes.steps_in_backward else grad_final,
        optimizer_read=res.read_bytes_per_step - 2 * params - res.grad_bytes_per_step, optimizer_read_full=opt,
        optimizer_write=opt, dram_free=res.cache_bytes, window=auto_prefetch_bytes(c["slice_part"]),
        boundary_per_micro_batch=tokens * shape.hidden_size * PARAM_BYTES[inp.dtype] * shape.num_layers,
        param_partition=0 if inp.offload_param == "none" else inp.param_partition_bytes,
        grad_partition=sizes.grad_bytes,
        flops_micro_batch_major=training_flops_per_token(shape, inp.params, inp.seq_len,
                                                         inp.activation_checkpointing) * tokens,
        flops_layer_major=training_flops_per_token(shape, inp.params, inp.seq_len, True) * tokens)


def _schedule_rates(inp: PlanInput) -> tuple[Rates, dict]:
    """The :class:`~aidaptiv_ds.planner.schedule.Rates` of a node of ``inp`` and how each was chosen (JSON)."""
    lay = _layout(inp.drives)
    drives = tuple((lay.share(i), d.read_gbps, d.write_gbps) for i, d in enumerate(inp.drives))
    link = None if inp.cpu_ranks else (inp.link_gbps or PCIE_PRESETS_GBPS[DEFAULT_PCIE])
    peak = inp.gpu_flops or (None if inp.cpu_ranks else GPU_PEAK_TFLOPS[DEFAULT_GPU] * 1e12)
    rates = Rates(drives=drives, ranks=inp.gpus, link_gbps=link,
                  device_flops=peak * inp.gpu_mfu if peak else None)
    info = {"drives": [{"share": s, "read_gbps": r, "write_gbps": w} for s, r, w in drives],
            "link_gbps": link,
            "link_source": "none (CPU ranks)" if inp.cpu_ranks else
            "given (--pcie-gbps)" if inp.link_gbps else f"preset {DEFAULT_PCIE}",
            "peak_flops": peak,
            "peak_source": "given (--gpu-tflops)" if inp.gpu_flops else
            "not estimated (CPU ranks: give --gpu-tflops)" if inp.cpu_ranks else f"preset {DEFAULT_GPU}",
            "mfu": inp.gpu_mfu, "device_flops": rates.device_flops}
    return rates, info


def schedule_costs(inp: PlanInput, c: dict) -> dict:
    """Both schedules' :func:`~aidaptiv_ds.planner.schedule.schedule_cost` (name -> dict) for ``inp`` and its
    core numbers ``c``; layer-major also gets ``cache_bytes_needed`` (the state the drives hold, with its
    boundary activations beyond the DRAM budget) and ``cache_fits`` (within the usable capacity)."""
    t = rank_traffic(inp, c)
    rates, _ = _schedule_rates(inp)
    out = {name: schedule_cost(name, t, rates, inp.nodes, inp.params) for name in SCHEDULES}
    for cost in out.values():
        need = c["cache_need"] + cost["boundary_activations"]["drive"]
        cost.update(cache_bytes_needed=need, cache_fits=need <= c["cache_usable"])
    if inp.cpu_ranks:  # what a CPU rank holds besides the DRAM budget under each schedule
        out[SCHEDULES[0]]["rank_host_bytes"] = c["cpu_rank"]["total"]
        lm = layer_major_cpu_activation_bytes(inp, c["act"])
        out[LAYER_MAJOR]["rank_host_bytes"] = cpu_rank_host_bytes(c["resolved"], c["sizes"], lm["total"])["total"]
        out[LAYER_MAJOR]["rank_activations"] = lm
    return out


def schedule_report(inp: PlanInput, c: dict, costs: dict | None = None) -> dict:
    """The ``schedules`` of the plan (module docstring, item 10): ``grad_accum``, ``shown`` (the schedules
    ``inp.schedule`` selects), the ``rates`` used and their sources, the formula and assumptions as text,
    one :func:`schedule_costs` entry per shown schedule, and with both ``layer_major_speedup`` (micro-batch-
    major's ``estimate_s`` over layer-major's)."""
    costs = costs or schedule_costs(inp, c)
    _, info = _schedule_rates(inp)
    shown = list(SCHEDULES) if inp.schedule == "both" else [inp.schedule]
    out: dict = {
        "grad_accum": inp.grad_accum, "shown": shown, "rates": info,
        "formula": "estimate = max(drives, link, compute), serial = drives + link + compute; drives = max over "
                   "drives of reads/read GB/s + writes/write GB/s (a drive serves them in turn; the 'step time >=' "
                   "line overlaps them); link = max(host->device, device->host) / link GB/s; compute = FLOPs / "
                   "(peak x mfu)",
        "assumptions": "an estimate: sequential drive rates, no latency, no GPU-to-GPU traffic"
                       + ("; layer-major as GreedySnake (arXiv 2512.17570) schedules it and the runtime's "
                          "engine.train_batch runs it (issue 38)" if LAYER_MAJOR in shown else ""),
    }
    for name in shown:
        out[name] = costs[name]
    if len(shown) == 2:
        lm = costs[SCHEDULES[1]]["step_time"]["estimate_s"]
        out["layer_major_speedup"] = costs[SCHEDULES[0]]["step_time"]["estimate_s"] / lm if lm else None
    return out


def make_plan(inp: PlanInput, wear: bool = True) -> CapacityPlan:
    """The capacity plan of ``inp`` (every formula in the module docstring); with ``wear``, its
    :attr:`CapacityPlan.wear` (changes re-planned without one).

    Raises:
        AidaptivConfigError: from :meth:`PlanInput.validate`, naming the flag, the value and the fix.
    """
    inp.validate()
    c = _core(inp)
    shape, N, dp, ranks, nodes = inp.shape, inp.params, inp.dp, inp.gpus, inp.nodes
    pb, mb = PARAM_BYTES[inp.dtype], inp.moment_bytes
    sizes: StateSizes = c["sizes"]
    res: ResidencyPlan = c["res"]
    dram: DramBudget = c["dram"]
    numel = -(-inp.trainable // dp)  # one rank's trainable elements: the master weights and moments
    per_elem_opt = MASTER_BYTES_PER_PARAM + mb
    res_sg_numel = int(sum(sizes.subgroup_bytes[i] for i in res.resident_subgroups) // per_elem_opt)
    all_ranks = dp

    def split(resident: int, total: int) -> dict:
        return {"vram": 0, "dram": resident * all_ranks, "cache": (total - resident) * all_ranks}

    if inp.params_swapped:
        params_tier = split(sizes.param_bytes if res.params_resident else 0, sizes.param_bytes)
    else:  # DeepSpeed's: host memory (offload_param cpu, or none on CPU ranks) or VRAM (none beside a GPU)
        held = inp.param_partition_bytes * all_ranks
        params_tier = {"vram": 0 if inp.deepspeed_param_host_bytes else held,
                       "dram": held if inp.deepspeed_param_host_bytes else 0, "cache": 0}
    tiers = {
        "parameters": params_tier,
        # gradient slices in DRAM (resident), on the drives (stored), or consumed inside backward (neither)
        "gradients": {"vram": 0, "dram": sum(sizes.grad_slices()[i] for i in res.resident_grad_subgroups) * all_ranks,
                      "cache": 0 if not sizes.grads_stored else
                      sum(b for i, b in enumerate(sizes.grad_slices()) if i not in res.resident_grad_subgroups)
                      * all_ranks},
        "master_weights": split(res_sg_numel * MASTER_BYTES_PER_PARAM, numel * MASTER_BYTES_PER_PARAM),
        "moments": split(math.ceil(res_sg_numel * mb), math.ceil(numel * mb)),
        "activations": {"vram": c["act"]["total"] * dp, "dram": 0, "cache": 0},
    }
    if inp.cpu_ranks:  # no GPU: activations are host memory
        tiers["activations"] = {"vram": 0, "dram": c["act"]["total"] * dp, "cache": 0}
    state_total = (sizes.total + (0 if inp.params_swapped else inp.param_partition_bytes)) * dp
    total = state_total + c["act"]["total"] * dp
    prefetch = prefetch_bytes_from_budget(res, c["slice_part"], len(shape.slice_params()))

    # bytes per optimizer step, per node (item 5): the micro-batch-major schedule (what the runtime does)
    costs = schedule_costs(inp, c)
    mbm = costs[MICRO_BATCH_MAJOR]
    write_step = mbm["write_bytes"]
    # a step inside backward that the clipping norm invalidates is redone after backward from the old state:
    # its sub-groups and parameters are written a second time (the gradients were kept, not rewritten)
    write_redone = write_step + (res.write_bytes_per_step - res.grad_bytes_per_step) * ranks \
        if c["step_in_backward"] and inp.gradient_clipping > 0 else write_step
    # the backward of each micro-step finds the end of its forward still read ahead: the runtime's default
    # read-ahead window (integration/runtime.py prefetch_bytes: max(2 x the largest slice, 256 MiB)),
    # besides what the budget caches (schedule.micro_batch_major's read_hits)
    read_step, read_best = mbm["read_bytes"], mbm["read_bytes_best"]
    # a step whose norm clipped is never followed by a step inside backward: the steps after it run after backward
    # and read the kept gradients back from the drives (where the write-back has not left them in DRAM)
    read_after_backward = read_best + rank_traffic(inp, c).grad_final_write * ranks \
        if c["step_in_backward"] and inp.gradient_clipping > 0 else read_best
    tokens_step = inp.micro_batch * inp.seq_len * inp.grad_accum * dp

    # step time (item 7)
    lay = _layout(inp.drives)
    shares = [lay.share(i) for i in range(len(inp.drives))]
    compute_s = None
    if inp.gpu_flops:
        compute_s = training_flops_per_token(shape, N, inp.seq_len, inp.activation_checkpointing) * tokens_step \
            / (dp * inp.gpu_flops)
    rt = [read_best * s / (d.read_gbps * 1e9) for d, s in zip(inp.drives, shares, strict=True)]
    wt = [write_step * s / (d.write_gbps * 1e9) for d, s in zip(inp.drives, shares, strict=True)]
    bounds = {"compute": compute_s or 0.0, "cache reads": max(rt), "cache writes": max(wt)}
    bound_by = max(bounds, key=lambda k: bounds[k])
    lower = bounds[bound_by]
    pace = inp.step_time_s if inp.step_time_s else lower
    steps_per_day = SECONDS_PER_DAY / pace if pace > 0 else 0.0

    steps_epoch = -(-int(inp.dataset_tokens) // tokens_step) if inp.dataset_tokens else None
    run_steps = math.ceil(steps_epoch * inp.epochs) if steps_epoch else None
    drives = []
    for d, s, r_s, w_s in zip(inp.drives, shares, rt, wt, strict=True):
        w_b = int(write_step * s)
        rating = EnduranceRating(capacity=d.capacity, rated_dwpd=d.rated_dwpd, warranty_years=d.warranty_years)
        proj = projection(0, w_b * steps_per_day, d.capacity, rating)
        per_epoch = w_b * steps_epoch if steps_epoch else None
        per_run = w_b * run_steps if run_steps else None
        drives.append(DrivePlan(
            path=d.path, capacity=d.capacity, usable=d.usable, share=s, state_bytes=int(c["cache_need"] * s),
            read_bytes_per_step=int(read_best * s), write_bytes_per_step=w_b, read_time_s=r_s, write_time_s=w_s,
            read_gbps=d.read_gbps, write_gbps=d.write_gbps, writes_per_epoch=per_epoch, writes_per_run=per_run,
            run_tbw_fraction=per_run / proj["rated_tbw_bytes"] if per_run is not None else None, endurance=proj))

    checks = _checks(inp, c)
    problems = []
    if not checks["vram"]:
        v = c["vram"]
        problems.append(
            f"vram: one GPU needs {_dec(v['total'])} (gathered slice {_dec(v['gathered_params'])}, activations "
            f"{_dec(v['activations'])}, gradients/buckets/overhead "
            f"{_dec(v['slice_gradients'] + v['reduce_bucket'] + v['overhead'])}"
            + (f", the parameter partitions DeepSpeed keeps there with offload_param none "
               f"{_dec(v['param_partitions'])}" if v.get("param_partitions") else "")
            + f") but has {_dec(inp.vram)}")
    if not checks["dram"]:
        cpu = c["cpu_rank"]
        problems.append(
            f"dram: the host needs {_dec(c['dram_need'])} (safety margin {_dec(dram.margin_bytes)} + working set "
            f"{_dec(dram.working_set_bytes)} of {ranks} rank(s)"
            + (f", of which DeepSpeed's gathered parameters and reduce buckets {_dec(cpu['deepspeed'] * ranks)} and "
               f"activations {_dec(cpu['activations'] * ranks)} on the CPU ranks" if cpu else "")
            + (f", of which the parameter partitions DeepSpeed keeps in host memory (offload_param "
               f"{inp.offload_param}) {_dec(inp.deepspeed_param_host_bytes * ranks)}"
               if inp.deepspeed_param_host_bytes else "")
            + (f" + budget {_dec(dram.budget_bytes)}" if inp.dram_budget is not None else "")
            + f") but has {_dec(inp.dram)}")
    if not checks["cache"]:
        problems.append(
            f"cache capacity: the state that does not fit the DRAM budget needs {_dec(c['cache_need'])} per "
            f"node but "
            f"the {len(inp.drives)} cache drive(s) ({' + '.join(_dec(d.capacity) for d in inp.drives)}) hold "
            f"{_dec(c['cache_usable'])} usable (free space less the store's reserve, striped); short by "
            f"{_dec(c['cache_need'] - c['cache_usable'])}")
    changes, fits_after = _fixes(inp, checks) if problems else ([], None)
    verdict = Verdict(all(checks.values()), checks, problems, changes, fits_after)

    inputs = dataclasses.asdict(inp)
    inputs.pop("shape")
    inputs["n_params"] = N
    inputs["sub_group_size"] = inp.sub_group_numel  # the one planned (the runtime's pick where left out)
    model = shape.as_dict()
    model.update(n_params=N, shape_source=inp.shape_source)
    plan = CapacityPlan(
        inputs=inputs, model=model, n_params=N, dp=dp, local_ranks=ranks,
        bytes_per_param=total / N, state_bytes_per_param=2 * pb + per_elem_opt,  # gradients in the model dtype
        total_state_bytes=total, rule_of_thumb_bytes=RULE_OF_THUMB_BYTES_PER_PARAM * N,
        tiers=tiers, vram_per_gpu=c["vram"], dram=dram.as_dict(),
        residency={**res.as_dict(), "step_in_backward": c["step_in_backward"], "shadow_bytes": c["shadow_bytes"]},
        prefetch=dataclasses.asdict(prefetch),
        per_step={"write_bytes": write_step, "write_bytes_if_clipped": write_redone,
                  "read_bytes": read_step, "read_bytes_best": read_best,
                  "read_bytes_after_backward": read_after_backward,
                  "tokens": tokens_step, "write_bytes_per_param": write_step * nodes / N},
        step_time={"compute_s": compute_s, "io_read_s": max(rt), "io_write_s": max(wt), "lower_bound_s": lower,
                   "bound_by": bound_by, "pace_s": pace,
                   "pace_source": "measured (--step-time)" if inp.step_time_s else "lower bound"},
        drives=drives,
        epoch={"steps_per_epoch": steps_epoch, "epochs": inp.epochs, "run_steps": run_steps,
               "run_days": run_steps * pace / SECONDS_PER_DAY if run_steps else None,
               "write_bytes_per_epoch": write_step * steps_epoch if steps_epoch else None},
        verdict=verdict, cpu_rank_host=c["cpu_rank"], schedules=schedule_report(inp, c, costs),
        rank_host={k: c["rank_host_phases"][k] for k in ("construction", "initialization", "steps")}
        | {"peak": c["rank_host_phases"]["total" if inp.cpu_ranks else "peak"]})
    if wear:
        from .wear import assess_wear

        plan.wear = assess_wear(inp, plan, lambda changed: make_plan(changed, wear=False))
    return plan


__all__ = ["CacheDrive", "PlanInput", "CapacityPlan", "DrivePlan", "Verdict", "make_plan", "state_sizes_for_rank",
           "rank_traffic", "schedule_costs", "schedule_report",
           "activation_bytes", "layer_activation_bytes", "training_flops_per_token", "usable_cache_bytes",
           "store_reserve", "PARAM_BYTES", "MOMENT_BYTES", "MOMENT_ELEMENT_BYTES", "RULE_OF_THUMB_BYTES_PER_PARAM",
           "MIN_FREE_BYTES", "FREE_FRACTION", "shape_gathered_numel"]
