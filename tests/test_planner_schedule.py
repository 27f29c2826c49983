"""The planner's gradient-accumulation schedules (``aidaptiv_ds.planner.schedule``): the formulas on small
hand-computed cases, the runtime's measured bytes at GA 2 and 4, the 405B case on the Phison server, the
CLI (``--ga``, ``--schedule``, the rates, ``--json``) and the README's rows."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest

from aidaptiv_ds.cli.main import main
from aidaptiv_ds.planner.model_size import preset_shape
from aidaptiv_ds.planner.plan import CacheDrive, PlanInput, make_plan, training_flops_per_token
from aidaptiv_ds.planner.schedule import (
    LAYER_MAJOR,
    MICRO_BATCH_MAJOR,
    RankTraffic,
    Rates,
    layer_major,
    micro_batch_major,
    parse_rate,
    schedule_cost,
    step_time,
)

GB, TB = 10 ** 9, 10 ** 12
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N405 = 405_853_388_800
#: the README's command for the 405B case on the Phison server (2 x 96 GB, 512 GB, one 8 TB drive at 7/6 GB/s)
PHISON_405B = ["plan", "--model", "llama-3.1-405b", "--gpus", "2", "--vram", "96GB", "--dram", "512GB",
               "--cache", "8TB:read=7:write=6", "--ga", "16"]


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


def traffic(k: int) -> RankTraffic:
    """A rank in GB: P 100 read per pass, 100 written; G 50 of gradient slices off DRAM, written at the end
    (clipping on) but not read back (steps inside backward); O 600 of optimizer state, 500 read with the fp32
    master credit; F 30 GB of free budget, W 20 GB of read-ahead; a 10 GB of boundary activations per
    micro-batch; partitions of 120 / 60 GB; 1 / 1.2 PFLOP per micro-batch."""
    return RankTraffic(grad_accum=k, param_read=100 * GB, param_write=100 * GB, grad_slices=50 * GB,
                       grad_final_write=50 * GB, grad_final_read=0, optimizer_read=500 * GB,
                       optimizer_read_full=600 * GB, optimizer_write=600 * GB, dram_free=30 * GB, window=20 * GB,
                       boundary_per_micro_batch=10 * GB, param_partition=120 * GB, grad_partition=60 * GB,
                       flops_micro_batch_major=1e15, flops_layer_major=1.2e15)


# ---------------------------------------------------------------- formulas, by hand

def test_micro_batch_major_by_hand():
    b = micro_batch_major(traffic(4))
    # every micro-batch reads P twice; 3 partial gradient sums written and read back; O without the fp32 credit
    assert b.reads == {"parameters": 800 * GB, "gradients": 150 * GB, "optimizer": 600 * GB, "activations": 0}
    assert b.writes == {"parameters": 100 * GB, "gradients": 200 * GB, "optimizer": 600 * GB, "activations": 0}
    assert b.read_hits == 4 * 50 * GB                    # one backward per micro-batch finds min(F + W, P)
    assert (b.read_bytes, b.read_bytes_best, b.write_bytes) == (1550 * GB, 1350 * GB, 900 * GB)
    assert (b.host_to_device, b.device_to_host, b.flops) == (960 * GB, 240 * GB, 4e15)
    assert b.boundary == {"bytes": 0, "dram": 0, "drive": 0}
    one = micro_batch_major(traffic(1))                  # GA 1: the residency plan's own bytes
    assert one.reads == {"parameters": 200 * GB, "gradients": 0, "optimizer": 500 * GB, "activations": 0}
    assert one.write_bytes == 750 * GB and one.read_hits == 50 * GB


def test_layer_major_by_hand():
    b = layer_major(traffic(4))
    # A = 4 x 10: 30 in the free budget, 10 written in forward and read in backward
    assert b.boundary == {"bytes": 40 * GB, "dram": 30 * GB, "drive": 10 * GB}
    assert b.reads == {"parameters": 200 * GB, "gradients": 0, "optimizer": 500 * GB, "activations": 10 * GB}
    assert b.writes == {"parameters": 100 * GB, "gradients": 50 * GB, "optimizer": 600 * GB, "activations": 10 * GB}
    assert b.read_hits == 20 * GB                        # the budget went to activations: the window only
    assert (b.read_bytes_best, b.write_bytes) == (690 * GB, 760 * GB)
    assert (b.host_to_device, b.device_to_host, b.flops) == (280 * GB, 280 * GB, 4.8e15)
    # what layer-major saves grows with k: 2(k-1)P of parameter reads and 2(k-1)G of partial gradients
    for k in (2, 8, 16):
        m, lm = micro_batch_major(traffic(k)), layer_major(traffic(k))
        act = max(10 * k - 30, 0) * GB
        assert m.read_bytes - lm.read_bytes == 2 * (k - 1) * 100 * GB + (k - 1) * 50 * GB + 100 * GB - act
        assert m.write_bytes - lm.write_bytes == (k - 1) * 50 * GB - act


def test_step_time_by_hand():
    rates = Rates(drives=((0.5, 10.0, 5.0), (0.5, 10.0, 5.0)), ranks=2, link_gbps=28.0, device_flops=1e14)
    t = step_time(layer_major(traffic(4)), rates)
    # per drive: half of 2 x 690 GB read at 10 GB/s + half of 2 x 760 GB written at 5 GB/s = 69 + 152 s
    assert t["drive_s"] == pytest.approx(221.0)
    assert t["link_s"] == pytest.approx(10.0)             # 280 GB each way at 28 GB/s, full duplex
    assert t["compute_s"] == pytest.approx(48.0)          # 4.8e15 / 1e14
    assert t["estimate_s"] == pytest.approx(221.0) and t["bound_by"] == "drives"
    assert t["serial_s"] == pytest.approx(279.0)
    # no link and no compute rate (CPU ranks without --gpu-tflops): the drives alone
    t = step_time(layer_major(traffic(4)), Rates(drives=((1.0, 10.0, 5.0),), ranks=1, link_gbps=None,
                                                  device_flops=None))
    assert (t["link_s"], t["compute_s"]) == (None, None)
    assert t["estimate_s"] == t["serial_s"] == pytest.approx(69.0 + 152.0)
    # a fast drive and a slow one: the slower share sets the time
    t = step_time(micro_batch_major(traffic(1)), Rates(drives=((0.75, 12.0, 12.0), (0.25, 2.0, 2.0)), ranks=1,
                                                       link_gbps=None, device_flops=None))
    assert t["drive_s"] == pytest.approx(0.25 * (650 + 750) / 2.0)


def test_schedule_cost_is_per_node_and_per_param():
    rates = Rates(drives=((1.0, 7.0, 6.0),), ranks=2, link_gbps=25.0, device_flops=5e14)
    c = schedule_cost(LAYER_MAJOR, traffic(4), rates, nodes=3, n_params=10 ** 12)
    assert c["write_bytes"] == 2 * 760 * GB and c["read_bytes_best"] == 2 * 690 * GB
    assert c["boundary_activations"] == {"bytes": 80 * GB, "dram": 60 * GB, "drive": 20 * GB}
    assert c["write_bytes_per_param"] == pytest.approx(3 * 2 * 760 * GB / 10 ** 12)
    assert c["link_per_rank"] == {"host_to_device": 280 * GB, "device_to_host": 280 * GB}
    with pytest.raises(ValueError, match="--schedule: 'diagonal'"):
        schedule_cost("diagonal", traffic(4), rates)


def test_parse_rate():
    assert parse_rate("pcie5", {"pcie5": 50.0}, "--pcie-gbps") == 50.0
    assert parse_rate("12.5", {}, "--pcie-gbps") == 12.5
    for bad in ("fast", "0", "-3", "inf", "nan"):
        with pytest.raises(ValueError, match="--pcie-gbps"):
            parse_rate(bad, {"pcie4": 25.0}, "--pcie-gbps")


# ---------------------------------------------------------------- what the runtime does (measured)

def stories_plan(ga: int, dtype: str, clip: float) -> dict:
    """The plan of the runs that measured the runtime's bytes (tests/test_plan_vs_measurement.py's setup)."""
    shape = preset_shape("stories260k")
    p = make_plan(PlanInput(shape=shape, gpus=1, vram=0, dram=24 * 2 ** 30, drives=[CacheDrive(10 * GB)],
                            dram_budget=0, dtype=dtype, micro_batch=2, seq_len=24, grad_accum=ga, cpu_ranks=True,
                            gradient_clipping=clip))
    return p.as_dict()


@pytest.mark.parametrize("dtype, clip, measured", [
    # written B/param/step by the ledger, stories260K, --cpu-ranks, budget 0, steps 2-4, at GA 1 / 2 / 4
    # (tests/scripts/train_oracle.py --model stories --zinit --budget 0 --ga K --clip C; grad_spilled_bytes
    # 0/2/6 and 2/4/8 B/param in bf16): each micro-batch but the last writes the partial gradient sum
    ("bf16", 0.0, (14.003, 16.004, 20.005)), ("bf16", 1e6, (16.004, 18.004, 22.005)),
    ("fp32", 0.0, (12.003, 16.004, 24.006)), ("fp32", 1e6, (16.004, 20.005, 28.007)),
])
def test_micro_batch_major_writes_equal_the_measured_runtime(dtype, clip, measured):
    for ga, m in zip((1, 2, 4), measured, strict=True):
        p = stories_plan(ga, dtype, clip)
        mbm = p["schedules"][MICRO_BATCH_MAJOR]
        assert p["per_step"]["write_bytes"] == mbm["write_bytes"]          # the plan's bytes are this schedule's
        assert mbm["write_bytes_per_param"] == pytest.approx(m, rel=0.002), (dtype, clip, ga)
        grad = 2 if dtype == "bf16" else 4
        assert mbm["writes"]["gradients"] / p["n_params"] == pytest.approx((ga - 1 + (clip > 0)) * grad, rel=1e-9)


def test_fp32_master_credit_only_at_ga_1():
    """The fp32 step inside backward takes its master weights from backward's parameter reads at GA 1 only
    (measured ``master_from_params_bytes``: 4.0 B/param at GA 1, 0 at GA 2 and 4); layer-major keeps it."""
    one, two = stories_plan(1, "fp32", 0.0)["schedules"], stories_plan(2, "fp32", 0.0)["schedules"]
    n = 260_032
    assert one[MICRO_BATCH_MAJOR]["reads"]["optimizer"] / n == pytest.approx(8.0, rel=1e-3)
    assert two[MICRO_BATCH_MAJOR]["reads"]["optimizer"] / n == pytest.approx(12.0, rel=1e-3)
    assert two[LAYER_MAJOR]["reads"]["optimizer"] / n == pytest.approx(8.0, rel=1e-3)


def test_kept_gradients_are_not_read_back_by_a_step_inside_backward():
    """With clipping on, the steps inside backward keep their gradients on the drive for a redo but step from
    the DRAM copy: the ledger reads 14.003 B/param/step in bf16 with clipping on as with it off (stories260K,
    budget 0, GA 1); the plan said 16 before it modelled that."""
    for clip in (0.0, 1e6):
        p = stories_plan(1, "bf16", clip)
        assert p["residency"]["step_in_backward"]
        assert p["per_step"]["read_bytes_best"] / p["n_params"] == pytest.approx(14.0, rel=1e-9)
        assert p["schedules"][MICRO_BATCH_MAJOR]["reads"]["gradients"] == 0


# ---------------------------------------------------------------- the 405B case

def test_405b_ga16_on_the_phison_server():
    p = make_plan(PlanInput(shape=preset_shape("llama-3.1-405b"), gpus=2, vram=96 * GB, dram=512 * GB,
                            drives=[CacheDrive(8 * TB, read_gbps=7, write_gbps=6)], grad_accum=16))
    assert p.fits and p.schedules is not None
    s = p.schedules
    assert s["shown"] == [MICRO_BATCH_MAJOR, LAYER_MAJOR]
    m, lm = s[MICRO_BATCH_MAJOR], s[LAYER_MAJOR]
    # the drive has no room for a second copy of the optimizer state: steps after backward, gradients kept
    assert not p.residency["step_in_backward"] and not p.residency["params_resident"]
    assert p.residency["resident_subgroups"] == []
    # parameters: 2 B x N, read twice per micro-batch (16 x 2 x 811.7 GB = 26 TB) against twice per step
    assert m["reads"]["parameters"] == 2 * 16 * 2 * N405 and lm["reads"]["parameters"] == 2 * 2 * N405
    assert m["writes"]["parameters"] == lm["writes"]["parameters"] == 2 * N405
    # optimizer state: 12 B x N, once per step either way (4.87 TB)
    assert m["writes"]["optimizer"] == lm["writes"]["optimizer"] == m["reads"]["optimizer"] == 12 * N405
    # gradients: what the budget does not hold, written and read 16 times against once (568 GB: the budget
    # leaves room for each rank's process peak, 109.6 GB with DeepSpeed's sub-groups as built: issue 34)
    g = lm["writes"]["gradients"]
    assert 560 * GB < g < 575 * GB and lm["reads"]["gradients"] == g
    assert m["writes"]["gradients"] == m["reads"]["gradients"] == 16 * g
    # boundary activations: 16 micro-batches x 4096 tokens x 16384 x 2 B x 126 blocks per GPU, 2 GPUs
    a = lm["boundary_activations"]
    assert a["bytes"] == 2 * 16 * 4096 * 16384 * 2 * 126 == 541_165_879_296
    assert a["dram"] == 2 * p.residency["cache_bytes"] and a["drive"] == a["bytes"] - a["dram"]
    assert lm["writes"]["activations"] == lm["reads"]["activations"] == a["drive"]
    assert m["read_bytes_best_per_param"] == pytest.approx(98.0, abs=0.05)
    assert m["write_bytes_per_param"] == pytest.approx(36.6, abs=0.05)
    assert lm["read_bytes_best_per_param"] == pytest.approx(18.7, abs=0.05)
    assert lm["write_bytes_per_param"] == pytest.approx(16.7, abs=0.05)
    # step time: drives at 7 / 6 GB/s, the pcie4 preset, an H100 SXM's 989 TFLOP/s at 50%
    for c in (m, lm):
        t = c["step_time"]
        assert t["drive_s"] == pytest.approx(c["read_bytes_best"] / 7e9 + c["write_bytes"] / 6e9)
        assert t["link_s"] == pytest.approx(max(c["link_per_rank"].values()) / 25e9)
        assert t["bound_by"] == "drives" and t["estimate_s"] == t["drive_s"]
    flops = training_flops_per_token(preset_shape("llama-3.1-405b"), N405, 4096, True) * 4096 * 16
    assert m["step_time"]["compute_s"] == lm["step_time"]["compute_s"] == pytest.approx(flops / (989e12 * 0.5))
    assert m["step_time"]["estimate_s"] == pytest.approx(8153, rel=1e-3)      # 2.26 h
    assert lm["step_time"]["estimate_s"] == pytest.approx(2216, rel=1e-3)     # 36.9 min
    assert s["layer_major_speedup"] == pytest.approx(3.68, abs=0.01)
    # GA 1 is what it was: the residency plan's bytes, "step time >= 17.4 min"
    one = make_plan(PlanInput(shape=preset_shape("llama-3.1-405b"), gpus=2, vram=96 * GB, dram=512 * GB,
                              drives=[CacheDrive(8 * TB)]))
    assert one.per_step["write_bytes"] == 2 * one.residency["write_bytes_per_step"]
    assert one.step_time["lower_bound_s"] / 60 == pytest.approx(17.4, abs=0.05)


# ---------------------------------------------------------------- CLI and README

def test_cli_ga_schedule_and_rates():
    rc, out = run_cli(*PHISON_405B, "--json")
    d = json.loads(out)
    assert rc == 0 and d["inputs"]["grad_accum"] == 16 and d["per_step"]["tokens"] == 16 * 4096 * 2
    s = d["schedules"]
    for name in (MICRO_BATCH_MAJOR, LAYER_MAJOR):
        for key in ("reads", "writes", "read_bytes", "read_bytes_best", "write_bytes", "boundary_activations",
                    "link_per_rank", "flops_per_rank", "step_time", "write_bytes_per_param", "cache_fits"):
            assert key in s[name], (name, key)
    assert s["rates"]["link_source"] == "preset pcie4" and s["rates"]["peak_source"] == "preset h100-sxm"
    assert any("--pcie-gbps" in a for a in d["inputs"]["assumed"])
    rc, out = run_cli(*PHISON_405B, "--schedule", "layer-major", "--pcie-gbps", "pcie5", "--gpu-tflops", "312",
                      "--mfu", "0.4", "--json")
    s = json.loads(out)["schedules"]
    assert s["shown"] == [LAYER_MAJOR] and MICRO_BATCH_MAJOR not in s and "layer_major_speedup" not in s
    assert (s["rates"]["link_gbps"], s["rates"]["peak_flops"], s["rates"]["device_flops"]) == (50.0, 312e12,
                                                                                               312e12 * 0.4)
    rc, text = run_cli(*PHISON_405B, "--schedule", "micro-batch-major")
    assert "schedules  GA 16" in text and "GA 16, micro-batch-major:" in text and "layer-major" not in text


def test_cli_schedule_errors_name_the_flag(capsys):
    base = ["plan", "--params", "1e9", "--gpus", "1", "--vram", "80GB", "--dram", "64GB", "--cache", "1TB"]
    assert main(base + ["--pcie-gbps", "fast"]) == 2
    assert "--pcie-gbps: 'fast'" in capsys.readouterr().err
    assert main(base + ["--gpu-tflops", "b300"]) == 2
    assert "--gpu-tflops: 'b300'" in capsys.readouterr().err
    assert main(base + ["--mfu", "1.5"]) == 2
    assert "--mfu: 1.5" in capsys.readouterr().err
    assert main(base + ["--ga", "0"]) == 2
    assert "--grad-accum: 0" in capsys.readouterr().err


def test_cli_cpu_ranks_estimate_without_link_or_compute():
    rc, out = run_cli("plan", "--params", "7e9", "--cache", "2TB", "--cpu-ranks", "--dram", "256GB", "--ga", "4",
                      "--json")
    s = json.loads(out)["schedules"]
    for name in (MICRO_BATCH_MAJOR, LAYER_MAJOR):
        t = s[name]["step_time"]
        assert (t["link_s"], t["compute_s"], t["bound_by"]) == (None, None, "drives")
    assert s["rates"]["link_source"] == "none (CPU ranks)"


def test_readme_rows_are_the_tools_output():
    """The README's planner table quotes ``schedule_summary`` of the 405B GA 16 command as printed; after a
    change to the planner, rerun the command and paste the two lines."""
    rc, text = run_cli(*PHISON_405B)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("GA 16, ")]
    assert [ln.split(":")[0] for ln in lines] == [f"GA 16, {MICRO_BATCH_MAJOR}", f"GA 16, {LAYER_MAJOR}"]
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert "aidaptiv-ds " + " ".join(PHISON_405B) in readme
    rows = re.findall(r"^\|[^|\n]*GA 16[^|\n]*\| (.*) \|$", readme, re.M)
    assert rows == lines


def test_cpu_rank_host_memory_of_each_schedule():
    """On CPU ranks each schedule has the rank's host bytes besides the budget: micro-batch-major the plan's own
    figure; layer-major the same working set with one block's activations, one micro-batch's logits and 4k block
    inputs in place of one micro-batch's activations, whatever the activation-checkpointing setting (it
    recomputes every block); the CLI prints both."""
    from aidaptiv_ds.planner.plan import CPU_LOSS_BYTES_PER_LOGIT, cpu_rank_host_bytes, layer_activation_bytes
    shape = preset_shape("stories260k")
    x = 2 * 24 * shape.hidden_size * 4  # one block's input: micro-batch 2 x seq 24 x hidden x fp32
    got = []
    for ac in (False, True):
        inp = PlanInput(shape=shape, gpus=1, vram=0, dram=24 * 2 ** 30, drives=[CacheDrive(10 * GB)], dram_budget=0,
                        dtype="fp32", micro_batch=2, seq_len=24, grad_accum=4, cpu_ranks=True,
                        activation_checkpointing=ac)
        p = make_plan(inp)
        s = p.schedules
        assert s[MICRO_BATCH_MAJOR]["rank_host_bytes"] == p.cpu_rank_host["total"]
        lm = s[LAYER_MAJOR]["rank_activations"]
        assert lm["block"] == layer_activation_bytes(shape, 24, 2) * 4 // 2  # fp32: twice the 16-bit figure
        assert lm["logits"] == 2 * 24 * shape.vocab_size * (4 + CPU_LOSS_BYTES_PER_LOGIT)
        assert lm["handed"] == lm["boundary_window"] == 2 * 4 * x
        assert lm["total"] == lm["block"] + lm["logits"] + 4 * 4 * x
        assert s[LAYER_MAJOR]["rank_host_bytes"] == cpu_rank_host_bytes(inp, None, lm["total"])["total"]
        got.append(s[LAYER_MAJOR]["rank_host_bytes"])
    assert got[0] == got[1]
    rc, out = run_cli("plan", "--params", "7e9", "--cache", "2TB", "--cpu-ranks", "--dram", "256GB", "--ga", "4")
    assert rc == 0 and "host memory per rank" in out


def test_the_drive_lines_read_what_the_step_line_reads():
    """Each drive's reads a step are its share of the plan's ``read_bytes_best`` (the figure its read time is
    computed from), not the figure where no read finds its bytes in DRAM: two figures for one quantity read as a
    contradiction on ``aidaptiv-ds plan``'s drive and per-step lines."""
    p = make_plan(PlanInput(shape=preset_shape("llama-3.1-405b"), gpus=2, vram=96 * GB, dram=512 * GB,
                            drives=[CacheDrive(8 * TB, read_gbps=7, write_gbps=6)] * 2, grad_accum=16))
    d = p.as_dict()
    assert d["per_step"]["read_bytes"] > d["per_step"]["read_bytes_best"]  # the read-ahead's hits count here
    assert sum(dr.read_bytes_per_step for dr in p.drives) == pytest.approx(d["per_step"]["read_bytes_best"], abs=2)
    for dr in p.drives:
        assert dr.read_time_s == pytest.approx(dr.read_bytes_per_step / (dr.read_gbps * 1e9), rel=1e-6)
