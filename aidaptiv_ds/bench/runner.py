"""Launch one worker process, watch its memory and time, collect its result.

Each run gets its own directory ``<work>/<NN>-<backend>/`` with ``spec.json``, ``result.json``,
``worker.log`` (the worker's stdout and stderr) and ``cache/`` (the run's ``nvme_path`` and aidaptiv
cache path, deleted after the run unless ``keep_cache``).

The watchdog samples the worker every ``poll_s`` seconds and kills it (SIGKILL) when its resident
set exceeds ``mem_limit_bytes`` or the host's ``MemAvailable`` falls below ``min_available_bytes``
(so a backend that cannot fit, e.g. DeepSpeed's CPU offload of a model larger than RAM, is stopped
before the kernel's OOM killer picks a process of someone else), or when it runs past ``timeout_s``.
The result then says which limit, at what RSS and in which phase.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import aidaptiv_ds

from ..io.atomic import atomic_write
from ..ports import free_port  # noqa: F401 - re-exported (callers import it from here)
from ..telemetry.sysinfo import host_memory
from ..torch_env import torch_huge_pages_env
from ..units import GiB
from .backends import keeps_no_heap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(aidaptiv_ds.__file__)))


def allocator_env() -> dict:
    """glibc tunables equal to what aidaptiv_ds's runtime sets with ``mallopt``
    (:func:`aidaptiv_ds.io.heap.reuse_freed_host_memory`: freed buffers below the mmap threshold
    stay in the heap for reuse instead of being unmapped and page-faulted again)."""
    from ..io.heap import reuse_freed_host_memory

    threshold = reuse_freed_host_memory.__defaults__[0]
    return {"MALLOC_MMAP_THRESHOLD_": str(threshold), "MALLOC_TRIM_THRESHOLD_": str(4 * threshold)}


#: MKL's conditional numerical reproducibility for every worker unless the caller set a mode: the
#: instruction set MKL would pick anyway, in strict mode, whose GEMM results do not depend on the
#: inputs' memory alignment. Without it DeepSpeed's CPU offload and aidaptiv_ds alike came out in one of
#: two last-bit variants from run to run (148M fp32: 2 of 8 runs the other one); with it 8 of 8 alike
#: (docs/profiling.md). The thread count is pinned in the worker (integration/blas_threads.py).
REPRODUCIBLE_MKL = {"MKL_CBWR": "AUTO,STRICT"}


def numerics_env(base: dict) -> dict:
    """What :func:`worker_env` adds for bit-reproducible CPU numerics: :data:`REPRODUCIBLE_MKL`, less any
    key the caller's environment ``base`` already sets (the user's choice wins)."""
    return {k: v for k, v in REPRODUCIBLE_MKL.items() if k not in base}


def worker_env(backend: str, base: dict, same_allocator: bool = True) -> dict:
    """``base`` plus what one worker needs: a free rendezvous port, the package on ``PYTHONPATH``, and
    aidaptiv_ds's DeepSpeed hooks only for the aidaptiv_ds backends (DeepSpeed runs untouched otherwise).

    With ``same_allocator`` the DeepSpeed backends get :func:`allocator_env`, so every backend runs
    with the allocator settings aidaptiv_ds's runtime applies to its own process; without it each
    backend runs as shipped (the difference is then partly the allocator's, not the storage path's).
    The aidaptiv_ds backends with a fixed DRAM budget (no heap kept) start PyTorch with its huge pages, as
    the runtime's log advises there (:mod:`aidaptiv_ds.torch_env`); the others, which keep their heap, do
    not. A key the caller's ``base`` sets stays as set. Every backend also gets :func:`numerics_env`, so
    losses compare bit for bit.
    """
    env = dict(base)
    env.update(numerics_env(base))
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    alloc = allocator_env()
    for k in alloc:  # never inherited from the caller: each backend gets exactly what is described above
        env.pop(k, None)
    if backend.startswith("aidaptiv"):
        env.pop("AIDAPTIV_DS_NO_AUTOINSTALL", None)
        if keeps_no_heap(backend):
            env.update(torch_huge_pages_env(base))
    else:
        env["AIDAPTIV_DS_NO_AUTOINSTALL"] = "1"
        if same_allocator:
            env.update(alloc)
    return env


def _proc_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def default_mem_limit() -> int:
    """90% of the host's memory (bytes)."""
    return int((host_memory().get("total_bytes") or 0) * 0.9) or 1 << 62


