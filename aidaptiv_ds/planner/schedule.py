"""Gradient accumulation schedules: what one optimizer step of ``k`` micro-batches moves through the cache
drives, the host-device link and the GPUs, micro-batch-major against layer-major, and a step-time estimate.

Pure arithmetic on per-rank byte counts (:class:`RankTraffic`, built by
:func:`aidaptiv_ds.planner.plan.rank_traffic` from the residency plan) and rates (:class:`Rates`). Bytes,
seconds, GB/s = 10^9 bytes per second. Notation, all per rank (one GPU, or one CPU rank) and per
optimizer step of ``k`` micro-batches:

* ``P``: parameter bytes one pass over the model reads from the drives (every parameter partition not in
  DRAM; fp32 ones from their master slots); ``Pw``: parameter bytes written (the updated ones not in DRAM);
* ``G``: bytes of the gradient slices the DRAM budget does not hold (one slice per optimizer sub-group,
  ``integration/gradients.py``); ``Gf``: the final gradient written once (``G`` unless the steps inside
  backward consume it: clipping off); ``Gr``: the final gradient read back (``Gf`` when the optimizer steps
  after backward; 0 when it steps inside backward, which takes the DRAM copy and keeps the written one
  only for a redo);
* ``O``: optimizer sub-group bytes (fp32 master + moments) not in DRAM, written once; ``Or``: read once
  (``O``, less the master weights when an fp32 step inside backward takes them from the parameters
  backward has read, ``docs/gradients.md``);
* ``F``: the DRAM budget the residency plan leaves free (it caches clean parameter slices); ``W``: the
  read-ahead window (``planner.auto.auto_prefetch_bytes``), which still holds the end of a forward when
  its backward starts;
* ``a``: boundary activations of one micro-batch, ``micro_batch x seq_len x hidden x dtype bytes x blocks``
  (each block's input, the activation-checkpointing boundary);
* ``Pp`` / ``Gp``: the rank's parameter / gradient partition bytes (what crosses the host-device link).

**Micro-batch-major** (what DeepSpeed does, and what the runtime does today: forward and backward of one
micro-batch through all blocks, then the next micro-batch)::

    reads  = 2k*P  (forward and backward of every micro-batch; one backward per micro-batch finds
                    H = min(F + W, P) still in DRAM: the best case subtracts k*H)
           + (k-1)*G + Gr + Or'          Or' = Or at k = 1, O at k > 1 (see below)
    writes = Pw + (k-1)*G + Gf + O
    host->device = 2k*Pp,   device->host = k*Gp

  ``(k-1)*G``: a gradient slice the budget does not hold is unpinned at the end of each backward
  (``GradientStore.end_backward``), so the DRAM tier writes the partial sum back to the drive and the next
  micro-batch reads it back (``GradientStore.open``). Measured with the ledger (stories260K, ``--cpu-ranks``,
  budget 0, steps 2-4; ``grad_spilled_bytes`` in the metrics): written B/param/step bf16 14 / 16 / 20 at
  GA 1 / 2 / 4 with clipping off, 16 / 18 / 22 with clipping on; fp32 12 / 16 / 24 and 16 / 20 / 28:
  exactly ``(k-1) x`` 2 (bf16) or 4 (fp32) B/param more per step. ``Or' = O`` at ``k > 1``: in fp32 the
  step inside backward took its master weights from backward's parameter reads at GA 1 only
  (``master_from_params_bytes`` 4.0 B/param at GA 1, 0 at GA 2 and 4), so it reads them from the drive.

**Layer-major** (GreedySnake: Yue, Yin and Qian 2025, arXiv 2512.17570, its "vertical" scheduling: every
micro-batch through one block before the next block; forward block by block, backward block by block in
reverse with each block's forward recomputed per micro-batch, the block's gradient accumulated over the
``k`` micro-batches in DRAM, its optimizer sub-group stepped when it is final)::

    reads  = 2*P  (forward once, backward once; the best case subtracts one H' = min(F - Ad + W, P))
           + Gr + Or + Aw
    writes = Pw + Gf + O + Aw
    A  = k*a     boundary activations of the step, kept from forward to backward
    Ad = min(A, F)   in DRAM: the budget the residency plan leaves free, as dirty cached slices
    Aw = A - Ad      on the drives: written once in forward, read once in backward
    host->device = 2*Pp + A,   device->host = k*Gp + A

  The optimizer state and the final gradient cost what they cost at GA 1 (they are touched once per
  step); ``Or`` keeps the fp32 master-weight credit because each block's step follows that block's
  backward reads, as the runtime's GA-1 step inside backward does (an assumption about the layer-major
  runtime, issue 38 items 1-3). [Note: which DRAM the activations take] A byte of boundary activation
  kept in DRAM saves one write and one read, exactly as a byte of gradient or optimizer state does, so
  taking the leftover ``F`` rather than a resident sub-group changes no total; it only takes ``F`` from
  the clean parameter cache (fewer backward hits, counted in ``H'``).

**Compute** per rank (Kaplan et al. 2020 via :func:`~aidaptiv_ds.planner.plan.training_flops_per_token`):
FLOPs per token x ``micro_batch x seq_len x k``; layer-major always recomputes (``8N`` per token), micro-batch-
major as the run is configured (``8N`` with activation checkpointing, ``6N`` without). Time = FLOPs / (peak
FLOP/s x utilisation) with the peak given (``--gpu-tflops``) or :data:`DEFAULT_GPU`'s from
:data:`GPU_PEAK_TFLOPS` and the utilisation ``--mfu`` (default :data:`DEFAULT_MFU`).

**Step time estimate** (per optimizer step; the ranks of a node run in parallel, so the slowest part
counts)::

    drive   = max over drives d of (reads_best x share_d / read_GBps_d + writes x share_d / write_GBps_d)
              (one drive serves reads and writes in turn; shares: the store's weighted striping)
    link    = max(host->device, device->host) / link GB/s  (full duplex, one link per GPU; none on CPU ranks)
    compute = FLOPs / (peak x utilisation)
    estimate = max(drive, link, compute)   (everything overlapped: the bound a perfect pipeline reaches)
    serial   = drive + link + compute      (nothing overlapped)

It is an estimate: sequential rates, no latency, no contention between the ranks' links, no all-gather or
reduce-scatter traffic between GPUs (NVLink or PCIe peer-to-peer, not counted), and for layer-major the
runtime of issue 38 items 1-3 as specified, not measured.
"""
from __future__ import annotations

