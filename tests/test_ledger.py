"""The endurance ledger: file format, projections, cross-process aggregation, and the store's booking."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from _storage_helpers import child_env, make_dirs, rand_tensor
from aidaptiv_ds.io import IOEngine
from aidaptiv_ds.store import EnduranceLedger, EnduranceRating, Namespace, PathSpec, SlabStore, projection
from aidaptiv_ds.store.ledger import SECONDS_PER_DAY, history_pace, read_ledger

TB = 10 ** 12


def test_file_format_after_flushes(tmp_path):
    node = str(tmp_path / "aidaptiv_ds" / "host")
    rating = EnduranceRating(capacity=2 * TB, rated_dwpd=30, warranty_years=5)
    led = EnduranceLedger(node, str(tmp_path), rating, "runA", 3)
    led.add(1000)
    led.add(234)
    assert read_ledger(node) is None                     # nothing on disk before flush
    led.flush()
    d = read_ledger(node)
    assert d["cache_path"] == str(tmp_path) and d["capacity_bytes"] == 2 * TB
    assert d["rated_dwpd"] == 30 and d["warranty_years"] == 5
    assert d["bytes_written_total"] == 1234 and d["first_write_time"] > 0
    assert d["runs"]["runA"]["bytes_written"] == 1234
    assert d["runs"]["runA"]["ranks"]["3"]["bytes_written"] == 1234
    assert d["history"][-1][1] == 1234
    led.flush()                                          # nothing new: no double count
    led.add(66)
    led.flush()
    d = read_ledger(node)
    assert d["bytes_written_total"] == 1300 and d["runs"]["runA"]["ranks"]["3"]["bytes_written"] == 1300
    # a later run and another rank add up; the first run's record stays
    other = EnduranceLedger(node, str(tmp_path), rating, "runB", 0)
    other.add(700)
    other.flush()
    d = read_ledger(node)
    assert d["bytes_written_total"] == 2000
    assert d["runs"]["runA"]["bytes_written"] == 1300 and d["runs"]["runB"]["bytes_written"] == 700
    with open(os.path.join(node, "ledger.json")) as f:
        assert json.load(f) == d                         # plain JSON


def test_capacity_defaults_to_the_filesystem_size(tmp_path):
    led = EnduranceLedger(str(tmp_path / "n"), str(tmp_path), EnduranceRating(), "r", 0)
    st = os.statvfs(str(tmp_path))
    assert led.capacity == st.f_blocks * st.f_frsize


def test_projection_numbers():
    rating = EnduranceRating(capacity=TB, rated_dwpd=10, warranty_years=5)
    p = projection(bytes_written_total=5 * TB, bytes_per_day=2 * TB, capacity=TB, rating=rating)
    assert p["rated_tbw_bytes"] == TB * 10 * 365 * 5
    assert p["dwpd"] == 2.0 and p["dwpd_fraction_of_rating"] == 0.2
    assert p["tbw_used_fraction"] == pytest.approx(5 / (10 * 365 * 5))
    assert p["days_to_rated_tbw"] == pytest.approx((TB * 10 * 365 * 5 - 5 * TB) / (2 * TB))
    idle = projection(0, 0.0, TB, rating)
    assert idle["days_to_rated_tbw"] == float("inf") and idle["dwpd"] == 0.0


def test_report_projects_at_this_runs_pace(tmp_path):
    led = EnduranceLedger(str(tmp_path / "n"), str(tmp_path), EnduranceRating(capacity=TB, rated_dwpd=1), "r", 0)
    led.run_start = time.time() - 100.0                 # 100 s into the run
    led.add(10 ** 9)
    rep = led.report()
    assert rep["this_run_bytes"] == 10 ** 9 and rep["bytes_written_total"] == 10 ** 9
    pace = rep["projection"]["bytes_per_day"]
    assert pace == pytest.approx(10 ** 9 / 100 * SECONDS_PER_DAY, rel=0.05)
    assert rep["projection"]["dwpd"] == pytest.approx(pace / TB)


def test_history_pace():
    assert history_pace({"history": [[0, 0]]}) == 0.0
    assert history_pace({"history": [[0, 0], [SECONDS_PER_DAY / 2, 10]]}) == pytest.approx(20)


_BOOKER = """
import importlib, json, os, sys, time, types
# ledger.py (and io/atomic.py, which it writes through) need only the standard library: load them without the
# packages' __init__ (which import torch, seconds per child), through stand-in packages
root = os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "aidaptiv_ds")
for name, sub in (("aidaptiv_ds", ""), ("aidaptiv_ds.io", "io"), ("aidaptiv_ds.store", "store")):
    pkg = sys.modules[name] = types.ModuleType(name)
    pkg.__path__ = [os.path.join(root, sub)]
