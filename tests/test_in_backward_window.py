"""The in-backward window (issue 16): optimizer steps inside backward hold at most
two sub-group slices, and the planner adds exactly that
to the backward phase ([Note: the in-backward window] in ``aidaptiv_ds/integration/backward_step.py``).

Unit tests: the planner's arithmetic, and :class:`~aidaptiv_ds.integration.backward_step.BackwardStepper`'s
read-ahead decisions against a real :class:`~aidaptiv_ds.tiers.HostTier` with a stand-in swapper. That the
bounded schedule still gives DeepSpeed's bits is the oracle's job (``tests/test_step_in_backward.py``).
"""
from __future__ import annotations

import types

import torch

from aidaptiv_ds.integration.backward_step import BackwardStepper
from aidaptiv_ds.planner.auto import cpu_rank_working_set, in_backward_window_bytes
from aidaptiv_ds.tiers import HostTier, TieredUnit

MiB = 1 << 20


def test_window_is_two_slices():
    assert in_backward_window_bytes(largest_slice_bytes=250) == 500
    assert in_backward_window_bytes(largest_slice_bytes=0) == 0


def test_cpu_rank_working_set_counts_the_window_in_backward():
    kw = dict(readahead_bytes=256 * MiB, grad_window_bytes=80 * MiB, deepspeed_bytes=160 * MiB, activation_bytes=0,
              subgroup_numels=[20_000_000] * 5, moment_bytes_per_param=8, baseline_bytes=0)
    off = cpu_rank_working_set(**kw)
    on = cpu_rank_working_set(**kw, in_backward_slice_bytes=240_000_000)
    assert off["in_backward"] == 0 and off["total"] == max(off["backward"], off["optimizer"])
    assert on["optimizer"] == off["optimizer"] == 3 * 20_000_000 * 16
    assert on["in_backward"] == 2 * 240_000_000
    assert on["backward"] == off["backward"] + on["in_backward"]
    # backward + window never exceeds the larger of backward + two slices and the optimizer phase
    assert on["total"] == max(off["backward"] + 2 * 240_000_000, off["optimizer"])
    big = cpu_rank_working_set(**{**kw, "activation_bytes": 2 << 30}, in_backward_slice_bytes=240_000_000)
    assert big["in_backward"] == 2 * 240_000_000 and big["total"] == big["backward"]


def test_planner_counts_the_window_only_where_steps_may_run_inside_backward():
    from aidaptiv_ds.planner.model_size import shape_from_config
    from aidaptiv_ds.planner.plan import CacheDrive, PlanInput, make_plan

    cfg = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2752, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 8192}
    base = dict(shape=shape_from_config(cfg, "t"), gpus=1, vram=0, dram=64 << 30, drives=[CacheDrive(capacity=1 << 50)],
                dram_budget=0, micro_batch=1, seq_len=128, dtype="bf16", cpu_ranks=True, sub_group_size=20_000_000,
                max_live_parameters=20_000_000, reduce_bucket_size=20_000_000, activation_checkpointing=True)
    on = make_plan(PlanInput(**base))
    off = make_plan(PlanInput(**base, step_in_backward=False))
    assert on.cpu_rank_host["in_backward"] >= 20_000_000 * 12 and off.cpu_rank_host["in_backward"] == 0


