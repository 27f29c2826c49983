"""The fused bf16-moment Adam tile (``tiers/fused_adam.py``, issue 39): torch's formulas within the stated
tolerance of the eager widened tile, one compile for every tile, the eager tile where it cannot compile.

Its oracle is the eager widened tile (torch's ``adam`` on moments widened to fp32, rounded back), which is
itself bit-identical with DeepSpeed's CPU offload with rounded moments (``tests/test_moment_dtype.py``); the
fused tile is not torch's bits ([Note: not torch's bits]), so it is held to :func:`moments_close` and a
parameter tolerance instead.
"""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

from aidaptiv_ds.errors import AidaptivConfigError, AidaptivWarning
from aidaptiv_ds.integration.config import parse_section
from aidaptiv_ds.integration.host_step import tiled_adam_step
from aidaptiv_ds.tiers import blockwise, fused_adam
from aidaptiv_ds.tiers.fused_adam import eager_tile, fused_tile, int8_moments_close, moments_close, step_scalars
from aidaptiv_ds.tiers.unit import MOMENT_FORMATS, UnitLayout


@pytest.fixture(scope="module")
def tile():
    t = fused_tile("bf16", "auto")
    if t is None:
        pytest.skip(f"the fused tile does not compile here: {fused_adam._COMPILED['bf16'].error}")
    return t


@pytest.fixture(scope="module")
def tile8():
    pytest.importorskip("torchao", reason="int8 moments quantize with torchao (pip install 'aidaptiv_ds[int8]')")
    t = fused_tile("int8", "auto")
    if t is None:
        pytest.skip(f"the fused int8 tile does not compile here: {fused_adam._COMPILED['int8'].error}")
    return t


def _group(**kw) -> dict:
    g = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "maximize": False,
         "decoupled_weight_decay": True}
    g.update(kw)
    return g


def _twins(n: int, seed: int, fused) -> tuple:
    """``(generator, [(param, AdamW, None), (param, AdamW, fused)])``: two equal ``(n,)`` parameters, one stepped
    with the eager tile and one with ``fused``."""
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=gen)
    runs = []
    for f in (None, fused):
        p = torch.nn.Parameter(init.clone())
        runs.append((p, torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1), f))
    return gen, runs


def _close_params(a: torch.Tensor, b: torch.Tensor, lr: float, steps: int) -> bool:
    return ((a - b).abs() - 1e-6 * b.abs()).max().item() <= 0.01 * lr * steps


@pytest.mark.parametrize("kw", [{}, {"decoupled_weight_decay": False}, {"maximize": True}, {"weight_decay": 0.0},
                                {"betas": (0.3, 0.99)}, {"lr": 0.05, "eps": 1e-3}],
                         ids=["adamw", "adam-l2", "maximize", "no-decay", "beta1-below-half", "big-lr-eps"])
def test_fused_tile_is_the_eager_tile_within_its_tolerance(tile, kw):
    """Five steps on a tile at an offset with an odd length (the vector loop's tail): moments close, parameters
    within 1% of lr per step, nothing written outside the tile; and the tolerance is not loose: a step that
    skips the bias correction falls outside it."""
    group = _group(**kw)
    gen = torch.Generator().manual_seed(7)
    n = 100_003
    p = torch.randn(n + 5, generator=gen)
    m = (torch.randn(n + 5, generator=gen) * 1e-2).bfloat16()
    v = (torch.rand(n + 5, generator=gen) * 1e-4).bfloat16()
    ref = [p.clone(), m.clone(), v.clone()]
    with torch.no_grad():
        for step in range(1, 6):
            g = torch.randn(n + 5, generator=gen) * 1e-2
            tile(p[5:], g[5:], m[5:], v[5:], step_scalars(group, step))
            eager_tile(ref[0][5:], g[5:], ref[1][5:], ref[2][5:], group, step)
            assert moments_close(m, ref[1]) and moments_close(v, ref[2]), step
            assert _close_params(p, ref[0], group["lr"], step), step
    assert torch.equal(p[:5], ref[0][:5]) and torch.equal(m[:5], ref[1][:5]) and torch.equal(v[:5], ref[2][:5])
    assert not torch.equal(p, ref[0])  # not torch's bits: the comparison above is a tolerance, not equality
    wrong = step_scalars(group, 6)
    wrong[5] = 1.0  # no bias correction of the second moment
    q = p.clone()
    with torch.no_grad():
        tile(q, g, m.clone(), v.clone(), wrong)
        eager_tile(p, g, m, v, group, 6)
    assert not _close_params(q, p, group["lr"], 1)


