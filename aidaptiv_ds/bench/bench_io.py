"""``bench-io``: read and write throughput of the I/O engine next to raw ``O_DIRECT`` on the same path.

One test file of ``size`` bytes is written once in full (so reads hit real blocks, not unwritten
extents), then for each request size (``blocks``) and each of ``repeats`` rounds, in alternating
order so drift on a shared machine hits both sides alike:

* **raw**: ``fio`` (``--direct=1``, libaio at the engine's queue depth, psync otherwise) when it is
  installed, else ``dd`` with ``oflag=direct``/``iflag=direct`` and ``bs`` = the request size, over
  the same file (``conv=notrunc``: the file is overwritten in place, never reallocated), once as a
  single stream (one request in flight) and once as ``threads`` dd processes on disjoint ranges at
  the same time (the engine's parallelism); the raw figure is the better of the two;
* **engine**: :class:`~aidaptiv_ds.io.engine.IOEngine` with ``threads`` workers, ``queue_depth``
  requests of ``block`` bytes in flight, each with its own page-aligned buffer of random bytes, so
  the engine takes its ``O_DIRECT`` path (the report says if the filesystem refused it; then the
  page cache is dropped with ``posix_fadvise(DONTNEED)`` before each read pass);
* **DeepSpeed's compiled aio handle** (``AsyncIOBuilder``) where it is already built, or when
  ``deepspeed_aio="build"`` allows a JIT build (minutes; needs libaio); otherwise the report says
  ``"not built: <reason>"``. Our own handle registered in this process is never mistaken for it.

GB/s are decimal (10^9 bytes per second, as ``dd`` and drive data sheets print them); each figure is
the median over the rounds, and every sample is kept in the result. The headline keys
(``engine_read_gbps``, ``engine_write_gbps``, ``raw_read_gbps``, ``raw_write_gbps`` and the ratios)
refer to the largest request size of at least 4 MiB (the largest size when none is that big).
The target is engine >= 0.9 x raw in both directions at that size.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import time

import torch

from ..io.buffers import alloc_aligned, round_down
from ..io.engine import READ_DEMAND, WRITE_BACK, IOEngine
from ..io.errors import StorageFullError
from ..io.futures import IOFuture
from ..units import MiB, format_bytes

TARGET_RATIO = 0.9
HEADLINE_MIN_BLOCK = 4 * MiB
FILE_NAME = ".aidaptiv_bench_io.{pid}.bin"


# ---------------------------------------------------------------------------- helpers
def filesystem_of(path: str) -> dict:
    """``{"fstype", "device", "mount"}`` of the mount holding ``path`` (from /proc/self/mounts)."""
    path = os.path.realpath(path)
    best = {"fstype": "unknown", "device": "unknown", "mount": "/"}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best["mount"]):
                    best = {"fstype": fstype, "device": dev, "mount": mnt}
    except OSError:
        pass
    return best


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_DD_SECONDS = re.compile(r"copied,\s*([0-9.eE+-]+)\s*s")


def _run_dd(args: list[str], nbytes: int) -> float:
    """Run dd; return GB/s from its own elapsed time (wall time around it if unparsable)."""
    t0 = time.perf_counter()
    p = subprocess.run(["dd", *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"dd {' '.join(args)} failed: {p.stderr.strip()}")
    m = _DD_SECONDS.search(p.stderr)
    secs = float(m.group(1)) if m else wall
    return _gbps(nbytes, secs)


def parse_fio_json(text: str, rw: str) -> float:
    """GB/s of the first job of ``fio --output-format=json`` output for ``rw`` (``"read"``/``"write"``)."""
    start = text.find("{")
    data = json.loads(text[start:])
    job = data["jobs"][0][rw]
    return job["bw_bytes"] / 1e9


def _run_dd_parallel(args_of: list[list[str]], nbytes: int) -> float:
    """Run several dd processes at once (disjoint ranges of one file); GB/s over the wall time of all."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", *a], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for a in args_of]
    errs = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - t0
    for p, a, e in zip(procs, args_of, errs):
        if p.returncode != 0:
            raise RuntimeError(f"dd {' '.join(a)} failed: {e.strip()}")
    return _gbps(nbytes, wall)


