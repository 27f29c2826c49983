"""The step timeline (issue 15, item 1): spans, the I/O engine's and the runtime's records, the module
hooks on a tiny model, the Chrome-trace file and one step's figures from fake spans, the picture
and its command. The tiny real DeepSpeed run is in ``tests/test_compare.py::test_compare_end_to_end_tiny``
(a timeline of each backend's steps 2-3, drawn)."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from aidaptiv_ds import spans
from aidaptiv_ds.errors import AidaptivConfigError
from aidaptiv_ds.io import READ_DEMAND, READ_PREFETCH, IOEngine, alloc_aligned
from aidaptiv_ds.telemetry import timeline, timeline_trace
from aidaptiv_ds.telemetry.timeline_trace import Trace, summarize_step, to_chrome, union_seconds

MiB = 1 << 20


@pytest.fixture
def recorder():
    rec = spans.start()
    yield rec
    spans.stop()


def _lane_nesting_errors(spans_: list[dict]) -> list[str]:
    """Spans of one lane that overlap without nesting (the Chrome-trace rule for one thread)."""
    bad = []
    by_lane: dict[str, list] = {}
    for s in spans_:
        by_lane.setdefault(s["lane"], []).append(s)
    for lane, ss in by_lane.items():
        open_: list[dict] = []
        for s in sorted(ss, key=lambda s: (s["start"], -s["end"])):
            while open_ and open_[-1]["end"] <= s["start"] + 1e-9:
                open_.pop()
            if open_ and s["end"] > open_[-1]["end"] + 1e-9:
                bad.append(f"{lane}: {s['name']} [{s['start']:.6f}, {s['end']:.6f}] overlaps {open_[-1]['name']} "
                           f"[{open_[-1]['start']:.6f}, {open_[-1]['end']:.6f}]")
            open_.append(s)
    return bad


# ---------------------------------------------------------------------------- spans
def test_span_is_a_shared_noop_when_nothing_records():
    assert spans.ACTIVE is None
    a, b = spans.span("aidaptiv::x"), spans.span("aidaptiv::y", lane="optimizer", subgroup=3)
    assert a is b is spans._NOOP
    with a:
        pass
    spans.complete("x", 0.0, 1.0, "compute")  # nothing to record into: no error, nothing kept
    assert spans.ACTIVE is None


def test_spans_keep_lanes_nesting_and_threads(recorder):
    with spans.span("aidaptiv::optimizer_step", lane="optimizer", subgroup=2):
        with spans.span("aidaptiv::io_wait", cat="wait"):  # inherits the optimizer lane
            pass
    with spans.span("outer"):
        pass
    seen = {}

    def helper():
        with spans.span("aidaptiv::io_wait", cat="wait"):
            pass
        spans.set_thread_lane()
        with spans.span("after set_thread_lane"):
            pass
        seen["name"] = threading.current_thread().name

    t = threading.Thread(target=helper, name="helper-7")
    t.start()
    t.join()
    spans.instant("decision", lane="optimizer", size=5)
    ev = {(e[1], e[3]) for e in recorder.events}
    assert ("aidaptiv::optimizer_step", "optimizer") in ev and ("aidaptiv::io_wait", "optimizer") in ev
    assert ("outer", "compute") in ev
    assert ("aidaptiv::io_wait", "thread helper-7") in ev  # never the compute lane from another thread
    assert ("after set_thread_lane", "compute") in ev
    step = next(e for e in recorder.events if e[1] == "aidaptiv::optimizer_step")
    wait = next(e for e in recorder.events if e[1] == "aidaptiv::io_wait" and e[3] == "optimizer")
    assert step[4] <= wait[4] <= wait[5] <= step[5] and step[6] == {"subgroup": 2} and wait[2] == "wait"
    inst = next(e for e in recorder.events if e[0] == "i")
    assert inst[1:4] == ("decision", "aidaptiv", "optimizer") and inst[6] == {"size": 5}
    with pytest.raises(RuntimeError, match="already recording"):
        spans.start()


def test_spans_show_in_a_users_torch_profiler_trace():
    from torch.profiler import ProfilerActivity, profile

    from aidaptiv_ds.integration.runtime import Timer

    timer = Timer()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with spans.span("aidaptiv::optimizer_step", subgroup=1):
            torch.ones(4).sum()
        with timer:
            pass
    names = [e.name for e in prof.events()]
    assert "aidaptiv::optimizer_step" in names and "aidaptiv::io_wait" in names
    assert spans.ACTIVE is None  # only the profiler was on: nothing else recorded
    assert timer.seconds > 0


def test_runtime_io_wait_timer_records_a_wait_span(recorder):
    from aidaptiv_ds.integration.runtime import Timer

    timer = Timer()
    with timer:
        with timer.__class__():  # a second timer nested: both spans, properly nested
            pass
    waits = [e for e in recorder.events if e[1] == "aidaptiv::io_wait"]
    assert len(waits) == 2 and all(e[2] == "wait" and e[3] == "compute" for e in waits)
    inner, outer = sorted(waits, key=lambda e: e[5] - e[4])
    assert outer[4] <= inner[4] <= inner[5] <= outer[5]  # properly nested
    # the span encloses the timer's own interval (same clock), whatever the scheduler did in between
    assert 0 < timer.seconds <= outer[5] - outer[4]


# ---------------------------------------------------------------------------- the I/O engine
def test_io_engine_records_every_system_call_per_drive_with_its_bytes(tmp_path, recorder):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    eng = IOEngine(block_size=MiB, threads_per_drive=2)
    try:
        fa, fb = eng.open(str(a / "slab")), eng.open(str(b / "slab"))
        src = alloc_aligned(3 * MiB)
        src.copy_(torch.randint(0, 256, (3 * MiB,), dtype=torch.uint8))
        eng.write(fa, 0, src).wait()
        eng.write(fb, 0, src[:MiB]).wait()
        dst = alloc_aligned(3 * MiB)
        eng.read(fa, 0, dst, READ_PREFETCH).wait()
        eng.read(fb, 0, dst[:MiB], READ_DEMAND).wait()
        assert torch.equal(dst, src)
    finally:
        eng.close()
    io = [e for e in recorder.events if e[2] in ("read", "write")]
    per = {}
    for _kind, name, cat, lane, t0, t1, args in io:
        assert lane.startswith(f"io {args['drive']} #") and name == cat and t1 >= t0
        assert args["queued_s"] >= 0 and args["file"] == "slab"
        per.setdefault((os.path.basename(args["drive"]), cat), []).append(args)
    assert sum(x["bytes"] for x in per[("a", "write")]) == 3 * MiB and len(per[("a", "write")]) == 3
    assert sum(x["bytes"] for x in per[("b", "write")]) == MiB
    assert sum(x["bytes"] for x in per[("a", "read")]) == 3 * MiB
    assert {x["priority"] for x in per[("a", "read")]} == {"prefetch"}
    assert {x["priority"] for x in per[("b", "read")]} == {"demand"}
    assert {x["priority"] for x in per[("a", "write")]} == {"write-back"}
    assert sorted(x["offset"] for x in per[("a", "write")]) == [0, MiB, 2 * MiB]
    blocked = [e for e in recorder.events if e[1] == "aidaptiv::io_blocked"]
    assert blocked and all(e[3] == "compute" and e[2] == "wait" and e[6]["bytes"] in (MiB, 3 * MiB) for e in blocked)


def test_io_engine_records_nothing_while_no_timeline_records(tmp_path):
    eng = IOEngine(block_size=MiB, threads_per_drive=1)
    try:
        fh = eng.open(str(tmp_path / "slab"))
        buf = alloc_aligned(2 * MiB)
        eng.write(fh, 0, buf).wait()
        rec = spans.start()  # started after the request: nothing of it may appear
        try:
            assert rec.events == []
        finally:
            spans.stop()
    finally:
        eng.close()


# ---------------------------------------------------------------------------- the file and its figures
def _fake_events():
    """Step 1 from 0 to 10 s: forward 0-4, backward 4-8, optimizer 8-10; reads on drive /d0 (two overlapping
    calls, 1 GB each, one read on demand), a write straddling the step's end, waits (one nested)."""
    ev = [("X", "step 1", "step", "step", 0.0, 10.0, {"step": 1}),
          ("X", "forward", "phase", "step", 0.0, 4.0, None),
          ("X", "backward", "phase", "step", 4.0, 8.0, None),
          ("X", "optimizer step", "phase", "step", 8.0, 10.0, None),
          ("X", "forward layers.0", "forward", "compute", 0.0, 2.0, {"block": 0}),
          ("X", "forward layers.1", "forward", "compute", 2.0, 4.0, {"block": 1}),
          ("X", "backward layers.1", "backward", "compute", 4.0, 6.0, {"block": 1}),
          ("X", "backward layers.0", "backward", "compute", 6.0, 8.0, {"block": 0}),
          ("X", "aidaptiv::io_wait", "wait", "compute", 1.0, 2.0, None),
          ("X", "aidaptiv::io_blocked", "wait", "compute", 1.2, 1.8, {"bytes": 1}),
          ("X", "aidaptiv::io_wait", "wait", "optimizer", 8.5, 9.0, None),
          ("X", "aidaptiv::io_wait", "wait", "thread helper", 3.0, 7.0, None),  # not compute waiting
          ("X", "aidaptiv::optimizer_step", "aidaptiv", "optimizer", 8.0, 10.0, {"subgroup": 0}),
          ("X", "read", "read", "io /d0 #0", 1.0, 3.0, {"drive": "/d0", "bytes": 10 ** 9, "priority": "prefetch"}),
          ("X", "read", "read", "io /d0 #1", 2.0, 4.0, {"drive": "/d0", "bytes": 10 ** 9, "priority": "demand"}),
          ("X", "write", "write", "io /d0 #2", 9.0, 11.0, {"drive": "/d0", "bytes": 2 * 10 ** 9,
                                                         "priority": "write-back"}),
          ("X", "write", "write", "io /d1 #0", 5.0, 6.0, {"drive": "/d1", "bytes": 10 ** 9,
                                                         "priority": "write-back"}),
          ("i", "decision", "aidaptiv", "optimizer", 8.0, None, {"n": 1})]
    ev.append(("X", "read", "read", "io /d1 #1", 10.5, 11.5,  # in the step's tail
               {"drive": "/d1", "bytes": 10 ** 9, "priority": "prefetch"}))
    meta = {"rank": 3, "steps": [{"step": 1, "start_s": 0.0, "end_s": 10.0, "until_s": 12.0}], "requested": [1, 1],
            "complete": True}
    return ev, meta