def test_one_compile_serves_every_tile_length_offset_thread_and_learning_rate(tile):
    """Tiles of other lengths (two elements and up) at storage offset 0 and past it, a new learning rate (a
    schedule), and a call from another thread reuse the kernels compiled and probed at configuration ([Note:
    compiling once]); a one-element tile, which would compile another, is refused."""
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    base = torch.randn(3_000_000)
    g = torch.randn(3_000_000) * 1e-2
    m, v = torch.zeros(3_000_000, dtype=torch.bfloat16), torch.zeros(3_000_000, dtype=torch.bfloat16)
    with torch.no_grad():
        for a, n, lr in ((0, 17, 1e-3), (2, 1000, 2e-3), (12_345, 2 << 20, 3e-4), (3, 2_999_997, 1e-5), (0, 2, 1e-3),
                         (5, 3, 1e-3)):
            tile(base[a:a + n], g[a:a + n], m[a:a + n], v[a:a + n], step_scalars(_group(lr=lr), 3))
        with pytest.raises(ValueError, match="at least 2 elements"):
            tile(base[:1], g[:1], m[:1], v[:1], step_scalars(_group(), 3))
    errors = []

    def worker():
        try:
            with torch.no_grad():
                tile(base[7:5007], g[7:5007], m[7:5007], v[7:5007], step_scalars(_group(), 4))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors
    assert counters["stats"]["unique_graphs"] == before


def test_a_tile_that_fails_inside_the_step_hands_the_rest_to_the_eager_tile(tile, monkeypatch):
    """[Note: a failure inside the step]: the fused tile raises on the step's second tile (before writing, as a
    failed compile does); the step finishes with the eager tile, the counter advances once, the tile is retired
    with a warning, and the result is the eager step but for the first tile (fused, within the tolerance)."""
    calls = []

    def flaky(*a):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a compile the probe did not foresee")
        tile.kernel(*a)
    broken = fused_adam.FusedTile("bf16", flaky)
    monkeypatch.setitem(fused_adam._COMPILED, "bf16", fused_adam._Compiled(tile=broken))
    n, t = 5000, 1000
    gen, runs = _twins(n, 9, broken)
    for it in range(2):
        grad = torch.randn(n, generator=gen)
        for p, opt, fused in runs:
            p.grad = grad.clone()
            if it == 1 and fused is not None:
                with pytest.warns(AidaptivWarning, match="failed inside the step.*eager tile"):
                    assert tiled_adam_step(opt, opt.param_groups[0], p, tile_numel=t, fused=fused)
            else:
                assert tiled_adam_step(opt, opt.param_groups[0], p, tile_numel=t, fused=fused)
            if it == 0:
                for k in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][k] = opt.state[p][k].bfloat16()
    (pe, oe, _), (pf, of, _) = runs
    assert len(calls) == 2 and not broken.usable
    assert torch.equal(oe.state[pe]["step"], of.state[pf]["step"]) and of.state[pf]["step"].item() == 2
    assert torch.equal(pe[t:], pf[t:])  # tiles 2.. ran eagerly, as the eager run's
    assert _close_params(pf.data[:t], pe.data[:t], 1e-3, 2)
    p, opt, _ = runs[1]
    p.grad = torch.randn(n, generator=gen)
    assert tiled_adam_step(opt, opt.param_groups[0], p, tile_numel=t, fused=broken) and len(calls) == 2  # retired


