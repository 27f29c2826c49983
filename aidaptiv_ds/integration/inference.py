"""ZeRO-Inference on aidaptiv_ds: HF ``generate`` on a ZeRO-3 engine without an optimizer, weights on the cache drives.

DeepSpeed's documented ZeRO-Inference setup (DeepSpeed tutorial "ZeRO-Inference", and
``DeepSpeedExamples/inference/huggingface/zero_inference``)::

    ds_config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": P}}, ...}
    dschf = HfDeepSpeedConfig(ds_config)            # optional: from_pretrained partitions under zero.Init
    model = AutoModelForCausalLM.from_pretrained(...)
    engine = deepspeed.initialize(model=model, config=ds_config)[0]
    engine.module.eval(); engine.module.generate(...)

With no optimizer DeepSpeed builds no Stage-3 optimizer: ``_configure_zero_optimizer(None)`` wraps
a ``DummyOptim`` and returns a ``DeepSpeedZeRoOffload`` (``runtime/engine.py:686``, ``:2721``). So
with an enabled ``"aidaptiv"`` section only two aidaptiv_ds parts are in play: the parameter
swapper (the process singleton :func:`~aidaptiv_ds.integration.hooks.param_swapper_factory`
builds for every ``zero.Init``) and the coordinator prefetch (:mod:`.prefetch`). DeepSpeed resets
the coordinator at the start of every forward (``parameter_offload.py:300-306``, "reset step if in
inference mode"), so the recorded trace is one forward pass: from the second forward (the first
decode step) on, partitions are read ahead in layer order within the prefetch window and the DRAM
tier evicts by furthest next use within a forward.

What :func:`install` adds, after DeepSpeed built the ``DeepSpeedZeRoOffload`` of an engine whose
partitions are ours (:func:`setup`):

1. ``from_unpacked``: the partitions are pointed at the store ``aidaptiv-ds unpack`` wrote;
2. ``dram_budget: "auto"`` is refined with the inference working set (2 x the largest partition
   for the live parameters plus the prefetch window), and ``io.reuse_host_memory: "auto"`` is settled
   (on when the weights and that working set fit in half the available memory);
3. residency: when every partition fits the budget they are read once into resident DRAM slices
   (no reads per token afterwards); otherwise the tier keeps what the budget holds;
4. the result as an :class:`InferencePlan` on ``engine.aidaptiv_inference``.

Writes: partitions are written once, when DeepSpeed partitions the model (none with
``from_unpacked``). Generating writes nothing: every release is a clean drop and, without an
optimizer, nothing calls ``swap_out_partitioned_params``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

from ..units import format_bytes
from .param_swapper import AidaptivParamSwapper
from .runtime import auto_dram_budget

log = logging.getLogger("aidaptiv_ds")
_ORIGINAL = None


@dataclasses.dataclass
class InferencePlan:
    """Where a ZeRO-Inference engine's weights live.

    Attributes:
        param_bytes: bytes of all parameter partitions of this rank.
        budget_bytes: the DRAM budget (resolved).
        params_resident: True when the weights are held in DRAM (read once).
        prefetch_bytes: the read-ahead window.
        adopted_bytes: bytes taken from an unpacked store (0 without ``from_unpacked``).
    """
    param_bytes: int
    budget_bytes: int
    params_resident: bool
    prefetch_bytes: int
    adopted_bytes: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def our_swapper(module) -> AidaptivParamSwapper | None:
    """The aidaptiv_ds parameter swapper of ``module``'s ZeRO-3 parameters, or None."""
    for p in module.parameters():
        sw = getattr(p, "nvme_swapper", None)
        if isinstance(sw, AidaptivParamSwapper):
            return sw
    return None


