"""``aidaptiv-ds plan --cpu-ranks``: training on the CPU needs no GPU flags, shows no VRAM, and its fixes are true.

On CPU ranks what a GPU would hold (gathered slices, activations) is host memory, outside the DRAM
budget; gradients live in the tiers (no flat host gradient buffer on our backend) with only their open
window in the working set; the verdict's changes are re-planned together and must fit.
"""
from __future__ import annotations

import dataclasses

import pytest

from aidaptiv_ds.cli.main import main
from aidaptiv_ds.planner.model_size import nearest_preset, preset_shape
from aidaptiv_ds.planner.plan import CacheDrive, PlanInput, make_plan
from aidaptiv_ds.telemetry.nvml import nvml_status

GB, TB = 10**9, 10**12
HOST = 25_280_000_000  # this machine's MemTotal, about


def _dram_is_true(p) -> bool:
    """Margin + working set (which holds the gradient window and the compute memory on CPU ranks)
    + what the residency plan keeps in DRAM fits the host."""
    resident = sum(t["dram"] for k, t in p.tiers.items() if k != "activations")
    return p.dram["margin_bytes"] + p.dram["working_set_bytes"] + resident <= p.inputs["dram"]


def test_7b_on_a_25_gb_host_gets_a_fix_that_really_fits():
    inp = PlanInput(shape=nearest_preset(int(7e9)), n_params=int(7e9), gpus=1, vram=0, dram=HOST,
                    drives=[CacheDrive(270 * GB)], cpu_ranks=True)
    p = make_plan(inp)
    assert not p.fits and not p.verdict.checks["dram"] and p.verdict.checks["vram"]
    dram_fix = p.verdict.changes[0]
    # DeepSpeed's 14 GB flat gradient buffer is not allocated on our backend (it was the reason for
    # "1e7 elements and 1024 tokens" before the gradient store): smaller sub-groups are enough
    assert dram_fix == "reduce sub_group_size to 2e+08 elements"
    assert "flat gradient buffer" not in p.verdict.problems[0]
    assert p.verdict.fits_after_changes is True
    fixed = make_plan(dataclasses.replace(inp, sub_group_size=2 * 10**8, drives=[CacheDrive(270 * GB)] * 2))
    assert fixed.fits and _dram_is_true(fixed)


@pytest.mark.parametrize("model, dram, drives", [("llama-3.1-70b", 512 * GB, [CacheDrive(8 * TB)]),
                                                 ("llama-2-7b", 64 * GB, [CacheDrive(2 * TB)]),
                                                 ("llama-3.1-8b", 24 * GB, [CacheDrive(2 * TB)])])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cpu_rank_plans_that_fit_are_true(model, dram, drives, dtype):
    inp = PlanInput(shape=preset_shape(model), gpus=1, vram=0, dram=dram, drives=drives, cpu_ranks=True,
                    dtype=dtype, seq_len=2048)
    p = make_plan(inp)
    # gradients in the accumulation dtype, split between DRAM and the cache tier by the residency plan;
    # consumed by the optimizer steps inside backward (no clipping): only resident sub-groups' slices remain
    g = p.tiers["gradients"]
    if p.residency["step_in_backward"]:
        assert g["cache"] == 0 and g["dram"] <= p.n_params * (2 if dtype == "bf16" else 4)
    else:
        assert g["dram"] + g["cache"] == pytest.approx(p.n_params * (2 if dtype == "bf16" else 4), rel=0.01)
    assert p.tiers["activations"]["vram"] == 0
    if p.fits:
        assert _dram_is_true(p)
    else:
        assert p.verdict.fits_after_changes in (True, None)
        assert all(c for c in p.verdict.changes) == (p.verdict.fits_after_changes is True)


