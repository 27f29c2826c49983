"""Host memory against model size: peak RSS of a few training steps over a sweep of Llama sizes, per backend.

The question it answers is whether host memory grows with the model (issue 16): each (size,
backend) pair trains ``steps`` optimizer steps in its own worker process (:mod:`.worker`), and the
peak resident set of the training steps (``VmHWM`` reset after the engine is built, so model
construction is not counted) is fitted against the parameter count by least squares::

    peak_rss(n_params) ~= fixed_bytes + slope x n_params

``slope`` (bytes per parameter) is the figure that must stay near 0 for a backend whose host memory
is bounded by its windows and budget; ``fixed_bytes`` is the interpreter, torch, DeepSpeed, the
windows and activations of a sequence. The process peak (model construction included)
is reported beside it. Each backend runs with its own allocator policy (DeepSpeed's as shipped:
glibc's defaults; aidaptiv_ds's from ``io.reuse_host_memory``). Every backend of one size runs on the
same machine one after another; the cache directory is emptied after each run. Each point also keeps
the per-step peak RSS by phase (forward, backward, optimizer step; :class:`.worker.PhasePeaks`), which
says where a peak sits.
"""
from __future__ import annotations

import dataclasses
import os
import time

from ..units import GiB
from .aio import aio_env, preflight
from .backends import LABELS, TrainSettings
from .compare import code_version, machine_info
from .models import LlamaShape, describe
from .runner import run_worker, worker_env


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b)``.

    Raises:
        ValueError: fewer than two distinct ``xs``.
    """
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a fit needs at least two different sizes")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def _or_default(value: int | None, default: int) -> int:
    """A DeepSpeed knob as the run's config has it: None (left out of the config, :func:`.backends.ds_config`)
    is DeepSpeed's default; 0 is 0."""
    return int(default if value is None else value)


def planned_host_bytes(shape: LlamaShape, settings: TrainSettings, ram_bytes: int | None = None,
                       layer_major: bool = False, cache_bytes: int | None = None) -> dict:
    """What ``aidaptiv-ds plan --cpu-ranks`` says one CPU rank of this run needs besides a DRAM budget of 0
    (:func:`aidaptiv_ds.planner.plan.cpu_rank_host_bytes`: the baseline plus the larger of the backward
    and optimizer phases), for the shape and DeepSpeed knobs the sweep's worker runs with; bytes by part.
    ``layer_major``: the run's steps are ``engine.train_batch`` (its activations:
    :func:`aidaptiv_ds.planner.plan.layer_major_cpu_activation_bytes`); then ``{"total", "activations"}``.
    ``cache_bytes``: the bytes free on the run's cache path (default: unbounded); a drive without room for a second
    copy of the optimizer state plans the steps after backward, as the runtime resolves ``step_in_backward: "auto"``
    (the plan's ``"step_in_backward"`` says which)."""
    from ..planner.auto import CPU_REDUCE_BUCKET_NUMEL
    from ..planner.model_size import shape_from_config
    from ..planner.plan import DEEPSPEED_MAX_LIVE_PARAMETERS, CacheDrive, PlanInput, make_plan
    from ..planner.schedule import LAYER_MAJOR
    hf = shape.hf_config().to_dict()
    drive = CacheDrive(capacity=int(cache_bytes) if cache_bytes else 1 << 50)
    inp = PlanInput(shape=shape_from_config(hf, describe(shape)), gpus=1, vram=0, dram=int(ram_bytes or 64 * GiB),
                    drives=[drive], dram_budget=0, micro_batch=settings.micro_batch,
                    seq_len=settings.seq, dtype=settings.dtype,
                    activation_checkpointing=bool(settings.activation_checkpointing),
                    sub_group_size=int(settings.sub_group_size), cpu_ranks=True,
                    gradient_clipping=float(settings.clip),
                    max_live_parameters=_or_default(settings.max_live_parameters, DEEPSPEED_MAX_LIVE_PARAMETERS),
                    max_reuse_distance=int(settings.max_reuse_distance),  # always in the run's config
                    param_persistence_threshold=int(settings.persistence_threshold),
                    reduce_bucket_size=_or_default(settings.reduce_bucket_size, CPU_REDUCE_BUCKET_NUMEL),
                    grad_accum=int(settings.gradient_accumulation))
    plan = make_plan(inp)
    if layer_major:
        lm = (plan.schedules or {})[LAYER_MAJOR]
        return {"total": lm["rank_host_bytes"], "activations": lm["rank_activations"]["total"]}
    return {**plan.cpu_rank_host, "step_in_backward": plan.residency["step_in_backward"]}