import dataclasses

from ..errors import AidaptivConfigError

MICRO_BATCH_MAJOR = "micro-batch-major"
LAYER_MAJOR = "layer-major"
SCHEDULES = (MICRO_BATCH_MAJOR, LAYER_MAJOR)
#: values of ``--schedule``
SCHEDULE_CHOICES = SCHEDULES + ("both",)

#: host-device link presets, GB/s per direction per GPU: about 80% of a x16 link's 31.5 (PCIe 4.0) and
#: 63 (PCIe 5.0) GB/s (16 and 32 GT/s per lane, 128b/130b encoding, PCI-SIG base specifications), what
#: copies from pinned host memory typically reach
PCIE_PRESETS_GBPS = {"pcie4": 25.0, "pcie5": 50.0}
DEFAULT_PCIE = "pcie4"
#: dense (no sparsity) 16-bit tensor TFLOP/s per GPU, NVIDIA data sheets (A100, H100 SXM and PCIe, H200 SXM,
#: L40S)
GPU_PEAK_TFLOPS = {"a100": 312.0, "h100-sxm": 989.0, "h100-pcie": 756.0, "h200": 989.0, "l40s": 362.0}
DEFAULT_GPU = "h100-sxm"
#: model FLOPs utilisation assumed for the compute estimate: the fraction of the peak training sustains
DEFAULT_MFU = 0.5


def parse_rate(value: str | float, presets: dict[str, float], field: str) -> float:
    """A positive rate from a number or a preset name of ``presets`` (case-insensitive).

    Raises:
        AidaptivConfigError: (a ``ValueError``) naming ``field``, the value, the presets and the fix.
    """
    if isinstance(value, str) and value.lower() in presets:
        return presets[value.lower()]
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = float("nan")
    if not x > 0 or x == float("inf"):
        raise AidaptivConfigError(f"{field}: {value!r} is neither a positive number nor a preset; fix: give a number "
                                  f"or one of {', '.join(sorted(presets))}")
    return x


