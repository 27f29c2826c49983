"""Optimizer moments in int8 (``"aidaptiv": {"optimizer_state": {"moments": "int8"}}``, issue 39 item 3).

Each moment is stored as uint8 codes of torchao's dynamic map with an fp32 scale per block of 256
(``tiers/blockwise.py``). The oracle for the engine is DeepSpeed's CPU offload with torch's AdamW whose stepped
sub-group's moments are quantized and dequantized after every step (``train_oracle.py --round_moments int8``):
the arithmetic our tiled step runs on the stored codes, so the two must agree bit for bit. The codec itself is
checked against torchao's own quantizer.
"""
from __future__ import annotations


import pytest
import torch

from _oracle import (assert_close_to_rounded_oracle, assert_identical, assert_resume_exact, differences, oracle,
                     run, written_per_param_per_step)
from aidaptiv_ds.integration.host_step import tiled_adam_step
from aidaptiv_ds.planner.working_set import RankState
from aidaptiv_ds.tiers import blockwise
from aidaptiv_ds.tiers.unit import MOMENT_FORMATS, UnitLayout

torchao = pytest.importorskip("torchao", reason="int8 moments quantize with torchao (pip install 'aidaptiv_ds[int8]')")


def _round_trip(v: torch.Tensor, signed: bool) -> torch.Tensor:
    codes = torch.empty(v.numel(), dtype=torch.uint8)
    scales = torch.empty(blockwise.n_blocks(v.numel()))
    blockwise.quantize(v.reshape(-1), codes, scales, signed)
    return blockwise.dequantize(codes, scales, signed).view_as(v)