def sweep(shapes: list[LlamaShape], settings: TrainSettings, *, backends: list[str], steps: int = 3,
          work_dir: str = "/tmp/aidaptiv_memory", seed: int = 0, aio: str = "python", build_aio: bool = False,
          extensions_dir: str | None = None, timeout_s: float = 3600, build_under_zero_init: bool = False,
          command: str = "", trace_detail: bool = False, build: str | None = None, say=None) -> dict:
    """Train every shape with every backend; return ``{"config", "points", "fits", "table", ...}``.

    Args:
        shapes: the model sizes (at least two; four or more for a fit worth reporting).
        settings: what every run shares (dtype, sequence, DeepSpeed's working-set knobs).
        backends: names from :data:`.backends.BACKENDS` / ``OPTIONAL_BACKENDS``.
        steps: optimizer steps per run; aio: the native backend's handle (``"python"`` needs no build).
        build_under_zero_init: construct the model inside ``deepspeed.zero.Init`` (each parameter is
            partitioned as it is created) instead of building it whole first, for models whose fp32
            weights alone would not fit in RAM.
        trace_detail: each RSS trace sample also says where the bytes are (C heap, DRAM tier by kind, buffer
            pool: :func:`.worker.memory_detail`).
        build: how the model is built (:mod:`.worker`'s ``build``): ``"whole"``, ``"zero_init"`` (the default
            with ``build_under_zero_init``), ``"from_pretrained"`` (the sweep first saves each size, HF-initialised,
            as safetensors under ``work_dir/models``) or ``"unpacked"`` (the same, then ``unpack`` into the run's
            cache path before the worker starts: aidaptiv_ds backends only).
    """
    say = say or (lambda _m: None)
    env = aio_env(extensions_dir=extensions_dir)
    pre = preflight(env, build=build_aio) if "native" in backends and aio == "compiled" else \
        {"aio": "python", "status": "aidaptiv_ds pure-Python handle"}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    build = build or ("zero_init" if build_under_zero_init else "whole")
    points = []
    for i, shape in enumerate(shapes):
        model_dir = _saved_model(shape, settings, seed, os.path.join(work_dir, "models"), say) \
            if build in ("from_pretrained", "unpacked") else None
        for b in backends:
            run_dir = os.path.join(work_dir, f"{stamp}-mem", f"{i:02d}-{b}")
            spec = {"backend": b, "shape": dataclasses.asdict(shape), "settings": settings.as_dict(), "steps": steps,
                    "seed": seed, "aio": pre["aio"], "native_dedup": True, "build": build,
                    "trace_detail": trace_detail, "model_dir": model_dir, "run_name": f"mem-{stamp}-{i:02d}"}
            if build == "unpacked":
                _unpack_for(model_dir, os.path.join(run_dir, "cache"), spec["run_name"], settings)
            say(f"{describe(shape)}: {b}")
            res = run_worker(spec, run_dir, worker_env(b, env, same_allocator=False), timeout_s=timeout_s, say=say)
            points.append({"backend": b, "n_params": shape.n_params(), "shape": shape.as_dict(),
                           "ok": bool(res.get("ok")),
                           "peak_rss_steps_bytes": res.get("peak_rss_steps_bytes"),
                           "peak_rss_process_bytes": res.get("peak_rss_process_bytes"),
                           "dram_tier_peak_bytes": max((s.get("dram_tier_bytes") or 0 for s in res.get("steps", [])),
                                                       default=None),
                           "median_step_s": _median([s["wall_s"] for s in res.get("steps", [])[1:]]),
                           "phase_peak_rss_bytes": [s.get("phase_peak_rss_bytes") for s in res.get("steps", [])],
                           "phase_start_rss_bytes": [s.get("phase_start_rss_bytes") for s in res.get("steps", [])],
                           "phase_peak_swap_buffer_bytes": [s.get("phase_peak_swap_buffer_bytes")
                                                            for s in res.get("steps", [])],
                           "setup_phase_peak_rss_bytes": res.get("setup_phase_peak_rss_bytes"),
                           "setup_phase_end_rss_bytes": res.get("setup_phase_end_rss_bytes"),
                           "rss_trace": res.get("rss_trace"),
                           "planned_host": planned_host_bytes(shape, settings) if b == "aidaptiv0" else None,
                           "error": None if res.get("ok") else res.get("error")})
    fits, process_fits = {}, {}
    for b in backends:
        for key, into in (("peak_rss_steps_bytes", fits), ("peak_rss_process_bytes", process_fits)):
            pts = [p for p in points if p["backend"] == b and p["ok"] and p[key]]
            if len({p["n_params"] for p in pts}) >= 2:
                a, slope = fit_line([p["n_params"] for p in pts], [p[key] for p in pts])
                into[b] = {"fixed_bytes": a, "bytes_per_param": slope, "points": len(pts)}
    result = {"config": {**settings.as_dict(), "steps": steps, "backends": backends, "seed": seed,
                         "build_under_zero_init": build == "zero_init", "build": build,
                         "models": [describe(s) for s in shapes]},
              "command": command, "machine": machine_info(work_dir), "code": code_version(), "aio": pre,
              "points": points, "fits": fits, "process_fits": process_fits}
    result["table"] = format_table(result)
    return result


