"""The DeepSpeed config of each compared backend: identical except where the offload differs.

Backends:

* ``native``: DeepSpeed ZeRO-3 NVMe offload of parameters and optimizer state with DeepSpeed's own
  swappers (``max_in_cpu: 0`` so every partition really goes to the drive; the parameter buffer
  pool is sized for the largest partition);
* ``cpu``: DeepSpeed ZeRO-3 offload of parameters and optimizer state to DRAM;
* ``aidaptiv0``: the ``native`` config plus an ``"aidaptiv"`` section with ``dram_budget: 0``, and
  ``max_in_cpu`` left at DeepSpeed's default (for ours it caps the parameters the budget keeps);
* ``aidaptiv_auto``: the same with ``dram_budget: "auto"``;
* ``aidaptiv_grads`` (optional, not in the default set): a budget of the fp32 gradients plus 5%, so
  the residency plan keeps exactly the gradients in DRAM (the "<= 14 bytes written per parameter
  once the gradients fit" case);
* ``aidaptiv0_bf16m`` (optional): ``aidaptiv0`` with Adam's moments kept in bf16
  (``"optimizer_state": {"moments": "bf16"}``): 8 bytes of optimizer state per parameter instead of 12;
  opt-in and not bit-identical (its losses differ from ``cpu``'s by the rounding); stepped by the fused tile
  (``tiers/fused_adam.py``), and ``aidaptiv0_bf16m_eager`` by the eager widened tile (``"fused_step": "off"``);
* ``aidaptiv0_int8m`` (optional): the same with int8 moments (``"moments": "int8"``, block-quantized with
  torchao's map): 6.03 bytes of optimizer state per parameter; needs torchao; ``aidaptiv0_int8m_eager`` with the
  eager tile;
* ``aidaptiv0_lm`` and ``aidaptiv_auto_lm`` (optional): ``aidaptiv0`` and ``aidaptiv_auto`` trained layer-major:
  each optimizer step is one ``engine.train_batch`` over its ``gradient_accumulation`` micro-batches, block by
  block (``integration/layer_major.py``); the same losses bit for bit;
* ``aidaptiv0_ride`` and ``aidaptiv_auto_ride`` (optional): ``aidaptiv0`` and ``aidaptiv_auto`` with
  ``"step_rides_forward": true``: the optimizer steps the norm left after backward ride the next forward (on CPU
  ranks ``"auto"`` keeps them in ``step()``), so one comparison measures both paths side by side;
* ``gpu`` (optional): ZeRO-3 without any offload: parameters, gradients and optimizer state on the
  accelerator (DeepSpeed's ``offload_*.device: none``). On a GPU it is the ceiling the offloads are
  measured against (no host memory or drive in the step); on CPU ranks it trains in host memory.

Shared by all: stage 3, AdamW with ``torch_adam`` (no ``cpu_adam`` compile), the same
``sub_group_size``, persistence threshold, gradient clipping, micro batch, gradient accumulation and dtype.
"""
from __future__ import annotations

import copy
import dataclasses

BACKENDS = ("native", "cpu", "aidaptiv0", "aidaptiv_auto")
OPTIONAL_BACKENDS = ("aidaptiv_grads", "aidaptiv0_bf16m", "aidaptiv0_bf16m_eager", "aidaptiv0_int8m",
                     "aidaptiv0_int8m_eager", "aidaptiv0_lm", "aidaptiv_auto_lm", "aidaptiv0_ride", "aidaptiv_auto_ride", "gpu")
LABELS = {
    "native": "DeepSpeed native NVMe",
    "cpu": "DeepSpeed CPU offload",
    "aidaptiv0": "aidaptiv_ds, DRAM budget 0",
    "aidaptiv_auto": "aidaptiv_ds, DRAM budget auto",
    "aidaptiv_grads": "aidaptiv_ds, DRAM budget = gradients",
    "aidaptiv0_bf16m": "aidaptiv_ds, DRAM budget 0, bf16 moments",
    "aidaptiv0_bf16m_eager": "aidaptiv_ds, DRAM budget 0, bf16 moments, eager tile",
    "aidaptiv0_int8m": "aidaptiv_ds, DRAM budget 0, int8 moments",
    "aidaptiv0_int8m_eager": "aidaptiv_ds, DRAM budget 0, int8 moments, eager tile",
    "aidaptiv0_lm": "aidaptiv_ds, DRAM budget 0, layer-major",
    "aidaptiv_auto_lm": "aidaptiv_ds, DRAM budget auto, layer-major",
    "aidaptiv0_ride": "aidaptiv_ds, DRAM budget 0, step rides the forward",
    "aidaptiv_auto_ride": "aidaptiv_ds, DRAM budget auto, step rides the forward",
    "gpu": "no offload (all on the accelerator)",
}
#: backends that store Adam's moments narrower than fp32, and how (``aidaptiv.optimizer_state``)
MOMENT_BACKENDS = {"aidaptiv0_bf16m": {"moments": "bf16"},
                   "aidaptiv0_bf16m_eager": {"moments": "bf16", "fused_step": "off"},
                   "aidaptiv0_int8m": {"moments": "int8"},
                   "aidaptiv0_int8m_eager": {"moments": "int8", "fused_step": "off"}}