def test_a_drive_without_room_for_a_second_copy_plans_the_budget_of_steps_after_backward():
    """``step_in_backward: "auto"`` on a drive that holds the state and the gradients but not a second copy of the
    state: the steps run after backward, so the plan, like the runtime ([Note: the budget follows the resolved
    path] in ``integration/stage3.py``), cuts the ``"auto"`` budget by the working set without the in-backward
    window and the master hold: the budget gets those bytes."""
    from aidaptiv_ds.planner.model_size import shape_from_config
    from aidaptiv_ds.planner.plan import CacheDrive, PlanInput, make_plan

    cfg = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2752, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 8192}
    base = dict(shape=shape_from_config(cfg, "t"), gpus=1, vram=0, dram=7 << 30, micro_batch=1, seq_len=128,
                dtype="fp32", cpu_ranks=True, sub_group_size=20_000_000)  # DeepSpeed's max_live, clipping 1.0
    roomy = make_plan(PlanInput(**base, drives=[CacheDrive(capacity=1 << 50)]))
    small_drive = [CacheDrive(capacity=2_500_000_000)]  # what the budget leaves of the state fits, not a second copy
    small = make_plan(PlanInput(**base, drives=small_drive))
    after = make_plan(PlanInput(**base, drives=small_drive, step_in_backward=False))
    assert roomy.residency["step_in_backward"] and not small.residency["step_in_backward"]
    assert roomy.cpu_rank_host["in_backward"] > 0 and small.cpu_rank_host == after.cpu_rank_host
    assert small.cpu_rank_host["in_backward"] == 0 and small.dram == after.dram
    freed = roomy.dram["working_set_bytes"] - small.dram["working_set_bytes"]
    assert freed >= roomy.cpu_rank_host["in_backward"]  # the window, and the master hold with it
    assert small.dram["budget_bytes"] - roomy.dram["budget_bytes"] == freed > 0
    assert small.schedules["layer-major"]["rank_host_bytes"] == after.schedules["layer-major"]["rank_host_bytes"]


class _Swapper:
    """What the stepper asks of the optimizer swapper: slice sizes, the tier, prefetch."""

    def __init__(self, tier: HostTier, slice_bytes: int, n: int) -> None:
        self.rt = types.SimpleNamespace(tier=tier, io_wait=_NoWait())
        self.groups = {str(i): types.SimpleNamespace(index=i, slice=None) for i in range(n)}
        self._bytes = slice_bytes
        self.prefetched: list[int] = []

    def slice_bytes(self, g) -> int:
        return self._bytes

    def can_speculate(self, g) -> bool:
        return True

    def prefetch(self, g, master_from_params: bool = False, demand: bool = False) -> None:
        g.slice = self.rt.tier.add(TieredUnit(("opt", g.index), torch.empty(self._bytes, dtype=torch.uint8), kind="opt",
                                         prefetched=True))
        self.prefetched.append(g.index)


class _NoWait:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _stepper(limit: int | None, n: int = 6, slice_bytes: int = 100):
    tier = HostTier(budget=0)
    sw = _Swapper(tier, slice_bytes, n)
    flat = [types.SimpleNamespace(ds_id=i) for i in range(n)]
    opt = types.SimpleNamespace(optimizer_swapper=sw, fp32_partitioned_groups_flat=flat, fp16_groups=[[]] * n,
                                dtype=torch.float32, _swappable_optimizer_subgroup=lambda i: True)
    return BackwardStepper(opt, enabled=True, keep_gradients=False, inflight_limit=limit), sw


def test_read_ahead_keeps_room_for_the_sub_group_that_completes_first():
    """Gradients of sub-groups 3, 5, 4 start arriving (in that order) before 5 is final. With a window of 2.5
    slices, 3 is not read ahead (5 and 4 complete first and have no slice yet: it would need room for one
    more), 5 is, and then 4, the next in line. Unbounded, all three are."""
    st, sw = _stepper(limit=250)
    for i in (3, 5, 4):
        st.prefetch(i)
    assert sw.prefetched == [5, 4]
    assert sw.rt.tier.working_bytes("opt") == 200
    free, sw_free = _stepper(limit=None)
    for i in (3, 5, 4):
        free.prefetch(i)
    assert sw_free.prefetched == [3, 5, 4]


def test_make_room_returns_when_nothing_is_left_to_wait_for():
    """A step needs its own slice whatever the window: with nothing in flight to wait for, it goes ahead
    (counted as a wait only when the window was full)."""
    st, sw = _stepper(limit=250)
    st.prefetch(5)
    st._make_room(sw.groups["4"])  # 100 + 100 <= 250: room, no wait
    assert st.counters.window_waits == 0
    sw.prefetch(sw.groups["4"])  # 4's state read on demand: 200 in working memory
    st._make_room(sw.groups["3"])  # 200 + 100 > 250 and nothing writing: counted, then goes ahead
    assert st.counters.window_waits == 1
    st._make_room(sw.groups["5"])  # in DRAM already: no wait
    assert st.counters.window_waits == 1


