"""The memory probes behind ``launch/memory_sweep.py`` (issue 34): the setup phases' peaks of the bench worker's
result file, the RSS trace, where the bytes are (heap, mappings), and the sweep's table of both peaks."""
from __future__ import annotations

import json
import mmap
import time

import pytest
import torch

from aidaptiv_ds.bench import probes

MiB = 1 << 20


def _touch(n: int) -> None:
    """``n`` bytes of a mapping of its own, touched whole and unmapped (whatever heap policy is set)."""
    region = mmap.mmap(-1, n)
    torch.frombuffer(region, dtype=torch.uint8).fill_(1)
    region.close()


def test_result_file_records_each_setup_phases_peak(tmp_path):
    from aidaptiv_ds.bench.worker import ResultFile

    if not probes.reset_peak_rss():
        pytest.skip("this kernel does not let a process reset its VmHWM (/proc/self/clear_refs)")
    out = ResultFile(str(tmp_path / "r.json"), backend="x")
    out.update(phase="build")
    _touch(192 * MiB)  # in "build" only
    out.update(phase="initialize")
    out.update(phase="step 1")  # closes "initialize"; the steps are PhasePeaks' business from here
    out.update(phase="step 2")
    data = json.loads((tmp_path / "r.json").read_text())
    peaks, ends = data["setup_phase_peak_rss_bytes"], data["setup_phase_end_rss_bytes"]
    assert list(peaks) == ["start", "build", "initialize"] and "step 1" not in peaks
    assert peaks["build"] - ends["build"] >= 180 * MiB
    assert peaks["initialize"] - ends["initialize"] < 64 * MiB
    assert out.setup_peak() == max(peaks.values())


def _until(cond, what: str, timeout_s: float = 120.0) -> None:
    """Wait for the sampler thread to have taken what ``cond`` looks for (a bound, never a timing assertion:
    on a loaded machine the thread may be scheduled late)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"the RSS trace took no sample {what} in {timeout_s:.0f} s")
        time.sleep(0.01)


def test_rss_trace_keeps_each_phases_first_and_largest_sample():
    phase = {"now": "a"}
    tr = probes.RssTrace(lambda: phase["now"], every_s=0.01, min_step=1 << 40,
                         detail=lambda: {"x": 1}).start()
    _until(lambda: any(x[2] == "a" for x in tr.samples()), 'in phase "a"')
    phase["now"] = "b"
    # 96 MiB resident while "b" is sampled, in a mapping of its own: heap memory that a long test process freed
    # may still be resident, and reusing it would not raise RSS (the CI run failed so with a bytearray)
    keep = mmap.mmap(-1, 96 * MiB)
    torch.frombuffer(keep, dtype=torch.uint8).fill_(1)

    def gap() -> bool:  # phase "b"'s largest sample above phase "a"'s by most of the 96 MiB
        s = tr.samples()
        a, b = [x[1] for x in s if x[2] == "a"], [x[1] for x in s if x[2] == "b"]
        return bool(a and b) and max(b) - max(a) >= 80 * MiB

    _until(gap, 'in phase "b" with the 96 MiB resident')
    tr.stop()
    keep.close()
    s = tr.samples()
    assert [x[0] for x in s] == sorted(x[0] for x in s)
    assert {x[2] for x in s} == {"a", "b"} and all(x[3] == {"x": 1} for x in s)
    top_a = max(x[1] for x in s if x[2] == "a")
    top_b = max(x[1] for x in s if x[2] == "b")
    assert top_b - top_a >= 80 * MiB


def test_smaps_and_heap_figures_name_where_the_bytes_are():
    import ctypes

    by = probes.smaps_rss()
    if not by:
        pytest.skip("no /proc/self/smaps")
    assert by.get("files", 0) > 0 and sum(by.values()) > 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    n = 32 * MiB
    addr = libc.mmap(None, n, 0x1 | 0x2, 0x02 | 0x20, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        ctypes.memset(addr, 1, n)
        named = probes.smaps_rss({"mine": (addr, addr + n)})
        assert named.get("mine", 0) >= 30 * MiB
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(n))
    h = probes.heap_bytes()
    assert h == {} or set(h) == {"heap", "heap_free", "mmapped"}


def test_sweep_table_shows_both_peaks_and_both_fits():
    from aidaptiv_ds.bench.memory import fit_line, format_table

    G = 1 << 30
    pts = [{"backend": "aidaptiv0", "n_params": n, "ok": True, "peak_rss_steps_bytes": int(1.5 * G + 0.2 * n),
            "peak_rss_process_bytes": int(1.6 * G + 0.3 * n), "planned_host": {"total": 2 * G}}
           for n in (100_000_000, 500_000_000, 1_000_000_000)]
    fits = {}
    for key, name in (("peak_rss_steps_bytes", "fits"), ("peak_rss_process_bytes", "process_fits")):
        a, b = fit_line([p["n_params"] for p in pts], [p[key] for p in pts])
        fits[name] = {"aidaptiv0": {"fixed_bytes": a, "bytes_per_param": b, "points": 3}}
    table = format_table({"config": {"backends": ["aidaptiv0"]}, "points": pts, **fits})
    assert "| **slope, B/param (steps)** | **0.20** |" in table
    assert "| **slope, B/param (process)** | **0.30** |" in table
    assert "1.52 / 1.63 GiB" in table  # 100M: steps / process


def test_the_sweeps_plan_keeps_an_explicit_zero_knob():
    """``planned_host_bytes``: a knob left out of the run's config (None) is DeepSpeed's default, an explicit 0
    is 0 (``stage3_max_live_parameters: 0`` prefetches nothing; with the sweep's reuse distance of 0 DeepSpeed
    then keeps two modules gathered, planner/auto.py [Note: what bounds the gathered parameters])."""
    from aidaptiv_ds.bench.backends import TrainSettings
    from aidaptiv_ds.bench.memory import planned_host_bytes
    from aidaptiv_ds.bench.models import LlamaShape

    shape = LlamaShape(hidden=256, intermediate=704, layers=4, heads=4, kv_heads=4, vocab=1024)
    unset = planned_host_bytes(shape, TrainSettings(dtype="fp32"))
    zero = planned_host_bytes(shape, TrainSettings(dtype="fp32", max_live_parameters=0))
    assert zero["total"] < unset["total"], (zero, unset)
