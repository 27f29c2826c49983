"""The optimizer step inside the backward pass, kept exact by speculation (Fuyou's / Ratel's "active
gradient offloading"; DeepSpeed's ``superoffload_stage3.py`` does it for CPU Adam without clipping).

At the gradient-accumulation boundary, a sub-group's gradient is final as soon as every partition of
it that receives gradients has arrived in this micro-step (:attr:`SubGroupGrads.complete_now`). Its
master weights and moments are read then (prefetched when its first partition arrived) and Adam runs
on it while backward goes on with earlier layers; its gradient is dropped unwritten.

[Note: why it is speculative]

DeepSpeed's step depends on two things known only after the whole backward: the global gradient norm
(clipping: ``unscale_and_clip_grads`` scales every gradient by ``clamp(norm / clip, min=1)``) and
whether it is finite (DeepSpeed skips the step on an invalid norm, ``stage3.py:2883``, in any
precision, and the norm is all-reduced, so one rank's NaN skips every rank's step). So each early step
is a *speculation*: it assumes a clipping factor of exactly 1.0 (DeepSpeed then multiplies by ``1 /
loss_scale``: the same operation, the same bits) and writes its new state to a shadow extent, the
old one staying intact (:meth:`AidaptivOptimizerSwapper.begin_speculation`). When DeepSpeed's step
computes the norm (:meth:`BackwardStepper.settle`):

* finite and not clipping, and the optimizer's hyperparameters unchanged: **commit**: the shadows
  become current (a swap of two extents, no I/O) and DeepSpeed's per-sub-group loop skips those
  sub-groups;
* clipping: **redo**: the shadows are dropped, the optimizer's scalars (Adam's ``step``) restored, and
  DeepSpeed's loop steps those sub-groups again from the old state with the clipped gradients, which
  were kept for that (in DRAM within the budget, written beyond it);
* invalid (or an fp16 overflow): **roll back**: the shadows are dropped and the parameters rewritten
  from the old master weights (DeepSpeed skips the step).

[Note: the in-backward window] A step inside backward holds its sub-group's slice (fp32 master and
moments) while backward still holds the parameter read-ahead, the open gradient slices, DeepSpeed's
gathered parameters and buckets, and the activations. Unbounded, the read-ahead of the next
sub-groups' state and the write-back of the stepped ones kept three slices there (a 590M bf16 Llama
at budget 0: 0.88 GiB of optimizer slices beside backward's own 0.4), the optimizer phase stacked on
the backward phase. So a sub-group's state is read ahead (:meth:`BackwardStepper.prefetch`) only when
its slice fits beside the optimizer slices already in working memory under ``inflight_limit``, with
room left for the sub-groups whose steps come first and have no slice yet (gradients of several
sub-groups start arriving before the first of them is final: reading all of them ahead left no room
for the one whose step came first), and before a step reads what was not read ahead
(:meth:`BackwardStepper.step_in_backward`) the stepper waits for write-backs until it fits (or none
is left in flight: a step holds one slice whatever the window). The window is
:func:`aidaptiv_ds.planner.auto.in_backward_window_bytes` on a CPU rank (two slices: the one written
back and the next one read, so the optimizer's I/O still overlaps; what the planner adds to the
backward phase), the whole pipeline (three slices) where a GPU holds backward's working set. Waiting
never changes what is computed, only when: the results stay bit-identical. The backward compute
waits only when the drive is behind; the waits are counted (``StepCounters.window_waits``,
``optimizer_steps`` in the metrics).

[Note: no speculation right after a clipped step] A redo writes the sub-group's state a second time (and
reads it again), so a run whose norm clips on every step would pay for each step twice. After a step
whose global norm clipped, the next step runs after backward; once a step's norm does not clip, the
following one speculates again. Both paths are exact; only the cost differs (:attr:`clipped_last`).

A speculation costs a second extent per sub-group on the drives (``2 x`` the optimizer state while a
step is open) and, with clipping on, the kept gradients; the preflight decides whether the space is
there (:func:`speculation_mode`), otherwise every sub-group steps after backward.

Each sub-group has a :class:`SubGroupStep` record with an explicit state: ``PENDING`` -> (backward)
``SPECULATED`` -> (settle) ``COMMITTED`` or back to ``PENDING`` (redo, rollback) -> (end of step)
``PENDING``.
"""
from __future__ import annotations

import dataclasses
import enum
import logging

import torch

from ..spans import span
from .optimizer_state import AidaptivOptimizerState
from .phase import Phase

