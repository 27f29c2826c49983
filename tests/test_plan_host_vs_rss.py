"""The planner's host memory per CPU rank bounds the measured peak RSS, at most 25% above it (issue 16, item 4).

Three bf16 Llama sizes (hidden 1024, 2 / 6 / 12 blocks, vocab 8192: 42M-169M parameters) each train 3
optimizer steps at ``dram_budget`` 0 in a worker of their own (:func:`aidaptiv_ds.bench.memory.sweep`, the
sweep behind ``launch/memory_sweep.py``; DeepSpeed's working-set knobs 2e7 elements, clipping 1.0). The peak
RSS of the steps (``VmHWM`` reset once the engine is built) is compared with what
``aidaptiv-ds plan --cpu-ranks`` says the rank needs besides the budget
(:func:`aidaptiv_ds.planner.plan.cpu_rank_host_bytes`). Slow (about 3 minutes on 2 cores): ``pytest -m slow``.

bf16, what GPU users run: since the steps inside backward keep to a window of two sub-group slices the
planner counts (41fb5c9 and after), its fp32 figure is an upper bound 10-25% above the peak on these sizes
(the gradient window, DeepSpeed's three reduce buckets and the in-backward window, each a maximum in
fp32 elements, do not peak together); README "Host memory against model size".
"""
from __future__ import annotations

import pytest

from aidaptiv_ds.bench.backends import TrainSettings
from aidaptiv_ds.bench.memory import sweep
from aidaptiv_ds.bench.models import LlamaShape

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


def test_planned_host_memory_matches_the_peak_rss(tmp_path):
    knob = int(2e7)
    settings = TrainSettings(dtype="bf16", seq=128, sub_group_size=knob, reduce_bucket_size=knob,
                             prefetch_bucket_size=knob, max_live_parameters=knob)
    shapes = [LlamaShape(hidden=1024, intermediate=2752, layers=n, heads=16, kv_heads=16, vocab=8192)
              for n in (2, 6, 12)]
    res = sweep(shapes, settings, backends=["aidaptiv0"], steps=3, work_dir=str(tmp_path), timeout_s=1200)
    print(res["table"])
    for p in res["points"]:
        assert p["ok"], p["error"]
        planned, measured = p["planned_host"]["total"], p["peak_rss_steps_bytes"]
        print(f"{p['n_params'] / 1e6:.1f}M: planned {planned / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB")
        # the plan is an upper bound (a budget is a promise), and not a loose one: within 25% above the peak
        assert 0.75 * planned <= measured <= planned
