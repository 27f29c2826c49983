"""The parts of a fine-tuning run's peak host memory, for the summary line and ``aidaptiv-ds report``.

Peak RSS alone does not say whose memory it was. The loop measures each accounting window's own peak
(``VmHWM`` reset as each starts, :mod:`.loop`), so the peak splits into:

* **model loading**: the peak before the first step (loading or building the model, a GGUF file
  de-quantised whole, ``deepspeed.initialize`` partitioning it): measured;
* **the steps' peak**, of which:

  - **ours**: aidaptiv_ds's buffers at their most: the DRAM tier (what the budget books, resident and
    cached, and its working memory: read-ahead not used yet, slices in use, write-back in flight) or the
    swap buffers' pool the tier's units are carved from, whichever is larger: measured (per rank, the ranks'
    sum divided by their number); the pool's misses, fresh memory beside it, fall in the rest;
  - **DeepSpeed's working set**: the parameters it keeps gathered (up to the larger of
    ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` plus two modules and a layer held (a
    layer-major step's block, a recomputed layer's frozen parameters), :func:`aidaptiv_ds.planner.auto.deepspeed_gathered_numel`) and its reduce buckets
    (:func:`aidaptiv_ds.planner.auto.deepspeed_cpu_rank_bytes`): planned, from the config's knobs and the
    model's module tree; host memory on CPU ranks only (on a GPU it is device memory). On one rank with the
    parameters on the cache tier the gathered parameters are our swap buffers, already in "ours" ([Note: the
    gathered parameters' partitions] in ``planner/auto.py``): only the buckets are counted here;
  - **activations and logits** of one micro-batch (:func:`aidaptiv_ds.planner.plan.activation_bytes` with
    the run's activation checkpointing, in the model dtype, and the logits of the tokens the LM head computed
    with the loss's fp32 copies, :func:`aidaptiv_ds.planner.plan.cpu_activation_bytes`): planned, from the
    model's shape; host memory on CPU ranks only;
  - **the rest**: the steps' peak less those three (the interpreter, torch, DeepSpeed and transformers
    themselves, the model's module objects, the heap's fragments), measured by difference.

The planned parts are estimates (the planner's formulas) and are named so wherever they are shown.
"""
from __future__ import annotations

from ..units import format_bytes


def planned_parts(model_config: dict | None, ds_config: dict, n_params: int, seq_len: int, micro_batch: int,
                  world: int, dtype_bytes: int, cpu: bool, checkpointing: bool = False,
                  logits_tokens: int | None = None, module=None) -> dict:
    """``{"deepspeed_bytes", "activations_logits_bytes"}`` per rank (None where unknown; 0 on GPU ranks,
    where both are device memory).

    Args:
        model_config: the model's HF config as a dict (``model.config.to_dict()``), or None.
        ds_config: the resolved DeepSpeed config (its ZeRO-3 knobs; DeepSpeed's defaults where absent).
        checkpointing: the run recomputed each layer's activations in backward.
        logits_tokens: the most tokens of one micro-batch the LM head computed logits for (default
            ``seq_len x micro_batch``; fewer with logits at the response positions only).
        module: the model as DeepSpeed built it (``engine.module``): its module tree gives the largest fetch and
            the persistent parameters (``integration/zero_params.py``); without it, the model config's shape
            (a module being the largest tensor), or the whole model as one module for a family the planner
            does not know.
    """
    if not cpu:
        return {"deepspeed_bytes": 0, "activations_logits_bytes": 0}
    from ..planner.auto import (
        CPU_REDUCE_BUCKET_NUMEL,
        deepspeed_cpu_rank_bytes,
        live_partition_bytes,
    )
    from ..planner.model_size import shape_from_config
    from ..planner.plan import (
        CPU_LOSS_BYTES_PER_LOGIT,
        DEEPSPEED_MAX_LIVE_PARAMETERS,
        DEEPSPEED_MAX_REUSE_DISTANCE,
        DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD,
        activation_bytes,
        shape_gathered_numel,
    )

    shape = None
    if model_config:
        try:
            shape = shape_from_config(model_config)
        except (ValueError, KeyError, TypeError):
            shape = None  # a model family the planner does not know
    zero = ds_config.get("zero_optimization") or {}
    knobs = {"max_live_numel": int(float(zero.get("stage3_max_live_parameters", DEEPSPEED_MAX_LIVE_PARAMETERS))),
             "max_reuse_numel": int(float(zero.get("stage3_max_reuse_distance", DEEPSPEED_MAX_REUSE_DISTANCE)))}
    if module is not None:  # the built model's own tree, as the runtime counts it (integration/stage3.py)
        from ..integration.trunk import module_gathered_numel

        gathered = module_gathered_numel(module, knobs["max_live_numel"], knobs["max_reuse_numel"])
    else:
        threshold = int(float(zero.get("stage3_param_persistence_threshold", DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD)))
        gathered = shape_gathered_numel(shape, n_params, persistence_threshold=threshold, **knobs)
    bucket = int(float(zero.get("reduce_bucket_size", CPU_REDUCE_BUCKET_NUMEL)))
    ds = deepspeed_cpu_rank_bytes(gathered, n_params, dtype_bytes, bucket, dtype_bytes, partition_ranks=world)
    if int(world) == 1 and (zero.get("offload_param") or {}).get("device") == "nvme":
        # the gathered parameters are their partitions' swap buffers, counted in ours (module docstring)
        ds -= live_partition_bytes(gathered, n_params, dtype_bytes, partition_ranks=1)
    act = None
    if shape is not None:
        try:
            a = activation_bytes(shape, seq_len, micro_batch, checkpointing=checkpointing)
            tokens = seq_len * micro_batch if logits_tokens is None else int(logits_tokens)
            # as plan.cpu_activation_bytes: 16-bit activations in the model dtype, the logits with the loss's copies
            act = a["layers"] * dtype_bytes // 2 + tokens * shape.vocab_size * (dtype_bytes + CPU_LOSS_BYTES_PER_LOGIT)
        except (ValueError, KeyError, TypeError):
            act = None  # a model family the planner does not know
    return {"deepspeed_bytes": ds, "activations_logits_bytes": act}