log = logging.getLogger("aidaptiv_ds")


class StepState(enum.Enum):
    PENDING = "pending"        # stepped by DeepSpeed's own loop after backward (if at all)
    STEPPING = "stepping"      # its speculative step is running (DeepSpeed's per-sub-group methods act)
    SPECULATED = "speculated"  # stepped in backward, new state in its shadow extent, old state kept
    COMMITTED = "committed"    # the speculation was accepted (or the deferred update ran): skipped this step
    DEFERRED = "deferred"      # its update rides the next forward (step_pipeline.py)


@dataclasses.dataclass
class SubGroupStep:
    """The in-backward step state of one optimizer sub-group (see the module's notes)."""
    index: int
    state: StepState = StepState.PENDING
    snapshot: dict | None = None  # optimizer scalars and state names before the speculative step
    hyper: dict | None = None  # the param group's hyperparameters the speculative step used
    gradient_kept: bool = False  # its gradient outlived the speculative step (a redo can use it)


@dataclasses.dataclass
class StepCounters:
    """Sub-group steps per path, cumulative (the metrics record their per-step deltas)."""
    in_backward: int = 0  # speculative steps run inside backward
    committed: int = 0  # of those, accepted
    redone: int = 0  # re-run after backward (clipping, changed hyperparameters)
    rolled_back: int = 0  # thrown away (invalid norm / overflow: the step was skipped)
    reopened: int = 0  # thrown away because DeepSpeed's state API looked at the sub-group before step()
    riding_forward: int = 0  # updated when the next forward needed them, not in step() (step_pipeline.py)
    after_backward: int = 0  # sub-groups DeepSpeed's own loop stepped (never speculated, or redone)
    window_waits: int = 0  # in-backward reads that first waited for write-backs ([Note: the in-backward window])

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _hyper(group: dict) -> dict:
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in group.items() if k != "params"}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