ledger = importlib.import_module("aidaptiv_ds.store.ledger")
assert "torch" not in sys.modules
EnduranceLedger, EnduranceRating = ledger.EnduranceLedger, ledger.EnduranceRating
node, cache, rank, n, step, sync = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
led = EnduranceLedger(node, cache, EnduranceRating(capacity=10 ** 12), "shared-run", rank)
open(os.path.join(sync, f"ready{rank}"), "w").close()
while not os.path.exists(os.path.join(sync, "go")):   # start together
    time.sleep(0.001)
t0 = time.time()
for i in range(n):
    led.add(step + i)
    led.flush()
    if i == n // 2:  # meet the other process half-way: both are booking at once, however the two are scheduled
        open(os.path.join(sync, f"half{rank}"), "w").close()
        while not os.path.exists(os.path.join(sync, f"half{1 - rank}")):
            time.sleep(0.001)
print(json.dumps([t0, time.time()]))
"""


@pytest.mark.subprocess
def test_two_processes_booking_the_same_path_add_up(tmp_path):
    node, cache = str(tmp_path / "aidaptiv_ds" / "host"), str(tmp_path)
    sync = tmp_path / "sync"
    sync.mkdir()
    n = 100
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_BOOKER), node, cache, str(rank), str(n),
                               str(step), str(sync)], env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank, step in ((0, 1000), (1, 7))]
    deadline = time.time() + 120
    while not all((sync / f"ready{r}").exists() for r in (0, 1)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "a booking process died"
        time.sleep(0.01)
    (sync / "go").touch()
    spans = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        spans.append(json.loads(out.strip().splitlines()[-1]))
    assert spans[0][0] <= spans[1][1] and spans[1][0] <= spans[0][1], f"the two processes did not overlap: {spans}"
    d = read_ledger(node)
    want = {0: sum(1000 + i for i in range(n)), 1: sum(7 + i for i in range(n))}
    assert d["bytes_written_total"] == want[0] + want[1]
    ranks = d["runs"]["shared-run"]["ranks"]
    assert {int(k): v["bytes_written"] for k, v in ranks.items()} == want
    assert d["runs"]["shared-run"]["bytes_written"] == want[0] + want[1]
    assert not [f for f in os.listdir(node) if ".tmp" in f]      # no temp files left behind


def test_store_books_every_byte_it_wrote_and_nothing_for_reads(tmp_path):
    dirs = make_dirs(tmp_path, 2)
    eng = IOEngine()
    try:
        ns = Namespace(dirs, "led", 0)
        st = SlabStore(ns, [PathSpec(d, weight=w, capacity=1 << 30) for d, w in zip(dirs, [1, 1])], engine=eng,
                       keep=True)
        t = rand_tensor(3 << 20, torch.uint8)
        st.put("a", t).wait()
        st.flush_ledger()
        totals = [read_ledger(ns.node_dir(i))["bytes_written_total"] for i in range(2)]
        assert totals == [st.io_counters()[d]["bytes_written"] for d in dirs] and sum(totals) == 3 << 20
        out = torch.empty_like(t)
        for _ in range(3):
            st.get("a", out).wait()                      # reads are not writes
        st.flush_ledger()
        assert [read_ledger(ns.node_dir(i))["bytes_written_total"] for i in range(2)] == totals
        st.close(keep=True)                              # the index it writes is booked too
        totals = [read_ledger(ns.node_dir(i))["bytes_written_total"] for i in range(2)]
        assert totals == [st.io_counters()[d]["bytes_written"] for d in dirs]
        assert totals[0] > 2 << 20                        # 2 MiB of stripe units + the index.json bytes
        st = SlabStore(ns, [PathSpec(d, capacity=1 << 30) for d in dirs], engine=eng)
        st.close(keep=False)
    finally:
        eng.close()
