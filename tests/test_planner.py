"""Capacity planner: model sizes, the public reference points, the verdict, the CLI, the runtime defaults."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os

import pytest
import torch
from _oracle import STORIES, STORIES_ABSENT

from aidaptiv_ds.cli.main import main
from aidaptiv_ds.cli.plan import parse_cache_spec
from aidaptiv_ds.planner import auto
from aidaptiv_ds.planner.model_size import (PRESETS, load_model_shape, nearest_preset, preset_shape,
                                            shape_from_config)
from aidaptiv_ds.planner.auto import RANK_OVERHEAD_BYTES
from aidaptiv_ds.planner.plan import (CacheDrive, PlanInput, activation_bytes, layer_activation_bytes, make_plan,
                                      state_sizes_for_rank, usable_cache_bytes)
from aidaptiv_ds.planner.residency import StateSizes, plan_residency
from aidaptiv_ds.units import GiB

GB, TB = 10 ** 9, 10 ** 12
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Published parameter counts (model cards / safetensors index total_size / bytes per element).
PUBLISHED = {"llama-3.1-405b": 405_853_388_800, "llama-3.1-70b": 70_553_706_496, "llama-3.1-8b": 8_030_261_248,
             "llama-2-70b": 68_976_648_192, "llama-2-7b": 6_738_415_616, "mistral-7b": 7_241_732_096,
             "qwen2.5-7b": 7_615_616_512, "smollm2-135m": 134_515_008, "stories260k": 260_032,
             "pythia-160m": 162_322_944, "gpt2": 124_439_808}


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


# ---------------------------------------------------------------- model sizes

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_counts_match_published(name):
    assert preset_shape(name).n_params == PUBLISHED[name]


SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 100}


@pytest.mark.parametrize("cfg", [
    {"model_type": "llama", **SMALL, "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True},
    {"model_type": "llama", **SMALL, "num_key_value_heads": 1, "tie_word_embeddings": True},
    {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2},
    {"model_type": "qwen3", **SMALL, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False},
    {"model_type": "mistral", **SMALL, "num_key_value_heads": 2},
    {"model_type": "gpt_neox", **SMALL},
    {"model_type": "gpt_neox", **SMALL, "attention_bias": False, "tie_word_embeddings": True},
    {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 32,
     "bos_token_id": 0, "eos_token_id": 0},
], ids=lambda c: c["model_type"])
def test_tensors_equal_transformers_model(cfg):
    """Every tensor name and shape equals the HF model's parameters (built on the meta device), in the same
    order: DeepSpeed packs them into sub-groups in that order, which the planner's working set follows."""
    transformers = pytest.importorskip("transformers")
    conf = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(conf)
    ref = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    shape = shape_from_config(conf.to_dict())
    assert [(t.name, t.shape) for t in shape.tensors()] == ref
    assert shape.n_params == sum(p.numel() for p in model.parameters())


