"""``aidaptiv-ds compare``: the same Llama, seed, batches and steps through each backend, side by side.

Every backend runs in its own process (:mod:`.worker`), one after another, interleaved over the
repeats in ABBA order (``native, cpu, aidaptiv0, aidaptiv_auto``, then the reverse, ...) so drift of a
shared machine hits every backend alike. Before any native run, DeepSpeed's compiled ``async_io`` op
is loaded once in a separate process (:func:`.aio.preflight`) so the measured runs only load a cached
build; when it cannot be loaded, native runs on aidaptiv_ds's pure-Python handle and the table says
``compiled aio unavailable: <reason>``.

The result (also written as JSON) holds the configuration, the machine, the aio status, every run
(per-step figures) and the per-backend summary with ratios to native (:mod:`.summary`).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import time

from ..telemetry.sysinfo import host_memory
from ..units import GiB
from .aio import aio_env, preflight
from .backends import BACKENDS, OPTIONAL_BACKENDS, REFERENCE, TrainSettings
from .models import LlamaShape, describe
from .runner import run_worker, worker_env
from .summary import check_targets, format_table, summarize


def machine_info(path: str) -> dict:
    """CPU model and cores, host memory, the filesystem of ``path``, torch/DeepSpeed/transformers versions."""
    from importlib.metadata import PackageNotFoundError, version

    from .bench_io import filesystem_of

    cpu = platform.processor() or "unknown"
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("unknown", "x86_64", ""):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    vers = {}
    for pkg in ("torch", "deepspeed", "transformers"):
        try:
            vers[pkg] = version(pkg)
        except PackageNotFoundError:
            vers[pkg] = None
    fs = filesystem_of(path)
    mem = host_memory()
    return {"cpu": cpu, "cores": os.cpu_count(), "avx2": " avx2" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "ram_bytes": mem.get("total_bytes"),
            "cache_filesystem": fs["fstype"], "cache_device": fs["device"], "cache_mount": fs["mount"],
            "python": platform.python_version(), **vers}


def code_version() -> dict:
    """The git commit of the aidaptiv_ds checkout and whether its tracked files differ from it."""
    import subprocess

    from .runner import REPO

    def git(*a):
        p = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": bool(changed) if changed is not None else None}


def run_order(backends: list[str], repeats: int) -> list[str]:
    """Backends in ABBA order over ``repeats`` rounds: ``a b c d d c b a a b c d ...``."""
    out: list[str] = []
    for r in range(repeats):
        out.extend(backends if r % 2 == 0 else list(reversed(backends)))
    return out


def disk_needed(shape: LlamaShape, dtype: str, backends: list[str]) -> int:
    """Bytes one run may keep on the cache path: the training state plus 10% (0 for CPU offload only)."""
    return int(shape.state_bytes(dtype) * 1.1) if any(b != "cpu" for b in backends) else 0


def compare(shape: LlamaShape, settings: TrainSettings, *, backends: list[str] | None = None, steps: int = 6,
            warmup: int = 2, repeats: int = 2, work_dir: str = "/tmp/aidaptiv_compare", seed: int = 0,
            aio: str = "compiled", build_aio: bool = False, extensions_dir: str | None = None,
            libaio_root: str | None = None, mem_limit_bytes: int | None = None, timeout_s: float = 3600,
            profile: bool = False, keep_cache: bool = False, native_dedup: bool = True, same_allocator: bool = True,
            command: str = "", say=None) -> dict:
    """Run the comparison; return the result dict (see the module docstring).

    Args:
        shape: the model; settings: what every backend shares.
        backends: from :data:`BACKENDS` and :data:`OPTIONAL_BACKENDS` (default: all of
            :data:`BACKENDS`), in the order of the first round.
        steps: optimizer steps per run; warmup: leading steps of each run left out of the figures.
        repeats: runs per backend (interleaved).
        work_dir: where each run's directory and cache path go (the cache path is emptied after each run).
        aio: ``"compiled"`` (DeepSpeed's op for native, if it loads) or ``"python"``.
        build_aio: allow the one-time JIT build of the op in the preflight (about 10 minutes here).
        extensions_dir, libaio_root: see :func:`.aio.aio_env`.
        mem_limit_bytes, timeout_s: per-run watchdog limits (:func:`.runner.run_worker`).
        profile: cProfile each run's measured steps into its run directory (inflates step times).
        native_dedup: let DeepSpeed's parameter swapper drop repeated parameters in ``swap_in`` (its
            NVMe prefetch passes a Llama's ``lm_head`` twice and it then asserts; see
            :func:`.worker.dedup_native_swap_in`); False runs DeepSpeed unmodified.
        same_allocator: give the DeepSpeed backends the glibc allocator settings aidaptiv_ds's runtime
            applies to its own process (:func:`.runner.allocator_env`); False runs each as shipped.
        command: the command line, recorded in the result.

    Raises:
        ValueError: bad arguments, or the cache path lacks the space for one run's training state.
    """
    say = say or (lambda _m: None)
    backends = list(backends or BACKENDS)
    bad = [b for b in backends if b not in BACKENDS + OPTIONAL_BACKENDS]
    if bad or not backends or len(set(backends)) != len(backends):
        raise ValueError(f"--backends {','.join(backends)}: choose each once from "
                         f"{', '.join(BACKENDS + OPTIONAL_BACKENDS)}")
    if steps <= warmup:
        raise ValueError(f"--steps {steps} must exceed --warmup {warmup} (figures come from the steps after warm-up)")
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if settings.seq > shape.max_positions:
        shape = dataclasses.replace(shape, max_positions=settings.seq)
    os.makedirs(work_dir, exist_ok=True)
    st = os.statvfs(work_dir)
    free, need = st.f_bavail * st.f_frsize, disk_needed(shape, settings.dtype, backends)
    if free < need:
        raise ValueError(f"--cache {work_dir}: {free / GiB:.1f} GiB free, one run needs about {need / GiB:.1f} GiB "
                         f"(the training state of {describe(shape)})")
    env = aio_env(extensions_dir=extensions_dir, libaio_root=libaio_root)
    if "native" in backends and aio == "compiled":
        say("loading DeepSpeed's async_io op once (preflight)" + (" - building it if missing" if build_aio else ""))
        pre = preflight(env, build=build_aio)
    else:
        pre = {"aio": "python", "status": "aidaptiv_ds pure-Python handle (--aio python)"}
    say(f"native aio: {pre['status']}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = {"shape": dataclasses.asdict(shape), "settings": settings.as_dict(), "steps": steps, "seed": seed,
            "aio": pre["aio"], "profile_after": warmup, "native_dedup": native_dedup}
    runs = []
    order = run_order(backends, repeats)
    for k, b in enumerate(order):
        run_dir = os.path.join(work_dir, f"{stamp}-{settings.dtype}", f"{k:02d}-{b}")
        spec = dict(base, backend=b)
        if profile:
            spec["profile"] = os.path.join(run_dir, "profile.prof")
        say(f"[{k + 1}/{len(order)}] {b} ({settings.dtype}, {describe(shape)})")
        res = run_worker(spec, run_dir, worker_env(b, env, same_allocator), timeout_s=timeout_s,
                         mem_limit_bytes=mem_limit_bytes, keep_cache=keep_cache, say=say)
        res["order"] = k
        runs.append(res)
    figs = summarize(runs, backends, warmup)
    result = {
        "config": {"model": describe(shape), "shape": shape.as_dict(), **settings.as_dict(), "steps": steps,
                   "warmup": warmup, "repeats": repeats, "seed": seed, "backends": backends, "order": order,
                   "reference": REFERENCE, "profiled": profile, "native_dedup": native_dedup,
                   "same_allocator": same_allocator,
                   "work_dir": work_dir},
        "command": command,
        "machine": machine_info(work_dir),
        "code": code_version(),
        "aio": pre,
        "summary": figs,
        "targets": check_targets(figs, settings.dtype),
        "runs": runs,
    }
    result["table"] = format_table(result)
    return result
