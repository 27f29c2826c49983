"""``aidaptiv-ds ledger``: bytes aidaptiv_ds wrote to each cache drive, and what that means for its endurance.

Reads the ledger files of :mod:`aidaptiv_ds.store.ledger` (``<cache_path>/aidaptiv_ds/<host>/ledger.json``,
one per node and path) and prints, per path and host: bytes written in total, each run (bytes,
ranks, duration, pace), DWPD at the historical pace against the drive's rating, and the days until
the rated TBW is used up (formulas in :mod:`aidaptiv_ds.store.ledger`). Next to our count it shows
the drive's own counters where this machine exposes them: ``/sys/block/<dev>/stat`` sectors written
since boot and NVMe SMART "Data Units Written" since manufacture (all writers, not only us).
"""
from __future__ import annotations

import json
import os

from ..jsonsafe import finite
from ..store.layout import ROOT_NAME
from ..store.ledger import SECONDS_PER_DAY, EnduranceLedger, EnduranceRating, history_pace, projection, read_ledger
from ..telemetry.sysinfo import drive_counters
from ..units import format_bytes


def _dec(n: float) -> str:
    """Bytes in decimal units, as drive vendors state capacity and TBW."""
    return format_bytes(n, decimal=True)


MIN_PACE_SPAN_S = 600.0


def run_summary(name: str, rec: dict, capacity: int | None) -> dict:
    """One run's record: ``{"run", "bytes_written", "ranks", "start", "last", "duration_s", "bytes_per_day", "dwpd"}``.

    Pace = bytes written / (last - start) x 86400; None for a run shorter than :data:`MIN_PACE_SPAN_S`
    (a pace over a few seconds says nothing about a day).
    """
    start, last = rec.get("start"), rec.get("last")
    dur = (last - start) if start is not None and last is not None else 0.0
    b = int(rec.get("bytes_written", 0))
    per_day = b / dur * SECONDS_PER_DAY if dur >= MIN_PACE_SPAN_S else None
    return {"run": name, "bytes_written": b, "ranks": len(rec.get("ranks", {})), "start": start, "last": last,
            "duration_s": dur, "bytes_per_day": per_day,
            "dwpd": per_day / capacity if capacity and per_day is not None else None}


def node_report(host: str, node_dir: str, d: dict) -> dict:
    """Summary of one ledger record (one node on one path) with the projection at the historical pace.

    The pace is :func:`~aidaptiv_ds.store.ledger.history_pace` (bytes between the first and the last
    history entry over their time span) when that span is at least :data:`MIN_PACE_SPAN_S`; otherwise
    there is no pace yet (``projection`` None, ``pace_status`` says why). ``history`` gives the
    first and last ``[unix time, bytes written total]`` points of the record.
    """
    capacity = d.get("capacity_bytes")
    rating = EnduranceRating(capacity=capacity, rated_dwpd=float(d.get("rated_dwpd", EnduranceRating.rated_dwpd)),
                             warranty_years=float(d.get("warranty_years", EnduranceRating.warranty_years)))
    total = int(d.get("bytes_written_total", 0))
    hist = d.get("history") or []
    span = hist[-1][0] - hist[0][0] if len(hist) >= 2 else 0.0
    pace, status = None, "ok"
    if span < MIN_PACE_SPAN_S:
        status = f"history spans {span:.0f} s, less than {MIN_PACE_SPAN_S:.0f} s: no pace yet"
    elif not capacity:
        status = "the ledger has no capacity_bytes: no DWPD"
    else:
        pace = history_pace(d)
    runs = [run_summary(k, v, capacity) for k, v in sorted(d.get("runs", {}).items(),
                                                              key=lambda kv: kv[1].get("start") or 0)]
    return {"host": host, "ledger": os.path.join(node_dir, EnduranceLedger.FILE), "bytes_written_total": total,
            "first_write_time": d.get("first_write_time"), "runs": runs,
            "history": {"points": len(hist), "first": hist[0] if hist else None, "last": hist[-1] if hist else None,
                        "span_s": span},
            "pace_status": status,
            "projection": projection(total, pace, capacity, rating) if pace is not None else None}