def test_a_one_element_last_tile_steps_eagerly(tile):
    """``n = 2 * tile + 1``: the last tile has one element, which the fused tile does not take (a dimension of 1
    would compile another kernel inside the step); the step still runs whole, the counter once."""
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    n, t = 2001, 1000
    p = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.AdamW([p], lr=1e-3)
    for it in range(3):
        p.grad = torch.randn(n)
        assert tiled_adam_step(opt, opt.param_groups[0], p, tile_numel=t, fused=tile)
        if it == 0:
            for k in ("exp_avg", "exp_avg_sq"):
                opt.state[p][k] = opt.state[p][k].bfloat16()
    assert opt.state[p]["step"].item() == 3 and torch.isfinite(p).all()
    assert counters["stats"]["unique_graphs"] == before


def test_an_infinite_parameter_does_not_make_adamws_moments_nan(tile):
    """AdamW has no L2 term: the moments see only the gradient, as torch's (``inf * 0`` is NaN, so the term is
    skipped, not multiplied by 0)."""
    p = torch.tensor([float("inf"), 1.0, -2.0, 3.0])
    m, v = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    with torch.no_grad():
        tile(p, torch.full((4,), 1e-3), m, v, step_scalars(_group(weight_decay=0.0), 1))
    assert torch.isfinite(m.float()).all() and torch.isfinite(v.float()).all()


