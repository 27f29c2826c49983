"""The planner's bytes written per step equal what the ledger measures in a real run (within 5%)."""
from __future__ import annotations

import json
import os

import pytest
from _oracle import STORIES, STORIES_ABSENT, run, written_per_param_per_step

from aidaptiv_ds.cli.main import main as cli

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)


def plan(budget: str, capsys, clip: float = 0.0, dtype: str = "bf16", ga: int = 1, sub_group: float = 1e9,
         offload_param: str = "nvme") -> dict:
    cfg = os.path.join(STORIES, "config.json")
    assert cli(["plan", "--model", cfg, "--gpus", "1", "--vram", "80GB", "--dram", "24GiB", "--dram-budget", budget,
                "--cache", "/tmp:10GB", "--dtype", dtype, "--micro-batch", "2", "--seq-len", "24", "--cpu-ranks",
                "--gradient-clipping", str(clip), "--ga", str(ga), "--sub-group-size", str(sub_group),
                "--offload-param", offload_param, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
@pytest.mark.parametrize("budget, clip", [("0", 0.0),                      # nothing in DRAM, gradients consumed
                                          ("0", 1e6),                      # clipping on, never triggered: kept
                                          ("0", 1e-3),                     # triggered every step: after backward
                                          (str(260032 * 2 + 4096), 0.0)])  # the bf16 parameters in DRAM
def test_planned_writes_match_the_ledger(budget, clip, tmp_path, capsys):
    p = plan(budget, capsys, clip)
    res = run("aidaptiv", ["--model", "stories", "--zinit", "--dtype", "bf16", "--steps", "4", "--budget", budget,
                           "--clip", str(clip)], str(tmp_path))
    assert res["nparams"] == p["n_params"]
    measured = written_per_param_per_step(res)
    # clipping every step: the first step's speculation is redone (write_bytes_if_clipped, the plan's cost of a
    # redo), and every later step runs after backward (a clipped step is never followed by a speculation)
    planned = p["per_step"]["write_bytes"] / p["n_params"]
    if clip == 1e-3:
        assert p["per_step"]["write_bytes_if_clipped"] / p["n_params"] == pytest.approx(30.0, rel=0.01)
        # the steps after the first run after backward: between the plan's best reads and those with the kept
        # gradients read back (which one depends on the write-back's timing)
        steps = res["io"][1:]
        read = sum(d["bytes_read"].get("cache", 0) for d in steps) / len(steps) / res["nparams"]
        assert p["per_step"]["read_bytes_best"] / p["n_params"] * 0.95 <= read <= \
            p["per_step"]["read_bytes_after_backward"] / p["n_params"] * 1.05
    print(f"budget {budget}, clip {clip}: planned {planned:.3f} B/param/step, measured {measured:.3f}")
    # the steps run inside backward in every case (the drives have room for the second copy)
    assert p["residency"]["step_in_backward"]
    # without clipping the gradients are consumed inside backward ("resident": never written)
    assert res["plan"]["grads_resident"] == p["residency"]["grads_resident"] == (clip == 0 or budget != "0")
    assert res["plan"]["params_resident"] == p["residency"]["params_resident"] == (budget != "0")
    assert measured == pytest.approx(planned, rel=0.05)


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
@pytest.mark.parametrize("dtype, clip, ga", [("bf16", 0.0, 2), ("fp32", 1e6, 4)])
def test_planned_writes_with_gradient_accumulation_match_the_ledger(dtype, clip, ga, tmp_path, capsys):
    """Micro-batch-major at GA ``k`` (the runtime's schedule, ``planner/schedule.py``): a gradient slice the
    budget does not hold is written back after every micro-batch but the last, ``(k-1) x`` 2 (bf16) or 4
    (fp32) B/param more than at GA 1 (bf16 GA 2 clipping off: 16; fp32 GA 4 clipping on: 28)."""
    p = plan("0", capsys, clip, dtype=dtype, ga=ga)
    res = run("aidaptiv", ["--model", "stories", "--zinit", "--dtype", dtype, "--steps", "4", "--budget", "0",
                           "--ga", str(ga), "--clip", str(clip)], str(tmp_path))
    measured = written_per_param_per_step(res)
    planned = p["per_step"]["write_bytes"] / p["n_params"]
    assert planned == p["schedules"]["micro-batch-major"]["write_bytes_per_param"]
    print(f"{dtype} GA {ga} clip {clip}: planned {planned:.3f} B/param/step, measured {measured:.3f}")
    assert planned == pytest.approx({("bf16", 2): 16.0, ("fp32", 4): 28.0}[(dtype, ga)], rel=1e-3)
    assert measured == pytest.approx(planned, rel=0.05)


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
def test_a_budget_holds_partial_gradients_first_above_one_micro_batch(tmp_path, capsys):
    """[Note: partial gradients between micro-batches] in ``planner/residency.py``: fp32, GA 4, clipping off
    (steps inside backward), sub-groups of 5e4 elements, a budget that holds about half the gradient slices:
    they take it (not the optimizer sub-groups), and the runtime writes what the plan says, the partial sums
    of the other slices included (before, the plan ignored GA and announced 12 B/param/step)."""
    budget = str(260032 * 4 // 2 + 4096)
    p = plan(budget, capsys, 0.0, dtype="fp32", ga=4, sub_group=5e4)
    res = run("aidaptiv", ["--model", "stories", "--zinit", "--dtype", "fp32", "--steps", "4", "--budget", budget,
                           "--ga", "4", "--sub_group_size", "5e4"], str(tmp_path))
    measured = written_per_param_per_step(res)
    planned = p["per_step"]["write_bytes"] / p["n_params"]
    runtime = res["plan"]  # the plan the runtime made (and announced) from DeepSpeed's own sub-groups
    announced = runtime["write_bytes_per_step"] / res["nparams"]
    print(f"fp32 GA 4 budget {budget}: planned {planned:.3f} (the runtime's own plan {announced:.3f}) "
          f"B/param/step, measured {measured:.3f}")
    assert runtime["resident_grad_subgroups"] and not runtime["resident_subgroups"]  # the slices took the budget
    assert runtime["grad_bytes_per_step"] > 0
    assert measured == pytest.approx(announced, rel=0.01)
    # the CLI draws the sub-group boundaries from the model's shape, not DeepSpeed's: one slice more fits there
    assert measured == pytest.approx(planned, rel=0.08)
    assert measured < 23.0  # ignoring GA the plan spent the budget elsewhere: 12 of state + 3 x 4 of partial sums


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_planned_reads_match_the_ledger(dtype, tmp_path, capsys):
    """Bytes read per step at budget 0: forward and backward read every parameter (fp32: from the master
    slots, which are never written on their own) but what the read-ahead window still holds from the
    forward (here the whole of this small model), plus the optimizer state (``read_bytes_best``)."""
    p = plan("0", capsys, dtype=dtype)
    res = run("aidaptiv", ["--model", "stories", "--zinit", "--dtype", dtype, "--steps", "4", "--budget", "0"],
              str(tmp_path))
    steps = res["io"][1:]
    measured = sum(d["bytes_read"].get("cache", 0) for d in steps) / len(steps) / res["nparams"]
    planned = p["per_step"]["read_bytes_best"] / p["n_params"]
    print(f"{dtype}: planned read {planned:.3f} B/param/step, measured {measured:.3f}")
    assert measured == pytest.approx(planned, rel=0.05)
    assert p["per_step"]["read_bytes"] / p["n_params"] == 16.0  # no window: fp32 4 + 4 + 8, bf16 2 + 2 + 12


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
def test_fp32_parameters_first_copy_goes_back_to_the_drive(tmp_path):
    """fp32 partitions are read from their master slots, so the copy ``zero.Init`` wrote first is given
    back to the store: no ``params/float32`` extent is left, and the store never grows past the optimizer
    state, its second copy for steps inside backward and the gradients (16 + 12 B/param here, not 20 + 12)."""
    res = run("aidaptiv", ["--model", "stories", "--zinit", "--dtype", "fp32", "--steps", "3", "--budget", "0",
                           "--clip", "1e6"], str(tmp_path))
    ext = res["store_extents"]
    assert not [k for k in ext if k.startswith("params/float32/")], sorted(ext)[:5]
    state = sum(n for k, n in ext.items() if not k.startswith(("grad", "params/")))
    assert state >= 24 * res["nparams"]  # master + 2 moments, and their second copy
    assert res["store_high_water"] <= sum(ext.values()) + (1 << 20), (res["store_high_water"], sum(ext.values()))


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
@pytest.mark.parametrize("dtype, clip", [("fp32", 0.0), ("bf16", 1.0)])
def test_the_announced_and_planned_bytes_hold_with_the_parameters_left_to_deepspeed(dtype, clip, tmp_path, capsys):
    """``offload_param`` on ``cpu`` (the optimizer state alone on the cache drive, a common first switch): the
    parameters are DeepSpeed's, never written or read by us, and the start line's and ``aidaptiv-ds plan
    --offload-param cpu``'s bytes per step say so (before, the start line counted them: 24.0 B/param announced
    against 20.0 measured in fp32, found by two new-user trials; the plan charged them to the drives: 16.0 written
    and 14.0 read against 14.0 and 12.0 in bf16 with clipping, and in fp32, whose parameters are read from the
    master slots, the bytes agreed but the parameters were planned on the drives, not in host memory)."""
    p = plan("0", capsys, clip, dtype=dtype, offload_param="cpu")
    res = run("aidaptiv", ["--model", "stories", "--dtype", dtype, "--steps", "4", "--budget", "0",
                           "--clip", str(clip), "--zero", json.dumps({"offload_param": {"device": "cpu"}})],
              str(tmp_path))
    measured = written_per_param_per_step(res)
    steps = res["io"][1:]
    read = sum(d["bytes_read"].get("cache", 0) for d in steps) / len(steps) / res["nparams"]
    announced = res["plan"]["write_bytes_per_step"] / res["nparams"]
    planned_w = p["per_step"]["write_bytes"] / p["n_params"]
    planned_r = p["per_step"]["read_bytes_best"] / p["n_params"]
    print(f"parameters on cpu, {dtype} clip {clip}: announced {announced:.3f} B/param/step written, planned "
          f"{planned_w:.3f}, measured {measured:.3f}; read planned {planned_r:.3f}, measured {read:.3f}")
    assert measured == pytest.approx(announced, rel=0.05)
    assert measured == pytest.approx(planned_w, rel=0.05)
    # read: the plan's (the step inside backward takes the gradients from DRAM); where the clipping norm redoes the
    # first step and the later ones run after backward, they read the gradients back (2 B/param in bf16:
    # read_bytes_after_backward) unless the write-back still has them in DRAM, which depends on its timing
    assert planned_r * 0.95 <= read <= p["per_step"]["read_bytes_after_backward"] / p["n_params"] * 1.05
    assert p["per_step"]["read_bytes_after_backward"] / p["n_params"] == planned_r + (0 if clip == 0 else 2)
    assert p["tiers"]["parameters"]["cache"] == 0 and p["tiers"]["parameters"]["dram"] == p["n_params"] * \
        {"fp32": 4, "bf16": 2}[dtype]