def setup(module, swapper: AidaptivParamSwapper) -> InferencePlan:
    """Adopt unpacked weights, settle the budget and the residency of a ZeRO-Inference model.

    Raises:
        FileNotFoundError, ValueError: ``from_unpacked`` and the unpacked store is missing or does
            not match the model (see :meth:`AidaptivParamSwapper.adopt_unpacked`).
    """
    rt = swapper.rt
    adopted = swapper.adopt_unpacked(module) if rt.cfg.from_unpacked else 0
    largest = swapper.largest_partition_bytes()
    if rt.cfg.dram_budget == "auto":
        ws = 2 * largest + rt.prefetch_bytes(2 * largest)
        held = rt.tier.resident_bytes() + rt.tier.cached_bytes()
        rt.set_budget(auto_dram_budget(working_set_bytes=ws - held))
    total = swapper.partition_bytes()
    # io.reuse_host_memory "auto": on. Streaming at budget 0 otherwise page-faults and unmaps every read
    # buffer, every token; and without an optimizer, gradients or a backward pass, what the heap keeps
    # for reuse is those read buffers themselves, at most the read-ahead window and the two partitions
    # in use: the working set outside the budget, so it takes nothing from the budget
    window = 2 * largest + rt.prefetch_bytes(2 * largest)
    rt.settle_host_memory_reuse(window, budget_free_bytes=window)
    resident = 0 < total <= rt.budget and not rt.cfg.from_unpacked  # unpacked regions: the tier caches them
    if resident:
        swapper.make_resident()
    plan = InferencePlan(total, rt.budget, resident or (0 < total <= rt.budget), swapper.prefetch_window(), adopted)
    if rt.rank == 0:
        log.info("aidaptiv_ds: ZeRO-Inference, %s of weights, DRAM budget %s -> weights %s; prefetch window %s",
                 format_bytes(total), format_bytes(rt.budget),
                 "in DRAM" if plan.params_resident else "streamed from the cache tier", format_bytes(plan.prefetch_bytes))
    return plan


def _wrap(orig):
    @functools.wraps(orig)
    def _configure_zero_optimizer(self, optimizer):
        out = orig(self, optimizer)
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

        if isinstance(out, DeepSpeedZeRoOffload):  # no optimizer: ZeRO-Inference
            sw = our_swapper(self.module)
            if sw is not None:
                self.aidaptiv_inference = setup(self.module, sw)
        return out
    _configure_zero_optimizer._aidaptiv_wrapped = orig
    return _configure_zero_optimizer


def install(engine_cls) -> None:
    """Wrap ``DeepSpeedEngine._configure_zero_optimizer`` (idempotent)."""
    global _ORIGINAL
    current = engine_cls._configure_zero_optimizer
    if getattr(current, "_aidaptiv_wrapped", None) is not None:
        return
    _ORIGINAL = current
    engine_cls._configure_zero_optimizer = _wrap(current)


def uninstall(engine_cls) -> None:
    if _ORIGINAL is not None:
        engine_cls._configure_zero_optimizer = _ORIGINAL


def full_parameter(param):
    """A context in which ``param.data`` is the whole tensor: DeepSpeed's ``GatheredParameters``
    for a ZeRO-3 parameter (collective: every rank must enter it), nothing for an ordinary one."""
    if getattr(param, "ds_id", None) is None:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=None)


def zero_inference_config(cache_path: str, dram_budget="auto", dtype: str = "fp32", **aidaptiv) -> dict:
    """The DeepSpeed config of ZeRO-Inference on aidaptiv_ds: stage 3, parameters offloaded to
    ``nvme`` at ``cache_path``, no optimizer, ``"aidaptiv"`` enabled with ``dram_budget`` and the
    keys in ``aidaptiv`` (e.g. ``run_name``, ``from_unpacked``).

    Args:
        dtype: ``"fp32"`` or ``"bf16"`` (DeepSpeed's ``bf16.enabled``).

    Raises:
        ValueError: another dtype.
    """
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype: {dtype!r} must be 'fp32' or 'bf16'")
    return {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10 ** 9,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_param": {"device": "nvme", "nvme_path": str(cache_path)}},
        "aidaptiv": {"enabled": True, "cache_paths": [str(cache_path)], "dram_budget": dram_budget, **aidaptiv},
    }
