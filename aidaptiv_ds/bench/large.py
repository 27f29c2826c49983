"""The large-model run: a Llama whose training state exceeds this machine's RAM, a few steps per backend.

Each backend (default order: aidaptiv_ds with budget ``"auto"``, aidaptiv_ds with budget 0,
DeepSpeed native NVMe, DeepSpeed CPU offload) trains the same model for ``steps`` optimizer steps
in its own process, one after another. The runner's watchdog stops a run whose RSS passes the
memory limit, or when the host runs out of available memory, before the kernel's OOM killer acts,
so a backend that cannot fit reports *how* it failed (the phase it reached, its RSS) instead of
taking the machine down. Each outcome: finished or not, seconds per step, time to the end of step
1 and in all, bytes written/read per parameter per step, peak RSS, and the failure.

Training state (the figure compared with RAM) is :meth:`LlamaShape.state_bytes`: parameter (2 B in
bf16, 4 B in fp32) + fp32 master 4 B + Adam moments 8 B + fp32 gradient 4 B per parameter.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

from ..telemetry.sysinfo import host_memory
from ..units import GiB
from .aio import aio_env, preflight
from .backends import LABELS, TrainSettings
from .compare import code_version, machine_info
from .memory import planned_host_bytes
from .models import LlamaShape, describe, state_vs_ram
from .runner import run_worker, worker_env

LARGE_BACKENDS = ("aidaptiv_auto", "aidaptiv0", "native", "cpu")
#: The training state must be at least this multiple of RAM for the run to prove the point.
MIN_STATE_OVER_RAM = 1.5



def drive_bytes_needed(shape: LlamaShape, dtype: str, backend: str) -> int:
    """Bytes a backend's run of ``shape`` needs free on the cache path, with a margin.

    DeepSpeed's native NVMe offload stores the parameters (4 B/param fp32, 2 bf16) and the fp32 master
    weights and moments (12 B/param) on the drive, +10 %; its gradients stay in its flat host buffer
    (``stage3.py:786-800``). aidaptiv_ds stores the fp32 master weights and two moments (12 B/param), the gradients it
    cannot hold in DRAM (4 B/param fp32 accumulation, 2 in bf16) and the bf16 parameters (2 B; fp32
    parameters are read from their master slots and their first copy is given back), +5 %; a second
    copy of the optimizer state for steps inside backward is taken only when there is room for it
    (``step_in_backward: "auto"``).
    """
    if not backend.startswith("aidaptiv"):
        return int(shape.n_params() * ((4 if dtype == "fp32" else 2) + 12) * 1.1)
    per_param = 12 + (4 if dtype == "fp32" else 2 + 2)
    return int(shape.n_params() * per_param * 1.05)

def outcome(res: dict) -> dict:
    """The figures of one large-model run (works on partial results of a killed run)."""
    steps = res.get("steps", [])
    n = res.get("n_params") or 0
    out = {
        "backend": res.get("backend"), "finished": bool(res.get("ok")), "steps_done": len(steps),
        "phase": res.get("phase"), "step_s": [s["wall_s"] for s in steps],
        "median_step_s": statistics.median(s["wall_s"] for s in steps) if steps else None,
        "setup_s": res.get("setup_s"), "first_step_s": res.get("first_step_s"), "total_s": res.get("wall_total_s"),
        "written_per_param": (sum(s["proc_write_bytes"] for s in steps) / (len(steps) * n)) if steps and n else None,
        "read_per_param": (sum(s["proc_read_bytes"] for s in steps) / (len(steps) * n)) if steps and n else None,
        "io_wait_share": (sum(s["io_wait_s"] for s in steps) / sum(s["wall_s"] for s in steps)) if steps else None,
        "peak_rss_bytes": max(res.get("peak_rss_process_bytes") or 0, res.get("watch_peak_rss_bytes") or 0),
        "peak_rss_steps_bytes": res.get("peak_rss_steps_bytes"),
        "failure": None if res.get("ok") else (res.get("killed") or res.get("error")),
        "losses": [s["loss"] for s in steps],
    }
    if res.get("aio"):
        out["aio"] = res["aio"]["status"]
    if res.get("budget_bytes") is not None:
        out["budget_bytes"] = res["budget_bytes"]
        out["plan"] = res.get("plan")
    return out


def large_run(shape: LlamaShape, settings: TrainSettings, *, steps: int = 3, backends: list[str] | None = None,
              work_dir: str = "/tmp/aidaptiv_large", seed: int = 0, aio: str = "compiled", build_aio: bool = False,
              extensions_dir: str | None = None, libaio_root: str | None = None,
              mem_limit_bytes: int | None = None, timeout_s: float = 7200, command: str = "", say=None) -> dict:
    """Run every backend on ``shape``; return ``{"config", "machine", "aio", "outcomes", "runs", "table"}``.

    A backend is skipped (with the reason) when the cache path lacks the space for its state.
    """
    say = say or (lambda _m: None)
    backends = list(backends or LARGE_BACKENDS)
    if settings.seq > shape.max_positions:
        shape = dataclasses.replace(shape, max_positions=settings.seq)
    ram = host_memory().get("total_bytes") or 0
    state = shape.state_bytes(settings.dtype)
    os.makedirs(work_dir, exist_ok=True)
    env = aio_env(extensions_dir=extensions_dir, libaio_root=libaio_root)
    pre = preflight(env, build=build_aio) if "native" in backends and aio == "compiled" else \
        {"aio": "python", "status": "aidaptiv_ds pure-Python handle (--aio python)"}
    say(f"{describe(shape)}, {settings.dtype}: {state_vs_ram(shape, settings.dtype, ram)}; native aio: {pre['status']}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs, outcomes = [], []
    for k, b in enumerate(backends):
        run_dir = os.path.join(work_dir, f"{stamp}-large", f"{k:02d}-{b}")
        free = None
        if b != "cpu":
            st = os.statvfs(work_dir)
            free = st.f_bavail * st.f_frsize
            need = drive_bytes_needed(shape, settings.dtype, b)
            if free < need:
                outcomes.append({"backend": b, "finished": False, "steps_done": 0, "phase": "not started",
                                 "failure": f"skipped: {free / GiB:.1f} GiB free on {work_dir}, the state needs "
                                            f"{need / GiB:.1f} GiB"})
                say(f"{b}: {outcomes[-1]['failure']}")
                continue
        say(f"[{k + 1}/{len(backends)}] {b}")
        spec = {"backend": b, "shape": dataclasses.asdict(shape), "settings": settings.as_dict(), "steps": steps,
                "seed": seed, "aio": pre["aio"], "native_dedup": True}
        res = run_worker(spec, run_dir, worker_env(b, env, same_allocator=True), timeout_s=timeout_s,
                         mem_limit_bytes=mem_limit_bytes,
                         say=say)
        runs.append(res)
        outcomes.append(outcome(res))
        if b.startswith("aidaptiv") and res.get("budget_bytes") is not None:
            # what aidaptiv-ds plan --cpu-ranks says this rank needs besides the budget, plus the budget it ran with;
            # planned with the room the cache path had (steps inside backward or after it, as the runtime chose)
            planned = planned_host_bytes(shape, settings, ram, cache_bytes=free)
            outcomes[-1]["planned_host_bytes"] = planned["total"] + res["budget_bytes"]
            outcomes[-1]["planned_step_in_backward"] = planned["step_in_backward"]
    result = {
        "config": {"model": describe(shape), "shape": shape.as_dict(), **settings.as_dict(), "steps": steps,
                   "seed": seed, "backends": backends, "state_bytes": state, "ram_bytes": ram,
                   "state_over_ram": state / ram if ram else None, "work_dir": work_dir},
        "command": command, "machine": machine_info(work_dir), "code": code_version(), "aio": pre,
        "outcomes": outcomes, "runs": runs,
    }
    result["table"] = format_table(result)
    return result


def format_table(result: dict) -> str:
    """Markdown: the model against RAM, then one row per backend (finished, times, bytes, RSS, failure)."""
    cfg = result["config"]
    lines = [f"**{cfg['model']}**, {cfg['dtype']}, seq {cfg['seq']}, micro-batch {cfg['micro_batch']}, "
             f"{cfg['steps']} optimizer steps; training state {cfg['state_bytes'] / GiB:.1f} GiB = "
             f"{(cfg['state_over_ram'] or 0):.2f} x RAM ({(cfg['ram_bytes'] or 0) / GiB:.1f} GiB).",
             f"Native aio: {result['aio']['status']}.", "",
             "| backend | finished | steps | s/step (median) | launch to step 1 s | total s | written B/param/step | "
             "I/O wait share | peak RSS GiB | failure |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt="{:.1f}"):
        return "n/a" if v is None else fmt.format(v)

    for o in result["outcomes"]:
        lines.append(f"| {LABELS.get(o['backend'], o['backend'])} | {'yes' if o['finished'] else 'no'} | "
                     f"{o['steps_done']} | {f(o.get('median_step_s'))} | {f(o.get('first_step_s'))} | "
                     f"{f(o.get('total_s'), '{:.0f}')} | {f(o.get('written_per_param'))} | "
                     f"{f(o.get('io_wait_share'), '{:.0%}')} | {f((o.get('peak_rss_bytes') or 0) / GiB, '{:.1f}')} | "
                     f"{(o.get('failure') or '') + (' (in ' + o['phase'] + ')' if o.get('failure') else '')} |")
    for o in result["outcomes"]:
        if o.get("planned_host_bytes") and o.get("peak_rss_steps_bytes"):
            lines.append(f"\n{LABELS.get(o['backend'], o['backend'])}: peak RSS of the steps "
                         f"{o['peak_rss_steps_bytes'] / GiB:.2f} GiB against the plan's "
                         f"{o['planned_host_bytes'] / GiB:.2f} GiB (its CPU-rank working set + the budget, "
                         f"{o['peak_rss_steps_bytes'] / o['planned_host_bytes'] - 1:+.0%}).")
    if (cfg.get("state_over_ram") or 0) < MIN_STATE_OVER_RAM:
        lines.append(f"\nNote: the state is only {(cfg['state_over_ram'] or 0):.2f} x RAM (< {MIN_STATE_OVER_RAM}); "
                     f"this run does not show training beyond RAM.")
    return "\n".join(lines)
