"""The timeline file: Chrome-trace JSON written from a :class:`~aidaptiv_ds.spans.Recorder`, read back,
and one step's figures computed from it. Pure data: no torch, no matplotlib.

File format (the Trace Event Format of Chrome's trace viewer, which Perfetto and ``chrome://tracing``
open): ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"aidaptiv_ds": META}}``.

* One *lane* is one Chrome-trace thread (``tid``), named by a ``thread_name`` metadata event and
  ordered by ``thread_sort_index``: ``step`` (the step and its phases), ``compute`` (forward and
  backward of each block, with the waits nested), ``optimizer``, any other lane of a span, then per
  drive one lane per I/O worker thread, ``io <cache path> #<worker>``.
* Spans are complete events (``"ph": "X"``), ``ts``/``dur`` in microseconds from the start of the
  recording; instants ``"ph": "i"``. ``cat`` says what a span is: ``step``, ``phase``, ``forward``,
  ``backward``, ``recompute``, ``wait`` (``aidaptiv::io_wait``: the runtime's wait timer;
  ``aidaptiv::io_blocked``: a blocking wait on an I/O request), ``read`` / ``write`` (one system
  call; ``args``: ``drive``, ``bytes``, ``offset``, ``file``, ``priority``, ``queued_s``), or
  whatever category the caller of :func:`aidaptiv_ds.spans.span` gave.
* ``META``: ``format`` (1), ``rank``, ``pid``, ``wall_origin`` (Unix seconds of time 0), ``steps``
  (``[{"step", "start_s", "end_s", "until_s"}]``, seconds from time 0, the steps recorded whole;
  ``end_s``: ``engine.step()`` returned; ``until_s``: the next step began or the recording stopped,
  the step's *tail* in between), ``requested``
  (``[first, last]``), ``complete`` (every requested step recorded), ``blocks`` (labels in forward
  order), and what the caller adds.
"""
from __future__ import annotations

import glob
import json
import os
import re

from ..jsonsafe import finite

FORMAT = 1
FIXED_LANES = ("step", "compute", "optimizer")
FILE_PATTERN = "timeline-rank{rank}.json"
WAIT_CAT = "wait"
IO_CATS = ("read", "write")


def _lane_order(lanes: set[str]) -> list[str]:
    io = sorted(lane for lane in lanes if lane.startswith("io "))
    fixed = [lane for lane in FIXED_LANES if lane in lanes]
    other = sorted(lanes - set(io) - set(fixed))
    return fixed + other + io


def to_chrome(events: list[tuple], origin: float, meta: dict) -> dict:
    """Chrome-trace JSON (a dict) from recorder ``events`` (see :class:`aidaptiv_ds.spans.Recorder`).

    Args:
        events: ``(kind, name, cat, lane, t0, t1, args)`` tuples, perf_counter seconds.
        origin: the perf_counter value that becomes ``ts`` 0.
        meta: ``otherData.aidaptiv_ds`` (``rank`` is used as the Chrome-trace ``pid``).
    """
    pid = int(meta.get("rank", 0))
    lanes = _lane_order({e[3] for e in events})
    tid = {lane: i + 1 for i, lane in enumerate(lanes)}
    out: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                        "args": {"name": f"aidaptiv_ds rank {pid}"}}]
    for lane, t in tid.items():
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": lane}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t, "args": {"sort_index": t}})
    for kind, name, cat, lane, t0, t1, args in sorted(events, key=lambda e: (e[4], -(e[5] or e[4]))):
        ev = {"ph": kind, "name": name, "cat": cat, "pid": pid, "tid": tid[lane], "ts": (t0 - origin) * 1e6}
        if kind == "X":
            ev["dur"] = max(t1 - t0, 0.0) * 1e6
        else:
            ev["s"] = "t"
        if args:
            ev["args"] = args
        out.append(ev)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"aidaptiv_ds": finite(dict(meta, format=FORMAT))}}