def test_cli_cpu_ranks_needs_no_gpu_flags_and_prints_no_vram(capsys):
    rc = main(["plan", "--params", "7e9", "--cache", "80GB", "--cpu-ranks", "--dram", "25GB"])
    out = capsys.readouterr().out
    assert rc == 1 and "VRAM" not in out and "vram" not in out
    assert "1 CPU rank(s)" in out and "re-planned with that change: FITS" in out
    rc = main(["plan", "--params", "1e9", "--cache", "4TB", "--cpu-ranks", "2", "--dram", "512GB", "--json"])
    assert rc == 0 and '"gpus": 2' in capsys.readouterr().out


def test_cli_without_gpu_flags_on_a_cpu_host_names_cpu_ranks(capsys):
    if nvml_status()["gpus"]:
        pytest.skip("this host has a GPU: the flags default from NVML")
    assert main(["plan", "--params", "7e9", "--cache", "/tmp"]) == 2
    err = capsys.readouterr().err
    assert "--gpus N --vram SIZE" in err and "--cpu-ranks" in err


def test_cli_cpu_ranks_and_gpus_must_agree(capsys):
    assert main(["plan", "--params", "1e9", "--cache", "4TB", "--cpu-ranks", "2", "--gpus", "4", "--dram", "64GB"]) == 2
    assert "disagree" in capsys.readouterr().err


def test_a_cpu_ranks_activations_and_logits_are_its_own():
    """Issue 34: on a CPU rank activations are host memory in the model dtype (fp32: twice the 16-bit figure a
    GPU's plan counts), and the logits of every token the LM head computes come with the loss's fp32 copies
    (measured: 4.05 x the fp32 logits at the peak of an LM head + cross-entropy backward); fewer tokens when
    the loss takes logits at the response positions only (``--logits-tokens``)."""
    from aidaptiv_ds.planner.plan import CPU_LOSS_BYTES_PER_LOGIT, activation_bytes

    shape = preset_shape("smollm2-135m")
    base = dict(shape=shape, gpus=1, vram=0, dram=HOST, drives=[CacheDrive(270 * GB)], cpu_ranks=True,
                dtype="fp32", seq_len=512, micro_batch=4, dram_budget=0, activation_checkpointing=False)
    full = make_plan(PlanInput(**base)).cpu_rank_host
    gpu_act = activation_bytes(shape, 512, 4, False, True, False)
    assert full["activations"] == 2 * gpu_act["layers"] + 2048 * shape.vocab_size * (4 + CPU_LOSS_BYTES_PER_LOGIT)
    kept = make_plan(PlanInput(**base, logits_tokens=700)).cpu_rank_host
    assert full["activations"] - kept["activations"] == (2048 - 700) * shape.vocab_size * 16
    ckpt = make_plan(PlanInput(**{**base, "activation_checkpointing": True}, logits_tokens=700)).cpu_rank_host
    assert ckpt["activations"] < kept["activations"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_riding_window_is_planned_where_the_runtime_rides(dtype):
    """``step_rides_forward``: the planner counts the riding window only where the runtime rides
    (``planner.auto.rides_forward``, asked by both): ``true`` on a CPU rank, never ``"auto"`` there
    ([Note: riding on CPU ranks]), never with fp16 (its loss scaler keeps the updates in ``step()``)."""
    base = dict(shape=preset_shape("smollm2-135m"), gpus=1, vram=0, dram=HOST, drives=[CacheDrive(270 * GB)],
                cpu_ranks=True, dtype=dtype, seq_len=512, micro_batch=4, dram_budget=0, gradient_clipping=1.0)
    host = {mode: make_plan(PlanInput(**base, step_rides_forward=mode)).cpu_rank_host
            for mode in ("auto", False, True)}
    assert host["auto"] == host[False] and host[False]["riding"] == 0
    if dtype == "fp16":
        assert host[True] == host[False]
    else:  # two sub-group slices and the step's temporaries in the forward phase
        assert host[True]["riding"] > 0 and host[True]["forward"] > host[False]["forward"]
