"""The optimizer step riding the next forward (issue 35, ``integration/step_pipeline.py``).

With a gradient norm that clips every step (``gradient_clipping`` 1e-3), no sub-group is stepped inside
backward after the first step, so every update of a sub-group on the cache tier rides the next forward:
bit-identical with DeepSpeed's CPU offload (losses, gradient norms, parameters, masters, moments) at GA 1 and
4, fp32 and bf16, one and two ranks (at budget 0, and with a sub-group the residency plan keeps in DRAM, which
steps in ``step()``), with a learning rate that changes every step (the update uses the one of the ``step()``
that deferred it); a checkpoint saved right after ``step()`` resumes exactly; a failure inside the pipeline is
raised by every later wait.
"""
from __future__ import annotations

import pytest
import torch
from test_zero3_api import run_scenario

from aidaptiv_ds.bench.fuzz import reproducer, run_backend, run_case

pytestmark = pytest.mark.multirank

CLIPS = {"clip": 1e-3}  # the norm of these models is far above it: every step clips


def _case(**kw) -> dict:
    base = {"model": "llama", "hidden": 64, "layers": 2, "dtype": "fp32", "world": 1, "ga": 1, "micro": 2,
            "steps": 4, "budget": "0", "zero": {"sub_group_size": 20000}, **CLIPS,
            "aidaptiv": {"step_rides_forward": True}}  # "auto" keeps the updates in step() on CPU ranks
    return {**base, **kw}


@pytest.mark.parametrize("kw", [
    {},
    {"ga": 4, "dtype": "bf16", "scheduler": "WarmupLR"},
    {"world": 2, "ga": 2, "scheduler": "WarmupLR"},
    {"model": "gpt2", "world": 2, "dtype": "bf16", "zero": {}},  # DeepSpeed's defaults: persistent parameters
    {"world": 2, "ga": 2, "budget": "600KiB"},  # one sub-group in DRAM: the pipeline's slices at the pool's top
], ids=["fp32", "bf16-ga4-lr", "ws2-ga2-lr", "gpt2-ws2-defaults", "ws2-ga2-budget"])
def test_updates_riding_the_forward_are_deepspeeds(tmp_path, kw):
    case = _case(**kw)
    o = run_case(case, str(tmp_path))
    assert o.ok, "\n".join(o.diffs or [o.error or ""]) + f"\nreproduce: {reproducer(case)}"
    ours, _, _ = run_backend(case, "aidaptiv", str(tmp_path / "again"))
    steps, resident = ours[0]["optimizer_steps"], ours[0]["plan"]["resident_subgroups"]
    assert steps["riding_forward"] >= case["steps"] - 1, steps  # every step after the first rides
    # only the sub-groups the residency plan keeps in DRAM step in step() ([Note: riding on CPU ranks])
    assert steps["after_backward"] == len(resident) * case["steps"], (steps, resident)
    assert (case["budget"] == "0") == (not resident), ours[0]["plan"]


def test_a_checkpoint_right_after_step_holds_the_ridden_updates(tmp_path):
    """``save_checkpoint`` between ``step()`` and the next forward runs the deferred updates first: the
    reload (whole, into a new engine) trains on exactly as DeepSpeed's."""
    from test_zero3_api import assert_same_as_deepspeed
    assert_same_as_deepspeed(tmp_path, "reload", 1, "--load", "full", "--clip", "1e-3", "--ride")


@pytest.mark.parametrize("scenario,args", [
    ("fragment_set", ("--api", "full")),  # safe_set_* / safe_get_* of weights and moments right after step()
    ("gathered_edit", ()),  # GatheredParameters(modifier_rank=0) edits between steps
    ("eval_between", ()),  # an eval forward (no backward) after each step()
], ids=["safe_set_get", "gathered_edit", "eval_forward"])
def test_deepspeeds_zero3_api_between_step_and_the_riding_forward(tmp_path, scenario, args):
    """DeepSpeed's public ZeRO-3 API called while updates wait for the next forward (two ranks): each call
    first runs the updates of what it touches (``StepPipeline.drain`` / the gather), so what it reads and
    writes, and the run after it, are DeepSpeed's bit for bit ([Note: exactness] in step_pipeline.py)."""
    from test_zero3_api import assert_same_as_deepspeed
    got = assert_same_as_deepspeed(tmp_path, scenario, 2, *args, "--clip", "1e-3", "--ride")
    assert got[0]["optimizer_steps"]["riding_forward"] > 0, got[0]["optimizer_steps"]


def test_a_failed_update_is_raised_by_every_later_wait(tmp_path):
    res = run_scenario(tmp_path, "aidaptiv", "ride_failure", 1, "--clip", "1e-3", "--dtype", "bf16", "--ride")
    failed = [k for k, v in res[0]["checks"].items() if not v]
    assert not failed and len(res[0]["checks"]) >= 5, res[0]["checks"]


@pytest.mark.parametrize("mode", ["auto", False], ids=["auto", "false"])
def test_without_riding_every_update_runs_in_step(tmp_path, mode):
    """``"step_rides_forward": false``, and ``"auto"`` on a CPU rank ([Note: riding on CPU ranks]): DeepSpeed's
    loop steps every sub-group inside ``step()`` (same bits)."""
    case = _case(aidaptiv={"step_rides_forward": mode})
    o = run_case(case, str(tmp_path))
    assert o.ok, "\n".join(o.diffs or [o.error or ""])
    ours, _, _ = run_backend(case, "aidaptiv", str(tmp_path / "again"))
    assert ours[0]["optimizer_steps"]["riding_forward"] == 0
    assert torch.is_tensor(ours[0]["masters"])
