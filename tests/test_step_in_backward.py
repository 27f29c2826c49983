"""The optimizer step inside backward (``integration/backward_step.py``) keeps the oracle in every mode.

Each case trains with DeepSpeed's CPU offload and with aidaptiv_ds (fresh processes), compares losses,
gathered parameters and fp32 master weights bit for bit, and checks from the per-step counters which
path each sub-group step took: speculated inside backward and committed; speculated, then redone after
backward because clipping triggered; or stepped after backward only.
"""
from __future__ import annotations

import pytest

from _oracle import assert_identical, oracle, run

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

LLAMA = ["--model", "llama", "--sub_group_size", "2e5"]  # ~3 sub-groups per rank


def _paths(res: dict) -> list[dict]:
    return [d["optimizer_steps"] for d in res["io"]]


def _clipped(res: dict, clip: float) -> list[bool]:
    """Steps where DeepSpeed's clipping factor was above 1 (its formula, from the reported norms)."""
    return [clip > 0 and (n + 1e-6) / clip > 1.0 for n in res["norms"]]


CASES = [
    # id, arguments, budget, what the counters must show
    ("fp32-noclip-ga1-budget0", ["--dtype", "fp32", "--steps", "5"], "0", "committed"),
    ("bf16-noclip-ga2-budget0", ["--dtype", "bf16", "--steps", "4", "--ga", "2"], "0", "committed"),
    ("fp32-noclip-ga4-half", ["--dtype", "fp32", "--steps", "3", "--ga", "4"], "3MiB", "committed"),
    ("fp32-clip-never-triggers", ["--dtype", "fp32", "--steps", "5", "--clip", "1e3"], "0", "committed"),
    ("bf16-clip-always-triggers-ga2", ["--dtype", "bf16", "--steps", "4", "--ga", "2", "--clip", "1e-3"], "0",
     "redone"),
    ("fp32-clip-some-steps", ["--dtype", "fp32", "--steps", "5", "--clip", "4.0", "--lr", "1e-2"], "0", "mixed"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_step_in_backward_is_bit_identical(case, tmp_path_factory):
    name, args, budget, expect = case
    args = LLAMA + args
    ref = oracle(args, str(tmp_path_factory.getbasetemp()))
    got = run("aidaptiv", args + ["--budget", budget], str(tmp_path_factory.mktemp(name)))
    assert_identical(ref, got)
    assert got["norms"] == ref["norms"]
    paths = _paths(got)
    clip = float(args[args.index("--clip") + 1]) if "--clip" in args else 0.0
    clipped = _clipped(ref, clip)
    prev_clipped = False
    for step, (p, c) in enumerate(zip(paths, clipped, strict=True)):
        assert p["rolled_back"] == 0
        if prev_clipped:  # right after a clipped step no speculation (a redo would cost the writes twice): the
            # updates ride the next forward (step_pipeline.py)
            assert p["in_backward"] == 0 and p["riding_forward"] > 0 and p["after_backward"] == 0, (step, p)
        else:
            assert p["in_backward"] > 0, f"step {step}: no sub-group was stepped inside backward: {p}"
            if c:  # every speculation of a clipping step is redone after backward, from the old state
                assert p["redone"] == p["in_backward"] and p["committed"] == 0, (step, p)
            else:
                assert p["committed"] == p["in_backward"] and p["redone"] == 0, (step, p)
        prev_clipped = c
    redone = sum(p["redone"] for p in paths)
    if expect == "committed":
        assert not any(clipped) and redone == 0
    elif expect == "redone":
        assert all(clipped) and redone > 0
    else:
        assert any(clipped) and not all(clipped), f"the case must mix clipping and non-clipping steps: {ref['norms']}"
        assert redone > 0, f"no clipped step followed an unclipped one: {clipped}"


def test_step_after_backward_when_switched_off(tmp_path_factory):
    args = LLAMA + ["--dtype", "fp32", "--steps", "4"]
    ref = oracle(args, str(tmp_path_factory.getbasetemp()))
    got = run("aidaptiv", args + ["--budget", "0", "--extra", '{"step_in_backward": false}'],
              str(tmp_path_factory.mktemp("off")))
    assert_identical(ref, got)
    assert all(p["in_backward"] == 0 and p["riding_forward"] > 0 for p in _paths(got))  # they ride the forward


def test_no_gradient_written_when_stepped_in_backward(tmp_path_factory):
    """Clipping off, budget 0: every gradient is consumed by its sub-group's step inside backward, so
    none is written (fp32: 12 B/param/step, the master weights and moments only)."""
    args = LLAMA + ["--dtype", "fp32", "--steps", "4"]
    got = run("aidaptiv", args + ["--budget", "0"], str(tmp_path_factory.mktemp("nograd")))
    assert all(d["grad_spilled_bytes"] == 0 for d in got["io"][1:])
    assert got["plan"]["grads_resident"]
    off = run("aidaptiv", args + ["--budget", "0", "--extra", '{"step_in_backward": false}'],
              str(tmp_path_factory.mktemp("gradoff")))
    assert all(d["grad_spilled_bytes"] > 0 for d in off["io"][1:])  # after backward they go through the drive


def test_master_weights_come_from_the_parameter_reads(tmp_path_factory):
    """fp32, budget 0, clipping off: a step inside backward reads only the moments; its master weights
    are the parameter bytes backward read (optimizer_swapper.py, [Note: master weights from the parameter
    reads]). The results stay bit-identical to DeepSpeed's CPU offload, the master bytes of every stepped
    sub-group are accounted for (copied from parameter slices, or read on demand), and the reads of the
    optimizer extents per step are a full read's less exactly the master bytes the slices supplied.
    A reduce bucket smaller than a sub-group makes gradients arrive while backward goes on (as on a large
    model); with one bucket for the whole model every step would come at the end of backward, when the
    parameters of all but the last sub-groups have left DRAM and are read on demand."""
    args = LLAMA + ["--dtype", "fp32", "--steps", "4", "--reduce_bucket_size", "5e4"]
    ref = oracle(args, str(tmp_path_factory.getbasetemp()))
    got = run("aidaptiv", args + ["--budget", "0"], str(tmp_path_factory.mktemp("master")))
    assert_identical(ref, got)
    off = run("aidaptiv", args + ["--budget", "0", "--extra", '{"step_in_backward": false, "step_rides_forward": false}'],
              str(tmp_path_factory.mktemp("master_off")))
    n = got["nparams"]
    slop = 2 * 3 * 4096 * 4  # per sub-group (3-4 here) an aligned block at each end of a read
    for d, o in zip(got["io"][1:], off["io"][1:], strict=True):
        assert d["optimizer_steps"]["in_backward"] > 0 and d["optimizer_steps"]["after_backward"] == 0, d
        master = d["master_from_params_bytes"] + d["master_demand_bytes"]
        assert 0.95 * 4 * n <= master <= 4 * n, (master, n)  # every master slot but its last block's tail
        assert d["master_from_params_bytes"] > 0, d
        assert d["buffer_pool_bytes"] > 0 and d["buffer_pool_peak_bytes"] > 0, d  # budget 0: no heap, a pool
        assert o["master_from_params_bytes"] == o["master_demand_bytes"] == 0  # after backward: a full read
        # Reads of the optimizer extents ("opt": fp32 parameters are read from their master slots, so the
        # parameters' reads are counted there too, the same in both runs): after backward the step reads
        # the master slots again, inside backward it reads only what no parameter slice supplied. How the
        # master bytes split between the slices and demand reads depends on when write-backs free the
        # in-backward window (timing), but the bytes read follow that split exactly. The gradients' reads
        # after backward ("grad") are left out: a slice whose write-back is still in flight when the step
        # reads it is taken from DRAM, so they vary with the load (seen: 3.3 instead of 4.0 B/param).
        opt, opt_off = d["bytes_read_by_kind"]["opt"], o["bytes_read_by_kind"]["opt"]
        assert abs((opt_off - opt) - d["master_from_params_bytes"]) <= slop, (opt, opt_off, d)


def test_master_bytes_backward_left_early_are_kept(tmp_path_factory):
    """One reduce bucket for the whole model: every gradient arrives at the end of backward, long after
    backward left the parameters of the sub-groups stepped then. The parameter bytes left while a
    sub-group had no slice are kept for its master slot up to one master slot ([Note: master weights
    from the parameter reads]), the rest is read on demand; the results stay bit-identical."""
    args = LLAMA + ["--dtype", "fp32", "--steps", "4", "--reduce_bucket_size", "5e8"]
    ref = oracle(args, str(tmp_path_factory.getbasetemp()))
    got = run("aidaptiv", args + ["--budget", "0"], str(tmp_path_factory.mktemp("held")))
    assert_identical(ref, got)
    n = got["nparams"]
    for d in got["io"][1:]:
        master = d["master_from_params_bytes"] + d["master_demand_bytes"]
        assert 0.95 * 4 * n <= master <= 4 * n, (master, n)
        assert 0 < d["master_held_bytes"] <= d["master_from_params_bytes"], d
        assert d["master_demand_bytes"] > 0, d  # the hold is bounded: the model's masters do not all fit
