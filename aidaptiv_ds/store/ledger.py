"""The endurance ledger: bytes aidaptiv_ds wrote to each cache path, persisted across runs.

One JSON file per (cache path, node): ``<cache_path>/aidaptiv_ds/<host>/ledger.json``. Every rank
of the node adds its own bytes under an ``fcntl`` lock, so the file aggregates all ranks; each run
keeps a per-rank record for the per-run summary. Projections follow the drive vendors' definitions:

* rated TBW (bytes) = capacity x rated DWPD x 365 x warranty years (JEDEC JESD218 endurance rating,
  the way DWPD and TBW are stated on SSD data sheets);
* DWPD at the measured pace = bytes written per day / capacity, where bytes per day comes from
  this run's bytes over its wall time (or all history when no run is active);
* days to rated TBW = (rated TBW - bytes written so far) / bytes per day.

Only bytes aidaptiv_ds wrote are counted here; ``aidaptiv-ds ledger`` shows the drive's own
counters next to ours where the OS exposes them.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import time

# absolute, not relative: this module is also loaded alone by file path (no package), and
# aidaptiv_ds.errors imports nothing (``import aidaptiv_ds`` stays cheap)
from aidaptiv_ds.errors import AidaptivError, AidaptivWarning
from aidaptiv_ds.io.atomic import write_json  # stdlib only, like aidaptiv_ds.errors

SECONDS_PER_DAY = 86400.0


class LedgerWarning(AidaptivWarning):
    """A ledger file could not be updated (see :meth:`SlabStore.flush_ledger`); its bytes are kept for a
    later flush."""


class LedgerError(AidaptivError, OSError):
    """A ledger file could not be written. Attributes: ``path`` (the file), ``errno``.

    An ``OSError`` (not a :class:`~aidaptiv_ds.io.errors.StorageError`) because this module needs only
    the standard library and :mod:`aidaptiv_ds.errors`: processes that book bytes load it alone.
    """

    _FIX = {errno.ENOSPC: "free space on the drive",
            errno.ENOENT: "its directory was removed; do not delete aidaptiv_ds/ under a cache path while a run "
                          "uses it",
            errno.EROFS: "the filesystem is read-only; remount it read-write",
            errno.EACCES: "make the directory writable by this user"}

    def __init__(self, path: str, cache_path: str, err: int | None) -> None:
        what = os.strerror(err) if err else "unknown error"
        super().__init__(err, what, path)
        self.path = path
        fix = self._FIX.get(err or 0, "check the drive and the path")
        self.message = (f"aidaptiv_ds: cannot update the endurance ledger {path} of cache path {cache_path}: {what}. "
                        f"Fix: {fix}.")

    def __str__(self) -> str:  # OSError.__str__ would print "[Errno n] ..." instead of the message
        return self.message


@dataclasses.dataclass
class EnduranceRating:
    """What the drive's data sheet promises.

    Attributes:
        capacity: drive capacity in bytes (None: the filesystem size of the cache path).
        rated_dwpd: drive writes per day over the warranty (cache SSDs: 30-100; TLC client drives: 0.3-1).
        warranty_years: warranty period the DWPD rating refers to.
    """
    capacity: int | None = None
    rated_dwpd: float = 1.0
    warranty_years: float = 5.0

    def rated_tbw_bytes(self, capacity: int) -> float:
        return capacity * self.rated_dwpd * 365.0 * self.warranty_years


def projection(bytes_written_total: int, bytes_per_day: float, capacity: int, rating: EnduranceRating) -> dict:
    """DWPD at a given pace and days until the rated TBW is used up (``inf`` at zero pace)."""
    tbw = rating.rated_tbw_bytes(capacity)
    dwpd = bytes_per_day / capacity if capacity else 0.0
    left = max(tbw - bytes_written_total, 0.0)
    days = left / bytes_per_day if bytes_per_day > 0 else float("inf")
    return {
        "capacity_bytes": capacity,
        "rated_dwpd": rating.rated_dwpd,
        "warranty_years": rating.warranty_years,
        "rated_tbw_bytes": tbw,
        "bytes_written_total": bytes_written_total,
        "bytes_per_day": bytes_per_day,
        "dwpd": dwpd,
        "dwpd_fraction_of_rating": dwpd / rating.rated_dwpd if rating.rated_dwpd else None,
        "tbw_used_fraction": bytes_written_total / tbw if tbw else None,
        "days_to_rated_tbw": days,
    }


def filesystem_capacity(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


class EnduranceLedger:
    """Per-node ledger of one cache path.

    Args:
        node_dir: ``<cache_path>/aidaptiv_ds/<host>`` (created if missing).
        cache_path: the user's cache path (for the record and for the filesystem capacity).
        rating: the drive's endurance rating.
        run: run name the bytes are booked under; rank: this process's global rank.
    """

    FILE = "ledger.json"

    def __init__(self, node_dir: str, cache_path: str, rating: EnduranceRating, run: str, rank: int) -> None:
        os.makedirs(node_dir, exist_ok=True)
        self.file = os.path.join(node_dir, self.FILE)
        self.cache_path = cache_path
        self.rating = rating
        self.run, self.rank = run, str(rank)
        self.capacity = rating.capacity or filesystem_capacity(cache_path)
        self._unflushed = 0
        self.run_bytes = 0
        self.run_start = time.time()

    def add(self, nbytes: int) -> None:
        """Book ``nbytes`` written by this process (kept in memory until :meth:`flush`)."""
        self._unflushed += int(nbytes)
        self.run_bytes += int(nbytes)

    def _locked_update(self, fn) -> dict:
        """Read, update with ``fn`` and atomically rewrite the file under the node-wide lock.

        Raises:
            LedgerError: the file could not be written (full, read-only or removed directory), naming
                it; the old file stays (:mod:`aidaptiv_ds.io.atomic` never renames a partial one).
        """
        fd = None
        try:
            fd = os.open(self.file + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = self._read()
            fn(data)
            write_json(self.file, data)  # temp file, checked writes, fsync, rename, directory fsync
            return data
        except OSError as e:
            raise LedgerError(self.file, self.cache_path, e.errno) from e
        finally:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def _read(self) -> dict:
        try:
            with open(self.file) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {"cache_path": self.cache_path, "bytes_written_total": 0, "first_write_time": None,
                    "runs": {}, "history": []}

    def flush(self) -> dict:
        """Add the unflushed bytes to the file (under the lock) and return the updated record.

        Raises:
            LedgerError: the file could not be written; the bytes stay unflushed for the next call.
        """
        delta, self._unflushed = self._unflushed, 0
        now = time.time()

        def update(d: dict) -> None:
            d["cache_path"] = self.cache_path
            d["capacity_bytes"] = self.capacity
            d["rated_dwpd"] = self.rating.rated_dwpd
            d["warranty_years"] = self.rating.warranty_years
            d["bytes_written_total"] = int(d.get("bytes_written_total", 0)) + delta
            if delta and not d.get("first_write_time"):
                d["first_write_time"] = now
            rec = d.setdefault("runs", {}).setdefault(self.run, {"start": self.run_start, "ranks": {}})
            r = rec["ranks"].setdefault(self.rank, {"bytes_written": 0, "start": self.run_start})
            r["bytes_written"] = int(r["bytes_written"]) + delta
            r["last"] = now
            rec["bytes_written"] = sum(int(x["bytes_written"]) for x in rec["ranks"].values())
            rec["last"] = now
            hist = d.setdefault("history", [])
            if not hist or now - hist[-1][0] >= 60 or delta:
                hist.append([now, d["bytes_written_total"]])
                del hist[:-1000]

        try:
            return self._locked_update(update)
        except BaseException:
            self._unflushed += delta
            raise

    def report(self) -> dict:
        """The record on disk plus projections at this run's pace (see module docstring)."""
        d = self.flush()
        elapsed = max(time.time() - self.run_start, 1.0)
        pace = self.run_bytes / elapsed * SECONDS_PER_DAY
        out = dict(d)
        out["this_run_bytes"] = self.run_bytes
        out["projection"] = projection(int(d["bytes_written_total"]), pace, self.capacity, self.rating)
        return out


def read_ledger(node_dir: str) -> dict | None:
    """The ledger file of one node on one cache path, or None if it does not exist."""
    try:
        with open(os.path.join(node_dir, EnduranceLedger.FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def history_pace(d: dict) -> float:
    """Bytes per day over the whole recorded history of a ledger record (0 when too short)."""
    hist = d.get("history") or []
    if len(hist) < 2:
        return 0.0
    (t0, b0), (t1, b1) = hist[0], hist[-1]
    return (b1 - b0) / max(t1 - t0, 1.0) * SECONDS_PER_DAY
