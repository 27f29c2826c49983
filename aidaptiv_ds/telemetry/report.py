"""Plots and a one-page report of a run, from its ``metrics.jsonl`` (matplotlib, no display needed).

:func:`write_report` reads the lines :mod:`aidaptiv_ds.finetune.loop` writes (eval lines, one line
per optimizer step, checkpoint lines, the summary) and writes, into the output directory:

* ``loss.png``: training loss per step and eval loss at the steps it was measured;
* ``io.png``: bytes read and written per step on each cache path (drive), in MB (10^6 bytes);
* ``io_wait.png``: the share of each step's wall time the training thread waited on I/O;
* ``memory.png``: per step, host RSS at the step's end and its peak within the step (largest rank), what
  the DRAM budget books (resident and cached slices) against the budget, and aidaptiv_ds's working
  buffers (read-ahead not used yet, slices in use, write-back in flight, the swap buffers' pool), which
  the budget does not bound (all ranks), in GiB;
* ``report.md``: the summary's figures as a table, the parts of the peak RSS (model loading, ours,
  DeepSpeed's working set, activations and logits, the rest: :mod:`aidaptiv_ds.finetune.memory`) and the
  four plots, one page. A run resumed from a checkpoint (in one or more later processes) is reported
  whole: the figures of every step from 1 on, every process's setup, evals and saves, and the largest
  peak of them, beside the last process's summary.

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
    """``{"evals", "steps", "redone", "checkpoints", "summary", "resumes", "setups"}`` from ``run_dir/metrics.jsonl``.

    A line cut by a killed run is skipped. A step that appears twice (a run resumed from a checkpoint older than
    its last step) keeps its last line in ``steps``; the lines it supersedes are in ``redone`` (that work ran, and
    its bytes reached the drives).

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir`` (names it and what writes it).
    """
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl; give the --output_dir of a launch/finetune.py run "
                                f"(or a metrics.jsonl written by aidaptiv_ds.telemetry.metrics.MetricsWriter)")
    evals, steps, ckpts, resumes, setups, redone, summary = {}, {}, [], [], [], [], None
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
            elif rec.get("setup"):
                setups.append(rec)
            elif "loss" in rec and "step" in rec:
                if rec["step"] in steps:
                    redone.append(steps[rec["step"]])
                steps[rec["step"]] = rec
    return {"evals": [evals[k] for k in sorted(evals)], "steps": [steps[k] for k in sorted(steps)],
            "redone": redone, "checkpoints": ckpts, "resumes": resumes, "setups": setups, "summary": summary}


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
    st = m["steps"]
    xs = [s["step"] for s in st]
    g = lambda s, k: (s.get(k) or 0) / GiB  # noqa: E731
    ax.plot(xs, [g(s, "rss_bytes") for s in st], label="RSS at the step's end (largest rank)", lw=1.2)
    if any(s.get("peak_rss_bytes") for s in st):
        ax.plot(xs, [g(s, "peak_rss_bytes") for s in st], label="peak RSS in the step (largest rank)", lw=1, ls=":")
    if any("dram_budgeted_bytes" in s for s in st):
        ax.plot(xs, [g(s, "dram_budgeted_bytes") for s in st], label="DRAM tier: what the budget books (all ranks)",
                lw=1.2, ls="--")
        ax.plot(xs, [g(s, "dram_bytes") - g(s, "dram_budgeted_bytes") + g(s, "buffer_pool_bytes") for s in st],
                label="aidaptiv_ds working buffers (all ranks)", lw=1.2, ls="-.")
        budget = max((s.get("dram_budget_bytes") or 0) for s in st) / GiB if st else 0
        ax.axhline(budget, color="gray", lw=0.8, ls=(0, (1, 3)), label=f"DRAM budget {budget:.2f} GiB (all ranks)")
    elif xs:  # a metrics file from before the budget's gauges: the tier with its working memory
        ax.plot(xs, [g(s, "dram_bytes") for s in st], label="DRAM tier with its working memory (all ranks)", lw=1.2,
                ls="--")
    return _save(plt, fig, ax, path, None if xs else "no steps recorded")


def whole_run(m: dict) -> dict | None:
    """Figures of a resumed run as a whole, from its lines (None when it never resumed): ``steps`` (each step
    once), ``redone`` (steps run again after a resume from an older checkpoint), ``processes``, ``written``/``read``
    (cache tier, every window of every process, redone steps included: their bytes reached the drives),
    ``per_path`` (the steps' bytes per drive), ``step_written``/``step_read`` (the steps', redone included),
    ``peak_rss_bytes`` (largest of every line)."""
    if not m["resumes"]:
        return None
    ran = m["steps"] + m.get("redone", [])  # every step line, a step redone after a resume as often as it ran
    windows = ran + m["evals"] + m["checkpoints"] + m["setups"]
    per_path: dict = {}
    for s in ran:
        for p, v in (s.get("per_path") or {}).items():
            cur = per_path.setdefault(p, {"bytes_written": 0, "bytes_read": 0})
            cur["bytes_written"] += v.get("write_bytes", 0)
            cur["bytes_read"] += v.get("read_bytes", 0)
    peaks = [r.get("peak_rss_bytes") or 0 for r in windows] + [(m["summary"] or {}).get("peak_rss_bytes") or 0]
    return {"steps": len(m["steps"]), "redone": len(ran) - len(m["steps"]), "processes": len(m["resumes"]) + 1,
            "written": sum(r.get("cache_write_bytes") or 0 for r in windows),
            "read": sum(r.get("cache_read_bytes") or 0 for r in windows),
            "step_written": sum(s.get("cache_write_bytes") or 0 for s in ran),
            "step_read": sum(s.get("cache_read_bytes") or 0 for s in ran),
            "per_path": per_path, "peak_rss_bytes": max(peaks) or None}


def ours_text(mem: dict) -> str:
    """``"<ours> (<its parts>)"`` of :func:`aidaptiv_ds.finetune.memory.memory_parts`: where there is a buffer pool the
    DRAM tier's units and buffers are carved from it, so ours is the larger of the two, not their sum."""
    b = lambda k: format_bytes(mem[k]) if mem.get(k) is not None else "n/a"  # noqa: E731
    tier = f"DRAM tier {b('dram_tier_bytes')} of the {b('dram_budget_bytes')} budget with its working buffers " \
           f"{b('dram_working_bytes')}"
    if mem.get("buffer_pool_bytes"):
        return f"{b('ours_bytes')} (the larger of the {tier} and the buffer pool {b('buffer_pool_bytes')} they are " \
               f"carved from)"
    return f"{b('ours_bytes')} ({tier})"


