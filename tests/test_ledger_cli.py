"""``aidaptiv-ds ledger``: a ledger written by ``EnduranceLedger`` read back through the CLI."""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from aidaptiv_ds.cli import ledger as ledger_cli
from aidaptiv_ds.cli.main import main
from aidaptiv_ds.store.layout import ROOT_NAME
from aidaptiv_ds.store.ledger import EnduranceLedger, EnduranceRating

TB, GB = 10 ** 12, 10 ** 9


def cli(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


def write_ledger(cache, host, runs, capacity=2 * TB, dwpd=30.0):
    """Book ``runs`` = [(run, rank, bytes)] with EnduranceLedger, then spread the history over one day."""
    node = os.path.join(str(cache), ROOT_NAME, host)
    rating = EnduranceRating(capacity=capacity, rated_dwpd=dwpd, warranty_years=5)
    for run, rank, nbytes in runs:
        led = EnduranceLedger(node, str(cache), rating, run, rank)
        led.add(nbytes)
        led.flush()
    path = os.path.join(node, EnduranceLedger.FILE)
    with open(path) as f:
        d = json.load(f)
    # pretend the bookings happened over 24 h: first history point at t0, last one day later
    t0 = d["history"][0][0] - 86400
    d["history"][0][0] = t0
    for r in d["runs"].values():
        r["start"] = t0
    d["first_write_time"] = t0
    with open(path, "w") as f:
        json.dump(d, f)
    return d


def test_ledger_cli_json_per_host_and_run(tmp_path):
    write_ledger(tmp_path, "nodeA", [("run1", 0, 3 * TB), ("run1", 1, 1 * TB), ("run2", 0, 2 * TB)])
    write_ledger(tmp_path, "nodeB", [("run1", 0, 500 * GB)])
    rc, out = cli("ledger", "--cache", str(tmp_path), "--json")
    assert rc == 0
    (rep,) = json.loads(out)
    assert rep["status"] == "ok" and [n["host"] for n in rep["nodes"]] == ["nodeA", "nodeB"]
    a = rep["nodes"][0]
    assert a["bytes_written_total"] == 6 * TB
    runs = {r["run"]: r for r in a["runs"]}
    assert runs["run1"]["bytes_written"] == 4 * TB and runs["run1"]["ranks"] == 2
    assert runs["run2"]["bytes_written"] == 2 * TB
    p = a["projection"]
    # history: first point after the first booking (3 TB), last after all (6 TB), one day apart
    assert p["bytes_per_day"] == pytest.approx(3 * TB, rel=1e-3)
    assert p["dwpd"] == pytest.approx(1.5, rel=1e-3)                       # 3 TB/day on a 2 TB drive
    assert p["rated_tbw_bytes"] == 2 * TB * 30 * 365 * 5
    assert p["days_to_rated_tbw"] == pytest.approx((p["rated_tbw_bytes"] - 6 * TB) / (3 * TB), rel=1e-3)
    assert rep["drive"] is not None and "sysfs" in rep["drive"]            # the drive's own counters, or why not


def test_ledger_cli_text_and_short_history(tmp_path):
    node = os.path.join(str(tmp_path), ROOT_NAME, "h1")
    led = EnduranceLedger(node, str(tmp_path), EnduranceRating(capacity=TB, rated_dwpd=100), "r", 0)
    led.add(10 * GB)
    led.flush()
    rc, out = cli("ledger", "--cache", str(tmp_path))
    assert rc == 0
    assert "host h1: 10.00 GB written by aidaptiv_ds" in out
    assert "no pace yet" in out                                            # seconds of history say nothing per day
    assert "drive's own counters:" in out


def test_ledger_cli_missing_and_empty_paths(tmp_path):
    rc, out = cli("ledger", "--cache", str(tmp_path), "--cache", str(tmp_path / "gone"))
    assert rc == 1
    assert "no ledger under" in out and "does not exist; fix:" in out
    assert main(["ledger"]) == 2


def test_drive_counters_from_fake_sysfs(tmp_path):
    """A partition's stat is resolved to its disk; bytes = sectors written x 512."""
    from aidaptiv_ds.telemetry import sysinfo
    st = os.stat(tmp_path)
    maj, mi = os.major(st.st_dev), os.minor(st.st_dev)
    if maj == 0:
        pytest.skip("tmp_path is on a filesystem without a block device")
    sys_root = tmp_path / "sys"
    disk = sys_root / "devices" / "nvme0n1"
    (disk / "nvme0n1p1").mkdir(parents=True)
    (disk / "nvme0n1p1" / "partition").write_text("1\n")
    (sys_root / "dev" / "block").mkdir(parents=True)
    os.symlink(disk / "nvme0n1p1", sys_root / "dev" / "block" / f"{maj}:{mi}")
    (sys_root / "block" / "nvme0n1").mkdir(parents=True)
    (sys_root / "block" / "nvme0n1" / "stat").write_text("1 2 3 4 5 6 1000 8 9 10 11\n")

    class Done:
        returncode, stdout, stderr = 0, json.dumps({"data_units_written": 7}), ""

    dc = sysinfo.drive_counters(str(tmp_path), str(sys_root), runner=lambda *a, **k: Done())
    assert dc["device"] == "nvme0n1"
    assert dc["sysfs"]["bytes_written"] == 1000 * 512
    assert dc["nvme_smart"]["bytes_written"] == 7 * 512_000
    rep = {"path": str(tmp_path), "status": "ok", "nodes": [], "drive": dc}
    text = ledger_cli.format_reports([rep])
    assert "512.00 KB since boot (sysfs nvme0n1)" in text and "3.58 MB since manufacture" in text
