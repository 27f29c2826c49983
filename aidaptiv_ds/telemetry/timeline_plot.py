"""One step of a timeline as a picture (matplotlib, no display needed): ``aidaptiv-ds timeline``.

Rows, top to bottom, time in seconds from the step's start on the x axis:

* **phases**: the step's forward, backward and optimizer step (``engine.step``), one bar per
  micro-batch;
* **compute**: forward (blue) and backward (orange) of each block, labelled with the block when the
  bar is wide enough; a recomputed forward inside the backward in purple; the waits of that lane
  (``aidaptiv::io_wait``, ``aidaptiv::io_blocked``) drawn over them in red;
* **optimizer** (when something marked spans there: sub-groups, swaps), with its waits in red;
* any other lane that has spans (helper threads);
* per drive (cache path) one row of **reads** and one of **writes**: every system call as a
  translucent bar (overlapping calls of the worker threads darken), reads read on demand in red,
  read ahead in blue, writes in green; the row's label gives the bytes, the busy time and the rate
  while busy (GB/s = 1e9 bytes/s).

The x axis runs on past the step's end (dashed line) to the next step's start: the step's *tail*,
the write-back it left in flight and the read-ahead of the next step. The title gives the step time,
the phases, the time compute waited, the bytes moved in the step and in its tail
(:func:`aidaptiv_ds.telemetry.timeline_trace.summarize_step`).
"""
from __future__ import annotations

import os

from .timeline_trace import IO_CATS, WAIT_CAT, Trace, drive_of, summarize_step

COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "recompute": "#8172b3", "optimizer": "#55a868",
          "wait": "#c44e52", "demand": "#c44e52", "prefetch": "#4c72b0", "write": "#55a868", "phase": "#bbbbbb"}
PHASE_COLORS = {"forward": "#aec7e8", "backward": "#ffbb78", "optimizer": "#98df8a"}


def _short(path: str, keep: int = 2) -> str:
    parts = [p for p in path.split(os.sep) if p]
    return (".../" if len(parts) > keep else "/") + "/".join(parts[-keep:])


def _bars(spans: list[dict], t0: float, t1: float) -> list[tuple[float, float]]:
    out = []
    for s in spans:
        a, b = max(s["start"], t0), min(s["end"], t1)
        if b > a:
            out.append((a - t0, b - a))
    return out