def _tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def stop_children_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so a running worker is killed with its parent (:func:`run_worker`
    kills it on any exception; the worker runs in its own session and would outlive a plain SIGTERM)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def run_worker(spec: dict, run_dir: str, env: dict, *, timeout_s: float = 3600, mem_limit_bytes: int | None = None,
               min_available_bytes: int = 1 * GiB, poll_s: float = 0.5, keep_cache: bool = False, say=None) -> dict:
    """Run ``python -m aidaptiv_ds.bench.worker`` for ``spec`` in ``run_dir``; return its result.

    ``spec`` gets ``cache_dir`` and ``t_launch`` filled in. The result is the worker's
    ``result.json`` (possibly partial) plus ``rc``, ``killed`` (None or the reason), ``wall_total_s``,
    ``watch_peak_rss_bytes`` (the largest RSS the watchdog saw), ``run_dir`` and, when the run did not
    succeed, ``log_tail``.
    """
    say = say or (lambda _m: None)
    limit = mem_limit_bytes or default_mem_limit()
    os.makedirs(run_dir, exist_ok=True)
    cache = os.path.join(run_dir, "cache")
    os.makedirs(cache, exist_ok=True)
    spec = dict(spec, cache_dir=cache)
    spec_path, result_path, log_path = (os.path.join(run_dir, n) for n in ("spec.json", "result.json", "worker.log"))
    if os.path.exists(result_path):
        os.unlink(result_path)
    spec["t_launch"] = time.time()
    atomic_write(spec_path, json.dumps(spec, indent=1).encode())
    t0 = time.perf_counter()
    killed, peak = None, 0
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "aidaptiv_ds.bench.worker", spec_path, result_path], env=env,
                             cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while p.poll() is None:
                time.sleep(poll_s)
                rss = _proc_rss(p.pid)
                peak = max(peak, rss)
                avail = host_memory().get("available_bytes") or 1 << 62
                if rss > limit:
                    killed = f"RSS {rss / GiB:.1f} GiB over the limit {limit / GiB:.1f} GiB"
                elif avail < min_available_bytes and rss > 2 * GiB:
                    killed = (f"host MemAvailable {avail / GiB:.2f} GiB under {min_available_bytes / GiB:.1f} GiB "
                              f"(worker RSS {rss / GiB:.1f} GiB)")
                elif time.perf_counter() - t0 > timeout_s:
                    killed = f"timeout after {timeout_s:.0f} s"
                if killed:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    break
        except BaseException:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            raise
    wall = time.perf_counter() - t0
    if env.get("MASTER_PORT"):  # the worker has exited: what DeepSpeed's shm all-reduce left (a killed one too)
        from ..integration.shm_buffer import release_allreduce_buffers_of_port

        release_allreduce_buffers_of_port(env["MASTER_PORT"])
    try:
        with open(result_path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"backend": spec["backend"], "ok": False, "phase": "start", "steps": [],
               "error": "the worker wrote no result"}
    res.update(rc=p.returncode, killed=killed, wall_total_s=wall, watch_peak_rss_bytes=peak, run_dir=run_dir)
    if not res.get("ok"):
        res["log_tail"] = _tail(log_path)
        if res.get("error") is None:
            res["error"] = killed or f"exit code {p.returncode} in phase {res.get('phase')}"
    if not keep_cache:
        shutil.rmtree(cache, ignore_errors=True)
    say(f"{spec['backend']}: {'ok' if res.get('ok') else 'FAILED: ' + str(res.get('error'))} ({wall:.0f} s)")
    return res
