"""The GPU check: one call on a lent GPU machine (or, without CUDA, the same steps at a tiny size on CPU).

Run through ``launch/gpu_check.sh OUTDIR`` (which installs the carried wheels first); by hand::

    python launch/gpu_check.py OUTDIR [--smoke] [--budget-s 450] [--sections env,oracle,hazard,bench]

Sections, in order, each writing its JSON into OUTDIR as it goes (a killed run keeps what it got):

* ``env.json``: the machine (GPU and driver from nvidia-smi and torch, CPU, RAM, disk), versions,
  DeepSpeed's accelerator, compilers and libaio (for DeepSpeed's async_io);
* ``oracle.json``: the oracle on the accelerator (``tests/_oracle.py``, ``tests/scripts/train_oracle.py``):
  per dtype (bf16, fp32) DeepSpeed's CPU offload (the reference, and on CUDA once more: a CUDA run
  must repeat bit for bit for the comparison to mean anything), aidaptiv_ds at DRAM budget 0 and at
  half the training state; losses, gradient norms, parameters and fp32 masters compared bit for bit;
* ``hazard.json``: ``tests/gpu/test_copy_hazard.py`` and ``tests/gpu/test_pinned_memory.py`` under
  pytest with ``CUDA_LAUNCH_BLOCKING=0`` (skipped, with the reason, without CUDA);
* ``bench.json``: ``launch/compare.py``'s own JSON (rewritten after every run) on a 1.1B bf16 Llama,
  seq 2048 (tiny on CPU): no offload (all on the GPU, the ceiling), DeepSpeed's CPU offload,
  aidaptiv_ds at ``auto`` and at budget 0, DeepSpeed native NVMe (its compiled async_io op when it
  was built here in time, in the background during the oracle; the pure-Python handle otherwise, and
  the table says so); the drive's bandwidth (``aidaptiv-ds bench-io``, the engine's rates) first,
  given to the comparison for the overlap efficiency; ``aio.json``: that build (status, log tail);
* ``summary.json``: one verdict per section, the comparison's model choice, drive and aio; the last
  lines printed say the same, with the comparison's table.

Time: everything ends by ``--t0 + --budget-s`` (``t0``: when gpu_check.sh started, installs
included). Each section gets a share; the comparison gets what is left and stops its last run at
the deadline. Exit code 0 when every section ran and the oracle and hazard checks passed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

SECTIONS = ("env", "oracle", "hazard", "bench")
BENCH_BACKENDS = "gpu,cpu,aidaptiv_auto,aidaptiv0,native"
#: presets tried for the comparison, largest first, until the training state fits the work disk
BENCH_FALLBACK = ("1.1B", "150M", "40M", "20M")


# ---------------------------------------------------------------------------- plumbing
class Clock:
    """Seconds since ``t0`` and until the deadline ``t0 + budget_s``."""

    def __init__(self, t0: float, budget_s: float) -> None:
        self.t0, self.deadline = t0, t0 + budget_s

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.deadline - time.time()


def say(clock: Clock, msg: str) -> None:
    print(f"[gpu_check {clock.elapsed():5.0f}s] {msg}", flush=True)


def write_json(path: str, data) -> None:
    """Atomically (re)write ``path`` (strict JSON: NaN and infinities become null)."""
    from aidaptiv_ds.jsonsafe import finite

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(finite(data), f, indent=1, default=str)
    os.replace(tmp, path)


def sh(cmd: list[str], timeout: float = 30, env: dict | None = None) -> tuple[int, str]:
    """Run a short probe; ``(exit code, stdout+stderr)``; 127 when the program is missing."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, (p.stdout + p.stderr).strip()
    except FileNotFoundError:
        return 127, f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{cmd[0]}: timed out after {timeout:.0f} s"