def path_report(path: str, sys_root: str = "/sys") -> dict:
    """Every node's ledger under ``path`` plus this machine's drive counters for ``path``.

    Returns ``{"path", "exists", "nodes": [node_report...], "drive": drive_counters(...), "status"}``.
    """
    root = os.path.join(os.path.abspath(path), ROOT_NAME)
    out = {"path": path, "exists": os.path.isdir(path), "nodes": [], "drive": None, "status": "ok"}
    if not out["exists"]:
        out["status"] = (f"{path} does not exist; fix: give the cache path the run used "
                         f"(aidaptiv.cache_paths in the DeepSpeed config)")
        return out
    if os.path.isdir(root):
        for host in sorted(os.listdir(root)):
            node_dir = os.path.join(root, host)
            d = read_ledger(node_dir) if os.path.isdir(node_dir) else None
            if d is not None:
                out["nodes"].append(node_report(host, node_dir, d))
    if not out["nodes"]:
        out["status"] = f"no ledger under {root} yet (aidaptiv_ds has not written to this path)"
    out["drive"] = drive_counters(path, sys_root)
    return out


def _days(x) -> str:
    if x is None or x == float("inf"):
        return "never at this pace"
    return f"{x:,.1f} days" if x < 3650 else f"{x / 365:,.1f} years"


def format_reports(reports: list[dict]) -> str:
    """The ledger reports as text for people."""
    lines = []
    for r in reports:
        lines.append(f"cache path {r['path']}: {r['status']}")
        for n in r["nodes"]:
            lines.append(f"  host {n['host']}: {_dec(n['bytes_written_total'])} written by aidaptiv_ds")
            for s in n["runs"]:
                pace = (f"{_dec(s['bytes_per_day'])}/day" if s["bytes_per_day"] is not None
                        else "too short for a pace")
                dwpd = f", {s['dwpd']:.3f} DWPD" if s["dwpd"] is not None else ""
                lines.append(f"    run {s['run']}: {_dec(s['bytes_written'])} by {s['ranks']} rank(s) in "
                             f"{s['duration_s'] / 3600:,.2f} h ({pace}{dwpd})")
            p = n["projection"]
            if p:
                lines.append(f"    pace {_dec(p['bytes_per_day'])}/day = {p['dwpd']:.3f} DWPD vs "
                             f"{p['rated_dwpd']:g} rated; {p['tbw_used_fraction']:.4%} of rated TBW "
                             f"{_dec(p['rated_tbw_bytes'])} used; rated TBW reached in "
                             f"{_days(p['days_to_rated_tbw'])}")
            else:
                lines.append(f"    pace: {n['pace_status']}")
        dc = r["drive"]
        if dc is not None:
            sysfs, smart = dc["sysfs"], dc["nvme_smart"]
            own = (f"{_dec(sysfs['bytes_written'])} since boot (sysfs {dc['device']})"
                   if sysfs.get("bytes_written") is not None else sysfs["status"])
            lines.append(f"  drive's own counters: {own}; NVMe SMART: "
                         + (f"{_dec(smart['bytes_written'])} since manufacture"
                            if smart.get("bytes_written") is not None else smart["status"]))
    return "\n".join(lines)


def register(subparsers) -> None:
    """Add ``ledger`` to the ``aidaptiv-ds`` subcommands."""
    p = subparsers.add_parser("ledger", help="bytes written per cache drive, DWPD and days to rated TBW",
                              description=__doc__)
    p.add_argument("--cache", action="append", default=[], metavar="PATH", help="a cache path (repeatable)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    """Print the reports; exit code 1 when a given path does not exist.

    Raises:
        ValueError: no ``--cache`` given.
    """
    if not args.cache:
        raise ValueError("--cache: no cache path given; fix: aidaptiv-ds ledger --cache /mnt/cache0 [--cache ...]")
    reports = [path_report(p) for p in args.cache]
    print(json.dumps(finite(reports), indent=1) if args.json else format_reports(reports))
    return 0 if all(r["exists"] for r in reports) else 1
