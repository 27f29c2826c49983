"""What a user sees when aidaptiv_ds starts: one line on rank 0, or one refusal without a traceback.

Called from the validating wrappers of :mod:`aidaptiv_ds.integration.hooks` (the only call sites):

* :func:`quiet_errors`: an error of ours (:class:`~aidaptiv_ds.AidaptivError`: a bad key, a missing path,
  a drive too small for the job; each names the value and the fix) that reaches the top of the program
  uncaught is printed as its message alone, once (rank 0, and the first rank of each other node, where a
  per-node path may differ), instead of 24-84 lines of ``[rankN]`` traceback per rank. A program that
  catches the error sees it unchanged; ``AIDAPTIV_DS_TRACEBACK=1`` prints the traceback as before.
* :func:`preflight_job`: before ``deepspeed.initialize`` builds the optimizer, the whole job's need on
  the cache paths (every parameter's state that the DRAM budget does not keep) against what the paths
  hold, so a drive too small is named with the job's bytes, not with the first extent that did not fit.
* :func:`announce`: after ``deepspeed.initialize`` returned, one line on rank 0 (stderr, whatever the
  logging configuration; an unchanged HF ``Trainer`` script shows it): aidaptiv_ds active, the cache
  paths and their free space, the DRAM budget, and the plan's verdict (bytes written per step, and the
  pace the drives' rated DWPD allows).
"""
from __future__ import annotations

import os
import sys
import threading

from ..errors import AidaptivError
from ..units import format_bytes

_LOCK = threading.Lock()
_STATE: dict = {}
TRACEBACK_ENV = "AIDAPTIV_DS_TRACEBACK"
SECONDS_PER_DAY = 86_400


