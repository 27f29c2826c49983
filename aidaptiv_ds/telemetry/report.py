"""Plots and a one-page report of a run, from its ``metrics.jsonl`` (matplotlib, no display needed).

:func:`write_report` reads the lines :mod:`aidaptiv_ds.finetune.loop` writes (eval lines, one line
per optimizer step, checkpoint lines, the summary) and writes, into the output directory:

* ``loss.png``: training loss per step and eval loss at the steps it was measured;
* ``io.png``: bytes read and written per step on each cache path (drive), in MB (10^6 bytes);
* ``io_wait.png``: the share of each step's wall time the training thread waited on I/O;
* ``memory.png``: host RSS (largest rank) and the DRAM tier's bytes (all ranks) per step, in GiB;
* ``report.md``: the summary's figures as a table and the four plots, one page.

Plots whose data the run does not have (no cache tier, a single step) are drawn with a note
instead of being left out, so the page always has the same layout.
"""
from __future__ import annotations

import json
import os

from ..units import format_bytes

MB = 1e6
GiB = float(1 << 30)
PLOTS = ("loss.png", "io.png", "io_wait.png", "memory.png")


def read_metrics(run_dir: str) -> dict:
    """``{"evals", "steps", "checkpoints", "summary", "resumes"}`` from ``run_dir/metrics.jsonl``.

    A line cut by a killed run is skipped. A step that appears twice (a run resumed from an earlier
    checkpoint without rewriting the file) keeps its last line.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir`` (names it and what writes it).
    """
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl; give the --output_dir of a launch/finetune.py run "
                                f"(or a metrics.jsonl written by aidaptiv_ds.telemetry.metrics.MetricsWriter)")
    evals, steps, ckpts, resumes, summary = {}, {}, [], [], None
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("summary"):
                summary = rec
            elif "eval_loss" in rec:
                evals[rec["step"]] = rec
            elif "checkpoint" in rec:
                ckpts.append(rec)
            elif "resumed_from" in rec:
                resumes.append(rec)
            elif "loss" in rec and "step" in rec:
                steps[rec["step"]] = rec
    return {"evals": [evals[k] for k in sorted(evals)], "steps": [steps[k] for k in sorted(steps)],
            "checkpoints": ckpts, "resumes": resumes, "summary": summary}


def _axes(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=100)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, ax, path: str, empty_note: str | None = None) -> str:
    if empty_note:
        ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes, color="gray")
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_loss(m: dict, path: str) -> str:
    plt, fig, ax = _axes("loss", "cross-entropy (nats/token)")
    xs = [s["step"] for s in m["steps"] if s.get("loss") is not None]
    ax.plot(xs, [s["loss"] for s in m["steps"] if s.get("loss") is not None], label="train loss", lw=1.2)
    ev = [e for e in m["evals"] if e.get("eval_loss") is not None]
    ax.plot([e["step"] for e in ev], [e["eval_loss"] for e in ev], "o-", label="eval loss", ms=4)
    for r in m["resumes"]:
        ax.axvline(r["step"], color="gray", ls=":", lw=1)
    return _save(plt, fig, ax, path, None if xs or ev else "no loss recorded")


def plot_io(m: dict, path: str) -> str:
    plt, fig, ax = _axes("cache tier: bytes per step per drive", "MB per step")
    xs = [s["step"] for s in m["steps"]]
    drives = sorted({p for s in m["steps"] for p in (s.get("per_path") or {})})
    for p in drives:
        ax.plot(xs, [(s.get("per_path") or {}).get(p, {}).get("read_bytes", 0) / MB for s in m["steps"]],
                label=f"read {p}", lw=1.2)
        ax.plot(xs, [(s.get("per_path") or {}).get(p, {}).get("write_bytes", 0) / MB for s in m["steps"]],
                label=f"written {p}", lw=1.2, ls="--")
    return _save(plt, fig, ax, path, None if drives else "no cache tier in this run (aidaptiv_ds not enabled)")


def plot_io_wait(m: dict, path: str) -> str:
    plt, fig, ax = _axes("I/O wait share of the step time", "share of step wall time")
    pts = [(s["step"], s["io_wait_fraction"]) for s in m["steps"] if s.get("io_wait_fraction") is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, label="I/O wait")
        ax.set_ylim(0, max(1.0, max(p[1] for p in pts)))
    return _save(plt, fig, ax, path, None if pts else "no step times recorded")


