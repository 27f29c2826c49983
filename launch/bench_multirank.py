"""Aggregate store throughput with several ranks over one and several cache paths, next to raw O_DIRECT.

For each number of ranks R (processes) and each path set (the first path alone, then all paths):

* **store**: R processes, each a :class:`~aidaptiv_ds.store.SlabStore` in its own namespace
  (run ``bench-<pid>-<config>``, rank ``r``; ``local_ranks=R``; placement ``striped``, equal
  weights), each with its own :class:`~aidaptiv_ds.io.IOEngine` (defaults: 8 MiB requests, 4 threads
  per path). After a barrier every process writes ``--gib`` GiB as extents of ``--extent-mib`` MiB,
  ``--depth`` extents in flight; after a second barrier it reads them all back the same way.
  Aggregate GB/s = all ranks' bytes over the time from the first start to the last end
  (``CLOCK_MONOTONIC``, shared by the processes). Untimed afterwards: the last extents read, and the
  first one read again, must hold their fill values;
* **raw**: the same bytes with ``dd`` (``oflag=direct`` / ``iflag=direct``, ``bs`` = 8 MiB) on the
  same paths: one preallocated file per (rank, path) pair, covered by 1 dd process, and again by 4 on
  disjoint ranges (the engine keeps 4 requests in flight per path), all files at once; aggregate GB/s
  over the wall time of all of them; the better of the two per direction (``--raw-streams``).

Raw and store alternate (raw first in odd repeats, store first in even ones) so drift on a shared
machine hits both; each figure is the median over ``--repeats``. GB/s are decimal (10^9 B/s, as dd
prints them). The files are deleted afterwards.

Usage (the numbers in ``launch/MULTINODE.md`` came from this)::

    python launch/bench_multirank.py --paths /tmp/mr0,/tmp/mr1,/tmp/mr2 --ranks 1,2,4 --gib 1 \\
        --repeats 2 --json output/bench_multirank.json

Paths that are directories on one filesystem share one drive: striping over them cannot add
bandwidth; the report says which device each path is on.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MiB = 1 << 20
DD_BLOCK = 8 * MiB


def _store_worker(rank: int, nranks: int, paths: list[str], run: str, nbytes: int, extent: int, depth: int,
                  barrier, results) -> None:
    """One rank: write then read ``nbytes`` through its own store; put its timings in ``results``."""
    from aidaptiv_ds.io import IOEngine
    from aidaptiv_ds.io.buffers import alloc_aligned
    from aidaptiv_ds.io.engine import READ_DEMAND, WRITE_BACK
    from aidaptiv_ds.store import Namespace, PathSpec, SlabStore

    engine = IOEngine()
    store = SlabStore(Namespace(paths, run, rank), [PathSpec(p) for p in paths], engine=engine, policy="striped",
                      local_ranks=nranks)
    try:
        n = nbytes // extent
        store.preflight(n * extent, "the benchmark extents")
        keys = [f"x{k}" for k in range(n)]
        for k in keys:
            store.allocate(k, extent)
        bufs = [alloc_aligned(extent) for _ in range(depth)]
        fill = [(rank * 31 + k) % 251 for k in range(n)]
        out = {"rank": rank, "bytes": n * extent}
        for phase in ("write", "read"):
            barrier.wait()
            inflight = [None] * depth
            t0 = time.monotonic()
            for k, key in enumerate(keys):
                s = k % depth
                if inflight[s] is not None:
                    inflight[s].wait()
                if phase == "write":
                    bufs[s].fill_(fill[k])
                    inflight[s] = store.write(key, bufs[s], 0, WRITE_BACK)
                else:
                    inflight[s] = store.read(key, bufs[s], 0, READ_DEMAND)
            for f in inflight:
                if f is not None:
                    f.wait()
            out[phase] = (t0, time.monotonic())
        # untimed check: the last extents read are still in the buffers; read the first one again
        bad = sum(int(not bool(bufs[k % depth].eq(fill[k]).all())) for k in range(max(n - depth, 0), n))
        store.read(keys[0], bufs[0], 0, READ_DEMAND).wait()
        out["bad"] = bad + int(not bool(bufs[0].eq(fill[0]).all()))
        out["per_path"] = store.io_counters()
        out["direct"] = all(s.fh.direct for s in store.slabs)
        results.put(out)
    finally:
        store.close(keep=False)
        engine.close()


def store_run(nranks: int, paths: list[str], nbytes: int, extent: int, depth: int, tag: str) -> dict:
    """Aggregate write and read GB/s of ``nranks`` store processes over ``paths``."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(nranks), ctx.Queue()
    run = f"bench-{os.getpid()}-{tag}"
    procs = [ctx.Process(target=_store_worker, args=(r, nranks, paths, run, nbytes, extent, depth, barrier, results))
             for r in range(nranks)]
    for p in procs:
        p.start()
    outs = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"bench_multirank: a store worker failed (exit code {p.exitcode})")
    total = sum(o["bytes"] for o in outs)
    res = {"bytes": total, "direct": all(o["direct"] for o in outs), "bad_extents": sum(o.get("bad", 0) for o in outs)}
    for phase in ("write", "read"):
        t0, t1 = min(o[phase][0] for o in outs), max(o[phase][1] for o in outs)
        res[f"{phase}_gbps"] = total / (t1 - t0) / 1e9
    per_path: dict[str, int] = {}
    for o in outs:
        for p, v in o["per_path"].items():
            per_path[p] = per_path.get(p, 0) + v["bytes_written"]
    res["written_per_path"] = per_path
    return res