def child_env(extra: dict | None = None) -> dict:
    """This process's environment with the repository first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def cuda_available() -> bool:
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver means no CUDA here
        return False


# ---------------------------------------------------------------------------- env
def section_env(a, clock: Clock) -> dict:
    """The machine and the software, for the record (``env.json``)."""
    import platform

    import torch

    from aidaptiv_ds.telemetry.nvml import nvml_status
    from aidaptiv_ds.telemetry.sysinfo import host_memory

    env: dict = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
                 "cpu_count": os.cpu_count(), "host_memory": host_memory(), "torch": torch.__version__,
                 "torch_cuda": torch.version.cuda, "cuda_available": cuda_available(), "smoke": a.smoke}
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": props.name, "total_memory_bytes": props.total_memory,
                      "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count()}
    env["nvml"] = nvml_status()
    env["nvidia_smi"] = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,"
                            "clocks.max.sm,temperature.gpu,power.draw", "--format=csv"])[1]
    code, out = sh([sys.executable, "-c", "import json, deepspeed, transformers, pydantic\n"
                    "from deepspeed.accelerator import get_accelerator\n"
                    "print(json.dumps({'deepspeed': deepspeed.__version__, 'transformers': transformers.__version__,"
                    "'pydantic': pydantic.__version__, 'accelerator': get_accelerator().device_name(),"
                    "'deepspeed_file': deepspeed.__file__}))"], timeout=120, env=child_env())
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    env["deepspeed"] = json.loads(lines[-1]) if code == 0 and lines else {"error": out[-2000:]}
    probes = (("nvcc", ["nvcc", "--version"]), ("cxx", ["c++", "--version"]), ("ninja", ["ninja", "--version"]))
    for name, cmd in probes:
        c, o = sh(cmd)
        env[name] = (o.splitlines() or [""])[-1] if c == 0 else f"unavailable ({o[-200:]})"
    import sysconfig

    inc = sysconfig.get_paths().get("include") or ""
    env["python_h"] = os.path.isfile(os.path.join(inc, "Python.h"))
    import ctypes.util

    env["libaio_system"] = ctypes.util.find_library("aio")  # None: DeepSpeed's async_io cannot link here
    env["libaio_root"] = a.libaio_root
    os.makedirs(a.work, exist_ok=True)
    st = os.statvfs(a.work)
    env["work"] = {"path": a.work, "free_bytes": st.f_bavail * st.f_frsize}
    from aidaptiv_ds.bench.bench_io import filesystem_of

    env["work"].update(filesystem_of(a.work))
    return env


# ---------------------------------------------------------------------------- oracle
def oracle_plan(cuda: bool) -> list[tuple[str, str, str, list[str]]]:
    """``[(dtype, run name, backend, extra arguments)]`` of the oracle section."""
    from _oracle import half_state_budget

    runs = []
    for dtype in ("bf16", "fp32"):
        runs.append((dtype, "reference", "cpu", []))
        if cuda:  # a CUDA run must repeat bit for bit before two backends can be compared there
            runs.append((dtype, "reference_repeat", "cpu", []))
        runs.append((dtype, "aidaptiv_budget0", "aidaptiv", ["--budget", "0"]))
        runs.append((dtype, "aidaptiv_half", "aidaptiv", ["--budget", str(half_state_budget(dtype))]))
    return runs


def _run_record(res: dict, wall: float) -> dict:
    from _oracle import written_per_param_per_step

    rec = {"ok": True, "wall_s": round(wall, 1), "device": res.get("device"), "accelerator": res.get("accelerator"),
           "losses": res["losses"], "norms": res.get("norms"), "nparams": res.get("nparams"),
           "swapper": res.get("swapper"), "optimizer_swapper": res.get("optimizer_swapper"),
           "nondeterministic_ops": res.get("nondeterministic_ops"),
           "cache_written_per_param_per_step": written_per_param_per_step(res) if len(res["io"]) > 1 else None}
    if res.get("plan") is not None:
        rec["plan"] = res["plan"]
        rec["budget_bytes"] = res.get("budget")
    return rec


def verdicts(results: dict, cuda: bool) -> dict:
    """Per dtype: does the reference repeat, and is each aidaptiv_ds run bit-identical to it."""
    from _oracle import differences

    out = {}
    for dtype, runs in results.items():
        v = {}
        ref = runs.get("reference")
        for name, r in runs.items():
            if name == "reference" or r is None:
                continue
            if not r.get("ok"):
                v[name] = f"failed: {r.get('error', '?')}"[:600]
            elif ref is None or not ref.get("ok"):
                v[name] = "not compared: the reference run failed"
            else:
                diff = differences(ref["_res"], r["_res"])
                if r["_res"].get("norms") != ref["_res"].get("norms"):
                    diff.append(f"gradient norms differ: {ref['_res'].get('norms')} vs {r['_res'].get('norms')}")
                v[name] = "identical" if not diff else "DIFFERENT: " + "; ".join(diff)[:1500]
        if ref is not None and ref.get("ok") and ref["_res"].get("norms"):
            v["clipping_acted"] = max(ref["_res"]["norms"]) > 1.0
        out[dtype] = v
    return out


def section_oracle(a, clock: Clock, out_path: str) -> dict:
    """Start the oracle runs (``a.jobs`` at a time), compare as they finish, rewrite ``oracle.json``."""
    import torch
    from _oracle import command as oracle_command
    from _oracle import cuda_oracle_args

    cuda = a.cuda
    plan = oracle_plan(cuda)
    deadline = time.time() + min(a.oracle_s, clock.left() - 5)
    threads = max(1, (os.cpu_count() or 1) // max(1, a.jobs))
    results: dict = {dtype: {} for dtype in ("bf16", "fp32")}
    meta = {"args": {d: cuda_oracle_args(d) for d in results}, "jobs": a.jobs, "omp_threads": threads,
            "cuda": cuda, "deadline_s": round(deadline - clock.t0, 1)}

    def dump() -> dict:
        public = {d: {n: {k: v for k, v in r.items() if k != "_res"} for n, r in runs.items()}
                  for d, runs in results.items()}
        data = {**meta, "runs": public, "verdicts": verdicts(results, cuda)}
        write_json(out_path, data)
        return data

    pending = list(plan)
    running: list[tuple] = []
    while pending or running:
        while pending and len(running) < a.jobs:
            dtype, name, backend, extra = pending.pop(0)
            if time.time() > deadline - 10:
                results[dtype][name] = {"ok": False, "error": "skipped: the oracle's time share ran out"}
                continue
            workdir = os.path.join(a.work, "oracle", f"{dtype}-{name}")
            shutil.rmtree(workdir, ignore_errors=True)
            cmd, env, res_path = oracle_command(backend, cuda_oracle_args(dtype) + extra, workdir,
                                                {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                                                 **({"CUDA_LAUNCH_BLOCKING": "0"} if cuda else {})})
            log = open(os.path.join(workdir, "run.log"), "w")
            p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                 start_new_session=True)
            running.append((p, log, dtype, name, res_path, time.time(), workdir))
            say(clock, f"oracle: started {dtype} {name} ({backend})")
        time.sleep(0.5)
        for item in list(running):
            p, log, dtype, name, res_path, t0, workdir = item
            over = time.time() > deadline
            if p.poll() is None and not over:
                continue
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
            log.close()
            running.remove(item)
            wall = time.time() - t0
            if p.returncode == 0 and os.path.isfile(res_path):
                res = torch.load(res_path, weights_only=False)
                rec = _run_record(res, wall)
                rec["_res"] = res
            else:
                with open(os.path.join(workdir, "run.log"), errors="replace") as f:
                    tail = f.read()[-3000:]
                why = "stopped at the oracle's deadline" if over else f"exit code {p.returncode}"
                rec = {"ok": False, "wall_s": round(wall, 1), "error": f"{why}: {tail[-1200:]}", "log_tail": tail}
            results[dtype][name] = rec
            verdict = dump()["verdicts"][dtype].get(name, "the reference" if rec["ok"] else "")
            say(clock, f"oracle: {dtype} {name}: {'ok' if rec['ok'] else 'FAILED'} ({wall:.0f} s) {verdict}"[:400])
    for workdir in glob.glob(os.path.join(a.work, "oracle", "*", "cache")):
        shutil.rmtree(workdir, ignore_errors=True)
    return dump()


# ---------------------------------------------------------------------------- hazard
def parse_junit(path: str) -> list[dict]:
    """``[{"test", "outcome", "message", "seconds"}]`` from a pytest junit XML file."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = child.tag, (child.get("message") or child.text or "")
            elif child.tag == "skipped":
                kind = child.get("type") or ""
                outcome = "xfailed" if "xfail" in kind else "skipped"
                message = child.get("message") or ""
        tests.append({"test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", "outcome": outcome,
                      "message": message[:800], "seconds": float(case.get("time") or 0)})
    return tests