@dataclasses.dataclass(frozen=True)
class RankTraffic:
    """What one rank moves per optimizer step, in the module docstring's notation (bytes, FLOPs).

    Attributes:
        grad_accum: ``k``, micro-batches per optimizer step.
        param_read: ``P``; param_write: ``Pw``.
        grad_slices: ``G``; grad_final_write: ``Gf``; grad_final_read: ``Gr``.
        optimizer_read: ``Or`` (with the fp32 master-weight credit where it applies); optimizer_read_full:
            ``O`` read without it; optimizer_write: ``O``.
        dram_free: ``F``; window: ``W``.
        boundary_per_micro_batch: ``a``.
        param_partition: ``Pp``; grad_partition: ``Gp``.
        flops_micro_batch_major / flops_layer_major: FLOPs of one micro-batch on this rank.
    """
    grad_accum: int
    param_read: int
    param_write: int
    grad_slices: int
    grad_final_write: int
    grad_final_read: int
    optimizer_read: int
    optimizer_read_full: int
    optimizer_write: int
    dram_free: int
    window: int
    boundary_per_micro_batch: int
    param_partition: int
    grad_partition: int
    flops_micro_batch_major: float
    flops_layer_major: float


@dataclasses.dataclass(frozen=True)
class Rates:
    """Rates of one node.

    Attributes:
        drives: per cache drive ``(share, read GB/s, write GB/s)``; shares sum to 1.
        ranks: ranks per node (they share the drives; each has its own link and device).
        link_gbps: host-device GB/s per direction per rank; None: no such link (CPU ranks).
        device_flops: FLOP/s one rank sustains (peak x utilisation); None: compute not estimated.
    """
    drives: tuple[tuple[float, float, float], ...]
    ranks: int
    link_gbps: float | None
    device_flops: float | None


@dataclasses.dataclass
class StepBytes:
    """One rank's bytes of one optimizer step under one schedule (module docstring).

    Attributes:
        reads / writes: cache-drive bytes by part: ``parameters``, ``gradients``, ``optimizer``, ``activations``.
        read_hits: parameter bytes the best case finds in DRAM (``k*H`` or ``H'``).
        boundary: ``{"bytes": A, "dram": Ad, "drive": Aw}`` (zeros for micro-batch-major: its checkpoints stay
            on the device).
        host_to_device / device_to_host: bytes over the rank's link.
        flops: FLOPs of the step on this rank.
    """
    reads: dict
    writes: dict
    read_hits: int
    boundary: dict
    host_to_device: int
    device_to_host: int
    flops: float

    @property
    def read_bytes(self) -> int:
        return sum(self.reads.values())

    @property
    def read_bytes_best(self) -> int:
        return max(self.read_bytes - self.read_hits, 0)

    @property
    def write_bytes(self) -> int:
        return sum(self.writes.values())


def micro_batch_major(t: RankTraffic) -> StepBytes:
    """One rank's step of ``k`` micro-batches, each through every block (module docstring)."""
    k = t.grad_accum
    hit = min(t.dram_free + t.window, t.param_read)
    partial = (k - 1) * t.grad_slices
    return StepBytes(
        reads={"parameters": 2 * k * t.param_read, "gradients": partial + t.grad_final_read,
               "optimizer": t.optimizer_read if k == 1 else t.optimizer_read_full, "activations": 0},
        writes={"parameters": t.param_write, "gradients": partial + t.grad_final_write,
                "optimizer": t.optimizer_write, "activations": 0},
        read_hits=k * hit, boundary={"bytes": 0, "dram": 0, "drive": 0},
        host_to_device=2 * k * t.param_partition, device_to_host=k * t.grad_partition,
        flops=k * t.flops_micro_batch_major)