def memory_parts(summary: dict, planned: dict, world: int) -> dict:
    """The parts of the peak (module docstring) from the loop's summary fields and :func:`planned_parts`.

    Returns:
        ``{"peak_rss_bytes", "model_loading_bytes", "steps_peak_rss_bytes", "ours_bytes", "dram_tier_bytes",
        "dram_working_bytes", "dram_budget_bytes", "buffer_pool_bytes", "deepspeed_bytes",
        "activations_logits_bytes", "rest_bytes"}`` (bytes per rank; None where not measured or planned).
    """
    w = max(int(world), 1)
    tier = (summary.get("dram_budgeted_peak_bytes") or 0) // w
    held = (summary.get("dram_peak_bytes") or 0) // w
    pool = (summary.get("buffer_pool_bytes") or 0) // w
    # the tier's units are carved from the pool where there is one (io/pool.py, [Note: the budget's units in
    # the pool]): the region holds them, a miss is fresh memory beside it
    ours = max(held, pool)
    steps = summary.get("steps_peak_rss_bytes") or None
    ds, act = planned.get("deepspeed_bytes"), planned.get("activations_logits_bytes")
    rest = steps - ours - (ds or 0) - (act or 0) if steps else None
    return {"peak_rss_bytes": summary.get("peak_rss_bytes"), "model_loading_bytes": summary.get("setup_peak_rss_bytes")
            or None, "steps_peak_rss_bytes": steps, "ours_bytes": ours, "dram_tier_bytes": tier,
            "dram_working_bytes": max(held - tier, 0), "dram_budget_bytes": (summary.get("dram_budget_bytes") or 0) // w,
            "buffer_pool_bytes": pool, "deepspeed_bytes": ds, "activations_logits_bytes": act, "rest_bytes": rest}


def describe(m: dict | None) -> str:
    """``peak RSS 9.11 GiB: model loading 3.2 GiB before step 1; the steps 2.1 GiB = ours ... + ...``."""
    if not m or not m.get("peak_rss_bytes"):
        return "peak RSS n/a"
    b = format_bytes
    out = f"peak RSS {b(m['peak_rss_bytes'])}"
    inner = []
    if m.get("model_loading_bytes"):
        inner.append(f"model loading {b(m['model_loading_bytes'])} before step 1")
    if m.get("steps_peak_rss_bytes"):
        from ..telemetry.report import ours_text
        parts = [f"ours {ours_text(m)}"]
        if m.get("deepspeed_bytes"):
            parts.append(f"DeepSpeed's working set ~{b(m['deepspeed_bytes'])} (planned)")
        if m.get("activations_logits_bytes"):
            parts.append(f"activations and logits ~{b(m['activations_logits_bytes'])} (planned)")
        if m.get("rest_bytes") is not None:
            parts.append(f"the rest {b(m['rest_bytes'])}")
        inner.append(f"the steps {b(m['steps_peak_rss_bytes'])} = " + " + ".join(parts))
    return out + (f" ({'; '.join(inner)})" if inner else "")


__all__ = ["describe", "memory_parts", "planned_parts"]