class RawBaseline:
    """Raw ``O_DIRECT`` sequential throughput of one file: fio where installed (libaio at the queue
    depth), else dd: one stream (``streams=1``) or ``streams`` dd processes on disjoint ranges at once."""

    def __init__(self, path: str, size: int, tool: str = "auto", queue_depth: int = 8, streams: int = 1) -> None:
        self.path, self.size, self.queue_depth, self.streams = path, size, queue_depth, max(int(streams), 1)
        if tool == "auto":
            tool = "fio" if shutil.which("fio") else "dd"
        if tool == "fio" and not shutil.which("fio"):
            raise RuntimeError("bench-io: --raw-tool fio given but fio is not installed")
        if tool == "dd" and not shutil.which("dd"):
            raise RuntimeError("bench-io: dd is not installed (coreutils); install fio or coreutils")
        self.tool = tool
        self.fio_engine = "libaio"

    def describe(self) -> str:
        if self.tool == "dd":
            return (f"dd oflag=direct / iflag=direct, bs = request size, {self.streams} "
                    f"process{'es on disjoint ranges' if self.streams > 1 else ''} at once")
        return f"fio --direct=1 --ioengine={self.fio_engine}" + (
            f" --iodepth={self.queue_depth}" if self.fio_engine == "libaio" else "")

    def run(self, write: bool, block: int) -> float:
        count = self.size // block
        nbytes = count * block
        if self.tool == "dd":
            def args(first: int, n: int) -> list[str]:
                if write:
                    return ["if=/dev/zero", f"of={self.path}", f"bs={block}", f"count={n}", f"seek={first}",
                            "oflag=direct", "conv=notrunc"]
                return [f"if={self.path}", "of=/dev/null", f"bs={block}", f"count={n}", f"skip={first}", "iflag=direct"]
            if self.streams == 1:
                return _run_dd(args(0, count), nbytes)
            per = -(-count // self.streams)
            return _run_dd_parallel([args(i, min(per, count - i)) for i in range(0, count, per)], nbytes)
        rw = "write" if write else "read"
        for engine in ([self.fio_engine] if self.fio_engine != "libaio" else ["libaio", "psync"]):
            cmd = ["fio", "--name=raw", f"--filename={self.path}", f"--rw={rw}", f"--bs={block}", f"--size={nbytes}",
                   "--direct=1", f"--ioengine={engine}", "--numjobs=1", "--output-format=json"]
            if engine == "libaio":
                cmd.append(f"--iodepth={self.queue_depth}")
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode == 0:
                self.fio_engine = engine
                return parse_fio_json(p.stdout, rw)
            err = p.stderr.strip()
        raise RuntimeError(f"fio failed on {self.path}: {err}")


# ---------------------------------------------------------------------------- engine
class EngineRunner:
    """Sequential passes over the test file through an :class:`IOEngine`, ``queue_depth`` requests in flight."""

    def __init__(self, path: str, size: int, threads: int, queue_depth: int, max_block: int) -> None:
        self.path, self.size, self.queue_depth = path, size, queue_depth
        self.engine = IOEngine(threads_per_drive=threads, block_size=max(8 * MiB, max_block))
        self.fh = self.engine.open(path, create=False)
        g = torch.Generator().manual_seed(0)
        self.buffers = []
        for _ in range(queue_depth):
            b = alloc_aligned(max_block)
            b.copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8, generator=g))
            self.buffers.append(b)

    @property
    def direct(self) -> bool:
        return self.fh.direct

    def run(self, write: bool, block: int) -> float:
        count = self.size // block
        if not write and not self.direct:
            _drop_cache(self.path)
        inflight: list[IOFuture | None] = [None] * self.queue_depth
        t0 = time.perf_counter()
        for i in range(count):
            slot = i % self.queue_depth
            if inflight[slot] is not None:
                inflight[slot].wait()
            buf = self.buffers[slot][:block]
            off = i * block
            inflight[slot] = (self.engine.write(self.fh, off, buf, WRITE_BACK) if write
                              else self.engine.read(self.fh, off, buf, READ_DEMAND))
        for f in inflight:
            if f is not None:
                f.wait()
        if write and not self.direct:
            self.fh.sync()
        return _gbps(count * block, time.perf_counter() - t0)

    def close(self) -> None:
        self.fh.close()
        self.engine.close()