def layer_major(t: RankTraffic) -> StepBytes:
    """One rank's step of ``k`` micro-batches, all of them through one block before the next (module
    docstring; GreedySnake, arXiv 2512.17570)."""
    k = t.grad_accum
    act = k * t.boundary_per_micro_batch
    in_dram = min(act, t.dram_free)
    spilled = act - in_dram
    hit = min(t.dram_free - in_dram + t.window, t.param_read)
    return StepBytes(
        reads={"parameters": 2 * t.param_read, "gradients": t.grad_final_read, "optimizer": t.optimizer_read,
               "activations": spilled},
        writes={"parameters": t.param_write, "gradients": t.grad_final_write, "optimizer": t.optimizer_write,
                "activations": spilled},
        read_hits=hit, boundary={"bytes": act, "dram": in_dram, "drive": spilled},
        host_to_device=2 * t.param_partition + act, device_to_host=k * t.grad_partition + act,
        flops=k * t.flops_layer_major)


def step_time(b: StepBytes, rates: Rates) -> dict:
    """The step-time estimate of one rank's :class:`StepBytes` on a node of ``rates.ranks`` such ranks.

    Returns:
        ``{"drive_s", "link_s", "compute_s", "estimate_s", "serial_s", "bound_by"}``: seconds (``link_s`` /
        ``compute_s`` None when not estimated, and left out of the max and the sum); ``estimate_s`` =
        max, ``serial_s`` = sum (module docstring), ``bound_by`` the part that sets ``estimate_s``
        (``"drives"``, ``"link"``, ``"compute"``).
    """
    reads, writes = b.read_bytes_best * rates.ranks, b.write_bytes * rates.ranks
    drive = max((reads * s / (r * 1e9) + writes * s / (w * 1e9) for s, r, w in rates.drives), default=0.0)
    link = max(b.host_to_device, b.device_to_host) / (rates.link_gbps * 1e9) if rates.link_gbps else None
    compute = b.flops / rates.device_flops if rates.device_flops else None
    parts = {"drives": drive, "link": link, "compute": compute}
    known = {k: v for k, v in parts.items() if v is not None}
    bound = max(known, key=lambda k: known[k])
    return {"drive_s": drive, "link_s": link, "compute_s": compute, "estimate_s": known[bound],
            "serial_s": sum(known.values()), "bound_by": bound}


def schedule_cost(name: str, t: RankTraffic, rates: Rates, nodes: int = 1, n_params: int | None = None) -> dict:
    """Bytes and step time of schedule ``name`` per optimizer step, JSON-ready.

    Drive bytes are per node (``rates.ranks`` ranks), link bytes and FLOPs per rank; ``*_per_param`` are
    the whole job's drive bytes (``x nodes``) per parameter (``read_bytes`` without the DRAM hits,
    ``read_bytes_best`` with them; the step time uses the best case).

    Raises:
        AidaptivConfigError: ``name`` is not one of :data:`SCHEDULES`.
    """
    if name not in SCHEDULES:
        raise AidaptivConfigError(f"--schedule: {name!r} is not a schedule; use one of {', '.join(SCHEDULE_CHOICES)}")
    b = (micro_batch_major if name == MICRO_BATCH_MAJOR else layer_major)(t)
    n = rates.ranks
    out: dict = {
        "schedule": name, "grad_accum": t.grad_accum,
        "reads": {k: v * n for k, v in b.reads.items()}, "writes": {k: v * n for k, v in b.writes.items()},
        "read_bytes": b.read_bytes * n, "read_bytes_best": b.read_bytes_best * n, "write_bytes": b.write_bytes * n,
        "boundary_activations": {k: v * n for k, v in b.boundary.items()},
        "link_per_rank": {"host_to_device": b.host_to_device, "device_to_host": b.device_to_host},
        "flops_per_rank": b.flops,
        "step_time": step_time(b, rates),
    }
    if n_params:
        out["read_bytes_per_param"] = out["read_bytes"] * nodes / n_params
        out["read_bytes_best_per_param"] = out["read_bytes_best"] * nodes / n_params
        out["write_bytes_per_param"] = out["write_bytes"] * nodes / n_params
    return out


__all__ = ["RankTraffic", "Rates", "StepBytes", "micro_batch_major", "layer_major", "step_time", "schedule_cost",
           "parse_rate", "SCHEDULES", "SCHEDULE_CHOICES", "MICRO_BATCH_MAJOR", "LAYER_MAJOR", "PCIE_PRESETS_GBPS",
           "DEFAULT_PCIE", "GPU_PEAK_TFLOPS", "DEFAULT_GPU", "DEFAULT_MFU"]