def test_chrome_trace_round_trip_and_format(tmp_path):
    ev, meta = _fake_events()
    data = to_chrome([(k, n, c, lane, t0 + 100.0, None if t1 is None else t1 + 100.0, a)
                      for k, n, c, lane, t0, t1, a in ev], 100.0, meta)
    path = timeline_trace.write(str(tmp_path / "timeline-rank3.json"), data)
    with open(path) as f:
        raw = json.load(f)
    assert raw["displayTimeUnit"] == "ms" and raw["otherData"]["aidaptiv_ds"]["format"] == timeline_trace.FORMAT
    names = {e["tid"]: e["args"]["name"] for e in raw["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    order = [names[t] for t in sorted(names)]
    assert order[:3] == ["step", "compute", "optimizer"]
    assert order[-5:] == ["io /d0 #0", "io /d0 #1", "io /d0 #2", "io /d1 #0", "io /d1 #1"]
    xs = [e for e in raw["traceEvents"] if e["ph"] == "X"]
    assert all(e["pid"] == 3 and isinstance(e["tid"], int) and e["dur"] >= 0 for e in xs)
    fwd = next(e for e in xs if e["name"] == "forward layers.1")
    assert fwd["ts"] == pytest.approx(2e6) and fwd["dur"] == pytest.approx(2e6)
    t = timeline_trace.load(path)
    assert len(t.spans) == len(ev) - 1 and len(t.instants) == 1 and t.meta["rank"] == 3
    assert t.tail_end(1) == 12.0
    assert timeline_trace.find(str(tmp_path)) == path
    assert not _lane_nesting_errors(t.spans)


def test_one_steps_figures_from_fake_spans():
    ev, meta = _fake_events()
    s = summarize_step(Trace(to_chrome(ev, 0.0, meta)))
    assert s["step"] == 1 and s["wall_s"] == pytest.approx(10.0)
    assert (s["forward_s"], s["backward_s"], s["optimizer_s"]) == pytest.approx((4.0, 4.0, 2.0))
    assert s["compute_busy_s"] == pytest.approx(8.0)
    assert s["io_wait_s"] == pytest.approx(1.5)  # 1-2 (the nested one once) + 8.5-9; the helper thread's not
    assert s["io_wait_share"] == pytest.approx(0.15)
    d0 = s["drives"]["/d0"]
    assert d0["read_bytes"] == 2 * 10 ** 9 and d0["demand_read_bytes"] == 10 ** 9
    assert d0["read_busy_s"] == pytest.approx(3.0) and d0["read_gbps"] == pytest.approx(2 / 3)
    assert d0["write_bytes"] == 10 ** 9  # half of the straddling write lies inside the step
    assert d0["write_busy_s"] == pytest.approx(1.0) and d0["write_gbps"] == pytest.approx(1.0)
    assert s["drives"]["/d1"]["write_bytes"] == 10 ** 9
    assert s["read_bytes"] == 2 * 10 ** 9 and s["write_bytes"] == 2 * 10 ** 9
    assert s["io_busy_share"] == pytest.approx(0.5)  # 1-4, 5-6, 9-10
    assert s["tail_s"] == pytest.approx(2.0) and s["tail_write_bytes"] == 10 ** 9  # the write's second half
    assert s["tail_read_bytes"] == 10 ** 9 and s["drives"]["/d1"]["tail_read_bytes"] == 10 ** 9
    assert s["drives"]["/d1"]["read_bytes"] == 0 and s["drives"]["/d0"]["tail_write_bytes"] == 10 ** 9
    text = timeline_trace.format_summary(s)
    assert "step 1: 10.000 s" in text and "/d0: read 2.000 GB (1.000 on demand)" in text
    assert union_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="holds steps 1"):
        summarize_step(Trace(to_chrome(ev, 0.0, meta)), 7)
    with pytest.raises(ValueError, match="no whole step"):
        summarize_step(Trace(to_chrome(ev, 0.0, dict(meta, steps=[]))))


def test_timeline_command_draws_one_step(tmp_path, capsys):
    from aidaptiv_ds.cli.main import main

    ev, meta = _fake_events()
    timeline_trace.write(str(tmp_path / "timeline-rank3.json"), to_chrome(ev, 0.0, meta))
    png = tmp_path / "out" / "step.png"
    assert main(["timeline", str(tmp_path), "--output", str(png)]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 20_000  # a drawn figure, not an empty canvas
    out = capsys.readouterr().out
    assert "step 1: 10.000 s" in out and str(png) in out
    assert main(["timeline", str(tmp_path), "--step", "1", "--json", "--no-plot"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["drives"]["/d0"]["read_bytes"] == 2 * 10 ** 9 and "output" not in got
    assert main(["timeline", str(tmp_path), "--step", "2"]) == 2
    assert "holds steps 1" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path / "out")]) == 2
    assert "no timeline-rank*.json" in capsys.readouterr().err


# ---------------------------------------------------------------------------- module hooks on a tiny model
class _Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.a, self.b = torch.nn.Linear(h, h), torch.nn.Linear(h, h)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class _Model(torch.nn.Module):
    def __init__(self, vocab=50, h=16, n=3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(_Block(h) for _ in range(n))
        self.head = torch.nn.Linear(h, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).logsumexp(-1).mean()


class _Engine:
    """What the timeline uses of a DeepSpeed engine: ``module``, ``backward``, ``step`` (an optimizer
    step every ``ga`` calls, marked as a span the way the Stage-3 adapter will) and ``global_steps``."""

    def __init__(self, model, ga=2):
        self.module, self.ga, self.micro, self.global_steps = model, ga, 0, 0
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def __call__(self, x):
        return self.module(x)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.micro += 1
        if self.micro % self.ga == 0:
            with spans.span("aidaptiv::optimizer_step", lane="optimizer", subgroup=0):
                self.opt.step()
                self.opt.zero_grad()
            self.global_steps += 1


def _train(engine, steps, ga=2, on_step=None):
    g = torch.Generator().manual_seed(0)
    for i in range(steps * ga):
        loss = engine(torch.randint(0, 50, (2, 8), generator=g))
        engine.backward(loss)
        engine.step()
        if on_step and (i + 1) % ga == 0:
            on_step(engine.global_steps)


def test_timeline_records_only_the_requested_steps_of_a_tiny_model(tmp_path):
    model = _Model()
    eng = _Engine(model)
    tl = timeline.enable(eng, steps="2-3", run_dir=str(tmp_path / "run"))
    assert [b[0] for b in tl.blocks] == ["emb", "layers.0", "layers.1", "layers.2", "head"]
    written_after = {}
    _train(eng, 5, on_step=lambda k: written_after.setdefault(k, tl.written))
    # written when step 4 begins: step 3's tail (what it left in flight) is in the file
    assert written_after[3] is None and written_after[4] == str(tmp_path / "run" / "timeline-rank0.json")
    t = timeline_trace.load(tl.written)
    assert [s["step"] for s in t.steps] == [2, 3] and t.meta["complete"] and t.meta["requested"] == [2, 3]
    s2, s3 = t.steps
    assert s2["end_s"] <= s2["until_s"] <= s3["start_s"] < s3["end_s"] <= s3["until_s"]
    assert s3["start_s"] - s2["until_s"] < 0.01
    assert not any(s["start"] > s3["until_s"] for s in t.spans)  # step 4 is not recorded
    assert t.meta["blocks"] == ["emb", "layers.0", "layers.1", "layers.2", "head"]
    fwd = [s for s in t.spans if s["cat"] == "forward"]
    bwd = [s for s in t.spans if s["cat"] == "backward"]
    assert len(fwd) == len(bwd) == 5 * 2 * 2  # blocks x micro-batches x steps
    assert not any(s["cat"] == "recompute" for s in t.spans)
    for step in t.steps:
        for micro in (0, 1):
            def order(ss, step=step, micro=micro):
                return [s["args"]["block"] for s in sorted(ss, key=lambda s: s["start"])
                        if s["args"]["micro"] == micro and step["start_s"] <= s["start"] <= step["end_s"]]
            assert order(fwd) == [0, 1, 2, 3, 4] and order(bwd) == [4, 3, 2, 1, 0]
    first_b = min(s["start"] for s in bwd)
    assert all(s["end"] <= first_b for s in fwd if s["args"]["micro"] == 0 and s["start"] < first_b)
    phases = [s["name"] for s in t.spans if s["cat"] == "phase"]
    assert phases.count("forward") == 4 and phases.count("backward") == 4 and phases.count("optimizer step") == 2
    assert phases.count("optimizer step (accumulating)") == 2
    opt = [s for s in t.spans if s["lane"] == "optimizer"]
    assert len(opt) == 2 and all(s["args"] == {"subgroup": 0} for s in opt)
    assert not _lane_nesting_errors(t.spans), _lane_nesting_errors(t.spans)
    assert spans.ACTIVE is None  # the window closed after step 3
    tl.close()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "step" not in eng.__dict__ and "backward" not in eng.__dict__  # the class's methods again


def test_timeline_closed_inside_the_window_writes_what_it_has(tmp_path):
    eng = _Engine(_Model(), ga=1)
    tl = timeline.enable(eng, steps=[2, 9], run_dir=str(tmp_path))
    _train(eng, 3, ga=1)
    assert tl.written is None and spans.ACTIVE is not None
    assert timeline.disable(eng) == str(tmp_path / "timeline-rank0.json")
    assert spans.ACTIVE is None
    t = timeline_trace.load(tl.written)
    assert not t.meta["complete"] and [s["step"] for s in t.steps] == [2, 3]
    assert timeline.disable(eng) is None


def test_parameter_gradients_end_the_backward_of_a_block_whose_inputs_need_none(tmp_path):
    """The embedding's input (token ids) needs no gradient: its backward ends at its weight's gradient."""
    eng = _Engine(_Model(), ga=1)
    tl = timeline.enable(eng, steps=1, run_dir=str(tmp_path))
    _train(eng, 1, ga=1)
    assert tl.written is None  # step 1's tail lasts until the next forward or the close
    t = timeline_trace.load(timeline.disable(eng))
    assert t.meta["complete"]
    emb = [s for s in t.spans if s["cat"] == "backward" and s["args"]["block"] == 0]
    layer0 = next(s for s in t.spans if s["cat"] == "backward" and s["args"]["block"] == 1)
    assert len(emb) == 1 and emb[0]["start"] >= layer0["end"] - 1e-9 and emb[0]["end"] >= emb[0]["start"]
    assert not tl._param_handles  # removed at the step's end


def test_recomputed_forward_inside_backward_is_marked(tmp_path):
    from torch.utils.checkpoint import checkpoint

    class Ckpt(_Model):
        def forward(self, ids):
            x = self.emb(ids)
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=True)
            return self.head(x).logsumexp(-1).mean()

    eng = _Engine(Ckpt(), ga=1)
    tl = timeline.enable(eng, steps=1, run_dir=str(tmp_path))
    _train(eng, 1, ga=1)
    assert tl.written is None  # step 1's tail lasts until the next forward or the close
    t = timeline_trace.load(timeline.disable(eng))
    assert t.meta["complete"]
    rec = [s for s in t.spans if s["cat"] == "recompute"]
    assert sorted(s["args"]["block"] for s in rec) == [1, 2, 3]
    assert len([s for s in t.spans if s["cat"] == "forward"]) == 5
    bwd = sorted((s for s in t.spans if s["cat"] == "backward"), key=lambda s: s["start"])
    assert [s["args"]["block"] for s in bwd] == [4, 3, 2, 1, 0]  # each checkpointed block's backward too
    for s in rec:  # the recomputation of block k runs just before its backward
        b = next(x for x in bwd if x["args"]["block"] == s["args"]["block"])
        assert s["end"] <= b["start"] + 1e-9
    assert not _lane_nesting_errors(t.spans), _lane_nesting_errors(t.spans)


def test_blocks_of_an_hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, vocab_size=64))
    assert [b[0] for b in timeline.select_blocks(m)] == ["embed_tokens", "layers.0", "layers.1", "norm", "lm_head"]
    assert [b[1] for b in timeline.select_blocks(m)][1] == "model.layers.0"
    assert "self_attn.q_proj" in [b[0] for b in timeline.select_blocks(m, "all")][1:] or \
        "q_proj" in [b[0] for b in timeline.select_blocks(m, "all")]
    with pytest.raises(AidaptivConfigError, match="profile.modules"):
        timeline.select_blocks(m, "layers")