def section_hazard(a, clock: Clock, out_path: str) -> dict:
    """The copy-hazard and pinned-memory tests under pytest (``CUDA_LAUNCH_BLOCKING=0``)."""
    xml_path = os.path.join(a.work, "hazard-junit.xml")
    if os.path.exists(xml_path):
        os.unlink(xml_path)
    files = [os.path.join("tests", "gpu", "test_copy_hazard.py"), os.path.join("tests", "gpu", "test_pinned_memory.py")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={xml_path}",
           f"--basetemp={os.path.join(a.work, 'hazard-tmp')}", *files]
    timeout = max(10.0, min(a.hazard_s, clock.left() - 5))
    t0 = time.time()
    code, out = sh(cmd, timeout=timeout, env=child_env({"CUDA_LAUNCH_BLOCKING": "0"}))
    data: dict = {"command": " ".join(cmd), "exit_code": code, "wall_s": round(time.time() - t0, 1),
                  "cuda_launch_blocking": "0", "output_tail": out[-4000:]}
    if os.path.isfile(xml_path):
        tests = parse_junit(xml_path)
        data["tests"] = tests
        data["counts"] = {k: sum(t["outcome"] == k for t in tests)
                          for k in ("passed", "failure", "error", "skipped", "xfailed")}
    else:
        data["tests"], data["counts"] = [], {}
    write_json(out_path, data)
    return data