class BackwardStepper:
    """Runs, settles and undoes speculative sub-group steps for one Stage-3 optimizer ``opt``.

    Args:
        opt: the :func:`~aidaptiv_ds.integration.stage3.make_stage3_class` optimizer (DeepSpeed's
            per-sub-group methods are called on it).
        enabled: speculation allowed at all (the mode chosen at initialisation).
        keep_gradients: clipping is on: gradients must outlive their speculative step until settled (see
            :attr:`keeps_gradients` for the other reasons).
        inflight_limit: bytes of optimizer sub-group slices the steps inside backward may hold in working
            memory at once (read ahead, stepping, being written back); None: unbounded. See [Note: the
            in-backward window].
    """

    def __init__(self, opt, enabled: bool, keep_gradients: bool, inflight_limit: int | None = None) -> None:
        self.opt = opt
        self.enabled = enabled
        self.keep_gradients = keep_gradients
        self.state_api_used = False  # DeepSpeed's state API was called: gradients are kept ([Note: the state API])
        self.pipeline = None  # the engine's StepPipeline (step_pipeline.py), set once it is built
        self.boundaries = 0  # accumulation boundaries settled so far
        self.subgroups = [SubGroupStep(i) for i in range(len(opt.fp16_groups))]
        self.counters = StepCounters()
        self.clipped_last = False  # the last settled step's norm clipped (see the note above)
        self.inflight_limit = None if inflight_limit is None else int(inflight_limit)
        self._done_from = len(self.subgroups)  # sub-groups from here up are done for this backward

    # ------------------------------------------------------------------ queries
    @property
    def keeps_gradients(self) -> bool:
        """A speculative step keeps its gradient until the step is settled: with clipping (a redo needs it),
        in the first optimizer step, and once DeepSpeed's state API was used ([Note: the state API])."""
        return self.keep_gradients or self.state_api_used or self.boundaries == 0

    def state(self, index: int) -> StepState:
        return self.subgroups[index].state

    def skips(self, index: int) -> bool:
        """DeepSpeed's per-sub-group step methods do nothing for ``index`` (stepped in backward, or deferred)."""
        return self.subgroups[index].state in (StepState.SPECULATED, StepState.COMMITTED, StepState.DEFERRED)

    def wanted(self, index: int) -> bool:
        """Sub-group ``index`` will still be stepped this window (worth reading ahead)."""
        return self.subgroups[index].state is StepState.PENDING

    def speculated(self) -> list[SubGroupStep]:
        return [r for r in self.subgroups if r.state is StepState.SPECULATED]

    def _swapper_group(self, index: int):
        sw = self.opt.optimizer_swapper
        return sw, sw.groups[str(self.opt.fp32_partitioned_groups_flat[index].ds_id)]

    def may_speculate(self, index: int) -> bool:
        opt = self.opt
        if not self.enabled or opt.dtype == torch.float16 or not opt._swappable_optimizer_subgroup(index):
            return False
        if self.keep_gradients and self.clipped_last:
            return False
        sw, g = self._swapper_group(index)
        return sw.can_speculate(g)

    # ------------------------------------------------------------------ backward
    def _fits(self, g, keep_free: int = 0) -> bool:
        """Sub-group ``g`` 's slice is in DRAM already, or fits beside the optimizer slices in working memory
        under :attr:`inflight_limit` with ``keep_free`` bytes to spare (see [Note: the in-backward window])."""
        if self.inflight_limit is None or g.slice is not None:
            return True
        sw = self.opt.optimizer_swapper
        return sw.rt.tier.working_bytes("opt") + sw.slice_bytes(g) + keep_free <= self.inflight_limit

    def _make_room(self, g) -> None:
        """Wait for write-backs until :meth:`_fits` (or none is left in flight: a step holds one slice
        whatever the window)."""
        if self._fits(g):
            return
        self.counters.window_waits += 1
        sw = self.opt.optimizer_swapper
        with sw.rt.io_wait:
            while not self._fits(g) and sw.rt.tier.wait_oldest_write():
                pass

    def prefetch(self, index: int) -> None:
        """Backward reads sub-group ``index`` 's parameters or it is receiving its gradients: start reading
        its state if it fits in the in-backward window now, with room left for the sub-groups whose steps
        come first and have no slice yet (gradients of several sub-groups start arriving before the first
        of them is final, and those steps must still fit). A read ahead never waits: the step reads what
        was not read ahead. fp32 master weights come from the parameters backward reads
        (:class:`~aidaptiv_ds.integration.optimizer_swapper.AidaptivOptimizerSwapper`, [Note: master
        weights from the parameter reads])."""
        if self.subgroups[index].state is not StepState.PENDING:
            return
        if self.may_speculate(index):
            sw, g = self._swapper_group(index)
            if g.slice is None and self._fits(g, keep_free=self._ahead_without_slice(index) * sw.slice_bytes(g)):
                sw.prefetch(g, master_from_params=True)
        elif self.pipeline is not None and self.pipeline.needed_first(index):
            # it will ride the next forward, which needs it first: read it now, from the parameters backward
            # reads ([Note: reading ahead for the forward] in step_pipeline.py)
            sw, g = self._swapper_group(index)
            if g.slice is None and self._fits(g):
                sw.prefetch(g, master_from_params=True)

    def _waiting(self, j: int) -> bool:
        """Sub-group ``j`` may still be stepped inside backward in this step."""
        return self.subgroups[j].state is StepState.PENDING and self.may_speculate(j)

    def _ahead_without_slice(self, index: int) -> int:
        """Sub-groups after ``index`` (backward completes them first) that may still be stepped inside
        backward and have no slice yet: the room a read ahead of ``index`` must leave them.

        Only the stretch below :attr:`_done_from` is looked at: from there up every sub-group is done for
        this backward (stepped, or never stepped inside it), and since backward completes them from the
        top down that stretch stays short, so a backward costs O(sub-groups), not O(sub-groups^2)."""
        while self._done_from > index + 1 and not self._waiting(self._done_from - 1):
            self._done_from -= 1
        return sum(1 for j in range(index + 1, self._done_from)
                   if self._waiting(j) and self._swapper_group(j)[1].slice is None)

    def step_in_backward(self, index: int) -> bool:
        """Sub-group ``index`` 's gradient is final: step it now, speculatively. Returns True if it ran.
        The timeline's optimizer lane shows it as ``aidaptiv::step_in_backward`` (its swap-in, update and
        write-back nested)."""
        rec = self.subgroups[index]
        if rec.state is not StepState.PENDING or not self.may_speculate(index):
            return False
        with span("aidaptiv::step_in_backward", lane="optimizer", subgroup=int(index)):
            self._speculate(index, rec)
        return True

    def _speculate(self, index: int, rec: SubGroupStep) -> None:
        opt = self.opt
        sw, g = self._swapper_group(index)
        self._make_room(g)
        sw.prefetch(g, master_from_params=True, demand=True)  # if not read ahead: the master from parameters in DRAM
        fp32 = opt.fp32_partitioned_groups_flat[index]
        rec.gradient_kept = self.keeps_gradients
        rec.snapshot = sw.begin_speculation(g, fp32, keep_gradient=rec.gradient_kept)
        rec.hyper = _hyper(opt.optimizer.param_groups[opt.sub_group_to_group_id[index]])
        rec.state = StepState.STEPPING
        try:
            opt._prepare_sub_group(index, None)  # None: no read-ahead of the sub-group after it (stepped already)
            if index > 0:  # the sub-group backward completes next: its read runs while this one steps
                self.prefetch(index - 1)
            # no clipping assumed: DeepSpeed's own call with a clipping factor of exactly 1.0
            opt.unscale_and_clip_grads(index, torch.zeros((), dtype=torch.float64))
            opt._optimizer_step(index)
            opt._reassign_or_swap_out_partitioned_parameters(index)
            opt._release_sub_group(index, None)
        except BaseException:
            rec.state = StepState.PENDING
            sw.discard(g, fp32, rec.snapshot)
            raise
        rec.state = StepState.SPECULATED
        self.counters.in_backward += 1

    # ------------------------------------------------------------------ settle
    def settle(self, scaled_global_norm, loss_scale: float, clip_grad: float) -> None:
        """DeepSpeed computed the global norm (``step()``): commit or redo the speculated sub-groups
        (an invalid norm is left to :meth:`rollback_all`, which DeepSpeed's overflow clean-up triggers)."""
        from deepspeed.runtime.utils import is_invalid_grad_norm

        if is_invalid_grad_norm(scaled_global_norm):
            return
        clips = False
        if clip_grad > 0.0:  # DeepSpeed's unscale_and_clip_grads, stage3.py:2979-2988
            clip = ((scaled_global_norm / loss_scale) + 1e-6) / clip_grad
            clips = bool(torch.clamp(clip, min=1.0) != 1.0)
        self.clipped_last = clips
        pending = self.speculated()
        if not pending:
            return
        opt = self.opt
        for rec in pending:
            sw, g = self._swapper_group(rec.index)
            same = _same(rec.hyper, _hyper(opt.optimizer.param_groups[opt.sub_group_to_group_id[rec.index]]))
            if clips or not same:
                sw.discard(g, opt.fp32_partitioned_groups_flat[rec.index], rec.snapshot)
                rec.state = StepState.PENDING  # DeepSpeed's loop steps it again, from the old state
                self.counters.redone += 1
            else:
                sw.commit(g)
                if rec.gradient_kept:
                    sw.gradients.consume(rec.index)
                rec.state = StepState.COMMITTED
                self.counters.committed += 1

    def rollback_all(self) -> None:
        """The step is skipped (invalid norm, fp16 overflow): drop every speculation and rewrite its
        parameters from the old master weights."""
        opt = self.opt
        for rec in self.speculated() + [r for r in self.subgroups if r.state is StepState.COMMITTED]:
            sw, g = self._swapper_group(rec.index)
            fp32 = opt.fp32_partitioned_groups_flat[rec.index]
            if rec.state is StepState.COMMITTED:
                raise RuntimeError(f"aidaptiv_ds: sub-group {rec.index} was committed before the step was skipped")
            sw.discard(g, fp32, rec.snapshot)
            rec.state = StepState.STEPPING  # let DeepSpeed's methods act: restore the partitions
            try:
                opt._optimizer_states_and_gradient_swap_in(rec.index)
                opt._reassign_or_swap_out_partitioned_parameters(rec.index)
                opt._release_swap_buffers(rec.index)
            finally:
                rec.state = StepState.PENDING
            self.counters.rolled_back += 1

    def reopen(self, index: int, what: str) -> None:
        """DeepSpeed's state API is about to read or change sub-group ``index`` between backward and
        ``step()`` (``what`` names the call): a step speculated inside backward is undone, so the call sees
        the state before the step, as with DeepSpeed, and DeepSpeed's loop steps the sub-group after it
        ([Note: the state API]).

        Raises:
            GradientConsumedError: the speculative step consumed the sub-group's gradient (clipping off),
                so the step could not be redone after the call.
        """
        self.state_api_used = True
        rec = self.subgroups[index]
        if rec.state is not StepState.SPECULATED:
            return
        if not rec.gradient_kept:
            from .errors import GradientConsumedError
            raise GradientConsumedError(
                f"aidaptiv_ds: {what} between backward and step(): optimizer sub-group {index} was already stepped "
                f"inside the backward pass and its gradient consumed (gradient_clipping is 0, so gradients are "
                f"not kept for the step). From the next step on gradients are kept until step() in this process, "
                f"so such calls work. Fix: call the state API from the first step on, or set "
                f"\"aidaptiv\": {{\"step_in_backward\": false}} (or keep gradient clipping on)")
        sw, g = self._swapper_group(index)
        sw.discard(g, self.opt.fp32_partitioned_groups_flat[index], rec.snapshot)
        rec.state = StepState.PENDING  # DeepSpeed's loop steps it, after the call
        rec.snapshot = rec.hyper = None
        self.counters.reopened += 1

    def end_step(self, stepped_after: int) -> None:
        """The optimizer step is over: every record back to ``PENDING``."""
        self.boundaries += 1
        self.counters.after_backward += stepped_after
        self._done_from = len(self.subgroups)
        for rec in self.subgroups:
            rec.state = StepState.PENDING
            rec.snapshot = rec.hyper = None