@pytest.mark.parametrize("value, expected", [(3, (3, 3)), ("3", (3, 3)), ("3-4", (3, 4)), (" 2 - 5 ", (2, 5)),
                                             ([1, 2], (1, 2)), ((4, 4), (4, 4))])
def test_parse_steps(value, expected):
    assert timeline.parse_steps(value) == expected


@pytest.mark.parametrize("value", [0, "4-3", "a", [1], True, 2.5, "1-2-3", None])
def test_parse_steps_refuses(value):
    with pytest.raises(AidaptivConfigError, match=r"aidaptiv\.profile\.steps.*Fix"):
        timeline.parse_steps(value)


def test_the_profile_config_key():
    from aidaptiv_ds.integration.config import parse_section

    cfg = parse_section({"profile": {"steps": "3-4", "dir": "out"}})
    assert cfg.profile.steps == [3, 4] and cfg.profile.dir == "out" and cfg.profile.modules == "blocks"
    assert parse_section({}).profile.steps is None
    with pytest.raises(AidaptivConfigError, match=r"aidaptiv\.profile\.steps"):
        parse_section({"profile": {"steps": "4-3"}})
    with pytest.raises(AidaptivConfigError, match=r"aidaptiv\.profile\.stpes.*steps"):
        parse_section({"profile": {"stpes": 3}})
    with pytest.raises(AidaptivConfigError, match=r"aidaptiv\.profile\.modules"):
        parse_section({"profile": {"steps": 1, "modules": "some"}})


def test_an_unwritable_run_dir_is_refused_at_enable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(str(ro), os.W_OK):
            pytest.skip("running as root: permissions do not bind")
        with pytest.raises(AidaptivConfigError, match="profile.dir.*not writable"):
            timeline.enable(_Engine(_Model()), steps=1, run_dir=str(ro))
    finally:
        ro.chmod(0o700)