def draw(trace: Trace, output: str, step: int | None = None, title: str | None = None, width: float = 14.0) -> dict:
    """Draw one step of ``trace`` into the PNG ``output``; returns the step's summary (with ``output``).

    Raises:
        ValueError: the trace holds no whole step, or not ``step``.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    summary = summarize_step(trace, step)
    k, t0, end = trace.step_window(summary["step"])
    t1 = max(trace.tail_end(k), end)  # the step and its tail (what it left in flight)
    inside = trace.within(t0, t1)
    rows: list[tuple[str, list]] = []  # (label, [(bars, color, alpha, y-fraction (lo, hi), labels)])

    phases = []
    for name, color in PHASE_COLORS.items():
        sel = [s for s in inside if s["lane"] == "step" and s["cat"] == "phase" and s["name"].startswith(name)]
        phases.append((_bars(sel, t0, t1), color, 1.0, (0.1, 0.9), None))
    rows.append(("phases", phases))

    def lane_row(lane: str, label: str) -> tuple[str, list]:
        sel = [s for s in inside if s["lane"] == lane]
        layers = []
        for cat in ("forward", "backward", "recompute"):
            cs = [s for s in sel if s["cat"] == cat]
            if cs:
                names = [s["name"].split(" ", 1)[-1] for s in cs]
                layers.append((_bars(cs, t0, t1), COLORS[cat], 0.9, (0.1, 0.9), names))
        other = [s for s in sel if s["cat"] not in ("forward", "backward", "recompute", WAIT_CAT)]
        if other:
            layers.append((_bars(other, t0, t1), COLORS["optimizer"], 0.8, (0.1, 0.9),
                           [str(s["args"].get("subgroup", "")) for s in other]))
        waits = [s for s in sel if s["cat"] == WAIT_CAT]
        if waits:
            layers.append((_bars(waits, t0, t1), COLORS["wait"], 0.85, (0.3, 0.7), None))
        return label, layers

    waited = summary["io_wait_s"]
    rows.append(lane_row("compute", f"compute\n(waited {waited:.2f} s)"))
    other_lanes = sorted({s["lane"] for s in inside} - {"step", "compute"})
    for lane in [x for x in other_lanes if x == "optimizer"] + [x for x in other_lanes
                                                                 if x != "optimizer" and not x.startswith("io ")]:
        rows.append(lane_row(lane, lane))
    io = [s for s in inside if s["cat"] in IO_CATS]
    for drive in sorted({drive_of(s) for s in io}):
        d = summary["drives"][drive]
        mine = [s for s in io if drive_of(s) == drive]
        reads = [s for s in mine if s["cat"] == "read"]
        demand = [s for s in reads if s["args"].get("priority") == "demand"]
        ahead = [s for s in reads if s["args"].get("priority") != "demand"]
        rate = "" if d["read_gbps"] is None else f", {d['read_gbps']:.2f} GB/s busy"
        rows.append((f"read {_short(drive)}\n{d['read_bytes'] / 1e9:.2f} GB in {d['read_busy_s']:.2f} s{rate}",
                     [(_bars(ahead, t0, t1), COLORS["prefetch"], 0.35, (0.1, 0.9), None),
                      (_bars(demand, t0, t1), COLORS["demand"], 0.35, (0.1, 0.9), None)]))
        writes = [s for s in mine if s["cat"] == "write"]
        rate = "" if d["write_gbps"] is None else f", {d['write_gbps']:.2f} GB/s busy"
        rows.append((f"write {_short(drive)}\n{d['write_bytes'] / 1e9:.2f} GB in {d['write_busy_s']:.2f} s{rate}",
                     [(_bars(writes, t0, t1), COLORS["write"], 0.35, (0.1, 0.9), None)]))

    wall = t1 - t0
    step_s = end - t0
    fig, ax = plt.subplots(figsize=(width, 0.75 * len(rows) + 1.8), dpi=110)
    n = len(rows)
    for i, (_, layers) in enumerate(rows):
        y = n - 1 - i
        for bars, color, alpha, (lo, hi), names in layers:
            if not bars:
                continue
            ax.broken_barh(bars, (y + lo, hi - lo), facecolors=color, alpha=alpha, linewidth=0)
            if names:
                for (x, w), name in zip(bars, names, strict=False):
                    if name and w > wall * 0.006 * (len(name) + 1):  # a 6-pt character is ~0.5% of the axis
                        ax.text(x + w / 2, y + 0.5, name, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks([n - 1 - i + 0.5 for i in range(n)])
    ax.set_yticklabels([label for label, _ in rows], fontsize=8)
    ax.set_ylim(0, n)
    ax.set_xlim(0, wall)
    if wall - step_s > wall * 0.002:
        ax.axvline(step_s, color="black", linestyle="--", linewidth=0.8)
        ax.text(step_s, n - 0.02, " step ends", ha="left", va="top", fontsize=7)
    ax.set_xlabel("seconds from the start of the step")
    ax.grid(True, axis="x", alpha=0.3)
    rb, wb = summary["read_bytes"] / 1e9, summary["write_bytes"] / 1e9
    tail = ""
    if summary["tail_s"] > 1e-3:
        tail = (f"\nthen {summary['tail_s']:.2f} s to the next step: {summary['tail_read_bytes'] / 1e9:.2f} GB read, "
                f"{summary['tail_write_bytes'] / 1e9:.2f} GB written (right of the dashed line)")
    ax.set_title(title or (
        f"step {k}: {step_s:.2f} s (forward {summary['forward_s']:.2f}, backward {summary['backward_s']:.2f}, "
        f"optimizer step {summary['optimizer_s']:.2f}); compute waited {waited:.2f} s "
        f"({(summary['io_wait_share'] or 0):.0%}); read {rb:.2f} GB, written {wb:.2f} GB" + tail), fontsize=10)
    legend = [Patch(color=COLORS["forward"], label="forward"), Patch(color=COLORS["backward"], label="backward"),
              Patch(color=COLORS["wait"], label="waiting for I/O")]
    if any(s["cat"] == "recompute" for s in inside):
        legend.append(Patch(color=COLORS["recompute"], label="recompute"))
    if any(s["lane"] == "optimizer" for s in inside):
        legend.append(Patch(color=COLORS["optimizer"], label="optimizer"))
    if io:
        legend += [Patch(color=COLORS["prefetch"], alpha=0.5, label="read ahead"),
                   Patch(color=COLORS["demand"], alpha=0.5, label="read on demand"),
                   Patch(color=COLORS["write"], alpha=0.5, label="write")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.5 / (n + 2)), ncol=len(legend),
              fontsize=8, frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return dict(summary, output=output)
