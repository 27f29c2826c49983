"""A state-API call that DeepSpeed fails half-way leaves nothing held (``integration/state_api.py``).

DeepSpeed's ``_get_fp32_opt_state_partition`` swaps the parameter's sub-group in and then looks the moment up; before
the first step there is none, and it raises ``KeyError`` (as on its CPU offload) without releasing the swap buffers.
Found by a new-user trial: at ``dram_budget`` 0 the sub-group stayed held, and the next ``load_checkpoint`` crashed in
``install_subgroup`` (``AttributeError: 'NoneType' object has no attribute 'refs'``).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.engine


def test_a_moment_asked_for_before_the_first_step_raises_and_holds_nothing(tmp_path, monkeypatch):
    import deepspeed
    from _engine import nvme_config, one_rank_env
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    import aidaptiv_ds  # noqa: F401  (installs the hooks)

    one_rank_env(monkeypatch)

    def engine(cache):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Linear(40, 48))
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=nvme_config(tmp_path / cache, dram_budget=0))
        return eng, model

    def close(eng):
        rt = eng.optimizer._aidaptiv.rt
        eng.destroy()
        rt.close()

    def train(eng, steps):
        torch.manual_seed(1)
        for _ in range(steps):
            eng.backward(eng(torch.randn(4, 48)).pow(2).mean())
            eng.step()

    eng, model = engine("a")
    train(eng, 2)
    eng.save_checkpoint(str(tmp_path / "ckpt"), tag="t2")
    want = [safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    want_m = safe_get_full_optimizer_state(model[1].weight, "exp_avg").clone()
    close(eng)

    fresh, model = engine("b")
    sw = fresh.optimizer.optimizer_swapper
    with pytest.raises(KeyError):  # as DeepSpeed's CPU offload raises it: no moment before the first step
        safe_get_full_optimizer_state(model[1].weight, "exp_avg")
    assert all(sw.refs(p) == 0 for p in fresh.optimizer.fp32_partitioned_groups_flat)
    fresh.load_checkpoint(str(tmp_path / "ckpt"), tag="t2")  # crashed here
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.equal(safe_get_full_fp32_param(p), w)
    assert torch.equal(safe_get_full_optimizer_state(model[1].weight, "exp_avg"), want_m)
    train(fresh, 1)  # and training goes on
    close(fresh)
