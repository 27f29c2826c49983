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
from aidaptiv_ds.tiers import fused_adam
from aidaptiv_ds.tiers.fused_adam import bf16_tile, eager_tile, moments_close, step_scalars


@pytest.fixture(scope="module")
def tile():
    t = bf16_tile("auto")
    if t is None:
        pytest.skip(f"the fused tile does not compile here: {fused_adam._Compiled.error}")
    return t


def _group(**kw) -> dict:
    g = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "maximize": False,
         "decoupled_weight_decay": True}
    g.update(kw)
    return g


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
    """Tiles of other lengths and offsets, a new learning rate (a schedule), and a call from another thread
    reuse the one kernel compiled at configuration ([Note: compiling once])."""
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    base = torch.randn(3_000_000)
    g = torch.randn(3_000_000) * 1e-2
    m, v = torch.zeros(3_000_000, dtype=torch.bfloat16), torch.zeros(3_000_000, dtype=torch.bfloat16)
    with torch.no_grad():
        for a, n, lr in ((0, 17, 1e-3), (1, 1000, 2e-3), (12_345, 2 << 20, 3e-4), (3, 2_999_997, 1e-5)):
            tile(base[a:a + n], g[a:a + n], m[a:a + n], v[a:a + n], step_scalars(_group(lr=lr), 3))
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


def test_tiled_step_takes_the_fused_tile_for_bf16_moments_only(tile):
    """The tiled step with the fused tile: bf16 moments step in it (the counter once, as torch), within the
    tolerance of the eager tiled step; fp32 moments (the first step's, torch's) and amsgrad keep the eager
    tile, bit for bit."""
    n = 10_007
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(n, generator=gen)
    runs = []
    for fused in (None, tile):
        p = torch.nn.Parameter(init.clone())
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1)
        runs.append((p, opt, fused))
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
    monkeypatch.setattr(fused_adam._Compiled, "kernel", None)
    monkeypatch.setattr(fused_adam._Compiled, "error", None)
    monkeypatch.setattr(fused_adam._Compiled, "warned", False)
    return monkeypatch


def test_without_a_compiler_auto_warns_and_keeps_the_eager_tile_and_on_refuses(fresh):
    def no_compiler(fn, **kw):
        def run(*a):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return run
    fresh.setattr(fused_adam.torch, "compile", no_compiler)
    with pytest.warns(AidaptivWarning, match="eager tile.*InvalidCxxCompiler"):
        assert bf16_tile("auto") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bf16_tile("auto") is None  # warned once per process
    with pytest.raises(AidaptivConfigError, match=r"fused_step is \"on\".*C\+\+ compiler.*Fix.*\"off\""):
        bf16_tile("on")
    assert bf16_tile("off") is None
    with pytest.raises(AidaptivConfigError, match=r"fused_step is 'fast'.*Fix"):
        bf16_tile("fast")


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
        assert bf16_tile("auto") is None
    fresh.setattr(fused_adam._Compiled, "error", None)
    fresh.setattr(fused_adam, "_tile", real)
    assert bf16_tile("on") is not None  # the right formula passes the same probe


def test_torch_compile_disable_keeps_the_eager_tile(fresh):
    fresh.setenv("TORCH_COMPILE_DISABLE", "1")
    with pytest.raises(AidaptivConfigError, match="TORCH_COMPILE_DISABLE"):
        bf16_tile("on")


def test_fused_step_setting_is_checked():
    assert parse_section({}).optimizer_state.fused_step == "auto"
    assert parse_section({"optimizer_state": {"moments": "bf16", "fused_step": "off"}}).optimizer_state.fused_step == "off"
    with pytest.raises(AidaptivConfigError, match=r"optimizer_state\.fused_step.*\"auto\", \"on\" or \"off\""):
        parse_section({"optimizer_state": {"fused_step": True}})