def test_room_left_ahead_counts_only_the_stretch_still_in_backward():
    """The count of sub-groups ahead without a slice equals a scan of all of them, while the scan itself
    stops where every sub-group above is done (stepped); a new step starts from the top again."""
    from aidaptiv_ds.integration.backward_step import StepState

    st, sw = _stepper(limit=10_000, n=8)

    def brute(i):
        return sum(1 for j in range(i + 1, 8) if st.subgroups[j].state is StepState.PENDING
                   and sw.groups[str(j)].slice is None)

    for j in (7, 6, 5):
        st.subgroups[j].state = StepState.SPECULATED
    sw.prefetch(sw.groups["3"])
    assert st._ahead_without_slice(2) == brute(2) == 1  # 4 (3 has a slice; 5-7 stepped)
    assert st._done_from == 5
    st.end_step(0)
    assert st._done_from == 8 and st._ahead_without_slice(2) == brute(2) == 4


def test_norm_scratch_counts_in_backward_only():
    """The gradient-norm scratch (integration/grad_norms.py) is 8 B per element of the largest partition's
    largest split, counted in the backward phase; a split above the cap takes DeepSpeed's own copy (0)."""
    from aidaptiv_ds.planner.auto import NORM_SCRATCH_MAX_NUMEL, norm_scratch_bytes
    assert norm_scratch_bytes(24_576_000) == 8 * 24_576_000
    assert norm_scratch_bytes(NORM_SCRATCH_MAX_NUMEL + 1) == 0
    assert norm_scratch_bytes(0) == 0
    kw = dict(readahead_bytes=1 << 28, grad_window_bytes=1 << 28, deepspeed_bytes=1 << 28, activation_bytes=0,
              subgroup_numels=[10_000_000], moment_bytes_per_param=8)
    off, on = cpu_rank_working_set(**kw), cpu_rank_working_set(**kw, norm_scratch=8 << 20)
    assert on["backward"] - off["backward"] == 8 << 20 and on["optimizer"] == off["optimizer"]


def test_master_hold_counts_in_backward_only():
    """The parameter bytes kept for a master slot (optimizer_swapper.py, [Note: master weights from the
    parameter reads]) are one master slot, counted in the backward phase of a CPU rank and in the host
    working set of a GPU rank."""
    from aidaptiv_ds.planner.auto import host_working_set, master_hold_bytes
    assert master_hold_bytes(80_000_000) == 80_000_000 and master_hold_bytes(-1) == 0
    kw = dict(readahead_bytes=1 << 28, grad_window_bytes=1 << 28, deepspeed_bytes=1 << 28, activation_bytes=0,
              subgroup_numels=[10_000_000], moment_bytes_per_param=8)
    off, on = cpu_rank_working_set(**kw), cpu_rank_working_set(**kw, master_hold=40 << 20)
    assert on["backward"] - off["backward"] == 40 << 20 and on["optimizer"] == off["optimizer"]
    g = dict(largest_slice_partition_bytes=1 << 20, largest_subgroup_numel=1 << 20, moment_bytes_per_param=8)
    assert host_working_set(**g, master_hold_bytes=4 << 20) - host_working_set(**g) == 4 << 20


def test_next_sub_group_is_read_while_this_one_steps():
    """Inside a step in backward, once sub-group 1's slice is bound, sub-group 0 (the one backward completes
    next) starts reading if the window holds both: before 1's update runs, not after it. With a window of
    one slice it does not (its read then waits for the step's end, as before)."""
    for limit, expect in ((200, [1, 0]), (100, [1])):
        st, sw = _stepper(limit=limit, n=2)
        seen: list[list[int]] = []
        sw.begin_speculation = lambda g, fp32, keep_gradient: {}
        opt = st.opt
        opt.sub_group_to_group_id = {0: 0, 1: 0}
        opt.optimizer = types.SimpleNamespace(param_groups=[{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                             "weight_decay": 0.0}])
        opt._prepare_sub_group = lambda i, timers: None
        opt.unscale_and_clip_grads = lambda i, norm: None
        opt._optimizer_step = lambda i: seen.append(list(sw.prefetched))
        opt._reassign_or_swap_out_partitioned_parameters = lambda i: None
        opt._release_sub_group = lambda i, timers: None
        assert st.step_in_backward(1)
        assert seen == [expect], (limit, seen)
