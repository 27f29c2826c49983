"""``aidaptiv-ds report``: PNGs and a one-page Markdown report from a run's metrics.jsonl (no training)."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("matplotlib")

from aidaptiv_ds.cli.main import main  # noqa: E402
from aidaptiv_ds.telemetry.report import PLOTS, read_metrics, write_report  # noqa: E402


def _step(i, paths=("/mnt/c0", "/mnt/c1")):
    return {"step": i, "loss": 3.0 - 0.1 * i, "lr": 1e-4, "tokens": 100, "step_time_s": 2.0, "io_wait_fraction": 0.25,
            "io_wait_s": 0.5, "per_path": {p: {"read_bytes": 8_000_000 + k, "write_bytes": 6_000_000}
                                           for k, p in enumerate(paths)},
            "rss_bytes": (2 << 30) + i, "peak_rss_bytes": 3 << 30, "dram_bytes": 1 << 30, "cache_write_bytes": 12_000_000}


def _run_dir(tmp_path, lines):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 9, "lo')
    return str(tmp_path)


SUMMARY = {"summary": True, "eval_loss_before": 3.1, "final_eval_loss": 2.5, "steps": 4, "mean_tokens_per_s": 50.0,
           "bytes_written_per_param_per_step": 12.0, "bytes_read_per_param_per_step": 18.4,
           "proc_bytes_written_per_param_per_step": 12.01, "peak_rss_bytes": 3 << 30, "dram_peak_bytes": 1 << 30,
           "drives": {"/mnt/c0": {"bytes_written": 24_000_000, "bytes_read": 32_000_000, "dwpd": 3.5, "rated_dwpd": 100}},
           "ledger_bytes_written": 48_000_000, "total_params": 1000, "dtype": "float32", "world_size": 2,
           "metrics_file": "m", "saved_model": "out", "checkpoints": ["out/checkpoint-2"]}


def test_report_writes_four_pngs_and_a_page_that_embeds_them(tmp_path):
    lines = [{"step": 0, "eval_loss": 3.1, "eval_tokens": 10}, *[_step(i) for i in range(1, 5)],
             {"checkpoint": "out/checkpoint-2", "step": 2}, {"step": 4, "eval_loss": 2.5, "eval_tokens": 10}, SUMMARY]
    out = write_report(_run_dir(tmp_path, lines))
    assert [os.path.basename(p) for p in out["plots"]] == list(PLOTS)
    for p in out["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(p) > 5000
    md = open(out["report"], encoding="utf-8").read()
    for name in PLOTS:
        assert f"]({name})" in md
    assert "3.1000 → 2.5000" in md and "3.50 DWPD" in md and "12.00 B" in md and "checkpoint-2" in md


def test_read_metrics_keeps_the_last_line_of_a_repeated_step_and_skips_a_cut_line(tmp_path):
    a, b = _step(1), dict(_step(1), loss=9.0)
    m = read_metrics(_run_dir(tmp_path, [a, {"resumed_from": "x/checkpoint-0", "step": 0}, b]))
    assert [s["loss"] for s in m["steps"]] == [9.0] and m["summary"] is None and len(m["resumes"]) == 1
    assert m["redone"] == [a]  # the superseded line: that step ran, and wrote


def test_steps_redone_after_a_resume_count_in_the_whole_runs_bytes(tmp_path):
    """A run saved at step 2, ran to step 4 and was resumed from step 2: steps 3 and 4 ran twice, and the drives
    took their writes twice; the whole run says so and counts them (endurance: every byte written)."""
    first = [_step(1), _step(2), {"checkpoint": "out/checkpoint-2", "step": 2}, _step(3), _step(4)]
    second = [{"resumed_from": "out/checkpoint-2", "step": 2}, _step(3), _step(4),
              dict(SUMMARY, resumed_from="out/checkpoint-2", resumed_from_step=2)]
    out = write_report(_run_dir(tmp_path, first + second))
    md = open(out["report"], encoding="utf-8").read()
    assert "| whole run: written / read per parameter per step (cache tier, 6 steps, 2 processes; 2 of them run " \
           "again after a resume, counted each time) | 12000.00 B" in md, md
    assert "| whole run: written / read in all (cache tier: setup, steps, evals, saves of every process) | " \
           "68.66 MiB /" in md  # 6 x 12 MB
    assert "| whole run: drive /mnt/c0 | 34.33 MiB written" in md  # 6 x 6 MB


def test_report_of_a_run_without_cache_tier_or_summary_still_renders(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, [_step(1, paths=()), _step(2, paths=())])
    assert main(["report", run_dir, "--output", str(tmp_path / "r")]) == 0
    md = open(tmp_path / "r" / "report.md", encoding="utf-8").read()
    assert "no summary line" in md and "wrote" in capsys.readouterr().out


def test_report_names_a_missing_run(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_a_resumed_run_is_reported_whole_and_the_peak_by_its_parts(tmp_path):
    """Two processes (the second resumed at step 2): the steps of both, both setups, the largest peak; the
    summary's memory parts as rows; the memory plot from the budget's gauges."""
    first = [{"setup": True, "step": 0, "cache_write_bytes": 5_000_000, "cache_read_bytes": 0, "peak_rss_bytes": 4 << 30},
             _step(1), dict(_step(2), peak_rss_bytes=9 << 30)]
    mem = {"peak_rss_bytes": 3 << 30, "model_loading_bytes": 2 << 30, "steps_peak_rss_bytes": 3 << 30,
           "ours_bytes": 1 << 30, "dram_tier_bytes": 0, "dram_working_bytes": 768 << 20, "dram_budget_bytes": 0,
           "buffer_pool_bytes": 1 << 30, "deepspeed_bytes": 100 << 20, "activations_logits_bytes": 400 << 20,
           "rest_bytes": 1524 << 20}
    second = [{"resumed_from": "out/checkpoint-2", "step": 2},
              {"setup": True, "step": 2, "cache_write_bytes": 1_000_000, "cache_read_bytes": 0},
              *[dict(_step(i), dram_budgeted_bytes=0, dram_budget_bytes=0, buffer_pool_bytes=1 << 28)
                for i in (3, 4)], dict(SUMMARY, resumed_from="out/checkpoint-2", resumed_from_step=2, memory=mem)]
    out = write_report(_run_dir(tmp_path, first + second))
    md = open(out["report"], encoding="utf-8").read()
    # 4 steps of 12 MB written, 1000 parameters: 12000 B/param/step; both setups' and all steps' bytes
    assert "| whole run: written / read per parameter per step (cache tier, 4 steps, 2 processes) | 12000.00 B" in md
    assert "| whole run: written / read in all (cache tier: setup, steps, evals, saves of every process) | " \
           "51.50 MiB /" in md, md
    assert "| peak RSS (largest rank, every process) | 9.00 GiB |" in md  # step 2 of the first process
    assert "| written per parameter per step (cache tier) (this process) | 12.00 B |" in md
    assert "| peak RSS: model loading (before step 1) | 2.00 GiB |" in md
    # the tier's buffers are carved from the pool: ours is the larger of the two (finetune/memory.py), not a sum
    assert "|   ours: aidaptiv_ds's buffers | 1.00 GiB (the larger of the DRAM tier 0 B of the 0 B budget with its " \
           "working buffers 768.00 MiB and the buffer pool 1.00 GiB they are carved from) |" in md
    assert "|   the rest (interpreter, libraries, model objects, heap) | 1.49 GiB |" in md