def _saved_model(shape: LlamaShape, settings: TrainSettings, seed: int, root: str, say) -> str:
    """``root/<shape>-<dtype>``: the HF Llama of ``shape`` (HF init, ``torch.manual_seed(seed)``) saved as safetensors
    shards of at most 1 GB, made once (this process's memory is not measured)."""
    import torch
    from transformers import LlamaForCausalLM

    path = os.path.join(root, f"h{shape.hidden}-l{shape.layers}-v{shape.vocab}-{settings.dtype}-s{seed}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    say(f"saving {describe(shape)} to {path}")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape.hf_config())
    if settings.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path + ".tmp", max_shard_size="1GB")
    os.replace(path + ".tmp", path)
    return path


def _unpack_for(model_dir: str, cache: str, run_name: str, settings: TrainSettings) -> None:
    """``aidaptiv-ds unpack`` of ``model_dir`` into ``cache`` under ``run_name``, one rank (before the worker runs)."""
    import torch

    from ..checkpoint.unpack import unpack

    os.makedirs(cache, exist_ok=True)
    unpack(model_dir, [cache], run_name, 1, torch.bfloat16 if settings.dtype == "bf16" else torch.float32)


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def format_table(result: dict) -> str:
    """Markdown: peak RSS of the steps / of the whole process per size and backend, then the fitted slopes
    and fixed parts of both."""
    backends = result["config"]["backends"]
    sizes = sorted({p["n_params"] for p in result["points"]})
    head = "| parameters | " + " | ".join(LABELS.get(b, b) for b in backends) + " |"
    lines = [head, "|---|" + "---|" * len(backends)]
    for n in sizes:
        cells = []
        for b in backends:
            p = next((q for q in result["points"] if q["n_params"] == n and q["backend"] == b), None)
            if p is None:
                cells.append("")
            elif not p["ok"]:
                cells.append(f"failed: {(p['error'] or '')[:60]}")
            else:
                cells.append(f"{p['peak_rss_steps_bytes'] / GiB:.2f} / {p['peak_rss_process_bytes'] / GiB:.2f} GiB")
        lines.append(f"| {n / 1e6:.1f}M | " + " | ".join(cells) + " |")
    planned = [p for p in result["points"] if p.get("planned_host") and p["ok"]]
    if planned:
        lines.append("| planned (budget 0), process peak against it | " + " | ".join(
            ", ".join(f"{p['n_params'] / 1e6:.0f}M {p['planned_host']['total'] / GiB:.2f} GiB "
                      f"({p['peak_rss_process_bytes'] / p['planned_host']['total'] - 1:+.0%})" for p in planned)
            if b == "aidaptiv0" else "" for b in backends) + " |")
    for title, fits in (("steps", result["fits"]), ("process", result.get("process_fits") or {})):
        lines.append(f"| **slope, B/param ({title})** | " + " | ".join(
            f"**{fits[b]['bytes_per_param']:.2f}**" if b in fits else "n/a" for b in backends) + " |")
        lines.append(f"| fixed part ({title}) | " + " | ".join(
            f"{fits[b]['fixed_bytes'] / GiB:.2f} GiB" if b in fits else "n/a" for b in backends) + " |")
    return "\n".join(lines)