def _rank() -> tuple[int, int]:
    """(global rank, local rank) from torch.distributed or the launchers' environment."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0") or 0)
    return rank, int(os.environ.get("LOCAL_RANK", "0") or 0)


def _prints_here() -> bool:
    rank, local = _rank()
    return rank == 0 or local == 0


def quiet_errors() -> None:
    """From now on an :class:`~aidaptiv_ds.AidaptivError` that ends the program uncaught prints as one
    line saying so and ``<module>.<kind>: <message>`` (a traceback's last line) alone (see the module
    docstring); other uncaught
    exceptions go to the hook that was there before (torch.distributed's ``[rankN]`` one, say).
    Installed once per process, by the first config with an enabled section."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        return
    with _LOCK:
        if _STATE.get("hooked"):
            return
        prev = sys.excepthook

        def hook(tp, value, tb):
            if isinstance(value, AidaptivError):
                if _prints_here():  # Python's own last line of a traceback, without the frames above it
                    print(f"aidaptiv_ds stopped the program (set {TRACEBACK_ENV}=1 for the traceback):\n"
                          f"{tp.__module__}.{tp.__qualname__}: {value}", file=sys.stderr, flush=True)
                return
            prev(tp, value, tb)

        sys.excepthook = hook
        _STATE["hooked"] = True


def _param_bytes(ds: dict) -> int:
    for key in ("bf16", "bfloat16", "fp16"):
        sec = ds.get(key)
        if isinstance(sec, dict) and sec.get("enabled") is True:
            return 2
    return 4


def _grad_accum(ds: dict, world: int) -> int:
    """``gradient_accumulation_steps`` as DeepSpeed resolves it (``runtime/config.py``
    ``_set_batch_related_parameters``): given, else ``train_batch_size / (train_micro_batch_size_per_gpu x
    world)``; 1 where the config leaves it open (an HF ``"auto"``, filled in later)."""
    ga, tbs, mbs = (ds.get(k) for k in ("gradient_accumulation_steps", "train_batch_size",
                                         "train_micro_batch_size_per_gpu"))
    if isinstance(ga, int) and not isinstance(ga, bool):
        return max(ga, 1)
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (tbs, mbs)):
        return max(tbs // mbs // max(world, 1), 1)
    return 1


def job_need(n_params: int, ds: dict, budget: int, world: int) -> dict:
    """This rank's bytes of training state on the cache tier at the least, by the planner's residency rules
    for ``budget``: the smaller of the runtime's two ways (steps after backward, the gradients stored; steps
    inside backward, the gradients consumed but a second copy of the optimizer state not kept in DRAM), so a
    job refused on it cannot run at any setting. ``{"need", "state", "resident", "param_bytes", "per_param"}``
    (``state``: parameters, gradients, master weights and moments; fp32 parameters are their master slots)."""
    from ..planner.plan import DEFAULT_SUB_GROUP_SIZE, MOMENT_BYTES, state_sizes_for_rank
    from ..planner.residency import plan_residency

    pb = _param_bytes(ds)
    sg = int(float((ds.get("zero_optimization") or {}).get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)))
    section = ds.get("aidaptiv") if isinstance(ds.get("aidaptiv"), dict) else {}
    narrow = (section.get("optimizer_state") or {}).get("moments") == "bf16"  # [Note: moment dtype]
    sizes = state_sizes_for_rank(n_params, max(world, 1), pb, MOMENT_BYTES["adamw"] // (2 if narrow else 1),
                                 max(sg, 1))
    alias = sizes.param_bytes if sizes.alias_params else 0  # fp32: read from the master slots
    state = sizes.total - alias
    after = plan_residency(sizes, budget)
    need = state - min(after.resident_bytes, state)
    sizes.grads_transient = sizes.steps_in_backward = True
    sizes.grad_accum = _grad_accum(ds, world)  # partial sums between micro-batches need the drives too
    inside = plan_residency(sizes, budget)
    shadows = sum(b for i, b in enumerate(sizes.subgroup_bytes) if i not in inside.resident_subgroups)
    need_inside = max(state - (0 if sizes.grads_stored else sizes.grad_bytes) - inside.resident_bytes, 0) + shadows
    need = min(need, need_inside)
    return {"need": need, "state": state, "resident": state - need if need < state else 0, "param_bytes": pb,
            "per_param": state / max(-(-n_params // max(world, 1)), 1)}


def preflight_job(cfg, ds: dict, model) -> None:
    """:func:`preflight_params` for a model built whole, before ``deepspeed.initialize`` partitions it. A model
    already partitioned (built under ``zero.Init``) is left to the optimizer's own preflight, which then knows
    what the parameters hold on the drives already."""
    if model is None or not hasattr(model, "parameters"):
        return
    params = list(model.parameters())
    if any(hasattr(p, "ds_numel") for p in params):
        return
    preflight_params(cfg, ds, sum(int(p.numel()) for p in params))


def preflight_params(cfg, ds: dict, n_params: int) -> None:
    """Refuse, before DeepSpeed builds the optimizer (or, from ``launch/finetune.py``, before the model is
    loaded), a job whose training state cannot fit the cache paths at any setting the runtime may choose
    (:func:`job_need`), naming the whole job's bytes instead of the first extent that did not fit.

    Args:
        cfg: the validated section; ds: the DeepSpeed config (dtype, sub-group size); n_params: the model's.

    Raises:
        StorageFullError: naming the cache paths, the job's need (parameters, bytes per parameter, ranks,
            what the DRAM budget keeps) and what the store can hold on them for this rank.
    """
    if not n_params:
        return
    from ..io.errors import StorageFullError
    from .runtime import _dist_rank_world, get_runtime

    rt = get_runtime(cfg)
    _, world = _dist_rank_world()
    j = job_need(n_params, ds, rt.budget, world)
    have = rt.store.capacity()
    if j["need"] <= have:
        return
    ranks = f" over {world} ranks" if world > 1 else ""
    what = (f"the training state of this job ({n_params:,} parameters{ranks}, {j['per_param']:.0f} B/param of "
            f"parameters, fp32 master weights, Adam moments and gradients: {format_bytes(j['state'])} for this rank"
            + (f", less {format_bytes(j['resident'])} kept by the DRAM budget of {format_bytes(rt.budget)})"
               if j["resident"] else f", DRAM budget {format_bytes(rt.budget)})"))
    raise StorageFullError(", ".join(rt.namespace.cache_paths), j["need"], have, what)


def _ratings(rt) -> list[tuple[int, float, bool]]:
    """``(capacity, rated_dwpd, rating given)`` per cache path."""
    given = "rated_dwpd" in getattr(rt.cfg.endurance, "model_fields_set", set())
    return [(int(led.capacity), float(led.rating.rated_dwpd), given) for led in rt.store.ledgers]


def startup_line(engine, rt) -> str:
    """The line :func:`announce` prints (pure but for the filesystem's free space)."""
    from .. import __version__
    from ..store.slab import free_bytes

    paths = []
    for p in rt.namespace.cache_paths:
        try:
            paths.append(f"{p} ({format_bytes(free_bytes(p))} free)")
        except OSError:
            paths.append(p)
    opt = getattr(engine, "optimizer", None)
    plan = getattr(opt, "aidaptiv_plan", None)
    n = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    parts = [f"aidaptiv_ds {__version__} active: cache path{'s' if len(paths) > 1 else ''} {', '.join(paths)}",
             f"DRAM budget {format_bytes(rt.budget)}/rank" + (" (auto)" if rt.cfg.dram_budget == "auto" else "")]
    if plan is None:
        parts.append(f"{n:,} parameters, no optimizer (ZeRO-Inference): nothing written per token")
        return "; ".join(parts)
    picked = getattr(getattr(opt, "_aidaptiv", None), "picked", None) or {}
    if picked:  # what the config left out and this backend chose (README, "The aidaptiv section")
        parts.append("left out of the config, chosen here: " + ", ".join(
            f"zero_optimization.{k} {v:.3g} (DeepSpeed's default "
            f"{ {'sub_group_size': 1e9, 'reduce_bucket_size': 5e8}.get(k, 0):.0e})" for k, v in picked.items()))
    node_w = plan.write_bytes_per_step * rt.local_world
    per_param = plan.write_bytes_per_step * rt.world / n if n else 0.0
    ratings = _ratings(rt)
    shares = rt.store.planned_share()
    slowest = 0.0
    for (cap, dwpd, _), share in zip(ratings, shares, strict=False):
        if cap and dwpd:
            slowest = max(slowest, node_w * share * SECONDS_PER_DAY / (cap * dwpd))
    verdict = (f"plan: the state fits the cache paths ({format_bytes(rt.store.allocated())} allocated at start); "
               f"{format_bytes(plan.write_bytes_per_step)} written per step per rank ({per_param:.1f} B/param)")
    if slowest:
        dwpd = ratings[0][1]
        every = f"{slowest:.2g} s" if slowest < 1 else f"{slowest:,.1f} s"
        verdict += (f"; the drives' rated {dwpd:g} DWPD allows one step every {every} or longer"
                    + ("" if ratings[0][2] else
                       " (rating assumed: set aidaptiv.endurance.rated_dwpd to the data sheet's, cache SSDs 30-100)"))
    parts.append(verdict)
    return "; ".join(parts)


def announce(engine) -> None:
    """Print :func:`startup_line` on rank 0 once per engine (stderr)."""
    from .runtime import current_runtime

    rt = current_runtime()
    if rt is None or _rank()[0] != 0:
        return
    print(startup_line(engine, rt), file=sys.stderr, flush=True)


__all__ = ["announce", "job_need", "preflight_job", "preflight_params", "quiet_errors", "startup_line"]