class BackwardStepMixin:
    """In-backward step overrides of the Stage-3 subclass (DeepSpeed 0.19.8 seams:
    ``_prepare_sub_group``, ``unscale_and_clip_grads``, ``_optimizer_step``,
    ``_reassign_or_swap_out_partitioned_parameters``, ``_release_sub_group`` (``stage3.py:2702-2741,
    1235-1262, 2854-2864, 2979-2988``) do nothing for a sub-group stepped in backward;
    ``_partitioned_params_swap_out`` (``stage3.py:1271-1290``) sends every NVMe partition to the swapper
    whatever its status; ``_get_norm_groups`` (``stage3.py:2573``) settles the speculations;
    ``_overflow_clean_up`` and ``_post_step`` (``stage3.py:2799, 2835``) end them; ``backward_prologue`` /
    ``backward_epilogue`` (``stage3.py:3050-3068``) bound the backward in which published parameters start
    their sub-groups' reads)."""

    _aidaptiv: AidaptivOptimizerState  # the engine's record (optimizer_state.py): its stepper, phase, pipeline

    # ---------------------------------------------------------------- called from partition_grads
    def _aidaptiv_gradient_arriving(self, index: int, param) -> None:
        st = self._aidaptiv.stepper
        if st is not None and st.skips(index):
            from .config import AidaptivConfigError
            raise AidaptivConfigError(
                f"aidaptiv_ds: parameter ds_id={param.ds_id} received a gradient after the optimizer step of its "
                f"sub-group {index} already ran inside the backward pass (reentrant activation checkpointing, or one "
                f"parameter used across several backward calls of one accumulation boundary). Fix: set "
                f"\"aidaptiv\": {{\"step_in_backward\": false}}, or use non-reentrant checkpointing "
                f"(use_reentrant=False).")

    def _aidaptiv_params_used(self, ds_ids) -> None:
        """The parameter swapper publishes partitions ``ds_ids``: inside the boundary backward, start
        reading their sub-groups' optimizer state (the first use in backward comes before the first
        gradient, which waits for its reduce bucket; read then, the master slot fills from these reads)."""
        st = self._aidaptiv.stepper
        if st is None or not (self._aidaptiv.phase.open(Phase.BACKWARD) and self.is_gradient_accumulation_boundary()):
            return
        where = self._aidaptiv.grad_where
        for i in sorted({where[d][0] for d in ds_ids if d in where}, reverse=True):
            st.prefetch(i)

    def backward_prologue(self):
        self._aidaptiv_drain()  # updates of sub-groups the forward did not gather
        super().backward_prologue()
        self._aidaptiv.phase.begin_backward()

    def backward_epilogue(self):
        self._aidaptiv.phase.end_backward()
        super().backward_epilogue()
        sw = getattr(self, "optimizer_swapper", None)
        if sw is not None and hasattr(sw, "release_held"):
            sw.release_held()  # the steps inside this backward are over

    def _aidaptiv_holds_master(self, index: int) -> bool:
        """Inside the boundary backward, sub-group ``index`` is still to be stepped in it: the parameter bytes
        backward leaves before the sub-group has a slice are kept for its master slot
        (:meth:`AidaptivOptimizerSwapper.take_master_bytes`)."""
        st = self._aidaptiv.stepper
        return (st is not None and self._aidaptiv.phase.open(Phase.BACKWARD)
                and self.is_gradient_accumulation_boundary()
                and st._waiting(index))

    def _aidaptiv_gradient_started(self, index: int) -> None:
        if self._aidaptiv.stepper is not None:
            self._aidaptiv.stepper.prefetch(index)

    def _aidaptiv_gradient_final(self, index: int) -> None:
        st = self._aidaptiv.stepper
        if st is not None and st.step_in_backward(index) and index > 0:
            st.prefetch(index - 1)  # the next sub-group backward completes

    # ---------------------------------------------------------------- DeepSpeed's step loop
    def _aidaptiv_skips(self, index: int) -> bool:
        return self._aidaptiv.stepper is not None and self._aidaptiv.stepper.skips(index)

    def _prepare_sub_group(self, sub_group_id, timer_names):
        pl = self._aidaptiv.pipeline
        if pl is not None and timer_names is not None and pl.should_defer(sub_group_id):  # DeepSpeed's step loop
            pl.defer(sub_group_id)
            return
        if not self._aidaptiv_skips(sub_group_id):
            super()._prepare_sub_group(sub_group_id, timer_names)

    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        pl = self._aidaptiv.pipeline
        if pl is not None and self._aidaptiv.stepper is not None and \
                self._aidaptiv.stepper.subgroups[sub_group_id].state is StepState.DEFERRED:
            pl.record_norm(total_norm)
        if not self._aidaptiv_skips(sub_group_id):
            super().unscale_and_clip_grads(sub_group_id, total_norm)

    def _optimizer_step(self, sub_group_id):
        if not self._aidaptiv_skips(sub_group_id):
            super()._optimizer_step(sub_group_id)

    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        if not self._aidaptiv_skips(sub_group_id):
            super()._reassign_or_swap_out_partitioned_parameters(sub_group_id)

    def _release_sub_group(self, sub_group_id, timer_names):
        if not self._aidaptiv_skips(sub_group_id):
            super()._release_sub_group(sub_group_id, timer_names)

    def _partitioned_params_swap_out(self, i):
        """DeepSpeed's method (``stage3.py:1271-1290``), except that every partition on the cache tier goes
        to the swapper even when ``AVAILABLE`` (DeepSpeed copies into an available partition in place,
        which is right after ``_partition_all_parameters`` but not inside backward, where the partition
        being released is still published): the swapper unpublishes it and writes the new content."""
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus

        offset = 0
        fp32 = self.fp32_partitioned_groups_flat[i]
        dst, src = [], []
        for param, part in zip(self.fp16_groups[i], self.fp16_partitioned_groups[i]):
            view = fp32.narrow(0, offset, part.ds_numel)
            if getattr(part, "final_location", None) == OffloadDeviceEnum.nvme:
                dst.append(param)
                src.append(view)
            elif part.status == PartitionedParamStatus.AVAILABLE:
                part.data.copy_(view.data)
            else:
                dst.append(param)
                src.append(view)
            offset += part.ds_numel
        if dst:
            dst[0].nvme_swapper.swap_out_partitioned_params(dst_fp16_params=dst, src_fp32_params=src)

    def _get_norm_groups(self):
        groups = super()._get_norm_groups()
        if self._aidaptiv.stepper is not None:
            from deepspeed.runtime.utils import combine_grad_norm_groups
            self._aidaptiv.stepper.settle(combine_grad_norm_groups(groups), self.loss_scale, self.clip_grad)
        return groups

    def _overflow_clean_up(self, prev_scale):
        if self._aidaptiv.stepper is not None:
            self._aidaptiv.stepper.rollback_all()
        super()._overflow_clean_up(prev_scale)
        if self._aidaptiv.stepper is not None:
            self._aidaptiv.stepper.end_step(0)

    def _post_step(self, timer_names):
        st = self._aidaptiv.stepper
        after = len(self.fp16_groups) - (sum(st.skips(i) for i in range(len(self.fp16_groups))) if st else 0)
        pl = self._aidaptiv.pipeline
        if pl is not None and pl.pending and not pl.started:  # the rest of the step rides the next forward
            pl.start(after)
            return
        super()._post_step(timer_names)
        if st is not None:
            st.end_step(after)

    def _aidaptiv_drain(self) -> None:
        """Run the optimizer updates still riding the forward (step_pipeline.py, [Note: exactness])."""
        if self._aidaptiv.pipeline is not None:
            self._aidaptiv.pipeline.drain()

    def _pre_step(self):
        self._aidaptiv_drain()  # a step() with nothing between it and the last one
        super()._pre_step()