# ---------------------------------------------------------------------------- bench
def drive_bandwidth(a, clock: Clock) -> dict:
    """The engine's read/write GB/s on the work path (``aidaptiv-ds bench-io``, 8 MiB requests; the raw
    O_DIRECT rates where the engine's are missing): the rates ``compare``'s own bench-io measures, given
    to it as ``--drive-gbps`` so it does not bench the drive again (also the raw rates, recorded)."""
    size = "64MiB" if a.smoke else "1GiB"
    path = os.path.join(a.work, "bench-io")
    os.makedirs(path, exist_ok=True)
    cmd = [sys.executable, "-m", "aidaptiv_ds.cli.main", "bench-io", "--path", path, "--size", size, "--block", "8MiB",
           "--repeats", "1", "--no-deepspeed-aio", "--json"]
    code, out = sh(cmd, timeout=max(10.0, min(90.0, clock.left() - 30)), env=child_env())
    shutil.rmtree(path, ignore_errors=True)
    start = out.find("{")
    try:
        res = json.loads(out[start:]) if code == 0 and start >= 0 else None
    except ValueError:
        res = None
    if not res:
        return {"ok": False, "error": out[-1500:]}
    return {"ok": True, "size": size, "read_gbps": res.get("engine_read_gbps") or res.get("raw_read_gbps"),
            "write_gbps": res.get("engine_write_gbps") or res.get("raw_write_gbps"),
            "raw_read_gbps": res.get("raw_read_gbps"), "raw_write_gbps": res.get("raw_write_gbps"),
            "filesystem": res.get("filesystem")}