def write(path: str, trace: dict) -> str:
    """Write ``trace`` (from :func:`to_chrome`) to ``path`` atomically (a temporary name, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------- reading
class Trace:
    """A timeline file read back: ``spans`` (dicts with ``name``, ``cat``, ``lane``, ``start``/``end``
    in seconds from time 0, ``args``), ``instants``, ``meta`` (``otherData.aidaptiv_ds``), ``path``."""

    def __init__(self, data: dict | list, path: str = "") -> None:
        self.path = path
        if isinstance(data, list):  # the JSON Array Format: events only
            data = {"traceEvents": data}
        self.meta: dict = (data.get("otherData") or {}).get("aidaptiv_ds") or {}
        events = data.get("traceEvents") or []
        names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
        self.spans: list[dict] = []
        self.instants: list[dict] = []
        for e in events:
            ph = e.get("ph")
            if ph not in ("X", "i"):
                continue
            rec = {"name": e["name"], "cat": e.get("cat", ""), "lane": names.get(e.get("tid"), str(e.get("tid"))),
                   "start": e["ts"] / 1e6, "args": e.get("args") or {}}
            if ph == "X":
                rec["end"] = rec["start"] + e.get("dur", 0.0) / 1e6
                self.spans.append(rec)
            else:
                self.instants.append(rec)

    @property
    def steps(self) -> list[dict]:
        """``[{"step", "start_s", "end_s"}]`` of the steps recorded whole."""
        return list(self.meta.get("steps") or [])

    def tail_end(self, step: int) -> float:
        """End of ``step``'s tail (``until_s``; its ``end_s`` in files without one)."""
        s = next(x for x in self.steps if x["step"] == step)
        return float(s.get("until_s", s["end_s"]))

    def step_window(self, step: int | None = None) -> tuple[int, float, float]:
        """``(step, start, end)`` in seconds for ``step`` (None: the last one recorded whole).

        Raises:
            ValueError: the file holds no whole step, or not that one (names the ones it has).
        """
        steps = self.steps
        if not steps:
            raise ValueError(f"{self.path or 'the timeline'}: no whole step was recorded (the run stopped inside "
                             f"the requested steps {self.meta.get('requested')}?)")
        if step is None:
            s = steps[-1]
        else:
            found = [s for s in steps if s["step"] == int(step)]
            if not found:
                raise ValueError(f"--step {step}: {self.path or 'the timeline'} holds steps "
                                 f"{', '.join(str(s['step']) for s in steps)}")
            s = found[0]
        return int(s["step"]), float(s["start_s"]), float(s["end_s"])

    def within(self, start: float, end: float) -> list[dict]:
        """Spans overlapping ``[start, end]``."""
        return [s for s in self.spans if s["end"] > start and s["start"] < end]


def load(path: str) -> Trace:
    """Read a timeline file.

    Raises:
        FileNotFoundError: no such file; ValueError: not a Chrome-trace JSON file.
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not a JSON timeline ({e})") from None
    if not isinstance(data, (dict, list)):
        raise ValueError(f"{path}: not a Chrome-trace file (no traceEvents)")
    return Trace(data, path)


def find(run_dir: str, rank: int | None = None) -> str:
    """The timeline file of ``rank`` (default: the lowest rank present) in ``run_dir``, or ``run_dir``
    itself when it is a file.

    Raises:
        FileNotFoundError: none there; the message says how to record one.
    """
    if os.path.isfile(run_dir):
        return run_dir
    if rank is not None:
        path = os.path.join(run_dir, FILE_PATTERN.format(rank=rank))
        if os.path.isfile(path):
            return path
    else:
        found = glob.glob(os.path.join(glob.escape(run_dir), FILE_PATTERN.format(rank="*")))
        ranks = sorted((int(m.group(1)), p) for p in found
                       if (m := re.search(r"timeline-rank(\d+)\.json$", p)))
        if ranks:
            return ranks[0][1]
    raise FileNotFoundError(
        f"{run_dir}: no {FILE_PATTERN.format(rank='*' if rank is None else rank)}; record one with "
        f"\"aidaptiv\": {{\"profile\": {{\"steps\": \"3-4\", \"dir\": \"{run_dir}\"}}}} in the DeepSpeed config, "
        f"aidaptiv_ds.telemetry.timeline.enable(engine, steps=(3, 4), run_dir=...), or compare --timeline 3-4")


# ---------------------------------------------------------------------------- figures
def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end]`` intervals (overlaps counted once)."""
    if not intervals:
        return 0.0
    ordered = sorted(intervals)
    total = 0.0
    cur_s, cur_e = ordered[0]
    for s, e in ordered[1:]:
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + cur_e - cur_s


