"""``aidaptiv-ds compare``: the same Llama, seed, batches and steps through each backend, side by side.

Every backend runs in its own process (:mod:`.worker`), one after another, interleaved over the
repeats in ABBA order (``native, cpu, aidaptiv0, aidaptiv_auto``, then the reverse, ...) so drift of a
shared machine hits every backend alike. Before any native run, DeepSpeed's compiled ``async_io`` op
is loaded once in a separate process (:func:`.aio.preflight`) so the measured runs only load a cached
build; when it cannot be loaded, native runs on aidaptiv_ds's pure-Python handle and the table says
``compiled aio unavailable: <reason>``.

Before the first run and after the last, a short ``bench-io`` of the work directory (the cache
path's filesystem: :func:`.bench_io.bench_io` at 8 MiB requests) measures the engine's read and write
GB/s; their means are the rates of each backend's ``overlap_efficiency`` (:mod:`.summary`), unless
the caller gives the drive's rates (``drive_gbps``), which replace the bench. With ``timeline``,
every run records those steps into ``<run dir>/timeline-rank0.json``
(:mod:`aidaptiv_ds.telemetry.timeline`; draw one with ``aidaptiv-ds timeline <run dir>``).

The result (also written as JSON) holds the configuration, the machine, the aio status, the
bench-io rates, every run (per-step figures) and the per-backend summary with ratios to native
(:mod:`.summary`). A ``progress`` callback gets the same dict after every run (a comparison stopped
half-way keeps what it measured), and a ``deadline`` bounds the whole comparison: the run in
progress is stopped then and the runs not started are recorded as skipped.

A step is an optimizer step throughout: with ``settings.gradient_accumulation`` ``N`` > 1 every backend
runs ``N`` micro-batches per step (DeepSpeed's ``gradient_accumulation_steps``), all backends the same ones,
and step time, bytes per parameter per step, I/O wait share, tokens/s and page faults per step are over all
``N``; the configuration (``config["gradient_accumulation"]``) and the table's header carry ``N``.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import time

from ..telemetry.sysinfo import host_memory
from ..units import GiB
from .aio import aio_env, preflight
from .backends import BACKENDS, OPTIONAL_BACKENDS, REFERENCE, TrainSettings, uses_drive
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
    """Bytes one run may keep on the cache path: the training state plus 10% (0 when no backend uses a drive)."""
    return int(shape.state_bytes(dtype) * 1.1) if any(uses_drive(b) for b in backends) else 0


#: A run is not started with less time than this before the deadline (seconds).
MIN_RUN_S = 20.0


def skipped_run(backend: str, why: str) -> dict:
    """The record of a run that was not started (``ok`` False, ``skipped`` the reason)."""
    return {"backend": backend, "ok": False, "skipped": why, "error": f"skipped: {why}", "steps": []}


IO_BENCH_BLOCK = 8 << 20


def cache_path_rates(work_dir: str, size: int, repeats: int = 2, say=None) -> dict:
    """The engine's read and write GB/s (1e9 bytes/s) at 8 MiB requests on ``work_dir``: a short
    :func:`.bench_io.bench_io` (``size`` bytes, ``repeats`` rounds, DeepSpeed's aio not measured).

    Returns ``{"read_gbps", "write_gbps", "raw_read_gbps", "raw_write_gbps", "direct_io", "size_bytes",
    "status"}``; the rates are None (and ``status`` says why) when the bench could not run (too little
    free space for the test file, for one), so the comparison still runs.
    """
    from ..io.errors import StorageError
    from .bench_io import bench_io

    say = say or (lambda _m: None)
    try:
        r = bench_io(work_dir, size, blocks=[IO_BENCH_BLOCK], repeats=repeats, deepspeed_aio="off")
    except (StorageError, ValueError, RuntimeError) as e:
        say(f"bench-io of {work_dir} failed: {e}")
        return {"read_gbps": None, "write_gbps": None, "size_bytes": size, "status": f"failed: {e}"}
    say(f"bench-io {work_dir}: engine read {r['engine_read_gbps']:.2f} GB/s, write {r['engine_write_gbps']:.2f} GB/s "
        f"at 8 MiB")
    return {"read_gbps": r["engine_read_gbps"], "write_gbps": r["engine_write_gbps"],
            "raw_read_gbps": r["raw_read_gbps"], "raw_write_gbps": r["raw_write_gbps"],
            "direct_io": r["engine_direct_io"], "size_bytes": r["file_bytes"], "status": "measured"}


def _mean(*xs):
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def io_rates(before: dict | None, after: dict | None, size: int,
             drive_gbps: tuple[float, float] | None) -> dict | None:
    """The cache path's read and write GB/s that every backend's overlap efficiency uses (``io_bench``
    of the result): ``drive_gbps`` (``(read, write)`` given by the caller, ``source`` "given") when
    set, else the means of the bench-io ``before`` and ``after`` the runs (:func:`cache_path_rates`;
    ``after`` None while the runs are going, or when the deadline left no time for it; ``source``
    "bench-io"); None when neither (``--io-bench-size 0``).
    """
    if drive_gbps:
        return {"source": "given", "read_gbps": float(drive_gbps[0]), "write_gbps": float(drive_gbps[1]),
                "status": "given (--drive-gbps)"}
    if before is None:
        return None
    rounds = [before] if after is None else [before, after]
    status = next((r["status"] for r in rounds if r["status"] != "measured"), "measured")
    return {"source": "bench-io", "before": before, "after": after, "block_bytes": IO_BENCH_BLOCK, "size_bytes": size,
            "read_gbps": _mean(*(r["read_gbps"] for r in rounds)),
            "write_gbps": _mean(*(r["write_gbps"] for r in rounds)), "status": status}


def compare(shape: LlamaShape, settings: TrainSettings, *, backends: list[str] | None = None, steps: int = 6,
            warmup: int = 2, repeats: int = 2, work_dir: str = "/tmp/aidaptiv_compare", seed: int = 0,
            aio: str = "compiled", build_aio: bool = False, extensions_dir: str | None = None,
            libaio_root: str | None = None, mem_limit_bytes: int | None = None, timeout_s: float = 3600,
            profile: bool = False, keep_cache: bool = False, native_dedup: bool = True, same_allocator: bool = True,
            io_bench_bytes: int = 1 << 30, timeline: tuple[int, int] | None = None, command: str = "",
            say=None, deadline: float | None = None, progress=None,
            drive_gbps: tuple[float, float] | None = None) -> dict:
    """Run the comparison; return the result dict (see the module docstring).

    Args:
        shape: the model; settings: what every backend shares.
        backends: from :data:`BACKENDS` and :data:`OPTIONAL_BACKENDS` (default: all of
            :data:`BACKENDS`), in the order of the first round.
        steps: optimizer steps per run, each ``settings.gradient_accumulation`` micro-batches; warmup: leading
            optimizer steps of each run left out of the figures.
        repeats: runs per backend (interleaved).
        work_dir: where each run's directory and cache path go (the cache path is emptied after each run).
        aio: ``"compiled"`` (DeepSpeed's op for native, if it loads) or ``"python"``.
        build_aio: allow the one-time JIT build of the op in the preflight (about 10 minutes here).
        extensions_dir, libaio_root: see :func:`.aio.aio_env`.
        mem_limit_bytes, timeout_s: per-run watchdog limits (:func:`.runner.run_worker`).
        profile: cProfile each run's measured steps into its run directory (inflates step times).
        native_dedup: let DeepSpeed's parameter swapper drop repeated parameters in ``swap_in`` (its
            NVMe prefetch passes a Llama's ``lm_head`` twice and it then asserts; see
            :func:`aidaptiv_ds.integration.bench_patches.dedup_native_swap_in`); False runs DeepSpeed unmodified.
        same_allocator: give the DeepSpeed backends the glibc allocator settings aidaptiv_ds's runtime
            applies to its own process (:func:`.runner.allocator_env`); False runs each as shipped.
        io_bench_bytes: test file of the bench-io before and after the runs (:func:`cache_path_rates`);
            0 skips it (no overlap efficiency then, unless ``drive_gbps`` is given).
        timeline: ``(first, last)`` optimizer steps each run records into its run directory.
        command: the command line, recorded in the result.
        deadline: ``time.time()`` by which the comparison ends: each run's timeout is cut to it, and a
            run with less than :data:`MIN_RUN_S` left is not started (recorded by :func:`skipped_run`).
        progress: ``fn(result)`` called after every run with the result so far (same keys as the
            return value; the summary covers the runs done).
        drive_gbps: ``(read, write)`` GB/s (1e9 bytes/s) of the cache path's drive measured elsewhere
            (e.g. ``aidaptiv-ds bench-io`` on the same path): an override of the bench-io, which is then
            not run; these rates give each backend's ``overlap_efficiency``
            (:func:`.summary.overlap_efficiency`, :func:`io_rates`).

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
    if timeline is not None and not (1 <= timeline[0] <= timeline[1] <= steps):
        raise ValueError(f"--timeline {timeline[0]}-{timeline[1]}: the steps must lie within 1..--steps ({steps})")
    if drive_gbps is not None and not (len(drive_gbps) == 2 and all(v > 0 for v in drive_gbps)):
        raise ValueError(f"--drive-gbps {drive_gbps}: give READ,WRITE, both > 0 GB/s (or leave it out to bench-io "
                         f"the cache path)")
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
    if timeline is not None:
        base["timeline"] = [int(timeline[0]), int(timeline[1])]
    io_before = None
    if drive_gbps:
        say(f"drive rates given: read {drive_gbps[0]:.2f} GB/s, write {drive_gbps[1]:.2f} GB/s (no bench-io)")
    elif io_bench_bytes:
        io_before = cache_path_rates(work_dir, io_bench_bytes, say=say)
    io_bench = io_rates(io_before, None, io_bench_bytes, drive_gbps)
    runs: list[dict] = []
    order = run_order(backends, repeats)
    head = {
        "config": {"model": describe(shape), "shape": shape.as_dict(), **settings.as_dict(), "steps": steps,
                   "warmup": warmup, "repeats": repeats, "seed": seed, "backends": backends, "order": order,
                   "reference": REFERENCE, "profiled": profile, "native_dedup": native_dedup,
                   "same_allocator": same_allocator, "timeline": timeline,
                   "mkl_cbwr": worker_env(REFERENCE, env).get("MKL_CBWR"),
                   "torch_thp": {b: worker_env(b, env, same_allocator).get("THP_MEM_ALLOC_ENABLE")
                                 for b in backends},
                   "drive_gbps": list(drive_gbps) if drive_gbps else None, "deadline": deadline,
                   "work_dir": work_dir},
        "command": command,
        "machine": machine_info(work_dir),
        "code": code_version(),
        "aio": pre,
    }

    def result_so_far() -> dict:
        figs = summarize(runs, backends, warmup, io_rates=io_bench, tokens_per_step=settings.tokens_per_step)
        targets = check_targets(figs, settings.dtype, settings.clip, settings.gradient_accumulation)
        res = dict(head, io_bench=io_bench, summary=figs, targets=targets, runs=runs)
        res["table"] = format_table(res)
        return res

    for k, b in enumerate(order):
        left = None if deadline is None else deadline - time.time()
        if left is not None and left < MIN_RUN_S:
            say(f"[{k + 1}/{len(order)}] {b}: skipped, {max(left, 0):.0f} s left before the deadline")
            runs.append(dict(skipped_run(b, f"time budget: {max(left, 0):.0f} s left before the deadline"), order=k))
            continue
        run_dir = os.path.join(work_dir, f"{stamp}-{settings.dtype}", f"{k:02d}-{b}")
        spec = dict(base, backend=b)
        if profile:
            spec["profile"] = os.path.join(run_dir, "profile.prof")
        say(f"[{k + 1}/{len(order)}] {b} ({settings.dtype}, {describe(shape)})")
        res = run_worker(spec, run_dir, worker_env(b, env, same_allocator),
                         timeout_s=timeout_s if left is None else min(timeout_s, left),
                         mem_limit_bytes=mem_limit_bytes, keep_cache=keep_cache, say=say)
        res["order"] = k
        runs.append(res)
        if progress is not None:
            progress(result_so_far())  # the overlap efficiency so far from the bench-io before the runs
    if io_before is not None:
        left = None if deadline is None else deadline - time.time()
        if left is None or left > 0:
            io_bench = io_rates(io_before, cache_path_rates(work_dir, io_bench_bytes, say=say), io_bench_bytes, None)
        else:
            say("bench-io after the runs skipped: the deadline has passed (the rates are the bench before them)")
    return result_so_far()
