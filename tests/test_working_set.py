"""One working-set calculation (issue 39, item 2): the runtime and the planner describe a rank in the same
records (:class:`~aidaptiv_ds.planner.working_set.RankState`, ``RankPolicy``) and call the same function.

What the runtime reads off DeepSpeed's optimizer for a real engine (a small HF Llama, ZeRO-3, both offloads on
our backend) must be what the planner derives from the model's shape (:func:`~aidaptiv_ds.planner.plan.rank_state`),
so that ``aidaptiv-ds plan`` says what ``dram_budget: "auto"`` will really take out; DeepSpeed's default
``sub_group_size`` left unset as well as a small one set.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from _engine import nvme_config, one_rank_env
from aidaptiv_ds.bench.models import LlamaShape, describe
from aidaptiv_ds.planner.model_size import shape_from_config
from aidaptiv_ds.planner.plan import CacheDrive, PlanInput, cpu_rank_policy, rank_state
from aidaptiv_ds.planner.working_set import RankPolicy, RankState, rank_working_set

SHAPE = LlamaShape(hidden=128, intermediate=352, layers=2, heads=4, kv_heads=2, vocab=1024)


def test_the_cpu_and_accelerator_figures_follow_the_policy():
    state = RankState(subgroup_numels=(1000, 3000), grad_numels=(1000, 3000), largest_partition_numel=600,
                      param_bytes=16000, largest_subgroup_param_bytes=12000, staging_partition_bytes=2400,
                      accum_elsize=4, alias=True)
    on = rank_working_set(state, RankPolicy(cpu_rank=True, step_rides_forward=True))
    off = rank_working_set(state, RankPolicy(cpu_rank=True, step_in_backward=False, step_rides_forward=False))
    assert on.may_step_in_backward and on.rides and not off.may_step_in_backward and not off.rides
    assert on.grad_window == off.grad_window == 2 * 12288  # two of the largest slice, 4 KiB aligned
    assert on.in_backward_window > 0 and off.in_backward_window == 0 and off.master_hold == 0 < on.master_hold
    fp16 = rank_working_set(state, RankPolicy(cpu_rank=True, fp16=True, step_rides_forward=True))
    assert not fp16.may_step_in_backward and not fp16.rides
    gpu = rank_working_set(state, RankPolicy(cpu_rank=False))
    assert gpu.rides and gpu.pool_bytes == 0 and gpu.phases == {}  # "auto" rides beside an accelerator
    stateless = rank_working_set(dataclasses.replace(state, states=0), RankPolicy(cpu_rank=True))
    assert not stateless.may_step_in_backward and not stateless.rides


def test_the_gathered_parameters_partitions_are_in_the_pool_and_counted_once():
    """[Note: the gathered parameters' partitions] (planner/auto.py): over one rank the parameters DeepSpeed keeps
    gathered are their partitions, swap buffers inside DeepSpeed's counted working set: the pool holds them and
    the total stays; over two ranks the partitions come beside the gathered copies: the total and the pool both
    grow by them."""
    from aidaptiv_ds.planner.auto import live_partition_bytes

    assert live_partition_bytes(10**9, 1000, 4, partition_ranks=1) == 4000  # at most the model
    assert live_partition_bytes(500, 1000, 4, partition_ranks=2) == 1000  # 250 elements of each rank's
    assert live_partition_bytes(501, 1000, 2, partition_ranks=2) == 502  # a partition rounds up
    with pytest.raises(ValueError, match="partition_ranks 0"):
        live_partition_bytes(10, 10, 4, partition_ranks=0)
    state = RankState(subgroup_numels=(1000, 3000), grad_numels=(1000, 3000), largest_partition_numel=600,
                      param_bytes=16000, largest_subgroup_param_bytes=12000, staging_partition_bytes=2400,
                      accum_elsize=4, alias=True)
    base = RankPolicy(cpu_rank=True, deepspeed_bytes=20000)
    none = rank_working_set(state, base)
    one = rank_working_set(state, dataclasses.replace(base, live_partition_bytes=16000, gather_ranks=1))
    two = rank_working_set(state, dataclasses.replace(base, live_partition_bytes=8000, gather_ranks=2))
    assert one.total == none.total and one.pool_bytes == none.pool_bytes + 16000
    assert two.total == none.total + 8000 and two.pool_bytes == none.pool_bytes + 8000
    assert two.phases["forward"] == none.phases["forward"] + 8000
    assert two.phases["backward"] == none.phases["backward"] + 8000
    assert two.phases["optimizer"] == none.phases["optimizer"]  # released before the step
    gpu = rank_working_set(state, RankPolicy(cpu_rank=False, live_partition_bytes=16000))
    assert gpu.pool_bytes == 0


@pytest.mark.engine
@pytest.mark.parametrize("sub_group_size, offload_param, frozen_base",
                         [(None, "nvme", False), (30_000, "nvme", False), (None, "cpu", False), (None, "nvme", True)],
                         ids=["deepspeed-default", "small", "params-on-cpu", "frozen-base"])
def test_the_planner_derives_the_state_the_runtime_reads(tmp_path, monkeypatch, sub_group_size, offload_param,
                                                         frozen_base):
    import deepspeed
    from transformers import LlamaForCausalLM

    import aidaptiv_ds  # noqa: F401  (installs the hooks)

    one_rank_env(monkeypatch)
    cfg = nvme_config(tmp_path / "cache", dram_budget="auto")
    zero = cfg["zero_optimization"]
    for k in ("sub_group_size", "stage3_param_persistence_threshold"):  # DeepSpeed's defaults unless set
        zero.pop(k)
    zero["offload_param"].pop("max_in_cpu")
    if offload_param != "nvme":  # DeepSpeed keeps the parameters: no read-ahead, no pooled partitions, no alias
        zero["offload_param"] = {"device": offload_param}
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    torch.manual_seed(0)
    model = LlamaForCausalLM(SHAPE.hf_config())
    trainable = None
    if frozen_base:  # a LoRA-like run: the attention's q and v projections trained, the rest frozen
        for name, p in model.named_parameters():
            p.requires_grad = name.endswith(("q_proj.weight", "v_proj.weight"))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    try:
        ran_state, policy, ran = engine.optimizer._aidaptiv.working_set
        inp = PlanInput(shape=shape_from_config(SHAPE.hf_config().to_dict(), describe(SHAPE)), gpus=1, vram=0,
                        dram=64 << 30, drives=[CacheDrive(capacity=1 << 40)], cpu_ranks=True, dtype="fp32",
                        offload_param=offload_param, trainable_params=trainable,
                        **({} if sub_group_size is None else {"sub_group_size": sub_group_size}))
        planned = rank_state(inp)
        if frozen_base:  # the largest trainable partition (the gradient norm's scratch) is not known from a count
            assert planned.largest_partition_numel >= ran_state.largest_partition_numel
            planned = dataclasses.replace(planned, largest_partition_numel=ran_state.largest_partition_numel)
        # the staged partition matters beside an accelerator only (the planner's is the largest slice's)
        assert dataclasses.replace(planned, staging_partition_bytes=0) == \
            dataclasses.replace(ran_state, staging_partition_bytes=0)
        assert rank_working_set(planned, policy) == ran
        # and the choices: the planner's policy (read-ahead, DeepSpeed's working set, baseline, settings) is the
        # runtime's, given the activations the runtime leaves to the safety margin
        assert cpu_rank_policy(inp, planned, 0) == policy
        # "auto" resolved to bytes (how many depends on the memory free now: a busy machine may leave none)
        assert isinstance(engine.optimizer._aidaptiv.rt.budget, int) and engine.optimizer._aidaptiv.rt.budget >= 0
    finally:
        rt = engine.optimizer._aidaptiv.rt
        engine.destroy()
        rt.close()


@pytest.mark.engine
def test_steps_after_backward_for_want_of_drive_room_take_the_window_into_the_budget(tmp_path, monkeypatch):
    """``step_in_backward: "auto"`` and cache paths without room for a second copy of the optimizer state: the
    steps run after backward, and the ``"auto"`` budget is cut again by the working set without the in-backward
    window and the master hold ([Note: the budget follows the resolved path]); that working set is the planner's
    for the same choice. The store's refusal is stood in for (a real full drive: ``tests/test_training_faults.py``)."""
    import deepspeed
    from transformers import LlamaForCausalLM

    import aidaptiv_ds  # noqa: F401  (installs the hooks)
    from aidaptiv_ds.integration import stage3
    from aidaptiv_ds.io.errors import StorageFullError
    from aidaptiv_ds.store.store import SlabStore

    one_rank_env(monkeypatch)
    preflight = SlabStore.preflight

    def no_room_for_a_second_copy(self, nbytes, what="the training state"):
        if "second copy" in what:
            raise StorageFullError("/stand-in", nbytes, nbytes - 1, what)
        return preflight(self, nbytes, what)

    cuts = []

    def recorded_cut(**kw):
        cuts.append((kw["working_set_bytes"], budget(**kw)))
        return cuts[-1][1]

    budget = stage3.auto_dram_budget
    monkeypatch.setattr(SlabStore, "preflight", no_room_for_a_second_copy)
    monkeypatch.setattr(stage3, "auto_dram_budget", recorded_cut)
    cfg = nvme_config(tmp_path / "cache", dram_budget="auto")
    cfg["gradient_clipping"] = 1.0  # HF Trainer's default
    zero = cfg["zero_optimization"]
    for k in ("sub_group_size", "stage3_param_persistence_threshold"):  # DeepSpeed's defaults
        zero.pop(k)
    zero["offload_param"].pop("max_in_cpu")
    torch.manual_seed(0)
    model = LlamaForCausalLM(SHAPE.hf_config())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    try:
        opt = engine.optimizer
        ran_state, policy, ran = opt._aidaptiv.working_set
        assert policy.step_in_backward is False and not opt._aidaptiv.stepper.enabled
        assert ran.in_backward_window == 0 and ran.master_hold == 0
        speculating = rank_working_set(ran_state, dataclasses.replace(policy, step_in_backward="auto"))
        assert speculating.in_backward_window > 0 and speculating.total > ran.total
        # cut twice, the second time by the smaller working set, and that cut is the budget the run took
        assert len(cuts) == 2 and cuts[1][0] < cuts[0][0] and opt._aidaptiv.rt.budget == cuts[1][1]
        inp = PlanInput(shape=shape_from_config(SHAPE.hf_config().to_dict(), describe(SHAPE)), gpus=1, vram=0,
                        dram=64 << 30, drives=[CacheDrive(capacity=1 << 40)], cpu_ranks=True, dtype="fp32",
                        step_in_backward=False)
        planned = rank_state(inp)
        assert cpu_rank_policy(inp, planned, 0) == policy
        assert rank_working_set(dataclasses.replace(planned, staging_partition_bytes=0), policy) == \
            rank_working_set(dataclasses.replace(ran_state, staging_partition_bytes=0), policy)
    finally:
        rt = engine.optimizer._aidaptiv.rt
        engine.destroy()
        rt.close()