# ---------------------------------------------------------------------------- DeepSpeed's compiled handle
def load_deepspeed_aio(mode: str = "auto"):
    """DeepSpeed's compiled ``async_io`` module, or ``(None, "not built: <reason>")``.

    ``mode``: ``"auto"`` uses it only when it is precompiled or already loaded (never starts a JIT
    build), ``"build"`` allows the JIT build (minutes; needs libaio-dev and a compiler), ``"off"``
    does not look (:func:`aidaptiv_ds.integration.aio_ops.load_compiled_async_io`).
    """
    if mode == "off":
        return None, "not built: not requested (--no-deepspeed-aio)"
    import contextlib
    import sys

    from ..integration.aio_ops import load_compiled_async_io

    # DeepSpeed logs to stdout (its handler binds sys.stdout on import); keep stdout for our JSON
    with contextlib.redirect_stdout(sys.stderr):
        return load_compiled_async_io(allow_build=mode == "build")


class DeepSpeedRunner:
    """The same passes through DeepSpeed's compiled ``aio_handle`` (batches of ``queue_depth``, then ``wait()``)."""

    def __init__(self, module, path: str, size: int, threads: int, queue_depth: int, max_block: int) -> None:
        self.path, self.size, self.queue_depth = path, size, queue_depth
        self.handles: dict[int, object] = {}
        self.module, self.threads = module, threads
        self.max_block = max_block
        self.buffers = None

    def _handle(self, block: int):
        h = self.handles.get(block)
        if h is None:
            h = self.handles[block] = self.module.aio_handle(block_size=block, queue_depth=self.queue_depth,
                                                             single_submit=False, overlap_events=True,
                                                             intra_op_parallelism=self.threads)
            if self.buffers is None:
                ex = torch.empty(0, dtype=torch.uint8)
                self.buffers = [h.new_cpu_locked_tensor(self.max_block, ex) for _ in range(self.queue_depth)]
                for b in self.buffers:
                    b.random_(0, 256)
        return h

    def run(self, write: bool, block: int) -> float:
        h = self._handle(block)
        count = self.size // block
        t0 = time.perf_counter()
        for start in range(0, count, self.queue_depth):
            n = min(self.queue_depth, count - start)
            for j in range(n):
                buf = self.buffers[j][:block]
                off = (start + j) * block
                rc = h.async_pwrite(buf, self.path, off) if write else h.async_pread(buf, self.path, off)
                if rc != 0:
                    raise RuntimeError(f"DeepSpeed aio_handle returned {rc} at offset {off}")
            if h.wait() != n:
                raise RuntimeError("DeepSpeed aio_handle.wait() count mismatch")
        return _gbps(count * block, time.perf_counter() - t0)