# ------------------------------------------------------------------------------------------ the codec
@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_torchaos_but_for_values_at_a_midpoint(signed):
    """Our table lookup ([Note: the code table]) against torchao's binary search on the same scaled values:
    at most one code apart, and apart only for values within 2^-11 (relative) of a midpoint between map values."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=g) * torch.logspace(-6, 0, 1 << 20)[torch.randperm(1 << 20, generator=g)]
    x = x if signed else x * x
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    scales = torch.empty(blockwise.n_blocks(x.numel()))
    blockwise.quantize(x, codes, scales, signed)
    scaled = (x.view(-1, blockwise.BLOCK) / scales.view(-1, 1)).view(-1)
    ref = quantize_8bit_with_qmap(scaled, blockwise.qmap(signed))
    diff = codes.int() - ref.int()
    assert diff.abs().max() <= 1
    assert 0 < (diff != 0).float().mean() < 0.005  # the table does differ, rarely
    q = blockwise.qmap(signed)
    lo = torch.minimum(q[codes.long()], q[ref.long()])[diff != 0]
    hi = torch.maximum(q[codes.long()], q[ref.long()])[diff != 0]
    mid = (lo + hi) / 2
    assert ((scaled[diff != 0] - mid).abs() <= mid.abs() * 2.0 ** -10 + 1e-30).all()
    back = blockwise.dequantize(codes, scales, signed)
    step = (q[1:] - q[:-1]).max()  # the widest gap of the map, relative to the block's scale
    assert ((back - x).abs() <= step * scales.repeat_interleave(blockwise.BLOCK)).all()


def test_a_range_on_block_boundaries_codes_as_the_whole():
    x = torch.randn(10 * blockwise.BLOCK + 37)
    whole_c, whole_s = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(blockwise.n_blocks(x.numel()))
    blockwise.quantize(x, whole_c, whole_s, True)
    c, s = torch.empty_like(whole_c), torch.empty_like(whole_s)
    for a in range(0, x.numel(), 3 * blockwise.BLOCK):
        b = min(a + 3 * blockwise.BLOCK, x.numel())
        blockwise.quantize(x[a:b], c[a:b], s[a // blockwise.BLOCK:blockwise.n_blocks(b)], True)
    assert torch.equal(c, whole_c) and torch.equal(s, whole_s)
    assert blockwise.dequantize(whole_c, whole_s, True)[-37:].abs().max() <= x[-37:].abs().max()


@pytest.mark.parametrize("signed", [True, False])
def test_quantizing_in_the_callers_scratch_gives_the_same_codes(signed):
    """``overwrite=True`` (the tiled step's scratch tile) computes in ``src`` 's memory: the same codes and scales
    bit for bit, the short last block included, with zeros, a lone -0.0 and a block of zeros."""
    x = torch.randn(5 * blockwise.BLOCK + 19) * 1e-3
    x = x if signed else x * x
    x[: blockwise.BLOCK] = 0.0
    x[blockwise.BLOCK + 3] = -0.0
    codes, scales = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(blockwise.n_blocks(x.numel()))
    blockwise.quantize(x, codes, scales, signed)
    c2, s2 = torch.empty_like(codes), torch.empty_like(scales)
    scratch = x.clone()
    blockwise.quantize(scratch, c2, s2, signed, overwrite=True)
    assert torch.equal(codes, c2) and torch.equal(scales.view(torch.int32), s2.view(torch.int32))
    assert not torch.equal(scratch, x)  # it did compute in the scratch


# ----------------------------------------------------------------------------------------- the layout
def test_quantized_slots_pack_codes_then_scales():
    fmt = MOMENT_FORMATS["int8"]
    lay = UnitLayout.packed(1001, [("master", torch.float32), fmt.spec("m", True), fmt.spec("v", False)])
    m, v = lay.slots[1], lay.slots[2]
    assert (m.offset, m.scale_offset, m.end) == (4004, 5008, 5024)  # 1001 codes, 4-aligned, 4 scales
    assert (v.offset, v.scale_offset, v.end) == (5024, 6028, 6044)
    assert lay.prefix_bytes() == 6044 and not lay.all_of(torch.float32) and lay.all_of(torch.float32, 1)
    assert fmt.bytes_per_element == 1 + 4 / 256
    buf = torch.zeros(lay.prefix_bytes(), dtype=torch.uint8)
    rows = torch.randn(3, 1001)
    rows[2] = rows[2] ** 2
    lay.fill(buf, rows)
    wide = lay.widened(buf, 3)
    assert torch.equal(wide[0], rows[0])
    assert torch.equal(wide[1], _round_trip(rows[1], True)) and torch.equal(wide[2], _round_trip(rows[2], False))
    assert torch.equal(m.read(buf, 256, 512), wide[1, 256:768])
    with pytest.raises(ValueError, match="block boundary"):
        m.read(buf, 100, 10)
    with pytest.raises(ValueError, match="end on a block"):
        m.write(buf, torch.zeros(10), 256)


def test_rank_state_counts_int8_moments_as_the_swapper_lays_them_out():
    from aidaptiv_ds.integration.optimizer_swapper import SubgroupFormat
    st = RankState(subgroup_numels=(100_003,), grad_numels=(100_003,), largest_partition_numel=1000,
                   param_bytes=400_012, largest_subgroup_param_bytes=400_012, staging_partition_bytes=0,
                   accum_elsize=4, alignment=4096, moments="int8")
    assert st.moment_bytes_per_param == pytest.approx(2.03125)
    fmt = SubgroupFormat(torch.float32, MOMENT_FORMATS["int8"], 2)  # the swapper's layout
    exact = fmt.layout(100_003, 3).prefix_bytes()
    assert st.opt_slice_bytes(100_003) == -(-exact // 4096) * 4096 and exact < 100_003 * 6.04


# ------------------------------------------------------------------------------------- the tiled step
@pytest.mark.parametrize("n,tile", [(10_007, 1024), (3000, 65_536), (5000, 1000)])  # tiles; one tile; a tile
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])          # not made of whole blocks
def test_tiled_step_on_int8_moments_is_torch_step_round_tripped(cls, n, tile):
    """Codes in a unit's slots step as torch's fp32 step followed by quantizing and dequantizing the moments."""
    fmt = MOMENT_FORMATS["int8"]
    lay = UnitLayout.packed(n, [("master", torch.float32), fmt.spec("s1", True), fmt.spec("s2", False)])
    buf = torch.zeros(lay.prefix_bytes(), dtype=torch.uint8)
    g = torch.Generator().manual_seed(3)
    init = torch.randn(n, generator=g)
    ref = torch.nn.Parameter(init.clone())
    got = torch.nn.Parameter(lay.slots[0].view(buf))
    got.data.copy_(init)
    ref_opt, got_opt = cls([ref], lr=1e-3, weight_decay=0.1), cls([got], lr=1e-3, weight_decay=0.1)
    slots = {"exp_avg": (lay.slots[1], buf), "exp_avg_sq": (lay.slots[2], buf)}
    for it in range(4):
        grad = torch.randn(n, generator=g) * (it + 1)
        ref.grad, got.grad = grad.clone(), grad.clone()
        ref_opt.step()
        for k, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            ref_opt.state[ref][k].copy_(_round_trip(ref_opt.state[ref][k], signed))
        if it == 0:  # torch creates fp32 state at the first step; the swapper quantizes it into the slots
            assert tiled_adam_step(got_opt, got_opt.param_groups[0], got, tile_numel=tile) or got_opt.step() is None
            for j, k in ((1, "exp_avg"), (2, "exp_avg_sq")):
                lay.slots[j].write(buf, got_opt.state[got][k])
                got_opt.state[got][k] = lay.slots[j].view(buf)
        else:
            assert not tiled_adam_step(got_opt, got_opt.param_groups[0], got, tile_numel=tile)  # codes alone: no
            assert tiled_adam_step(got_opt, got_opt.param_groups[0], got, tile_numel=tile, slots=slots)
        assert got_opt.state[got]["exp_avg"].dtype == torch.uint8
        assert torch.equal(ref.data, got.data), it
        for j, k in ((1, "exp_avg"), (2, "exp_avg_sq")):
            assert torch.equal(ref_opt.state[ref][k], lay.slots[j].read(buf)), (it, k)


# ---------------------------------------------------------------------------- a real engine, exact
INT8 = '{"optimizer_state": {"moments": "int8"}}'
#: the eager tile ([Note: narrow moments]): the path whose oracle is bit-identity
INT8_EAGER = '{"optimizer_state": {"moments": "int8", "fused_step": "off"}}'


@pytest.mark.subprocess
def test_engine_with_int8_moments_matches_round_tripped_oracle(tmp_path):
    """Llama with HF's clipping 1.0 and GA 2 (the norm clips at this lr: speculative steps inside backward are
    redone), budget 0: with the eager tile, bit-identical with the CPU-offload reference whose moments go through
    the codec after every step, and the drives see about 6 B/param/step fewer than with fp32 moments. With the
    default fused tile (``tiers/fused_adam.py``) the same run within 2.5% of lr per step of that reference (a
    moment a hair apart may take the neighbouring code: 1% is bf16's bound; measured 0.9% on 4 steps here), and
    not equal to the eager run (so the fused tile did run)."""
    args = ["--model", "llama", "--steps", "4", "--ga", "2", "--clip", "1.0", "--lr", "1e-2"]
    ref = oracle(args + ["--round_moments", "int8"], str(tmp_path))
    got = run("aidaptiv", args + ["--budget", "0", "--extra", INT8_EAGER], str(tmp_path / "aid"))
    assert_identical(ref, got)
    plain = oracle(args, str(tmp_path))
    assert plain["losses"][-1] != got["losses"][-1]  # the quantization does change the run: the test can fail
    fp32 = run("aidaptiv", args + ["--budget", "0"], str(tmp_path / "fp32"))
    w8, w32 = written_per_param_per_step(got), written_per_param_per_step(fp32)
    assert w8 < w32 - 5.5, (w8, w32)  # 5.97 B/param of moments fewer per step
    fused = run("aidaptiv", args + ["--budget", "0", "--extra", INT8], str(tmp_path / "fused"))
    assert_close_to_rounded_oracle(ref, fused, lr=1e-2, steps=4, per_step=0.025)
    assert differences(got, fused), "the fused tile did not run (its results equal the eager tile's)"
    assert abs(written_per_param_per_step(fused) - w8) < 0.5


@pytest.mark.subprocess
def test_int8_moments_resume_exactly(tmp_path):
    """A checkpoint keeps the codes and scales beside the dequantized rows, so a resume goes on bit for bit
    (a dequantize-quantize round trip would not: the signed map has no -1)."""
    args = ["--model", "llama", "--steps", "4", "--clip", "1.0", "--budget", "0", "--extra", INT8,
            "--sub_group_size", "2e5"]
    assert_resume_exact(args, tmp_path)


# ----------------------------------------------------------------------------------- the public state API
@pytest.mark.engine
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_state_api_reads_and_writes_narrow_moments_as_fp32(tmp_path, monkeypatch, fmt):
    """``safe_get/set_full_optimizer_state`` and the local variants on bf16 / int8 moments: the getter returns the
    moment decoded to fp32 (not the bf16 slot or the uint8 codes), and a setter's values come back rounded or
    quantized within the codec's error ([Note: narrow moments in the state API])."""
    import deepspeed
    from deepspeed.utils import (safe_get_full_optimizer_state, safe_get_local_optimizer_state,
                                 safe_set_full_optimizer_state)

    import aidaptiv_ds  # noqa: F401  (installs the hooks)
    from _engine import nvme_config, one_rank_env
    from aidaptiv_ds.integration.state_readout import flat_optimizer_state

    one_rank_env(monkeypatch)
    cfg = nvme_config(tmp_path / "cache", dram_budget=0)
    cfg["aidaptiv"]["optimizer_state"] = {"moments": fmt}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Linear(40, 48))
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(2):
        loss = eng(torch.randn(4, 48)).pow(2).mean()
        eng.backward(loss)
        eng.step()
    p = model[1].weight
    m = safe_get_full_optimizer_state(p, "exp_avg")
    v = safe_get_full_optimizer_state(p, "exp_avg_sq")
    assert m.dtype == v.dtype == torch.float32 and m.shape == p.ds_shape
    assert (v >= 0).all() and 0 < m.abs().max() < 1e-2 and v.max() < 1e-3  # moments, not codes (0..255)
    local = safe_get_local_optimizer_state(p, "exp_avg")
    assert local.dtype == torch.float32 and torch.equal(local.reshape(-1)[:p.ds_numel], m.reshape(-1))
    flat = flat_optimizer_state(eng.optimizer)
    assert flat["exp_avg"].abs().max() < 1e-2  # the readout decodes too
    x = torch.randn(p.ds_shape) * 1e-3
    safe_set_full_optimizer_state(p, x, "exp_avg")
    back = safe_get_full_optimizer_state(p, "exp_avg")
    if fmt == "bf16":
        assert torch.equal(back, x.bfloat16().float())
    else:
        assert (back - x).abs().max() <= 0.02 * x.abs().max() and not torch.equal(back, x)
    loss = eng(torch.randn(4, 48)).pow(2).mean()  # and training goes on from it
    eng.backward(loss)
    eng.step()
    assert torch.isfinite(safe_get_full_optimizer_state(p, "exp_avg")).all()
    eng.destroy()
    from aidaptiv_ds.integration import runtime
    runtime.shutdown()
