"""The tiled host optimizer step (:mod:`aidaptiv_ds.integration.host_step`) is torch's own Adam/AdamW step,
bit for bit, and steps aside wherever it would not be."""
from __future__ import annotations

import itertools

import pytest
import torch

from aidaptiv_ds.integration.host_step import tiled_adam_step


def _opt(cls, n, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    return p, cls([p], lr=1e-3, **kw), g


def _grad(p, g, it):
    p.grad = (torch.randn(p.shape, generator=g) * (it + 1)).to(p.dtype)


@pytest.mark.parametrize("cls,amsgrad,maximize,wd,n,tile", [
    (cls, a, m, wd, n, tile) for (cls, a, m, wd), (n, tile) in itertools.product(
        itertools.product([torch.optim.Adam, torch.optim.AdamW], [False, True], [False, True], [0.0, 0.1]),
        [(10_007, 1000), (300_001, 65_536)]) if not (m and n > 20_000)])
def test_tiled_step_is_torch_step(cls, amsgrad, maximize, wd, n, tile):
    ref, ref_opt, gr = _opt(cls, n, amsgrad=amsgrad, maximize=maximize, weight_decay=wd)
    got, got_opt, gg = _opt(cls, n, amsgrad=amsgrad, maximize=maximize, weight_decay=wd)
    for it in range(4):  # the first step initialises the state (torch's _init_group), the rest reuse it
        _grad(ref, gr, it)
        _grad(got, gg, it)
        ref_opt.step()
        assert tiled_adam_step(got_opt, got_opt.param_groups[0], got, tile_numel=tile)
    assert torch.equal(ref.data, got.data)
    for k, v in ref_opt.state[ref].items():
        assert torch.equal(v, got_opt.state[got][k]), k


class _MyAdam(torch.optim.AdamW):
    pass


@pytest.mark.parametrize("why", ["subclass", "foreach", "hook", "small", "bf16", "two-params", "no-grad"])
def test_tiled_step_steps_aside(why):
    n = 5000
    cls = _MyAdam if why == "subclass" else torch.optim.AdamW
    p, opt, g = _opt(cls, n, foreach=True if why == "foreach" else None)
    if why == "bf16":
        p.data = p.data.bfloat16()
    _grad(p, g, 0)
    if why == "no-grad":
        p.grad = None
    if why == "two-params":
        opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3)))
    handle = opt.register_step_pre_hook(lambda *a: None) if why == "hook" else None
    before = p.detach().clone()
    assert not tiled_adam_step(opt, opt.param_groups[0], p, tile_numel=n if why == "small" else 100)
    assert torch.equal(p.detach(), before) and not opt.state
    if handle is not None:
        handle.remove()