def _memory_rows(mem: dict | None) -> list[tuple[str, str]]:
    if not mem:
        return []
    b = lambda k: format_bytes(mem[k]) if mem.get(k) is not None else "n/a"  # noqa: E731
    rows = [("peak RSS: model loading (before step 1)", b("model_loading_bytes")),
            ("peak RSS: the steps", b("steps_peak_rss_bytes")),
            ("  ours: aidaptiv_ds's buffers", ours_text(mem))]
    if mem.get("deepspeed_bytes"):
        rows.append(("  DeepSpeed's working set (planned: gathered parameters, reduce buckets)", b("deepspeed_bytes")))
    if mem.get("activations_logits_bytes"):
        rows.append(("  activations and logits (planned, one micro-batch)", b("activations_logits_bytes")))
    rows.append(("  the rest (interpreter, libraries, model objects, heap)", b("rest_bytes")))
    return rows


def _rows(s: dict | None, m: dict) -> list[tuple[str, str]]:
    if s is None:
        last = m["steps"][-1]["step"] if m["steps"] else 0
        return [("status", f"no summary line: the run stopped (or is still running) after step {last}")]

    def f(v, fmt="{:.4f}"):
        return "n/a" if v is None else fmt.format(v)

    w, n = whole_run(m), s.get("total_params") or 0
    rows = [("eval loss before → after", f"{f(s.get('eval_loss_before'))} → {f(s.get('final_eval_loss'))}"),
            ("steps", str(s.get("steps")) + (f" (resumed at {s['resumed_from_step']})" if s.get("resumed_from") else ""))]
    if w is not None and n:
        ran = w["steps"] + w["redone"]
        redone = f"; {w['redone']} of them run again after a resume, counted each time" if w["redone"] else ""
        rows += [(f"whole run: written / read per parameter per step (cache tier, {ran} steps, "
                  f"{w['processes']} processes{redone})", f"{w['step_written'] / n / max(ran, 1):.2f} B / "
                                                          f"{w['step_read'] / n / max(ran, 1):.2f} B"),
                 ("whole run: written / read in all (cache tier: setup, steps, evals, saves of every process)",
                  f"{format_bytes(w['written'])} / {format_bytes(w['read'])}")]
        rows += [(f"whole run: drive {p}", f"{format_bytes(d['bytes_written'])} written, {format_bytes(d['bytes_read'])} "
                                          f"read by the steps") for p, d in w["per_path"].items()]
    last = " (this process)" if w is not None else ""
    rows += [(f"tokens/s (after the first step){last}", f(s.get("mean_tokens_per_s"), "{:,.0f}")),
             (f"written per parameter per step (cache tier){last}", f(s.get("bytes_written_per_param_per_step"), "{:.2f} B")),
             (f"read per parameter per step (cache tier){last}", f(s.get("bytes_read_per_param_per_step"), "{:.2f} B")),
             (f"written per parameter per step (/proc){last}",
              f(s.get("proc_bytes_written_per_param_per_step"), "{:.2f} B"))]
    for p, d in (s.get("drives") or {}).items():
        dwpd = f(d.get("dwpd"), "{:.2f}")
        rated = f" (rated {d['rated_dwpd']:g})" if d.get("rated_dwpd") is not None else ""
        rows.append((f"drive {p}{last}", f"{format_bytes(d['bytes_written'])} written, {format_bytes(d['bytes_read'])} "
                                         f"read; {dwpd} DWPD at this pace{rated}"))
    if s.get("ledger_bytes_written") is not None:
        rows.append((f"endurance ledger{last or ' (this run)'}", format_bytes(s["ledger_bytes_written"])))
    peak = max(w["peak_rss_bytes"] or 0, s.get("peak_rss_bytes") or 0) if w is not None else s.get("peak_rss_bytes")
    rows.append(("peak RSS (largest rank" + (", every process)" if w is not None else ")"),
                 format_bytes(peak) if peak else "n/a"))
    rows += _memory_rows(s.get("memory"))
    if not s.get("memory"):  # a summary from before the parts were recorded
        rows.append(("peak DRAM tier (with its working memory)", format_bytes(s.get("dram_peak_bytes") or 0)))
    rows += [("parameters, dtype, ranks", f"{s.get('total_params'):,}, {s.get('dtype')}, {s.get('world_size')}"),
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