def test_tiled_step_takes_the_fused_tile_for_bf16_moments_only(tile):
    """The tiled step with the fused tile: bf16 moments step in it (the counter once, as torch), within the
    tolerance of the eager tiled step; fp32 moments (the first step's, torch's) and amsgrad keep the eager
    tile, bit for bit."""
    n = 10_007
    gen, runs = _twins(n, 3, tile)
    init = runs[0][0].detach().clone()
    for it in range(4):
        grad = torch.randn(n, generator=gen)
        for p, opt, fused in runs:
            p.grad = grad.clone()
            assert tiled_adam_step(opt, opt.param_groups[0], p, tile_numel=1000, fused=fused) or it == 0
            if it == 0:  # n > tile_numel: the first (fp32-moment) step ran tiled and eager in both
                for k in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][k] = opt.state[p][k].bfloat16()
        (pe, oe, _), (pf, of, _) = runs
        if it == 0:
            assert torch.equal(pe, pf)
        else:
            assert _close_params(pf.data, pe.data, 1e-3, it + 1), it
        assert torch.equal(oe.state[pe]["step"], of.state[pf]["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            assert moments_close(of.state[pf][k], oe.state[pe][k]), (it, k)
    assert not torch.equal(pe, pf)  # the fused tile ran
    # amsgrad: the eager tile, bit for bit, even with the fused tile handed in
    outs = []
    for fused in (None, tile):
        p = torch.nn.Parameter(init.clone())
        opt = torch.optim.AdamW([p], lr=1e-3, amsgrad=True)
        for it in range(2):
            p.grad = torch.ones(n) * (it + 1)
            assert tiled_adam_step(opt, opt.param_groups[0], p, tile_numel=1000, fused=fused)
            if it == 0:
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    opt.state[p][k] = opt.state[p][k].bfloat16()
        outs.append(p.detach().clone())
    assert torch.equal(*outs)


@pytest.fixture
def fresh(monkeypatch):
    """A process with no compiled tile yet, whose ``torch.compile`` is the caller's to replace."""
    monkeypatch.setitem(fused_adam._COMPILED, "bf16", fused_adam._Compiled())
    return monkeypatch


def test_without_a_compiler_auto_warns_and_keeps_the_eager_tile_and_on_refuses(fresh):
    def no_compiler(fn, **kw):
        def run(*a):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return run
    fresh.setattr(fused_adam.torch, "compile", no_compiler)
    with pytest.warns(AidaptivWarning, match="eager tile.*InvalidCxxCompiler"):
        assert fused_tile("bf16", "auto") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused_tile("bf16", "auto") is None  # warned once per process
    with pytest.raises(AidaptivConfigError, match=r"fused_step is \"on\".*C\+\+ compiler.*Fix.*\"off\""):
        fused_tile("bf16", "on")
    assert fused_tile("bf16", "off") is None
    with pytest.raises(AidaptivConfigError, match=r"fused_step is 'fast'.*Fix"):
        fused_tile("bf16", "fast")


def test_a_tile_that_disagrees_with_torch_is_not_used(fresh):
    """The probe runs the compiled tile against the eager one on this machine: a tile computing another
    formula (here: plain ``torch.compile`` replaced by the function itself, with the bias correction lost) is
    refused, and the step keeps the eager tile."""
    real = fused_adam._tile

    def wrong(p, g, m, v, s):
        s = s.clone()
        s[5] = 1.0
        real(p, g, m, v, s)
    fresh.setattr(fused_adam, "_tile", wrong)
    fresh.setattr(fused_adam.torch, "compile", lambda fn, **kw: fn)
    with pytest.warns(AidaptivWarning, match="disagrees with torch's eager tile"):
        assert fused_tile("bf16", "auto") is None
    fresh.setitem(fused_adam._COMPILED, "bf16", fused_adam._Compiled())
    fresh.setattr(fused_adam, "_tile", real)
    assert fused_tile("bf16", "on") is not None  # the right formula passes the same probe


def test_torch_compile_disable_keeps_the_eager_tile(fresh):
    fresh.setenv("TORCH_COMPILE_DISABLE", "1")
    with pytest.raises(AidaptivConfigError, match="TORCH_COMPILE_DISABLE"):
        fused_tile("bf16", "on")


# ------------------------------------------------------------------------------------------------ int8
def _int8(x: torch.Tensor, signed: bool) -> tuple:
    codes, scales = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(blockwise.n_blocks(x.numel()))
    blockwise.quantize(x, codes, scales, signed)
    return codes, scales


@pytest.mark.parametrize("kw", [{}, {"decoupled_weight_decay": False}, {"maximize": True}],
                         ids=["adamw", "adam-l2", "maximize"])
def test_fused_int8_tile_is_the_eager_tile_within_its_tolerance(tile8, kw):
    """Five steps over whole blocks at a block offset: codes and scales close (the same codec: equal moments code
    equally), parameters within 2.5% of lr per step, the block before the tile untouched."""
    group = _group(**kw)
    gen = torch.Generator().manual_seed(11)
    n, off = 256 * 301, 256
    p = torch.randn(n + off, generator=gen)
    m = _int8(torch.randn(n + off, generator=gen) * 1e-2, True)
    v = _int8(torch.rand(n + off, generator=gen) * 1e-4, False)
    ref = [p.clone(), tuple(t.clone() for t in m), tuple(t.clone() for t in v)]

    def part(x):
        return x[0][off:], x[1][off // 256:]
    with torch.no_grad():
        for step in range(1, 6):
            g = torch.randn(n + off, generator=gen) * 1e-2
            tile8(p[off:], g[off:], *part(m), *part(v), step_scalars(group, step))
            eager_tile(ref[0][off:], g[off:], part(ref[1]), part(ref[2]), group, step)
            assert int8_moments_close(m, ref[1], True) and int8_moments_close(v, ref[2], False), step
            assert ((p - ref[0]).abs() - 1e-6 * ref[0].abs()).max().item() <= 0.025 * group["lr"] * step, step
    assert torch.equal(p[:off], ref[0][:off]) and torch.equal(m[0][:off], ref[1][0][:off])
    assert torch.equal(m[1][:1], ref[1][1][:1])
    with pytest.raises(ValueError, match="whole blocks of 256"):
        tile8(p[:300], g[:300], m[0][:300], m[1][:2], v[0][:300], v[1][:2], step_scalars(group, 6))


@pytest.mark.parametrize("n,tile_numel,fused_part", [(10_007, 1024, True), (5000, 1024, True), (300, 1024, False),
                                                      (2 * 1024 + 256, 1024, True)])
def test_tiled_step_on_int8_slots_takes_the_fused_tile_and_the_eager_tile_for_the_rest(tile8, n, tile_numel,
                                                                                       fused_part):
    """int8 slots in a unit: whole-block tiles of two blocks or more step fused; the unit's short last block,
    and a last tile of one block (``2 * 1024 + 256``), step eagerly in the same step. The counter advances once;
    a unit too small for the fused tile (300) is the eager step bit for bit."""
    fmt = MOMENT_FORMATS["int8"]
    runs = []
    gen = torch.Generator().manual_seed(5)
    init = torch.randn(n, generator=gen)
    for fused in (None, tile8):
        lay = UnitLayout.packed(n, [("master", torch.float32), fmt.spec("s1", True), fmt.spec("s2", False)])
        buf = torch.zeros(lay.prefix_bytes(), dtype=torch.uint8)
        p = torch.nn.Parameter(lay.slots[0].view(buf))
        p.data.copy_(init)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1)
        runs.append((p, opt, fused, lay, buf))
    for it in range(3):
        grad = torch.randn(n, generator=gen)
        for p, opt, fused, lay, buf in runs:
            p.grad = grad.clone()
            slots = {"exp_avg": (lay.slots[1], buf), "exp_avg_sq": (lay.slots[2], buf)}
            if it == 0:
                assert tiled_adam_step(opt, opt.param_groups[0], p, tile_numel=tile_numel) or opt.step() is None
                for j, k in ((1, "exp_avg"), (2, "exp_avg_sq")):
                    lay.slots[j].write(buf, opt.state[p][k])
                    opt.state[p][k] = lay.slots[j].view(buf)
            else:
                assert tiled_adam_step(opt, opt.param_groups[0], p, tile_numel=tile_numel, slots=slots, fused=fused)
    (pe, oe, _, le, be), (pf, of, _, lf, bf) = runs
    assert torch.equal(oe.state[pe]["step"], of.state[pf]["step"]) and of.state[pf]["step"].item() == 3
    if not fused_part:
        assert torch.equal(be, bf)
        return
    assert not torch.equal(pe, pf)  # the fused tile ran
    assert ((pe - pf).abs() - 1e-6 * pe.abs()).max().item() <= 0.025 * 1e-3 * 3
    for j, signed in ((1, True), (2, False)):
        a = (le.slots[j].view(be), le.slots[j].scales(be))
        b = (lf.slots[j].view(bf), lf.slots[j].scales(bf))
        assert int8_moments_close(b, a, signed)


def test_one_int8_compile_serves_every_number_of_blocks(tile8):
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    g = _group()
    with torch.no_grad():
        for blocks in (2, 3, 17, 8192):
            n = 256 * blocks
            p, gr = torch.randn(n), torch.randn(n) * 1e-2
            m, v = _int8(torch.randn(n) * 1e-2, True), _int8(torch.rand(n) * 1e-4, False)
            tile8(p, gr, *m, *v, step_scalars(g, 2))
    assert counters["stats"]["unique_graphs"] == before


def test_fused_step_setting_is_checked():
    assert parse_section({}).optimizer_state.fused_step == "auto"
    assert parse_section({"optimizer_state": {"moments": "bf16", "fused_step": "off"}}).optimizer_state.fused_step == "off"
    with pytest.raises(AidaptivConfigError, match=r"optimizer_state\.fused_step.*\"auto\", \"on\" or \"off\""):
        parse_section({"optimizer_state": {"fused_step": True}})