#: backends whose optimizer steps ride the next forward where the norm leaves them after backward
RIDING_BACKENDS = ("aidaptiv0_ride", "aidaptiv_auto_ride")
#: backends that train each optimizer step layer-major (``engine.train_batch``)
LAYER_MAJOR_BACKENDS = ("aidaptiv0_lm", "aidaptiv_auto_lm")
#: The backend every ratio is taken against.
REFERENCE = "native"


def dram_budget(backend: str, n_params: int) -> int | str:
    """The ``aidaptiv.dram_budget`` of an aidaptiv_ds backend (bytes, or ``"auto"``) for a model of
    ``n_params`` parameters.

    Raises:
        KeyError: ``backend`` is not an aidaptiv_ds backend.
    """
    return {"aidaptiv0": 0, "aidaptiv0_bf16m": 0, "aidaptiv0_bf16m_eager": 0, "aidaptiv0_int8m": 0,
            "aidaptiv0_int8m_eager": 0, "aidaptiv_auto": "auto",
            "aidaptiv0_lm": 0, "aidaptiv_auto_lm": "auto", "aidaptiv0_ride": 0, "aidaptiv_auto_ride": "auto",
            "aidaptiv_grads": int(n_params * 4 * 1.05)}[backend]


def keeps_no_heap(backend: str) -> bool:
    """An aidaptiv_ds backend with a fixed DRAM budget: its runtime returns freed host memory instead of
    keeping it for reuse, so PyTorch's huge pages pay there (:mod:`aidaptiv_ds.torch_env`)."""
    return backend.startswith("aidaptiv") and dram_budget(backend, 1) != "auto"


def uses_drive(backend: str) -> bool:
    """True for the backends that keep training state on the cache path (``nvme_path``)."""
    return backend == "native" or backend.startswith("aidaptiv")