def bench_shape(a, backends: list[str]) -> tuple[str, str]:
    """The preset to compare and why: ``a.bench_params`` if its state fits the work disk, else the
    largest of :data:`BENCH_FALLBACK` that does."""
    from aidaptiv_ds.bench.compare import disk_needed
    from aidaptiv_ds.bench.models import PRESETS
    from aidaptiv_ds.units import GiB

    st = os.statvfs(a.work)
    free = st.f_bavail * st.f_frsize
    order = [a.bench_params] + [p for p in BENCH_FALLBACK if p != a.bench_params]
    for p in order:
        need = disk_needed(PRESETS[p], "bf16", backends)
        if need <= free * 0.9:
            why = "as asked" if p == a.bench_params else \
                f"{a.bench_params} needs {disk_needed(PRESETS[a.bench_params], 'bf16', backends) / GiB:.1f} GiB on " \
                f"{a.work}, {free / GiB:.1f} GiB free"
            return p, why
    return order[-1], f"even {order[-1]} may not fit: {free / GiB:.1f} GiB free on {a.work}"


def start_aio_build(a) -> subprocess.Popen | None:
    """JIT-build DeepSpeed's async_io op (and its pin_memory op) in the background, into the extensions
    directory the comparison loads from; None when not wanted."""
    from aidaptiv_ds.bench.aio import aio_env

    try:
        env = aio_env(child_env({"MAX_JOBS": str(os.cpu_count() or 4)}), extensions_dir=a.torch_ext,
                      libaio_root=a.libaio_root)
    except ValueError as e:
        a.aio_note = f"not built: {e}"
        return None
    os.makedirs(a.work, exist_ok=True)
    out = open(os.path.join(a.work, "aio-build.out"), "w")
    err = open(os.path.join(a.work, "aio-build.log"), "w")
    a.aio_t0 = time.time()
    return subprocess.Popen([sys.executable, "-m", "aidaptiv_ds.bench.aio", "--build"], env=env, stdout=out,
                            stderr=err, cwd=REPO, start_new_session=True)