# ---------------------------------------------------------------------------- the benchmark
def bench_io(path: str, size: int, blocks: list[int] | tuple[int, ...] = (1 * MiB, 8 * MiB), threads: int = 4,
             queue_depth: int | None = None, repeats: int = 3, raw_tool: str = "auto", deepspeed_aio: str = "auto",
             keep_file: bool = False, progress=None) -> dict:
    """Measure engine, raw and (where built) DeepSpeed throughput on ``path``; see the module docstring.

    Args:
        path: directory on the drive to test (a cache path).
        size: bytes of the test file (rounded down to a multiple of the largest block).
        blocks: request sizes in bytes (multiples of 4096).
        threads: the engine's worker threads (``threads_per_drive``); also DeepSpeed's intra-op parallelism.
        queue_depth: requests in flight (default ``2 x threads``).
        repeats: rounds per request size (median reported).
        raw_tool: ``"auto"`` (fio if installed, else dd), ``"fio"`` or ``"dd"``.
        deepspeed_aio: ``"auto"``, ``"build"`` or ``"off"`` (see :func:`load_deepspeed_aio`).
        keep_file: leave the test file behind (default: delete it).
        progress: optional ``callable(str)`` for one line per measurement.

    Returns:
        A JSON-serialisable dict (keys in the module docstring, a per-size ``table``, ``ratios``).

    Raises:
        CachePathError: ``path`` is not a writable directory.
        StorageFullError: the drive lacks ``size`` bytes (plus 64 MiB) of free space.
        ValueError: bad sizes.
    """
    from ..store.layout import check_cache_path

    path = check_cache_path(path, "bench-io --path")
    blocks = sorted({int(b) for b in blocks})
    if not blocks or any(b <= 0 or b % 4096 for b in blocks):
        raise ValueError(f"bench-io --block: request sizes must be positive multiples of 4096 bytes, got {blocks}")
    max_block = blocks[-1]
    size = round_down(int(size), max_block)
    if size < max_block:
        raise ValueError(f"bench-io --size: {format_bytes(size)} is smaller than the largest request "
                         f"({format_bytes(max_block)})")
    threads = int(threads)
    queue_depth = int(queue_depth or 2 * threads)
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < size + 64 * MiB:
        raise StorageFullError(path, size + 64 * MiB, free, "the bench-io test file (--size plus 64 MiB)")
    say = progress or (lambda _msg: None)

    fpath = os.path.join(path, FILE_NAME.format(pid=os.getpid()))
    fd = os.open(fpath, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(fd)
    runner = ds = None
    result: dict = {}
    try:
        runner = EngineRunner(fpath, size, threads, queue_depth, max_block)
        raw = RawBaseline(fpath, size, raw_tool, queue_depth)
        # dd keeps one request in flight; the engine keeps several, so dd also runs as `threads`
        # processes at once, and the better of the two is the raw figure the engine is held to
        rawpar = RawBaseline(fpath, size, "dd", queue_depth, streams=threads) \
            if raw.tool == "dd" and threads > 1 else None
        say(f"filling {format_bytes(size)} test file {fpath}")
        runner.run(True, max_block)                   # every block written once, unmeasured
        ds_module, ds_status = load_deepspeed_aio(deepspeed_aio)
        if ds_module is not None:
            try:
                ds = DeepSpeedRunner(ds_module, fpath, size, threads, queue_depth, max_block)
            except Exception as e:  # noqa: BLE001
                ds, ds_status = None, f"not built: handle failed: {e}"
        table = []
        for block in blocks:
            samples: dict[str, list[float]] = {f"{side}_{rw}": [] for rw in ("write", "read") for side in
                                               ("engine", "raw_single", "raw_parallel", "deepspeed")}
            for r in range(repeats):
                sides = ["raw_single", "engine"] + (["raw_parallel"] if rawpar else []) \
                    + (["deepspeed"] if ds is not None else [])
                if r % 2:
                    sides.reverse()
                for write in (True, False):
                    for side in sides:
                        key = f"{side}_{'write' if write else 'read'}"
                        try:
                            gbps = {"raw_single": raw.run, "engine": runner.run,
                                    "raw_parallel": rawpar.run if rawpar is not None else None,
                                    "deepspeed": ds.run if ds is not None else None}[side](write, block)
                        except Exception as e:  # noqa: BLE001
                            if side != "deepspeed":
                                raise
                            ds, ds_status = None, f"not built: failed while measuring: {e}"
                            continue
                        samples[key].append(gbps)
                        say(f"{format_bytes(block):>10} {key:<16} {gbps:7.3f} GB/s")
            row: dict = {"block_bytes": block, "block": format_bytes(block)}
            for key, vals in samples.items():
                row[f"{key}_gbps"] = statistics.median(vals) if vals else None
            for rw in ("write", "read"):
                row[f"raw_{rw}_gbps"] = max(v for v in (row[f"raw_single_{rw}_gbps"], row[f"raw_parallel_{rw}_gbps"])
                                            if v is not None)
            row["write_ratio"] = row["engine_write_gbps"] / row["raw_write_gbps"]
            row["read_ratio"] = row["engine_read_gbps"] / row["raw_read_gbps"]
            row["samples_gbps"] = {k: v for k, v in samples.items() if v}
            table.append(row)
        head = next((row for row in reversed(table) if row["block_bytes"] >= HEADLINE_MIN_BLOCK), table[-1])
        fs = filesystem_of(path)
        result = {
            "path": path, "file": fpath, "file_bytes": size, "filesystem": fs["fstype"], "device": fs["device"],
            "threads": threads, "queue_depth": queue_depth, "repeats": repeats,
            "engine_direct_io": runner.direct, "engine_fallback": dict(runner.engine.fallback_paths),
            "raw_tool": raw.describe() + (f"; and {rawpar.describe()}; raw = the better of the two"
                                          if rawpar else ""),
            "units": "GB/s = 1e9 bytes/s, median of repeats",
            "headline_block_bytes": head["block_bytes"],
            "engine_read_gbps": head["engine_read_gbps"], "engine_write_gbps": head["engine_write_gbps"],
            "raw_read_gbps": head["raw_read_gbps"], "raw_write_gbps": head["raw_write_gbps"],
            "read_ratio": head["read_ratio"], "write_ratio": head["write_ratio"],
            "deepspeed_read_gbps": head["deepspeed_read_gbps"], "deepspeed_write_gbps": head["deepspeed_write_gbps"],
            "deepspeed_aio": ds_status if ds is None else "measured",
            "target_ratio": TARGET_RATIO,
            "meets_target": head["read_ratio"] >= TARGET_RATIO and head["write_ratio"] >= TARGET_RATIO,
            "ratios": {row["block"]: {"read": row["read_ratio"], "write": row["write_ratio"]} for row in table},
            "table": table,
        }
        return result
    finally:
        if runner is not None:
            runner.close()
        if not keep_file and os.path.exists(fpath):
            os.unlink(fpath)


def format_table(result: dict) -> str:
    """A Markdown table of a :func:`bench_io` result (the form pasted into the README)."""
    def f(v):
        return "n/a" if v is None else f"{v:.2f}"

    ds = result["deepspeed_aio"] != "measured"
    lines = [
        f"bench-io on {result['path']} ({result['filesystem']}, {result['device']}), test file "
        f"{format_bytes(result['file_bytes'])}, engine {result['threads']} threads x {result['queue_depth']} in "
        f"flight, direct I/O: {'yes' if result['engine_direct_io'] else 'NO (buffered fallback)'}; "
        f"raw: {result['raw_tool']}; {result['units']}",
        "",
        "| request | engine write | raw write (1 / N streams) | write ratio | engine read | raw read (1 / N streams) "
        "| read ratio |" + ("" if ds else " DeepSpeed aio write | DeepSpeed aio read |"),
        "|---|---|---|---|---|---|---|" + ("" if ds else "---|---|"),
    ]
    for r in result["table"]:
        line = (f"| {r['block']} | {f(r['engine_write_gbps'])} | {f(r['raw_single_write_gbps'])} / "
                f"{f(r['raw_parallel_write_gbps'])} | {f(r['write_ratio'])} | {f(r['engine_read_gbps'])} | "
                f"{f(r['raw_single_read_gbps'])} / {f(r['raw_parallel_read_gbps'])} | {f(r['read_ratio'])} |")
        if not ds:
            line += f" {f(r['deepspeed_write_gbps'])} | {f(r['deepspeed_read_gbps'])} |"
        lines.append(line)
    lines.append("")
    lines.append(f"target engine >= {result['target_ratio']} x raw at {format_bytes(result['headline_block_bytes'])}: "
                 f"{'met' if result['meets_target'] else 'NOT met'} (read {result['read_ratio']:.2f}, "
                 f"write {result['write_ratio']:.2f}); DeepSpeed aio: {result['deepspeed_aio']}")
    return "\n".join(lines)