@dataclasses.dataclass
class TrainSettings:
    """Settings every backend of one comparison shares.

    Attributes:
        dtype: ``"fp32"`` or ``"bf16"`` (model and partitions; masters and moments are fp32).
        micro_batch: sequences per micro-batch (DeepSpeed's ``train_micro_batch_size_per_gpu``); seq: tokens
            per sequence.
        gradient_accumulation: micro-batches per optimizer step (DeepSpeed's ``gradient_accumulation_steps``,
            >= 1): the worker runs forward, ``engine.backward`` and ``engine.step()`` once per micro-batch, and
            DeepSpeed steps the optimizer on the last of each ``gradient_accumulation``; every "per step" figure
            of a comparison is per optimizer step, i.e. ``gradient_accumulation`` micro-batches (tokens per step
            = ``micro_batch * seq * gradient_accumulation``).
        sub_group_size: optimizer sub-group size in elements (``zero_optimization.sub_group_size``).
        persistence_threshold: ``stage3_param_persistence_threshold`` (elements; 0: every
            parameter is partitioned and offloaded).
        max_reuse_distance: ``stage3_max_reuse_distance`` (elements). DeepSpeed keeps a parameter
            gathered after use when it is used again within this many elements of later modules;
            with its default 1e9 every partition of a model under 1e9 parameters stays live from its
            forward use to its backward use, so DeepSpeed's native swapper needs one pool buffer
            (each sized for the largest partition) per parameter, e.g. 111 x 98 MB at 150M in fp32,
            and otherwise asserts "Not enough buffers". 0 (the default here) releases a parameter
            after each use: the pool only holds the current module and the prefetch.
        native_pipeline: DeepSpeed's ``pipeline_read``/``pipeline_write`` of the optimizer swapper
            (default off, DeepSpeed's default).
        param_buffer_count: DeepSpeed's ``offload_param.buffer_count`` (its parameter buffer pool).
        aio_block_size, aio_queue_depth, aio_intra_op: DeepSpeed's ``"aio"`` section (native only).
        pin_memory: ``pin_memory`` of both offload sections (only meaningful with a GPU).
        lr: AdamW learning rate; clip: ``gradient_clipping``.
        reduce_bucket_size, prefetch_bucket_size, max_live_parameters: DeepSpeed's own working-set
            knobs (``reduce_bucket_size``, ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
            elements); None leaves DeepSpeed's defaults (5e8, 5e7, 1e9), which on CPU ranks let host
            memory grow with the model up to those sizes.
        activation_checkpointing: HF's gradient checkpointing of every decoder layer, non-reentrant
            (``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``):
            backward recomputes each layer's forward, so activations are the layers' inputs (``2*s*b*h``
            per layer) instead of growing by a layer's full activations per layer.
        aidaptiv_extra: keys merged into the ``"aidaptiv"`` section of the aidaptiv_ds backends (nested
            dicts merged key by key), for ablations, e.g. ``{"step_in_backward": false}`` or
            ``{"io": {"reuse_host_memory": true}}``; the section's own validation judges them.
    """
    dtype: str = "fp32"
    micro_batch: int = 1
    gradient_accumulation: int = 1
    seq: int = 256
    sub_group_size: int = 20_000_000
    persistence_threshold: int = 0
    max_reuse_distance: int = 0
    native_pipeline: bool = False
    param_buffer_count: int = 5
    aio_block_size: int = 1 << 20
    aio_queue_depth: int = 8
    aio_intra_op: int = 1
    pin_memory: bool = False
    lr: float = 1e-4
    clip: float = 1.0
    reduce_bucket_size: int | None = None
    prefetch_bucket_size: int | None = None
    max_live_parameters: int | None = None
    activation_checkpointing: bool = False
    aidaptiv_extra: dict | None = None

    def __post_init__(self) -> None:
        ga = self.gradient_accumulation
        if isinstance(ga, bool) or not isinstance(ga, int) or ga < 1:
            raise ValueError(f"gradient_accumulation {ga!r}: must be an integer >= 1 (micro-batches per optimizer "
                             f"step; 1: no accumulation)")

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step: ``micro_batch * seq * gradient_accumulation``."""
        return int(self.micro_batch) * int(self.seq) * int(self.gradient_accumulation)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _align(n: int, to: int) -> int:
    return -(-int(n) // to) * to


def ds_config(backend: str, settings: TrainSettings, cache_dir: str, largest_tensor: int, n_params: int = 0) -> dict:
    """The DeepSpeed config dict of ``backend``.

    Args:
        backend: one of :data:`BACKENDS`.
        settings: the shared settings.
        cache_dir: ``nvme_path`` (and the aidaptiv cache path) of this run.
        largest_tensor: elements of the model's largest parameter: DeepSpeed's parameter buffers
            (``offload_param.buffer_size``) must hold its partition or it asserts.
        n_params: the model's parameters (sizes the ``aidaptiv_grads`` budget).

    Raises:
        ValueError: unknown backend.
    """
    if backend not in BACKENDS + OPTIONAL_BACKENDS:
        raise ValueError(f"backend {backend!r}: choose from {', '.join(BACKENDS + OPTIONAL_BACKENDS)}")
    s = settings
    dev = {"cpu": "cpu", "gpu": "none"}.get(backend, "nvme")
    zero: dict = {
        "stage": 3,
        "sub_group_size": int(s.sub_group_size),
        "stage3_param_persistence_threshold": int(s.persistence_threshold),
        "stage3_max_reuse_distance": int(s.max_reuse_distance),
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_param": {"device": dev, "pin_memory": s.pin_memory},
        "offload_optimizer": {"device": dev, "pin_memory": s.pin_memory},
    }
    for key, value in (("reduce_bucket_size", s.reduce_bucket_size),
                       ("stage3_prefetch_bucket_size", s.prefetch_bucket_size),
                       ("stage3_max_live_parameters", s.max_live_parameters)):
        if value is not None:
            zero[key] = int(value)
    if dev == "nvme":
        zero["offload_param"].update(nvme_path=cache_dir, max_in_cpu=0, buffer_count=int(s.param_buffer_count),
                                     buffer_size=_align(largest_tensor, 1 << 20))
        zero["offload_optimizer"].update(nvme_path=cache_dir, buffer_count=4, pipeline_read=s.native_pipeline,
                                         pipeline_write=s.native_pipeline)
    cfg: dict = {
        "train_micro_batch_size_per_gpu": int(s.micro_batch),
        "gradient_accumulation_steps": int(s.gradient_accumulation),
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        "gradient_clipping": float(s.clip),
        "bf16": {"enabled": s.dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": float(s.lr), "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": zero,
    }
    if dev == "nvme":
        cfg["aio"] = {"block_size": int(s.aio_block_size), "queue_depth": int(s.aio_queue_depth),
                      "intra_op_parallelism": int(s.aio_intra_op), "single_submit": False, "overlap_events": True}
    if backend.startswith("aidaptiv"):
        # DeepSpeed's default max_in_cpu (1e9) for ours: it caps the parameters the DRAM budget keeps
        # ([Note: max_in_cpu] in integration/stage3.py); 0 would keep them on the drives whatever the budget
        zero["offload_param"].pop("max_in_cpu", None)
        budget = dram_budget(backend, n_params)
        section = {"enabled": True, "cache_paths": [cache_dir], "dram_budget": budget}
        if backend in MOMENT_BACKENDS:
            section["optimizer_state"] = dict(MOMENT_BACKENDS[backend])
        if backend in RIDING_BACKENDS:
            section["step_rides_forward"] = True
        cfg["aidaptiv"] = _merged(section, s.aidaptiv_extra or {})
    return copy.deepcopy(cfg)


def _merged(base: dict, extra: dict) -> dict:
    """``base`` with ``extra``'s keys set, dicts on both sides merged recursively (a new dict)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out