def raw_run(nranks: int, paths: list[str], nbytes: int, tag: str, streams: int = 1) -> dict:
    """Aggregate dd O_DIRECT write and read GB/s: one file per (rank, path) of ``nbytes / len(paths)``,
    each covered by ``streams`` dd processes on disjoint ranges, all at once."""
    from aidaptiv_ds.bench.bench_io import _run_dd_parallel

    count = max(nbytes // len(paths) // DD_BLOCK, 1)
    per = -(-count // streams)
    files = []
    for r in range(nranks):
        for p in paths:
            f = os.path.join(p, f".bench_multirank.{os.getpid()}.{tag}.{r}.bin")
            fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, count * DD_BLOCK)  # like the store's slabs: reserved, then written
            finally:
                os.close(fd)
            files.append(f)
    total = count * DD_BLOCK * len(files)
    ranges = [(f, first, min(per, count - first)) for f in files for first in range(0, count, per)]
    try:
        w = _run_dd_parallel([["if=/dev/zero", f"of={f}", f"bs={DD_BLOCK}", f"count={n}", f"seek={first}",
                               "oflag=direct", "conv=notrunc"] for f, first, n in ranges], total)
        r = _run_dd_parallel([[f"if={f}", "of=/dev/null", f"bs={DD_BLOCK}", f"count={n}", f"skip={first}",
                               "iflag=direct"] for f, first, n in ranges], total)
    finally:
        for f in files:
            os.unlink(f)
    return {"bytes": total, "write_gbps": w, "read_gbps": r, "dd_processes": len(ranges), "streams": streams}


def raw_best(nranks: int, paths: list[str], nbytes: int, tag: str, streams: list[int]) -> dict:
    """:func:`raw_run` with each number of ``streams`` per file; the better figure per direction."""
    runs = [raw_run(nranks, paths, nbytes, f"{tag}s{s}", s) for s in streams]
    return {"bytes": runs[0]["bytes"], "write_gbps": max(x["write_gbps"] for x in runs),
            "read_gbps": max(x["read_gbps"] for x in runs), "runs": runs}


def device_of(path: str) -> str:
    from aidaptiv_ds.bench.bench_io import filesystem_of
    fs = filesystem_of(path)
    return f"{fs['device']} ({fs['fstype']} on {fs['mount']})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", required=True, help="comma-separated cache directories (created if missing)")
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated numbers of processes")
    ap.add_argument("--gib", type=float, default=1.0, help="GiB each rank writes and reads")
    ap.add_argument("--extent-mib", type=int, default=64, help="extent size in MiB")
    ap.add_argument("--depth", type=int, default=4, help="extents in flight per rank")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--raw-streams", default="1,4", help="dd processes per (rank, path) file to try; the better "
                    "counts (4 = the engine's threads per path)")
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args(argv)
    paths = [os.path.abspath(p) for p in a.paths.split(",") if p]
    for p in paths:
        os.makedirs(p, exist_ok=True)
    if not shutil.which("dd"):
        raise SystemExit("bench_multirank: dd (coreutils) is needed for the raw O_DIRECT baseline")
    raw_streams = [int(x) for x in a.raw_streams.split(",") if x]
    nbytes = int(a.gib * (1 << 30)) // (a.extent_mib * MiB) * (a.extent_mib * MiB)
    path_sets = [paths[:1]] + ([paths] if len(paths) > 1 else [])
    devices = {p: device_of(p) for p in paths}
    same = len({os.stat(p).st_dev for p in paths}) == 1
    rows = []
    t_start = time.monotonic()
    for ps in path_sets:
        for nr in [int(x) for x in a.ranks.split(",") if x]:
            samples = {"store": [], "raw": []}
            for rep in range(a.repeats):
                order = ("raw", "store") if rep % 2 == 0 else ("store", "raw")
                for side in order:
                    tag = f"{nr}r{len(ps)}p{rep}"
                    samples[side].append(store_run(nr, ps, nbytes, a.extent_mib * MiB, a.depth, tag) if side == "store"
                                         else raw_best(nr, ps, nbytes, tag, raw_streams))
            row = {"ranks": nr, "paths": len(ps), "bytes_per_direction": samples["store"][0]["bytes"],
                   "samples": samples}
            for side in ("store", "raw"):
                for d in ("write", "read"):
                    row[f"{side}_{d}_gbps"] = statistics.median(s[f"{d}_gbps"] for s in samples[side])
            for d in ("write", "read"):
                row[f"{d}_ratio"] = row[f"store_{d}_gbps"] / row[f"raw_{d}_gbps"]
            row["direct"] = all(s["direct"] for s in samples["store"])
            row["bad_extents"] = sum(s["bad_extents"] for s in samples["store"])
            rows.append(row)
            print(f"  {nr} rank(s), {len(ps)} path(s): store write {row['store_write_gbps']:.2f} GB/s "
                  f"(raw {row['raw_write_gbps']:.2f}), read {row['store_read_gbps']:.2f} GB/s "
                  f"(raw {row['raw_read_gbps']:.2f})", flush=True)
    result = {"paths": paths, "devices": devices, "paths_share_one_filesystem": same, "gib_per_rank": a.gib,
              "extent_bytes": a.extent_mib * MiB, "depth": a.depth, "repeats": a.repeats,
              "seconds": time.monotonic() - t_start, "rows": rows}
    print(format_table(result))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    bad = sum(r["bad_extents"] for r in rows)
    if bad:
        print(f"bench_multirank: {bad} extent(s) read back wrong", file=sys.stderr)
        return 1
    return 0


def format_table(result: dict) -> str:
    lines = ["| ranks | paths | store write GB/s | raw write GB/s | write ratio | store read GB/s | raw read GB/s "
             "| read ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['ranks']} | {r['paths']} | {r['store_write_gbps']:.2f} | {r['raw_write_gbps']:.2f} | "
                     f"{r['write_ratio']:.2f} | {r['store_read_gbps']:.2f} | {r['raw_read_gbps']:.2f} | "
                     f"{r['read_ratio']:.2f} |")
    devs = sorted(set(result["devices"].values()))
    note = (f"All paths on one filesystem ({devs[0]}): one physical drive, so 3 paths cannot add bandwidth."
            if result["paths_share_one_filesystem"] else "Devices: " + "; ".join(devs))
    direct = all(r["direct"] for r in result["rows"])
    lines.append("")
    lines.append(f"{note} {result['gib_per_rank']} GiB per rank per direction, extents of "
                 f"{result['extent_bytes'] >> 20} MiB, {result['depth']} in flight per rank; median of "
                 f"{result['repeats']}; store I/O {'O_DIRECT' if direct else 'partly buffered (O_DIRECT refused)'}; "
                 f"{result['seconds']:.0f} s in all.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