def finish_aio_build(a, proc: subprocess.Popen | None, wait_s: float, out_path: str) -> dict:
    """Wait up to ``wait_s`` for the background build, stop it if still running, record ``aio.json``."""
    if proc is None:
        data = {"built": False, "status": getattr(a, "aio_note", None) or "not built: not attempted"}
        write_json(out_path, data)
        return data
    try:
        proc.wait(timeout=max(0.0, wait_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    wall = time.time() - a.aio_t0
    with open(os.path.join(a.work, "aio-build.out"), errors="replace") as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith("{")]
    with open(os.path.join(a.work, "aio-build.log"), errors="replace") as f:
        log = f.read()
    if proc.returncode == -9:
        data = {"built": False, "status": f"not built: the JIT build did not finish in {wall:.0f} s (stopped)"}
    elif lines:
        res = json.loads(lines[-1])
        data = {"built": res.get("aio") == "compiled", "status": res.get("status"), **res}
    else:
        data = {"built": False, "status": f"not built: the build exited with {proc.returncode}"}
    data.update(wall_s=round(wall, 1), log_tail=log[-6000:])
    write_json(out_path, data)
    return data


def section_bench(a, clock: Clock, out_path: str, aio: dict) -> dict:
    """``launch/compare.py`` over the backends, stopped at the deadline; its own JSON (rewritten after
    every run) is ``out_path``; returns what led to it (model choice, drive, aio) and its last result."""
    from aidaptiv_ds.units import GiB

    backends = [b for b in a.bench_backends.split(",") if b]
    preset, why = (a.bench_params, "smoke (no CUDA): tiny") if a.smoke else bench_shape(a, backends)
    drive = drive_bandwidth(a, clock)
    say(clock, f"bench: drive {drive.get('read_gbps')} GB/s read, {drive.get('write_gbps')} GB/s write; model {preset} "
               f"({why}); aio: {aio.get('status')}")
    work = os.path.join(a.work, "compare")
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, os.path.join(REPO, "launch", "compare.py"), "--params", preset, "--dtype", "bf16",
           "--seq", str(a.seq), "--micro-batch", "1", "--steps", str(a.bench_steps), "--warmup", str(a.bench_warmup),
           "--repeats", "1", "--backends", ",".join(backends), "--cache", work, "--json", out_path,
           "--deadline-s", f"{max(30.0, clock.left() - 20):.0f}", "--mem-limit", f"{a.mem_limit_gib}GiB",
           "--torch-extensions-dir", a.torch_ext, "--aio", "compiled" if aio.get("built") else "python"]
    if a.cuda:
        cmd.append("--pin-memory")
    if a.libaio_root:
        cmd += ["--libaio-root", a.libaio_root]
    if drive.get("ok") and drive.get("read_gbps") and drive.get("write_gbps"):
        cmd += ["--drive-gbps", f"{drive['read_gbps']:.3f},{drive['write_gbps']:.3f}"]
    t0 = time.time()
    p = subprocess.Popen(cmd, env=child_env({"PYTHONUNBUFFERED": "1"}), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines = []
    for line in p.stdout:
        lines.append(line.rstrip())
        if not line.startswith("|") and line.strip():
            say(clock, "bench: " + line.rstrip())
    p.wait()
    data = {"command": " ".join(cmd), "exit_code": p.returncode, "wall_s": round(time.time() - t0, 1),
            "model": preset, "model_choice": why, "drive": drive, "aio": aio, "output": "\n".join(lines)[-8000:]}
    try:
        with open(out_path) as f:
            data["comparison"] = json.load(f)["comparisons"][-1]
    except (OSError, ValueError, KeyError, IndexError):
        data["comparison"] = None
    data["free_after_gib"] = round(shutil.disk_usage(a.work).free / GiB, 1)
    return data


# ---------------------------------------------------------------------------- summary
def summarize(report: dict) -> dict:
    """One verdict per section (``ok`` True only when it ran and its checks passed)."""
    out: dict = {}
    o = report.get("oracle")
    if o is not None:
        flat = {f"{d} {n}": v for d, vs in o.get("verdicts", {}).items() for n, v in vs.items()
                if n != "clipping_acted"}
        needed = [k for k in flat if "aidaptiv" in k or "repeat" in k]
        out["oracle"] = {"ok": bool(needed) and all(flat[k] == "identical" for k in needed), "verdicts": flat,
                         "clipping_acted": {d: vs.get("clipping_acted") for d, vs in o.get("verdicts", {}).items()}}
    h = report.get("hazard")
    if h is not None:
        c = h.get("counts") or {}
        ran = c.get("passed", 0) + c.get("xfailed", 0)
        out["hazard"] = {"ok": bool(h.get("tests")) and not c.get("failure") and not c.get("error") and ran > 0,
                         "counts": c, "exit_code": h.get("exit_code")}
    b = report.get("bench")
    if b is not None:
        comp = b.get("comparison") or {}
        figs = comp.get("summary") or {}
        out["bench"] = {"ok": bool(figs) and all(f.get("ok") for f in figs.values()), "model": b.get("model"),
                        "aio": (b.get("aio") or {}).get("status"),
                        "backends": {k: ("ok" if f.get("ok") else "; ".join(f.get("errors", []))[:300])
                                     for k, f in figs.items()}}
    return out


def print_summary(report: dict, summary: dict, clock: Clock) -> None:
    print("\n==== gpu_check summary ====", flush=True)
    env = report.get("env") or {}
    print(f"machine: {(env.get('gpu') or {}).get('name', 'no CUDA')}, torch {env.get('torch')}, "
          f"DeepSpeed {(env.get('deepspeed') or {}).get('deepspeed')}, accelerator "
          f"{(env.get('deepspeed') or {}).get('accelerator')}, smoke {env.get('smoke')}")
    for name, s in summary.items():
        print(f"{name}: {'OK' if s.get('ok') else 'NOT OK'}")
        if name == "oracle":
            for k, v in s["verdicts"].items():
                print(f"  {k}: {v[:300]}")
            print(f"  clipping acted: {s['clipping_acted']}")
        elif name == "hazard":
            print(f"  {s['counts']} (pytest exit {s['exit_code']})")
            for t in (report["hazard"].get("tests") or []):
                if t["outcome"] not in ("passed",):
                    print(f"  {t['outcome']}: {t['test']}: {t['message'][:200]}")
        elif name == "bench":
            print(f"  model {s['model']}; aio: {s['aio']}")
            for k, v in s["backends"].items():
                print(f"  {k}: {v}")
    table = ((report.get("bench") or {}).get("comparison") or {}).get("table")
    if table:
        print("\n" + table)
    print(f"\nelapsed {clock.elapsed():.0f} s of {clock.deadline - clock.t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------- main
def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="launch/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", help="where the JSON results go (created)")
    p.add_argument("--smoke", action="store_true",
                   help="the same sections at a tiny size (the default when no CUDA device is visible)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated from {','.join(SECTIONS)}")
    p.add_argument("--t0", type=float, default=None, help="start time (epoch s) the budget counts from (default now)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="everything ends by t0 + this (default 450 on a GPU, 2400 for the smoke on CPU)")
    p.add_argument("--work", default="/tmp/aidaptiv_gpu",
                   help="scratch directory: runs, cache paths (default %(default)s)")
    p.add_argument("--jobs", type=int, default=None, help="oracle runs at a time (default: 8 on a GPU, 1 on CPU)")
    p.add_argument("--oracle-s", type=float, default=None, help="the oracle's time share (default 170 / 1500 s)")
    p.add_argument("--hazard-s", type=float, default=90, help="the hazard tests' time share (default 90 s)")
    p.add_argument("--bench-params", default=None, help="comparison model preset (default 1.1B; smoke: tiny)")
    p.add_argument("--bench-backends", default=BENCH_BACKENDS, help="default %(default)s")
    p.add_argument("--seq", type=int, default=None, help="comparison sequence length (default 2048; smoke 64)")
    p.add_argument("--bench-steps", type=int, default=4, help="steps per comparison run (default 4)")
    p.add_argument("--bench-warmup", type=int, default=1, help="of which not measured (default 1)")
    p.add_argument("--mem-limit-gib", type=int, default=None,
                   help="kill a comparison run above this RSS (default: 115 on a GPU machine, whose MemTotal can "
                        "start low and grow; else the runner's 90%% of RAM)")
    p.add_argument("--libaio-root", default=None, help="an unpacked libaio1 + libaio-dev tree (gpu_check.sh sets it)")
    p.add_argument("--torch-ext", default="/tmp/aidaptiv_torch_ext", help="TORCH_EXTENSIONS_DIR for DeepSpeed's ops")
    p.add_argument("--no-aio-build", action="store_true", help="do not JIT-build DeepSpeed's async_io op")
    a = p.parse_args(argv)
    a.cuda = cuda_available()
    a.smoke = a.smoke or not a.cuda
    a.sections = [s for s in a.sections.split(",") if s]
    bad = [s for s in a.sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {','.join(bad)}; choose from {','.join(SECTIONS)}")
    a.budget_s = a.budget_s if a.budget_s is not None else (2400.0 if a.smoke else 450.0)
    a.jobs = a.jobs or (1 if a.smoke else 8)
    a.oracle_s = a.oracle_s if a.oracle_s is not None else (1500.0 if a.smoke else 170.0)
    a.bench_params = a.bench_params or ("tiny" if a.smoke else "1.1B")
    a.seq = a.seq or (64 if a.smoke else 2048)
    if a.mem_limit_gib is None:
        from aidaptiv_ds.bench.runner import default_mem_limit

        a.mem_limit_gib = 115 if a.cuda else max(1, default_mem_limit() >> 30)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    clock = Clock(a.t0 or time.time(), a.budget_s)
    os.makedirs(a.outdir, exist_ok=True)
    say(clock, f"{'smoke (no CUDA: tiny sizes on CPU)' if a.smoke and not a.cuda else 'smoke' if a.smoke else 'GPU'} "
               f"run; sections {','.join(a.sections)}; budget {a.budget_s:.0f} s; results in {a.outdir}")
    report: dict = {}
    status: dict = {}

    def save_summary() -> dict:
        s = summarize(report)
        bench = {k: v for k, v in (report.get("bench") or {}).items() if k != "comparison"}
        write_json(os.path.join(a.outdir, "summary.json"),
                   {"summary": s, "sections": status, "bench_run": bench or None,
                    "elapsed_s": round(clock.elapsed(), 1), "budget_s": a.budget_s, "smoke": a.smoke, "cuda": a.cuda})
        return s

    aio_proc = None
    want_native = "bench" in a.sections and "native" in a.bench_backends.split(",")
    if want_native and not a.smoke and not a.no_aio_build:
        aio_proc = start_aio_build(a)
        say(clock, "aio: JIT-building DeepSpeed's async_io op in the background" if aio_proc else
            f"aio: {getattr(a, 'aio_note', '')}")
    elif want_native:
        a.aio_note = "not built: " + ("--smoke (the JIT build takes minutes on a small CPU)" if a.smoke
                                      else "--no-aio-build")
    steps = [("env", lambda: section_env(a, clock)),
             ("oracle", lambda: section_oracle(a, clock, os.path.join(a.outdir, "oracle.json"))),
             ("hazard", lambda: section_hazard(a, clock, os.path.join(a.outdir, "hazard.json")))]
    for name, fn in steps:
        if name not in a.sections:
            continue
        say(clock, f"{name}: start ({clock.left():.0f} s left)")
        t0 = time.time()
        try:
            report[name] = fn()
            status[name] = {"ran": True, "wall_s": round(time.time() - t0, 1)}
            if name == "env":
                write_json(os.path.join(a.outdir, "env.json"), report[name])
        except Exception as e:  # noqa: BLE001 - one section's failure is recorded; the others still run
            status[name] = {"ran": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            say(clock, f"{name}: ERROR {type(e).__name__}: {e}")
        save_summary()
    if "bench" in a.sections:
        t0 = time.time()
        try:
            aio = finish_aio_build(a, aio_proc, wait_s=min(120.0, clock.left() - 200), out_path=os.path.join(
                a.outdir, "aio.json")) if want_native else {"built": False, "status": "native not compared"}
            say(clock, f"bench: start ({clock.left():.0f} s left)")
            report["bench"] = section_bench(a, clock, os.path.join(a.outdir, "bench.json"), aio)
            status["bench"] = {"ran": True, "wall_s": round(time.time() - t0, 1)}
        except Exception as e:  # noqa: BLE001
            status["bench"] = {"ran": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            say(clock, f"bench: ERROR {type(e).__name__}: {e}")
    elif aio_proc is not None:
        os.killpg(aio_proc.pid, 9)
    summary = save_summary()
    print_summary(report, summary, clock)
    checks = ["oracle"] + (["hazard"] if a.cuda else [])  # without CUDA the hazard tests skip, with the reason
    ok = all(status.get(s, {}).get("ran") for s in a.sections) and all(
        summary[s]["ok"] for s in checks if s in a.sections and s in summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
