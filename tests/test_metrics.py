"""Per-step metrics: records from counter deltas, the JSONL file, TensorBoard when installed, the one-liner."""
from __future__ import annotations

import importlib.util
import json

import pytest

from aidaptiv_ds.telemetry import counters
from aidaptiv_ds.telemetry.metrics import MetricsWriter, build_record, format_step_summary, scalars
from aidaptiv_ds.telemetry.nvml import FakeGpu, FakeNvml

GiB = 1 << 30


class FakeProvider:
    """A counter provider whose cumulative numbers the test advances."""

    def __init__(self):
        self.read = self.written = 0
        self.wait = 0.0
        self.dram = 0

    def __call__(self):
        return {"bytes_read": {"cache": self.read}, "bytes_written": {"cache": self.written},
                "per_path": {"/mnt/c0": {"bytes_read": self.read // 2, "bytes_written": self.written // 2},
                             "/mnt/c1": {"bytes_read": self.read - self.read // 2,
                                         "bytes_written": self.written - self.written // 2}},
                "dram_bytes": self.dram, "dram_peak_bytes": self.dram, "io_wait_s": self.wait}


@pytest.fixture
def provider():
    p = FakeProvider()
    counters.register_provider("test-metrics", p)
    yield p
    counters.unregister_provider("test-metrics")


def test_writer_records_per_step_deltas(tmp_path, provider):
    fake = FakeNvml([FakeGpu("g0", 96 * GiB, 70 * GiB), FakeGpu("g1", 96 * GiB, 60 * GiB)])
    with MetricsWriter(str(tmp_path), tensorboard=False, nvml_backend=fake) as w:
        provider.read, provider.written, provider.wait, provider.dram = 4 * 10**9, 2 * 10**9, 0.5, 45 * GiB
        r1 = w.step(0, loss=2.5, tokens=4096, step_time_s=2.0, lr=1e-4)
        provider.read, provider.written, provider.wait = 5 * 10**9, 2 * 10**9, 0.75
        r2 = w.step(1, loss=2.25, tokens=4096, step_time_s=1.0)
    assert r1["cache_read_bytes"] == 4 * 10**9 and r1["cache_write_bytes"] == 2 * 10**9
    assert r1["cache_read_gbps"] == pytest.approx(2.0) and r1["cache_write_gbps"] == pytest.approx(1.0)
    assert r1["per_path"]["/mnt/c0"]["read_gbps"] == pytest.approx(1.0)
    assert r1["io_wait_fraction"] == pytest.approx(0.25) and r1["tokens_per_s"] == pytest.approx(2048)
    assert r1["vram_used_bytes"] == [70 * GiB, 60 * GiB] and r1["dram_bytes"] == 45 * GiB
    assert r1["rss_bytes"] > 0 and r1["peak_rss_bytes"] >= r1["rss_bytes"]
    # the second record holds only the second step's bytes
    assert r2["cache_read_bytes"] == 10**9 and r2["cache_write_bytes"] == 0
    assert r2["io_wait_s"] == pytest.approx(0.25)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1] and lines[0]["loss"] == 2.5 and lines[1]["lr"] is None


def test_writer_appends_and_reports_nvml_absence(tmp_path, provider):
    (tmp_path / "metrics.jsonl").write_text('{"step": -1}\n')
    w = MetricsWriter(str(tmp_path), nvml_backend=FakeNvml(error="NVML Shared Library Not Found"))
    rec = w.step(5, loss=float("nan"))
    w.close()
    w.close()                                                            # idempotent
    assert rec["vram_used_bytes"] is None
    assert rec["vram_status"] == "NVML not available: NVML Shared Library Not Found"
    assert rec["cache_read_gbps"] is None                                # no step time, no rate
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["loss"] is None         # strict JSON for a NaN loss


def test_tensorboard_optional(tmp_path, provider):
    have_tb = importlib.util.find_spec("tensorboard") is not None
    w = MetricsWriter(str(tmp_path), nvml_backend=FakeNvml([]))
    assert w.tensorboard_enabled is have_tb
    w.step(0, loss=1.0, step_time_s=1.0)
    w.close()
    if have_tb:
        assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
    else:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            MetricsWriter(str(tmp_path), tensorboard=True)


def test_scalars_flatten_numbers_only():
    rec = {"step": 3, "time": 1.0, "loss": 2.0, "vram_status": "ok", "lr": None, "flag": True,
           "per_path": {"/c0": {"read_gbps": 1.5, "write_gbps": None}}, "vram_used_bytes": [1, 2]}
    assert scalars(rec) == {"loss": 2.0, "per_path//c0/read_gbps": 1.5, "vram_used_bytes/0": 1.0,
                            "vram_used_bytes/1": 2.0}


def test_format_step_summary():
    d = {"bytes_read": {"cache": 3 * 10**9}, "bytes_written": {"cache": 10**9}, "per_path": {}, "io_wait_s": 0.3,
         "dram_bytes": int(45.25 * GiB), "dram_peak_bytes": 0, "proc_read_bytes": 0, "proc_write_bytes": 0}
    vram = {"available": True, "status": "ok", "gpus": [{"used_bytes": 70 * GiB, "total_bytes": 96 * GiB},
                                                        {"used_bytes": 72 * GiB, "total_bytes": 96 * GiB}]}
    rec = build_record(7, d, step_time_s=2.0, loss=1.23456, tokens=8192, vram=vram)
    assert format_step_summary(rec) == \
        "loss 1.2346 | 4,096 tok/s | cache R 1.50 W 0.50 GB/s | io-wait 15% | DRAM 45.2 GiB | VRAM 72.0 GiB"
    # with the budget's gauges: what the budget books, and the tier's working memory beside it
    rec = build_record(7, {**d, "dram_budgeted_bytes": int(40 * GiB), "dram_budget_bytes": int(40 * GiB)})
    assert format_step_summary(rec) == "DRAM tier 40.0 + working 5.2 GiB"
    assert format_step_summary(build_record(0, {"bytes_read": {}, "bytes_written": {}})) == ""