def plot_memory(m: dict, path: str) -> str:
    plt, fig, ax = _axes("host memory", "GiB")
    xs = [s["step"] for s in m["steps"]]
    rss = [(s.get("rss_bytes") or 0) / GiB for s in m["steps"]]
    ax.plot(xs, rss, label="RSS (largest rank)", lw=1.2)
    if any(s.get("peak_rss_bytes") for s in m["steps"]):
        ax.plot(xs, [(s.get("peak_rss_bytes") or 0) / GiB for s in m["steps"]], label="peak RSS", lw=1, ls=":")
    ax.plot(xs, [(s.get("dram_bytes") or 0) / GiB for s in m["steps"]], label="DRAM tier (all ranks)", lw=1.2,
            ls="--")
    return _save(plt, fig, ax, path, None if xs else "no steps recorded")


def _rows(s: dict | None, m: dict) -> list[tuple[str, str]]:
    if s is None:
        last = m["steps"][-1]["step"] if m["steps"] else 0
        return [("status", f"no summary line: the run stopped (or is still running) after step {last}")]

    def f(v, fmt="{:.4f}"):
        return "n/a" if v is None else fmt.format(v)

    rows = [("eval loss before → after", f"{f(s.get('eval_loss_before'))} → {f(s.get('final_eval_loss'))}"),
            ("steps", str(s.get("steps")) + (f" (resumed at {s['resumed_from_step']})" if s.get("resumed_from") else "")),
            ("tokens/s (after the first step)", f(s.get("mean_tokens_per_s"), "{:,.0f}")),
            ("written per parameter per step (cache tier)", f(s.get("bytes_written_per_param_per_step"), "{:.2f} B")),
            ("read per parameter per step (cache tier)", f(s.get("bytes_read_per_param_per_step"), "{:.2f} B")),
            ("written per parameter per step (/proc)", f(s.get("proc_bytes_written_per_param_per_step"), "{:.2f} B"))]
    for p, d in (s.get("drives") or {}).items():
        dwpd = f(d.get("dwpd"), "{:.2f}")
        rated = f" (rated {d['rated_dwpd']:g})" if d.get("rated_dwpd") is not None else ""
        rows.append((f"drive {p}", f"{format_bytes(d['bytes_written'])} written, {format_bytes(d['bytes_read'])} read; "
                                  f"{dwpd} DWPD at this pace{rated}"))
    if s.get("ledger_bytes_written") is not None:
        rows.append(("endurance ledger (this run)", format_bytes(s["ledger_bytes_written"])))
    rows += [("peak RSS (largest rank)", format_bytes(s["peak_rss_bytes"]) if s.get("peak_rss_bytes") else "n/a"),
             ("peak DRAM tier", format_bytes(s.get("dram_peak_bytes") or 0)),
             ("parameters, dtype, ranks", f"{s.get('total_params'):,}, {s.get('dtype')}, {s.get('world_size')}"),
             ("metrics", str(s.get("metrics_file"))), ("model", str(s.get("saved_model")))]
    if s.get("checkpoints"):
        rows.append(("checkpoints", ", ".join(os.path.basename(c) for c in s["checkpoints"])))
    return rows


def write_report(run_dir: str, out_dir: str | None = None) -> dict:
    """Write the PNGs and ``report.md`` for the run in ``run_dir`` into ``out_dir`` (default ``run_dir``).

    Returns:
        ``{"report": path of report.md, "plots": [paths of the PNGs]}``.

    Raises:
        FileNotFoundError: see :func:`read_metrics`.
        ImportError: matplotlib is not installed (names the extra that brings it).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError("aidaptiv-ds report needs matplotlib: pip install 'aidaptiv_ds[report]' "
                          "(or pip install matplotlib)") from e
    m = read_metrics(run_dir)
    out_dir = out_dir or (os.path.dirname(run_dir) if run_dir.endswith(".jsonl") else run_dir)
    os.makedirs(out_dir, exist_ok=True)
    plots = [fn(m, os.path.join(out_dir, name)) for fn, name in
             zip((plot_loss, plot_io, plot_io_wait, plot_memory), PLOTS)]
    s = m["summary"]
    title = os.path.basename(os.path.abspath(out_dir))
    md = [f"# Run report: {title}", ""]
    md += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in _rows(s, m)] + [""]
    if m["checkpoints"]:
        md.append("Checkpoints saved at steps " + ", ".join(str(c["step"]) for c in m["checkpoints"]) + ".")
        md.append("")
    if m["resumes"]:
        md.append("Resumed: " + "; ".join(f"from {r['resumed_from']} at step {r['step']}" for r in m["resumes"]) +
                  " (dotted lines in the loss plot).")
        md.append("")
    for p in plots:
        md += [f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.basename(p)})", ""]
    report = os.path.join(out_dir, "report.md")
    with open(report, "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    return {"report": report, "plots": plots}