def _clip(spans: list[dict], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of ``spans`` inside ``[start, end]``."""
    return [(max(s["start"], start), min(s["end"], end)) for s in spans if s["end"] > start and s["start"] < end]


def drive_of(span: dict) -> str:
    return span["args"].get("drive") or span["lane"][3:].rsplit(" #", 1)[0]


def summarize_step(trace: Trace, step: int | None = None) -> dict:
    """Figures of one step from its spans (seconds, bytes; GB/s = 1e9 bytes/s).

    ``step``, ``wall_s``; ``forward_s``, ``backward_s``, ``optimizer_s`` (the step lane's phases);
    ``compute_busy_s`` (union of the block spans), ``io_wait_s`` (union of the wait spans on the
    compute and optimizer lanes: the time compute waited), ``io_wait_share``; ``drives``: per cache
    path ``read_bytes``, ``write_bytes``, ``demand_read_bytes`` (reads issued on demand, not read
    ahead), ``read_busy_s`` / ``write_busy_s`` (union of its system calls), ``read_gbps`` /
    ``write_gbps`` (bytes over busy time), ``busy_share`` (reads or writes in flight / wall);
    ``read_bytes``, ``write_bytes`` (all drives); ``update_s``: the optimizer's arithmetic (union of its
    ``aidaptiv::optimizer_step`` spans, one per sub-group, inside backward or after it), ``optimizer_lane_s``:
    everything on the optimizer lane (the update, its swap-ins and write-backs, steps inside backward),
    ``subgroups_stepped``: the sub-groups updated. Bytes of a system call that straddles the step's
    edge count in proportion to its part inside. ``tail_s``: seconds from the step's end to the next
    step's start (or the recording's end), ``tail_read_bytes`` / ``tail_write_bytes`` (also per drive):
    I/O in that tail (write-back the step left in flight, read-ahead for the next step).
    """
    k, t0, t1 = trace.step_window(step)
    wall = t1 - t0
    inside = trace.within(t0, t1)
    phases = {p: union_seconds(_clip([s for s in inside if s["lane"] == "step" and s["cat"] == "phase"
                                      and s["name"].startswith(p)], t0, t1))
              for p in ("forward", "backward", "optimizer")}
    blocks = [s for s in inside if s["cat"] in ("forward", "backward", "recompute")]
    waits = [s for s in inside if s["cat"] == WAIT_CAT and not s["lane"].startswith(("io ", "thread "))]
    drives: dict[str, dict] = {}
    for s in inside:
        if s["cat"] not in IO_CATS:
            continue
        d = drives.setdefault(drive_of(s), {"read_bytes": 0.0, "write_bytes": 0.0, "demand_read_bytes": 0.0,
                                            "_read": [], "_write": []})
        a, b = max(s["start"], t0), min(s["end"], t1)
        dur = s["end"] - s["start"]
        share = (b - a) / dur if dur > 0 else 1.0
        nbytes = float(s["args"].get("bytes", 0)) * share
        d[f"{s['cat']}_bytes"] += nbytes
        if s["cat"] == "read" and s["args"].get("priority") == "demand":
            d["demand_read_bytes"] += nbytes
        d[f"_{s['cat']}"].append((a, b))
    for d in drives.values():
        for op in IO_CATS:
            busy = union_seconds(d.pop(f"_{op}"))
            d[f"{op}_busy_s"] = busy
            d[f"{op}_gbps"] = d[f"{op}_bytes"] / busy / 1e9 if busy > 0 else None
        d["read_bytes"], d["write_bytes"] = int(round(d["read_bytes"])), int(round(d["write_bytes"]))
        d["demand_read_bytes"] = int(round(d["demand_read_bytes"]))
    until = trace.tail_end(k)
    tail = {"read": 0.0, "write": 0.0}
    for s in trace.within(t1, until):
        if s["cat"] in IO_CATS:
            a, b = max(s["start"], t1), min(s["end"], until)
            dur = s["end"] - s["start"]
            nbytes = float(s["args"].get("bytes", 0)) * ((b - a) / dur if dur > 0 else 1.0)
            tail[s["cat"]] += nbytes
            d = drives.setdefault(drive_of(s), {"read_bytes": 0, "write_bytes": 0, "demand_read_bytes": 0,
                                                "read_busy_s": 0.0, "write_busy_s": 0.0, "read_gbps": None,
                                                "write_gbps": None})
            d[f"tail_{s['cat']}_bytes"] = d.get(f"tail_{s['cat']}_bytes", 0.0) + nbytes
    for d in drives.values():
        for op in IO_CATS:
            d[f"tail_{op}_bytes"] = int(round(d.get(f"tail_{op}_bytes", 0.0)))
    updates = [s for s in inside if s["lane"] == "optimizer" and s["name"] == "aidaptiv::optimizer_step"]
    optimizer_lane = [s for s in inside if s["lane"] == "optimizer"]
    all_io = _clip([s for s in inside if s["cat"] in IO_CATS], t0, t1)
    wait_s = union_seconds(_clip(waits, t0, t1))
    return {"step": k, "wall_s": wall, "forward_s": phases["forward"], "backward_s": phases["backward"],
            "optimizer_s": phases["optimizer"], "compute_busy_s": union_seconds(_clip(blocks, t0, t1)),
            "io_wait_s": wait_s, "io_wait_share": wait_s / wall if wall > 0 else None,
            "io_busy_share": union_seconds(all_io) / wall if wall > 0 else None,
            "read_bytes": sum(d["read_bytes"] for d in drives.values()),
            "write_bytes": sum(d["write_bytes"] for d in drives.values()),
            "tail_s": until - t1, "tail_read_bytes": int(round(tail["read"])),
            "tail_write_bytes": int(round(tail["write"])), "drives": drives,
            "update_s": union_seconds(_clip(updates, t0, t1)),
            "optimizer_lane_s": union_seconds(_clip(optimizer_lane, t0, t1)),
            "subgroups_stepped": len(updates)}


def format_summary(s: dict) -> str:
    """A few lines of :func:`summarize_step` for the terminal."""
    lines = [f"step {s['step']}: {s['wall_s']:.3f} s (forward {s['forward_s']:.3f}, backward {s['backward_s']:.3f}, "
             f"optimizer {s['optimizer_s']:.3f}); compute waited {s['io_wait_s']:.3f} s "
             f"({(s['io_wait_share'] or 0):.0%}); I/O in flight {(s['io_busy_share'] or 0):.0%} of the step; "
             f"then {s['tail_s']:.3f} s to the next step, with {s['tail_read_bytes'] / 1e9:.3f} GB read and "
             f"{s['tail_write_bytes'] / 1e9:.3f} GB written"]
    if s.get("subgroups_stepped"):
        lines.append(f"  optimizer: {s['subgroups_stepped']} sub-group update(s) in {s['update_s']:.3f} s, "
                     f"{s['optimizer_lane_s']:.3f} s on its lane with their swaps")
    for drive, d in s["drives"].items():
        def rate(v):
            return "n/a" if v is None else f"{v:.2f} GB/s"
        lines.append(f"  {drive}: read {d['read_bytes'] / 1e9:.3f} GB ({d['demand_read_bytes'] / 1e9:.3f} on demand) "
                     f"in {d['read_busy_s']:.3f} s busy ({rate(d['read_gbps'])}), "
                     f"written {d['write_bytes'] / 1e9:.3f} GB in {d['write_busy_s']:.3f} s busy "
                     f"({rate(d['write_gbps'])})")
    return "\n".join(lines)