def test_stories260k_count_equals_safetensors():
    cfg = os.path.join(STORIES, "config.json")
    st = os.path.join(STORIES, "model.safetensors")
    if not (os.path.isfile(cfg) and os.path.isfile(st)):
        pytest.skip(STORIES_ABSENT)
    from safetensors import safe_open
    with safe_open(st, "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    shape = load_model_shape(cfg)
    assert shape.n_params == sum(math.prod(s) for s in shapes.values()) == 260_032
    assert {t.name: t.shape for t in shape.tensors()} == shapes
    assert load_model_shape(STORIES).n_params == shape.n_params      # a model directory works too


def test_unknown_model_and_preset_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type 'mamba' is not supported.*--params"):
        shape_from_config({"model_type": "mamba"})
    with pytest.raises(ValueError, match="presets: .*llama-3.1-405b"):
        load_model_shape("no-such-model")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_model_shape(str(tmp_path))
    with pytest.raises(ValueError, match="intermediate_size"):
        shape_from_config({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "vocab_size": 10})


def test_nearest_preset():
    assert nearest_preset(405e9).name == "llama-3.1-405b"
    assert nearest_preset(7.9e9).name == "llama-3.1-8b"
    with pytest.raises(ValueError, match="--params"):
        nearest_preset(0)


# ---------------------------------------------------------------- formulas

def test_activation_formula_reduces_to_korthikanti():
    """f = 4h, MHA, dropout, no flash attention: s*b*h*(34 + 5*a*s/h) per layer (Korthikanti 2022, eq. 1)."""
    cfg = {"model_type": "gpt_neox", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 2,
           "num_attention_heads": 16, "vocab_size": 1000}
    shape = shape_from_config(cfg)
    s, b, h, a = 2048, 2, 1024, 16
    assert layer_activation_bytes(shape, s, b, flash_attention=False, dropout=True) == s * b * h * (34 + 5 * a * s // h)
    act = activation_bytes(shape, s, b, checkpointing=True)
    assert act["layers"] == 2 * (2 * s * b * h) + layer_activation_bytes(shape, s, b)
    assert act["logits"] == s * b * 1000 * 6


def test_state_sizes_for_rank():
    s = state_sizes_for_rank(10_000_000_001, dp=4, param_bytes=2, moment_bytes=8, sub_group_size=10 ** 9)
    numel = 2_500_000_001
    assert s.param_bytes == 2 * numel and s.grad_bytes == 2 * numel  # gradients accumulate in bf16 (DeepSpeed's default)
    assert s.subgroup_bytes == [12 * 10 ** 9] * 2 + [12 * 500_000_001]
    assert s.subgroup_grad_bytes == [2 * 10 ** 9] * 2 + [2 * 500_000_001]
    assert s.total == 16 * numel


def test_usable_cache_follows_striping():
    same = [CacheDrive(2 * TB), CacheDrive(2 * TB)]
    assert 3.99 * TB < usable_cache_bytes(same) <= 4 * TB
    # a fast small drive with a slow big one: weighted RAID-0 is limited by the small drive's share
    mixed = [CacheDrive(1 * TB, read_gbps=14, write_gbps=12), CacheDrive(4 * TB, read_gbps=3.5, write_gbps=3)]
    assert usable_cache_bytes(mixed) < 1.3 * TB


# ---------------------------------------------------------------- reference points

def ref_405b(drives, dram=512 * GB):
    return PlanInput(shape=preset_shape("llama-3.1-405b"), gpus=2, vram=96 * GB, dram=dram, drives=drives)


def test_405b_on_2x96gb_with_8tb_fits():
    p = make_plan(ref_405b([CacheDrive(8 * TB)]))
    assert p.fits, p.verdict.problems
    assert p.state_bytes_per_param == 16  # bf16 parameter + bf16 gradient + fp32 master and moments
    assert 16.0 <= p.bytes_per_param <= 20.5                           # Phison: "about 20 B/param"
    assert 6.4 * TB <= p.total_state_bytes <= 8.2 * TB                 # "405B ~ 8 TB"
    assert p.rule_of_thumb_bytes == 20 * 405_853_388_800
    # what lives where: all 16 B/param are in DRAM or on the cache drive
    state = sum(t["dram"] + t["cache"] for k, t in p.tiers.items() if k != "activations")
    assert state == 16 * 405_853_388_800
    assert p.vram_per_gpu["total"] <= 96 * GB
    # DeepSpeed writes 18 B/param per step; the DRAM budget saves some of it, never adds
    assert 0 < p.per_step["write_bytes"] < 18 * p.n_params
    assert p.per_step["write_bytes"] == p.residency["write_bytes_per_step"] * 2   # from plan_residency, 2 ranks
    assert p.step_time["bound_by"] == "cache writes"
    assert p.step_time["lower_bound_s"] == pytest.approx(p.per_step["write_bytes"] / 6e9)


def test_405b_verdict_follows_from_each_ranks_process_peak():
    """Issue 34: the DRAM check counts each rank's host memory in every phase of the process (the model built
    under zero.Init, deepspeed.initialize, the steps), not the steps alone, and the verdict follows from the
    peak: 2 ranks x 96 GB GPUs, 512 GB DRAM, 8 TB fits; a host without room for the margin and both ranks'
    peak does not."""
    p = make_plan(ref_405b([CacheDrive(8 * TB)]))
    rh = p.rank_host
    assert set(rh) == {"construction", "initialization", "steps", "peak"}
    assert rh["peak"] == max(rh["construction"], rh["initialization"], rh["steps"])
    # construction: one whole parameter on the GPU; its partition (the 128256 x 16384 embedding over 2 ranks,
    # bf16) copied to the host and staged once, beside the rank's allowance
    emb_part = -(-128256 * 16384 // 2) * 2
    assert rh["construction"] == RANK_OVERHEAD_BYTES + 2 * emb_part
    # initialization and the steps hold one / three of the largest sub-group (a sub-group holds whole
    # partitions: DeepSpeed's default 1e9 elements plus up to one partition)
    from aidaptiv_ds.planner.plan import rank_state

    st = rank_state(ref_405b([CacheDrive(8 * TB)]))
    sg = max(st.subgroup_numels)
    assert 10**9 <= sg < 2.1e9 and rh["initialization"] < rh["steps"]
    # the steps as the runtime counts them (planner/working_set.py, one function for both): the allowance, two
    # staged partitions, the optimizer pipeline's three sub-groups (4 B master + 8 B moments + 4 B gradient)
    # and the gradient window, two sub-groups' bf16 accumulation slices (GradientStore.window_bytes); no master
    # hold (bf16 parameters are not read from their master slots)
    assert rh["steps"] == (RANK_OVERHEAD_BYTES + 2 * st.staging_partition_bytes + 3 * sg * 16
                           + 2 * -(-sg * 2 // 4096) * 4096)
    assert p.dram["working_set_bytes"] == 2 * rh["peak"]
    need = p.dram["margin_bytes"] + 2 * rh["peak"]
    assert p.fits and need <= 512 * GB
    # the margin is 10% of the host: 2 x peak / 0.95 leaves less than that beside both peaks, / 0.85 more
    assert not make_plan(ref_405b([CacheDrive(8 * TB)], dram=int(2 * rh["peak"] / 0.95))).verdict.checks["dram"]
    assert make_plan(ref_405b([CacheDrive(8 * TB)], dram=int(2 * rh["peak"] / 0.85))).verdict.checks["dram"]


def test_405b_fits_even_without_dram_budget():
    p = make_plan(ref_405b([CacheDrive(8 * TB)], dram=256 * GB))
    assert p.fits, p.verdict.problems


def test_70b_on_4x48gb_512gb_2x2tb_fits():
    p = make_plan(PlanInput(shape=preset_shape("llama-2-70b"), gpus=4, vram=48 * GB, dram=512 * GB,
                            drives=[CacheDrive(2 * TB), CacheDrive(2 * TB)]))
    assert p.fits, p.verdict.problems
    assert 1.05 * TB < p.total_state_bytes < 1.4 * TB  # 16 B/param (bf16 gradients) + activations
    assert [d.share for d in p.drives] == [0.5, 0.5]
    assert sum(d.write_bytes_per_step for d in p.drives) == p.per_step["write_bytes"]
    assert p.residency["grads_resident"]  # 17.5 GB/rank of bf16 gradient slices first (never written)


def test_405b_on_one_2tb_drive_does_not_fit():
    p = make_plan(ref_405b([CacheDrive(2 * TB)]))
    assert not p.fits
    assert p.verdict.checks == {"vram": True, "dram": True, "cache": False}
    assert len(p.verdict.problems) == 1 and p.verdict.problems[0].startswith("cache capacity")
    assert "2.00 TB" in p.verdict.problems[0]
    assert p.verdict.smallest_change == "add 3 cache drives of 2.00 TB (4 in all)"
    fixed = make_plan(ref_405b([CacheDrive(2 * TB)] * 4))
    assert fixed.fits


def test_vram_problem_names_the_smallest_change():
    base = dict(shape=preset_shape("llama-3.1-8b"), gpus=1, vram=24 * GB, dram=128 * GB, drives=[CacheDrive(2 * TB)])
    p = make_plan(PlanInput(**base, activation_checkpointing=False))
    assert p.verdict.checks == {"vram": False, "dram": True, "cache": True}
    assert "vram: one GPU needs" in p.verdict.problems[0]
    assert p.verdict.smallest_change == "enable activation checkpointing"
    p = make_plan(PlanInput(**base, micro_batch=8, grad_accum=2))
    assert not p.verdict.checks["vram"]
    change = p.verdict.smallest_change
    assert change.startswith("reduce micro-batch to ")
    mb = int(change.split()[3])
    assert mb < 8 and make_plan(PlanInput(**base, micro_batch=mb, grad_accum=16 // mb)).fits
    assert not make_plan(PlanInput(**base, micro_batch=mb * 2)).verdict.checks["vram"]      # the largest that fits
    p = make_plan(PlanInput(**base, micro_batch=4, seq_len=8192, activation_checkpointing=False))
    assert p.verdict.smallest_change.startswith("enable activation checkpointing and reduce micro-batch to")


def test_dram_problem():
    p = make_plan(PlanInput(shape=preset_shape("llama-3.1-70b"), gpus=8, vram=80 * GB, dram=128 * GB,
                            drives=[CacheDrive(8 * TB)]))
    assert not p.verdict.checks["dram"]
    assert "dram: the host needs" in p.verdict.problems[0]
    assert p.verdict.changes[0].startswith("reduce sub_group_size to")
    # a sub-group holds whole partitions (DeepSpeed's _create_fp16_sub_groups): the embedding's 131M-element
    # partition per rank is a floor no sub_group_size goes under, so 64 GB for 8 ranks takes more DRAM
    p = make_plan(PlanInput(shape=preset_shape("llama-3.1-70b"), gpus=8, vram=80 * GB, dram=64 * GB,
                            drives=[CacheDrive(8 * TB)]))
    assert p.verdict.changes[0].startswith("use ") and "of DRAM or more" in p.verdict.changes[0]


def test_sub_groups_are_deepspeeds():
    """DeepSpeed closes a sub-group once it holds sub_group_size elements or more (stage3.py
    _create_fp16_sub_groups): a sub-group reaches sub_group_size + a partition - 1, never less than one partition."""
    from aidaptiv_ds.planner.auto import deepspeed_sub_group_numels
    from aidaptiv_ds.planner.plan import rank_sub_group_numels

    assert deepspeed_sub_group_numels([5, 5, 5, 5], 7) == [10, 10]
    assert deepspeed_sub_group_numels([5, 5, 5], 100) == [15]
    assert deepspeed_sub_group_numels([20, 1, 1], 7) == [20, 2]
    assert deepspeed_sub_group_numels([], 7) == []
    inp = PlanInput(shape=preset_shape("llama-3.1-70b"), gpus=8, vram=80 * GB, dram=128 * GB,
                    drives=[CacheDrive(8 * TB)], sub_group_size=10**7)
    g = rank_sub_group_numels(inp)
    emb = -(-128256 * 8192 // 8)  # the embedding's partition (and the LM head's)
    assert sum(g) >= inp.params // 8 and emb <= max(g) < emb + 10**7


def test_endurance_uses_ledger_projection():
    drive = CacheDrive(8 * TB, rated_dwpd=100, warranty_years=5)
    p = make_plan(PlanInput(shape=preset_shape("llama-3.1-8b"), gpus=1, vram=80 * GB, dram=32 * GB, drives=[drive],
                            step_time_s=60.0, dataset_tokens=10 ** 8, epochs=2))
    d = p.drives[0]
    per_day = d.write_bytes_per_step * 86400 / 60.0
    assert d.endurance["dwpd"] == pytest.approx(per_day / (8 * TB))
    assert d.endurance["rated_tbw_bytes"] == 8 * TB * 100 * 365 * 5
    assert d.endurance["days_to_rated_tbw"] == pytest.approx(d.endurance["rated_tbw_bytes"] / per_day)
    steps = -(-10 ** 8 // 4096)
    assert p.epoch["steps_per_epoch"] == steps
    assert d.writes_per_epoch == d.write_bytes_per_step * steps
    assert d.writes_per_run == d.write_bytes_per_step * steps * 2


def test_compute_bound_kaplan():
    shape = preset_shape("llama-3.1-8b")
    p = make_plan(PlanInput(shape=shape, gpus=1, vram=80 * GB, dram=1000 * GB, drives=[CacheDrive(8 * TB)],
                            gpu_flops=1e15, activation_checkpointing=False))
    n_mm = shape.n_params - 128256 * 4096                         # less the embedding lookup
    flops = 6 * (n_mm + 32 * 4096 * 4096) * 4096
    assert p.step_time["compute_s"] == pytest.approx(flops / 1e15)


def test_invalid_input_names_the_flag():
    with pytest.raises(ValueError, match="--gpus: 0"):
        make_plan(PlanInput(shape=preset_shape("gpt2"), gpus=0, vram=GB, dram=GB, drives=[CacheDrive(TB)]))
    with pytest.raises(ValueError, match="--optimizer"):
        make_plan(PlanInput(shape=preset_shape("gpt2"), gpus=1, vram=GB, dram=GB, drives=[CacheDrive(TB)],
                            optimizer="adafactor"))


# ---------------------------------------------------------------- runtime defaults

def test_auto_dram_budget_margin():
    assert auto.auto_dram_budget(100 * GiB) == 90 * GiB                       # 10% margin
    assert auto.auto_dram_budget(20 * GiB) == 16 * GiB                        # 4 GiB floor
    assert auto.auto_dram_budget(100 * GiB, 30 * GiB) == 60 * GiB            # working set
    assert auto.auto_dram_budget(3 * GiB) == 0
    b = auto.resolve_dram_budget("auto", 2 * GiB, local_ranks=2,
                                 meminfo={"total_bytes": 64 * GiB, "available_bytes": 50 * GiB})
    assert b.budget_bytes == 50 * GiB - int(6.4 * GiB) - 2 * GiB and b.per_rank_bytes == b.budget_bytes // 2
    assert auto.resolve_dram_budget("48GiB").budget_bytes == 48 * GiB
    with pytest.raises(ValueError, match="aidaptiv.dram_budget"):
        auto.resolve_dram_budget("lots")


def test_prefetch_takes_what_residency_leaves():
    sizes = StateSizes(param_bytes=300, grad_bytes=200, subgroup_bytes=[300, 300])
    res = plan_residency(sizes, 260)
    assert res.grads_resident and not res.params_resident and res.cache_bytes == 60
    pf = auto.prefetch_bytes_from_budget(res, slice_bytes=20, n_slices=5)
    assert (pf.depth, pf.bytes) == (3, 60)                                     # 60 B left / 20 B slices
    assert auto.prefetch_bytes_from_budget(res, slice_bytes=20, n_slices=3).depth == 2    # one pass ahead
    assert auto.prefetch_bytes_from_budget(res, slice_bytes=20, n_slices=5, max_depth=1).depth == 1
    res = plan_residency(sizes, 500)                                           # grads + params resident
    assert res.params_resident and auto.prefetch_bytes_from_budget(res, slice_bytes=20, n_slices=5).depth == 0


def test_gradient_slices_take_the_budget_in_backward_order():
    """One gradient slice per sub-group, the last sub-group's first (its gradients are complete first in
    backward); a slice that does not fit is written and read back once per step."""
    sizes = StateSizes(param_bytes=300, grad_bytes=200, subgroup_bytes=[300, 300], subgroup_grad_bytes=[100, 100])
    p = plan_residency(sizes, 150)
    assert p.resident_grad_subgroups == [1] and not p.grads_resident and not p.params_resident
    assert (p.write_bytes_per_step, p.read_bytes_per_step) == (300 + 100 + 600, 2 * 300 + 100 + 600)
    p = plan_residency(sizes, 200)
    assert p.resident_grad_subgroups == [0, 1] and p.grads_resident and p.write_bytes_per_step == 300 + 600
    default = StateSizes(param_bytes=300, grad_bytes=200, subgroup_bytes=[300, 100])
    assert default.grad_slices() == [150, 50]  # split like the sub-groups when not given


def test_transient_gradients_cost_no_budget_and_no_writes():
    """Stepped inside backward, a sub-group's gradient never outlives its step."""
    sizes = StateSizes(param_bytes=300, grad_bytes=200, subgroup_bytes=[300, 300], grads_transient=True)
    p = plan_residency(sizes, 0)
    assert p.grads_resident and not p.params_resident and p.resident_bytes == 0
    assert (p.write_bytes_per_step, p.read_bytes_per_step) == (300 + 600, 2 * 300 + 600)
    p = plan_residency(sizes, 300)  # the whole budget goes to the parameters, none to the gradients
    assert p.params_resident and p.resident_subgroups == [] and p.write_bytes_per_step == 600


def test_partial_gradients_take_the_budget_first_above_one_micro_batch():
    """[Note: partial gradients between micro-batches]: with steps inside backward, GA 1 consumes each gradient
    (no budget, nothing written); at GA 4 a slice not kept is written and read back 3 times per step, so the
    slices take the budget first (the last sub-group's first, as backward completes them)."""
    def sizes(ga):
        return StateSizes(param_bytes=300, grad_bytes=200, subgroup_bytes=[300, 300], subgroup_grad_bytes=[100, 100],
                          grads_transient=True, steps_in_backward=True, grad_accum=ga)
    one = plan_residency(sizes(1), 150)
    assert not sizes(1).grads_stored and one.resident_grad_subgroups == [] and one.grad_bytes_per_step == 0
    assert one.write_bytes_per_step == 300 + 600
    four = plan_residency(sizes(4), 150)
    assert sizes(4).grads_stored and four.resident_grad_subgroups == [1] and not four.grads_resident
    assert four.grad_bytes_per_step == 3 * 100  # slice 0's partial sums; its final sum is consumed in backward
    assert (four.write_bytes_per_step, four.read_bytes_per_step) == (300 + 300 + 600, 2 * 300 + 300 + 600)
    clipped = dataclasses.replace(sizes(4), grads_transient=False)  # clipping: the final gradients are kept too
    assert plan_residency(clipped, 150).grad_bytes_per_step == 3 * 100 + 100


def test_working_set_counts_the_gradient_window():
    base = auto.host_working_set(100, 10, 8, rank_overhead_bytes=1000)
    assert auto.host_working_set(100, 10, 8, rank_overhead_bytes=1000, grad_window_bytes=4000) == base + 4000
    assert auto.host_working_set(100, 10, 8, local_ranks=2, rank_overhead_bytes=1000,
                                 grad_window_bytes=4000) == 2 * (base + 4000)


# ---------------------------------------------------------------- CLI

def test_cli_json_params(tmp_path):
    rc, out = run_cli("plan", "--params", "405e9", "--gpus", "2", "--vram", "96GB", "--dram", "512GB",
                      "--cache", "8TB", "--json")
    d = json.loads(out)
    assert rc == 0 and d["fits"] is True
    assert d["n_params"] == 405 * 10 ** 9
    assert 6.4 * TB < d["total_state_bytes"] < 8.2 * TB  # 16 B/param: bf16 gradients
    for key in ("tiers", "vram_per_gpu", "dram", "residency", "per_step", "step_time", "drives", "verdict"):
        assert key in d
    assert "llama-3.1-405b" in d["model"]["shape_source"]


def test_cli_bf16_moments_halve_the_moments(tmp_path):
    """``--moments bf16`` (or the ``--deepspeed`` config's ``optimizer_state.moments``): 4 B/param fewer of optimizer
    state on the tiers, and written per step; a non-Adam optimizer is refused with the fix."""
    common = ["plan", "--params", "70e9", "--gpus", "4", "--vram", "48GB", "--dram", "256GB", "--cache", "8TB",
              "--dram-budget", "0", "--json"]
    rc32, out32 = run_cli(*common)
    rc16, out16 = run_cli(*common, "--moments", "bf16")
    d32, d16 = json.loads(out32), json.loads(out16)
    assert d32["total_state_bytes"] - d16["total_state_bytes"] == 4 * 70 * 10 ** 9
    assert d32["per_step"]["write_bytes"] - d16["per_step"]["write_bytes"] == pytest.approx(4 * 70e9, rel=0.01)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "gradient_clipping": 0,
                               "aidaptiv": {"optimizer_state": {"moments": "bf16"}}}))
    rc, out = run_cli(*common, "--deepspeed", str(cfg))
    assert json.loads(out)["total_state_bytes"] == d16["total_state_bytes"]
    rc8, out8 = run_cli(*common, "--moments", "int8")  # codes and one fp32 scale per 256: 2.03 B/param
    d8 = json.loads(out8)
    assert d32["total_state_bytes"] - d8["total_state_bytes"] == pytest.approx((8 - 2.03125) * 70e9, rel=1e-6)
    assert d32["per_step"]["write_bytes"] - d8["per_step"]["write_bytes"] == pytest.approx(5.97 * 70e9, rel=0.01)

def test_cli_plans_the_deepspeed_config_it_is_given(tmp_path):
    """``--deepspeed CONFIG`` gives the run's settings the flags leave out (cli/plan_config.py): the plan of a
    config equals the plan of the same settings as flags; a key the config leaves out is DeepSpeed's default
    (``gradient_clipping`` 1.0, fp32 without a bf16/fp16 section); ``aidaptiv.dram_budget`` is per rank; a flag
    given wins; an HF ``"auto"`` is named among the assumptions; a missing file is refused by name (found by a
    new-user trial: the plan of a budget-0, clipping-1.0, fp32 config printed the defaults' 0 B written)."""
    common = ["plan", "--params", "7e9", "--gpus", "2", "--vram", "48GB", "--dram", "256GB", "--cache", "8TB",
              "--json"]
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 3, "sub_group_size": 5e7, "stage3_max_live_parameters": 1e8,
                              "stage3_max_reuse_distance": 1e8, "stage3_param_persistence_threshold": 1e4,
                              "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}},
        "aidaptiv": {"cache_paths": [str(tmp_path)], "dram_budget": "10GiB", "step_in_backward": False}}))
    flags = ["--dtype", "fp32", "--gradient-clipping", "1.0", "--micro-batch", "2", "--ga", "4",
             "--sub-group-size", "5e7", "--max-live-parameters", "1e8", "--max-reuse-distance", "1e8",
             "--param-persistence-threshold", "1e4", "--dram-budget", str(2 * 10 * 2 ** 30), "--step-in-backward",
             "false"]
    _, by_config = run_cli(*common, "--deepspeed", str(cfg))
    _, by_flags = run_cli(*common, *flags)
    a, b = json.loads(by_config), json.loads(by_flags)
    assert a["per_step"] == b["per_step"] and a["total_state_bytes"] == b["total_state_bytes"]
    assert a["dram"] == b["dram"] and a["per_step"]["write_bytes"] > 0
    _, bf16 = run_cli(*common, "--deepspeed", str(cfg), "--dtype", "bf16")  # a flag given wins
    assert json.loads(bf16)["total_state_bytes"] < a["total_state_bytes"]
    for device in ("cpu", "none"):  # the parameters where DeepSpeed keeps them (left out: "none", DeepSpeed's)
        d = json.loads(cfg.read_text())
        d["zero_optimization"]["offload_param"] = {"device": device} if device == "cpu" else None
        d["zero_optimization"] = {k: v for k, v in d["zero_optimization"].items() if v is not None}
        cfg.write_text(json.dumps(d))
        _, by_config = run_cli(*common, "--deepspeed", str(cfg))
        _, by_flags = run_cli(*common, *flags, "--offload-param", device)
        c, f = json.loads(by_config), json.loads(by_flags)
        assert c["per_step"] == f["per_step"] and c["tiers"] == f["tiers"] and c["dram"] == f["dram"]
        # fp32: the parameters were read from the master slots (forward and backward), never written on their own
        assert c["tiers"]["parameters"]["cache"] == 0 and c["per_step"]["read_bytes"] < a["per_step"]["read_bytes"]
        assert c["tiers"]["parameters"]["dram" if device == "cpu" else "vram"] == 7e9 * 4
    d["zero_optimization"]["offload_param"] = {"device": "nvme"}
    cfg.write_text(json.dumps(d))
    cfg.write_text(json.dumps({"gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                               "zero_optimization": {"stage": 3}}))
    _, auto = run_cli(*common, "--deepspeed", str(cfg))
    assumed = " ".join(json.loads(auto)["inputs"]["assumed"])
    assert "gradient_clipping (--gradient-clipping)" in assumed and "(--dtype)" in assumed and "HF fills" in assumed
    # DeepSpeed's derivation from train_batch_size (2 ranks: 32 = 2 x 8 x 2), its older bfloat16 key, a lenient
    # step_in_backward as the runtime reads it, a number written as a string, a stage other than 3 said
    cfg.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                               "bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2, "sub_group_size": "5e7"},
                               "aidaptiv": {"cache_paths": [str(tmp_path)], "step_in_backward": "yes"}}))
    _, derived = run_cli(*common, "--deepspeed", str(cfg))
    d = json.loads(derived)
    assert d["inputs"]["grad_accum"] == 8 and d["inputs"]["dtype"] == "bf16" and d["inputs"]["sub_group_size"] == 5e7
    assert d["inputs"]["step_in_backward"] is True and "stage 2" in " ".join(d["inputs"]["assumed"])
    with pytest.raises(ValueError, match="no such file"):
        from aidaptiv_ds.cli.plan_config import read_config_settings
        read_config_settings(str(tmp_path / "missing.json"))


def test_cli_refuses_bf16_moments_without_adam(capsys):
    assert main(["plan", "--params", "1e9", "--gpus", "1", "--vram", "48GB", "--dram", "64GB", "--cache", "1TB",
                 "--moments", "bf16", "--optimizer", "sgd"]) == 2
    err = capsys.readouterr().err
    assert "--moments" in err and "'bf16'" in err and "adamw" in err


def test_cli_model_preset_and_cache_path_spec(tmp_path):
    rc, out = run_cli("plan", "--model", "llama-3.1-405b", "--gpus", "2", "--vram", "96GB", "--dram", "512GB",
                      "--cache", f"{tmp_path}:2TB:read=7:write=6:dwpd=100", "--json")
    d = json.loads(out)
    assert rc == 1 and d["fits"] is False
    assert d["drives"][0]["path"] == str(tmp_path)
    assert d["drives"][0]["endurance"]["rated_dwpd"] == 100
    assert "cache capacity" in d["verdict"]["problems"][0]
    assert d["verdict"]["smallest_change"].startswith("add 3 cache drives")


def test_cli_model_config_json_text():
    cfg = os.path.join(STORIES, "config.json")
    if not os.path.isfile(cfg):
        pytest.skip(STORIES_ABSENT)
    rc, out = run_cli("plan", "--model", cfg, "--gpus", "1", "--vram", "8GB", "--dram", "16GB", "--cache", "1TB")
    assert rc == 0
    assert "260,032 parameters" in out
    assert "verdict    FITS" in out and "assumed" in out          # default drive figures are listed as assumed


def test_cli_errors_name_the_flag(capsys):
    assert main(["plan", "--params", "abc", "--gpus", "1", "--vram", "8GB", "--dram", "8GB", "--cache", "1TB"]) == 2
    assert "--params: 'abc'" in capsys.readouterr().err
    assert main(["plan", "--params", "1e9", "--gpus", "1", "--vram", "8GB", "--dram", "8GB"]) == 2
    assert "--cache" in capsys.readouterr().err
    assert main(["plan", "--params", "1e9", "--gpus", "1", "--vram", "8GB", "--dram", "8GB",
                 "--cache", "/no/such/dir"]) == 2
    assert "PATH:SIZE" in capsys.readouterr().err


def test_parse_cache_spec(tmp_path):
    dflt = {"read_gbps": 7.0, "write_gbps": 6.0, "rated_dwpd": 1.0, "warranty_years": 5.0}
    assert parse_cache_spec("2TB", dflt).capacity == 2 * TB
    d = parse_cache_spec(f"{tmp_path}:1.5TB:dwpd=30:years=3", dflt)
    assert (d.path, d.capacity, d.rated_dwpd, d.warranty_years) == (str(tmp_path), 1.5 * TB, 30.0, 3.0)
    bare = parse_cache_spec(str(tmp_path), dflt)                          # capacity and free space of the fs
    assert bare.capacity >= bare.free > 0 and bare.usable <= bare.free
    with pytest.raises(ValueError, match="unknown key 'speed'"):
        parse_cache_spec("2TB:speed=3", dflt)


def test_main_registers_every_module_loudly():
    from aidaptiv_ds.cli import main as m
    assert {"aidaptiv_ds.cli.plan", "aidaptiv_ds.cli.doctor", "aidaptiv_ds.cli.ledger"} <= set(m.SUBCOMMAND_MODULES)
    with pytest.raises(ImportError):
        m.build_parser(["aidaptiv_ds.cli.no_such_subcommand"])
    with pytest.raises(TypeError, match="register"):
        m.build_parser(["aidaptiv_ds.units"])


def test_the_plan_plans_the_sub_group_the_runtime_picks_where_the_config_leaves_it_out(tmp_path):
    """``sub_group_size`` left out (of the flags and the config): the plan is the plan of what aidaptiv_ds's runtime
    picks then (``auto_sub_group_numel``, the one formula of both: at least 4 sub-groups a rank, 3 in flight within
    5% of its memory, between 1e6 and 1e9), not of DeepSpeed's 1e9, and names it among its assumptions; a
    sub-group given (flag or config) is planned as given and says nothing."""
    from aidaptiv_ds.planner.auto import auto_sub_group_numel

    assert auto_sub_group_numel(7 * 10 ** 9, 1, 25 * 10 ** 9) == int(0.05 * 25e9) // 48  # memory-bound: 26.0M
    assert auto_sub_group_numel(100 * 10 ** 6, 2, 10 ** 12) == 12_500_000  # a quarter of a rank's 50M
    assert auto_sub_group_numel(10 ** 6, 1, 10 ** 12) == 10 ** 6 and auto_sub_group_numel(10 ** 13, 1, 0) == 10 ** 9
    common = ["plan", "--params", "7e9", "--cpu-ranks", "--dram", "25GB", "--cache", "2TB", "--json"]
    _, out = run_cli(*common)
    left_out = json.loads(out)
    assumed = " ".join(left_out["inputs"]["assumed"])
    assert left_out["inputs"]["sub_group_size"] == 26_041_666 and "sub_group_size 26,041,666 elements" in assumed
    _, picked = run_cli(*common, "--sub-group-size", "26041666")
    picked = json.loads(picked)
    assert "sub_group_size" not in " ".join(picked["inputs"]["assumed"])
    for p in (left_out, picked):
        p["inputs"].pop("assumed")
        p["wear"].pop("changes")  # re-planned with more DRAM, a sub-group left out is picked anew (grows with it)
    assert left_out == picked  # the same plan as the pick given
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": 2e8}}))
    _, from_config = run_cli(*common, "--deepspeed", str(cfg))
    from_config = json.loads(from_config)["inputs"]
    assert from_config["sub_group_size"] == 2 * 10 ** 8 and "sub_group_size" not in " ".join(from_config["assumed"])
    _, given = run_cli(*common, "--sub-group-size", "2e8")
    assert "sub_group_size" not in " ".join(json.loads(given)["inputs"]["assumed"])


def test_cli_takes_the_cache_paths_of_the_deepspeed_config_without_cache(tmp_path):
    """``plan --deepspeed CONFIG`` without ``--cache`` plans the drives the run would use: ``aidaptiv.cache_paths``,
    else the config's ``nvme_path`` (the runtime's default), and says so (a new-user trial met ``--cache: no cache
    drive given`` with the paths in the config)."""
    a, b = tmp_path / "c0", tmp_path / "c1"
    a.mkdir(), b.mkdir()
    nvme = {"device": "nvme", "nvme_path": str(a)}
    cfg = {"zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme},
           "aidaptiv": {"enabled": True, "dram_budget": 0}}
    common = ["plan", "--params", "7e6", "--cpu-ranks", "--dram", "8GB", "--json"]
    for paths in (None, [str(a), str(b)]):
        if paths:
            cfg["aidaptiv"]["cache_paths"] = paths
        f = tmp_path / "ds.json"
        f.write_text(json.dumps(cfg))
        _, out = run_cli(*common, "--deepspeed", str(f))
        p = json.loads(out)
        assert [d["path"] for d in p["inputs"]["drives"]] == (paths or [str(a)])
        assert any("cache drives: --deepspeed" in x for x in p["inputs"]["assumed"])


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
def test_a_lora_plan_charges_the_optimizer_state_of_the_adapters_alone():
    """``--trainable-params`` (PEFT's count): only the adapters have gradients, master weights and moments, and
    only their partitions are written each step; the frozen base is on the drive and read. A new-user trial's
    LoRA run (stories260K, q/v adapters, r=8: 8,960 trainable; HF defaults: clipping 1.0, GA 4; budget 0) wrote
    258,048 B per step (its start line: 249.00 KiB; extents rounded to 4 KiB), the plan without the flag 7.28 MB
    (28 B/param of the whole model); with it 28 B/param of the adapters: their optimizer state 12, three partial
    sums and the final gradient kept for the clipping norm 16."""
    common = ["plan", "--model", STORIES, "--cpu-ranks", "--dram", "24GiB", "--cache", "/tmp:10GB",
              "--dram-budget", "0", "--micro-batch", "2", "--seq-len", "32", "--ga", "4", "--dtype", "fp32",
              "--gradient-clipping", "1.0", "--json"]
    _, whole = run_cli(*common)
    _, lora = run_cli(*common, "--trainable-params", "8960")
    w, p = json.loads(whole), json.loads(lora)
    assert w["per_step"]["write_bytes"] == 28 * w["n_params"]
    assert p["per_step"]["write_bytes"] == 28 * 8960 == pytest.approx(258_048, rel=0.03)
    assert p["tiers"]["parameters"] == w["tiers"]["parameters"]  # the whole model, on the drive
    assert p["tiers"]["master_weights"]["cache"] == 4 * 8960 and p["tiers"]["moments"]["cache"] == 8 * 8960
    assert p["tiers"]["gradients"]["cache"] == 4 * 8960
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc, _ = run_cli(*common, "--trainable-params", str(10 ** 9))
    assert rc != 0 and "--trainable-params" in err.getvalue()


def test_trainable_parameters_fill_sub_groups_as_the_state_sizes_do():
    """The adapters' partitions in sub-groups of at most ``sub_group_size`` (a review found them planned as one
    sub-group of every adapter: 207.5M elements and a 15.05 GB working set per rank for an all-linear r=64 LoRA of
    70B over 4 GPUs at sub_group_size 5e7, against 5 sub-groups and 6.88 GB of DeepSpeed's grouping); all of the
    model trainable is the plan without the flag."""
    common = ["plan", "--params", "70e9", "--gpus", "4", "--vram", "80GB", "--dram", "512GB", "--cache", "8TB",
              "--json"]
    _, base = run_cli(*common)
    _, whole = run_cli(*common, "--trainable-params", "70e9")
    b, w = json.loads(base), json.loads(whole)
    for key in ("per_step", "tiers", "dram", "rank_host", "residency"):
        assert b[key] == w[key], key
    inp = PlanInput(shape=nearest_preset(70e9), n_params=int(70e9), gpus=4, vram=80 * GiB, dram=512 * GiB,
                    drives=[CacheDrive(8 * 10 ** 12)], sub_group_size=int(5e7), trainable_params=int(8.3e8))
    from aidaptiv_ds.planner.plan import rank_state
    numels = rank_state(inp).subgroup_numels
    assert len(numels) == 5 and max(numels) == int(5e7) and sum(numels) == -(-int(8.3e8) // 4)
    assert rank_state(inp).largest_partition_numel <= int(5e7)
    _, lora = run_cli(*common, "--trainable-params", "8.3e8", "--sub-group-size", "5e7")
    assert json.loads(lora)["rank_host"]["peak"] < 8e9
