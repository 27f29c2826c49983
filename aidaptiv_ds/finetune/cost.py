"""What a fine-tuning run cost the cache drives: per-drive totals, the DWPD they imply, the ledger's view.

Figures (bytes; DWPD after JEDEC JESD218 as in :mod:`aidaptiv_ds.store.ledger`):

* per cache path: bytes written and read by the whole run (every accounting window of
  :mod:`.loop`: setup, evals, steps, saves), summed over ranks;
* DWPD at the run's measured pace = (bytes written to that path during the timed steps / their
  wall time) x 86 400 s / the drive's capacity (the ``endurance.capacity`` of the config, else the
  filesystem size of the path), next to the drive's rated DWPD;
* ``ledger_bytes_written``: what this run's ranks booked in the endurance ledger files, read back
  from the files (every rank reads its own entry; summed): equal to the bytes the counters saw,
  since each accounting window is settled (write-back done and booked) before it closes.
"""
from __future__ import annotations

import json

from ..store.ledger import SECONDS_PER_DAY
from . import distributed


def _runtime():
    from ..integration.runtime import current_runtime

    return current_runtime()


def ledger_booked() -> dict[str, int] | None:
    """Bytes this rank's ledger entries record for the current run, per cache path (None without
    an aidaptiv_ds store in this process). Reads the files (under no lock: a reader never sees a
    partial file, they are replaced atomically)."""
    rt = _runtime()
    if rt is None:
        return None
    out = {}
    for path, led in zip(rt.namespace.cache_paths, rt.store.ledgers):
        try:
            with open(led.file, encoding="utf-8") as f:
                d = json.load(f)
            out[path] = int(d["runs"][led.run]["ranks"][led.rank]["bytes_written"])
        except (OSError, ValueError, KeyError):
            out[path] = 0
    return out


def drive_ratings() -> dict[str, dict]:
    """``{cache path: {"capacity_bytes", "rated_dwpd"}}`` of this process's store (empty without one)."""
    rt = _runtime()
    if rt is None:
        return {}
    return {p: {"capacity_bytes": int(led.capacity), "rated_dwpd": float(led.rating.rated_dwpd)}
            for p, led in zip(rt.namespace.cache_paths, rt.store.ledgers)}


def run_cost(stats: dict) -> dict:
    """Per-drive figures and the ledger's total for the loop's ``stats`` (collective: every rank calls it).

    Returns ``{"drives": {path: {"bytes_written", "bytes_read", "timed_bytes_written",
    "bytes_per_day", "dwpd", "capacity_bytes", "rated_dwpd"}}, "ledger_bytes_written"}``
    (``ledger_bytes_written`` None when no rank has a store).
    """
    booked = distributed.gather_objects(ledger_booked())
    ratings = {}
    for r in distributed.gather_objects(drive_ratings()):
        for p, v in r.items():
            ratings.setdefault(p, v)
    ledger = None if all(b is None for b in booked) else sum(sum(b.values()) for b in booked if b)
    timed_s = stats.get("timed_time_s") or 0.0
    drives = {}
    for p, v in (stats.get("bytes_per_path_total") or {}).items():
        timed_w = (stats.get("timed_bytes_written_per_path") or {}).get(p, 0)
        per_day = timed_w / timed_s * SECONDS_PER_DAY if timed_s > 0 else None
        rating = ratings.get(p, {})
        cap = rating.get("capacity_bytes")
        drives[p] = {"bytes_written": v["bytes_written"], "bytes_read": v["bytes_read"], "timed_bytes_written": timed_w,
                     "bytes_per_day": per_day, "dwpd": per_day / cap if per_day is not None and cap else None,
                     "capacity_bytes": cap, "rated_dwpd": rating.get("rated_dwpd")}
    return {"drives": drives, "ledger_bytes_written": ledger}
