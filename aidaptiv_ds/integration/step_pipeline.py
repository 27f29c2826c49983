"""The optimizer step riding the next forward: each sub-group is updated when the next forward needs its
parameters, while the drives read the next sub-groups' state and write back the earlier ones.

[Note: why the step rides the forward]
With gradient clipping on (HF Trainer's and DeepSpeed's default of 1.0) and a norm that clips, the steps inside
backward (``backward_step.py``) must wait for the global norm, so the whole optimizer I/O -- every sub-group's
fp32 master and moments read and written, its kept gradient read back -- ran after backward while nothing
computed. Here ``step()`` does what DeepSpeed's does up to its per-sub-group loop (the norm, the clipping
factor, the overflow check), and the loop defers every sub-group whose state is on the drives
(:meth:`StepPipeline.defer`) instead of stepping it. ``step()`` returns; the next forward's gather of a
module's parameters first runs the deferred update of their sub-group (:func:`ensure_before_gather`, on
DeepSpeed's ``Init._ensure_availability_of_partitioned_params``, through which every all-gather of a
parameter passes), and each update starts the read of the next sub-group's state. So the optimizer's reads
and write-backs overlap the forward's compute (GreedySnake, arXiv 2512.17570, does this for the step
after backward).

[Note: exactness] The updates are DeepSpeed's own per-sub-group calls (``_prepare_sub_group``,
``unscale_and_clip_grads`` with the norm ``step()`` computed, ``_optimizer_step``,
``_reassign_or_swap_out_partitioned_parameters``, ``_release_sub_group``), with the param group's
hyperparameters as they were when ``step()`` ran (the engine steps the learning-rate scheduler right after
it): only *when* they run changes, so the results are bit-identical. Everything that looks at the state
first runs what is left (:meth:`StepPipeline.drain`): the next backward, the next ``step()``, DeepSpeed's
state API, checkpoint save and load, ``engine.destroy()``, the runtime's flush and close (process exit);
a gather (forward, ``GatheredParameters``, a 16-bit save) runs the sub-groups of the parameters it gathers.
Persistent parameters (``stage3_param_persistence_threshold``) are not re-gathered at the end of ``step()``
as DeepSpeed does: the next forward gathers them like the others, after their update.

[Note: the updated parameters stay for the forward] An update runs when the forward is about to gather its
sub-group's parameters. bf16 (or fp16) partitions are written from a staging buffer that stays their host
slice, so the gather finds them in DRAM; fp32 partitions are read from their sub-group's master slot, whose
write-back carries them, so the parameter swapper keeps a copy of the new bytes as a clean, read-ahead
slice instead (``keep_master_copies``): the forward does not read back what was just written (4 B per fp32
parameter and step), and the copy is dropped unwritten once used. Only for an update a gather asked for: a
drain (a checkpoint save right after ``step()``) keeps no copies, which would hold every parameter in DRAM.
The copies of one sub-group live beside the window's two optimizer slices (the planner's ``riding``).

[Note: riding on CPU ranks] With ``step_rides_forward: "auto"`` the updates ride the forward only where the
forward computes on an accelerator: there the CPU runs the update while the GPU runs the forward. On a CPU
rank both take the same cores, so riding moves the update's compute without hiding it; the read-ahead
already overlaps most of its I/O. Measured side by side (148M fp32 Llama, budget 0, clipping 1.0, 2 cores,
``launch/compare.py --params 150M --dtype fp32 --gradient-clipping 1.0 --backends cpu,aidaptiv0``, one run
each): riding 3.02 s/step against DeepSpeed's CPU offload 2.27 s (1.33x), in ``step()`` 2.95 s against
2.10 s (1.40x); riding reads 18.0 B/param/step instead of 21.6 (the updated fp32 parameters stay for the
forward) but faults 97k pages per step instead of 82k. Again on 2026-12-07 in one comparison (backend
``aidaptiv0_ride``: ``--params 150M --dtype fp32 --seq 256 --steps 6 --warmup 2 --repeats 2 --backends
cpu,aidaptiv0,aidaptiv0_ride``): riding 4.68 s, in ``step()`` 4.70 s, CPU offload 3.34 s; at 40M riding gains
(1.29 against 1.54 s, CPU offload 1.10), where the forward is long beside the optimizer's I/O. No gain at the
benchmark's size worth a path less run, so ``"auto"`` keeps CPU ranks in ``step()``; ``true`` turns riding on
there.

[Note: a failure in the pipeline] An update that fails (a write that failed for good, a read error) is
raised by the gather or call that ran it, naming the sub-group, and again by every later wait: the run can
neither go on nor save a checkpoint from a half-updated state.

The per-sub-group record is the stepper's :class:`~aidaptiv_ds.integration.backward_step.SubGroupStep`:
``PENDING`` -> (``step()``'s loop) ``DEFERRED`` -> (its update) ``STEPPING`` -> ``COMMITTED`` -> (all done)
``PENDING``. Sub-groups kept in DRAM by the residency plan, fp16 and hpZ engines step in ``step()`` as before.
"""
from __future__ import annotations

import logging
import weakref

from ..spans import span
from .backward_step import StepState, _hyper
from .errors import PipelineError

log = logging.getLogger("aidaptiv_ds")

#: Sub-groups read ahead at the end of backward for the next forward ([Note: reading ahead for the forward]).
READ_IN_BACKWARD = 2

#: Pipelines with deferred updates now: ds_id of a parameter -> (pipeline, sub-group index).
_WAITING: dict[int, tuple] = {}


class StepPipeline:
    """The deferred optimizer updates of one Stage-3 optimizer ``opt`` (see the module notes).

    Args:
        opt: the :func:`~aidaptiv_ds.integration.stage3.make_stage3_class` optimizer.
        stepper: its :class:`~aidaptiv_ds.integration.backward_step.BackwardStepper` (the records, the window).
        enabled: the mode chosen at initialisation (``aidaptiv.step_rides_forward``).
    """

    def __init__(self, opt, stepper, enabled: bool) -> None:
        self._opt = weakref.ref(opt)
        self.stepper = stepper
        self.enabled = enabled
        self.norm = None  # the norm step() handed unscale_and_clip_grads
        self.hyper: dict[int, dict] = {}  # param group id -> its hyperparameters when step() ran
        self.deferred: list[int] = []  # sub-groups deferred by this step(), in step order
        self.started = False
        self.failed: tuple[int, BaseException] | None = None
        self.stepped_after = 0  # sub-groups DeepSpeed's own loop stepped in this step() (for end_step)
        self._first: frozenset | None = None  # see needed_first

    @property
    def opt(self):
        return self._opt()

    @property
    def pending(self) -> bool:
        return bool(self.deferred)

    # ------------------------------------------------------------------ inside step()
    def should_defer(self, index: int) -> bool:
        """DeepSpeed's loop reaches sub-group ``index``: leave its update to the next forward (its state is on
        the drives and this engine can ride, see the module docstring)."""
        opt = self.opt
        if not self.enabled or self.failed is not None or opt is None:
            return False
        rec = self.stepper.subgroups[index]
        if rec.state is not StepState.PENDING or not opt._swappable_optimizer_subgroup(index):
            return False
        sw, g = self.stepper._swapper_group(index)
        return not g.resident

    def defer(self, index: int) -> None:
        rec = self.stepper.subgroups[index]
        rec.state = StepState.DEFERRED
        self.deferred.append(index)

    def record_norm(self, norm) -> None:
        self.norm = norm

    def start(self, stepped_after: int) -> None:
        """``step()`` ends with updates deferred: capture the hyperparameters, make the deferred parameters wait
        for their update, and start reading the first sub-groups' state."""
        opt = self.opt
        self.stepped_after = stepped_after
        self.hyper = {gid: _hyper(group) for gid, group in enumerate(opt.optimizer.param_groups)}
        where = opt._aidaptiv.grad_where
        ids = {i for i in self.deferred}
        for ds_id, (i, _) in where.items():
            if i in ids:
                _WAITING[ds_id] = (self, i)
        self.started = True
        self.stepper.counters.riding_forward += len(self.deferred)
        self._prefetch_next(None)

    # ------------------------------------------------------------------ running the updates
    def ensure(self, indices) -> None:
        """Run the deferred updates of ``indices`` (sub-groups) now, if not done yet."""
        self._raise_if_failed()
        for i in sorted(set(indices)):
            if i in self.deferred:
                self._run(i, for_gather=True)

    def drain(self) -> None:
        """Run every deferred update (see [Note: exactness] for who calls it)."""
        self._raise_if_failed()
        while self.deferred:
            self._run(self.deferred[0])

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            index, exc = self.failed
            raise PipelineError(f"aidaptiv_ds: the optimizer update of sub-group {index}, riding the forward after "
                                f"step(), failed ({type(exc).__name__}: {exc}); the training state is only partly "
                                f"updated, so this run can neither go on nor save a checkpoint from it. Resume from "
                                f"the last checkpoint.") from exc

    def _run(self, index: int, for_gather: bool = False) -> None:
        """Run sub-group ``index`` 's deferred update; ``for_gather``: a gather of its parameters follows at once
        (they stay in DRAM for it: [Note: the updated parameters stay for the forward])."""
        opt, st = self.opt, self.stepper
        rec = st.subgroups[index]
        self.deferred.remove(index)
        rec.state = StepState.STEPPING
        gid = opt.sub_group_to_group_id[index]
        group = opt.optimizer.param_groups[gid]
        now = {k: v for k, v in group.items() if k != "params"}
        try:
            with span("aidaptiv::step_riding_forward", lane="optimizer", subgroup=int(index)):
                sw, g = st._swapper_group(index)
                st._make_room(g)
                opt._prepare_sub_group(index, None)  # None: no read-ahead by index, ours follows the pipeline
                self._prefetch_next(index)
                group.update(self.hyper.get(gid, {}))  # the learning rate of the step() that deferred it
                try:
                    opt.unscale_and_clip_grads(index, self.norm)
                    opt._optimizer_step(index)
                finally:
                    group.update(now)
                psw = opt._aidaptiv_param_swapper() if for_gather else None
                if psw is not None:
                    psw.keep_master_copies = True  # [Note: the updated parameters stay for the forward]
                try:
                    opt._reassign_or_swap_out_partitioned_parameters(index)
                finally:
                    if psw is not None:
                        psw.keep_master_copies = False
                opt._release_sub_group(index, None)
        except BaseException as e:
            self.failed = (index, e)
            rec.state = StepState.DEFERRED
            raise PipelineError(f"aidaptiv_ds: the optimizer update of sub-group {index}, riding the forward after "
                                f"step(), failed: {type(e).__name__}: {e}") from e
        rec.state = StepState.COMMITTED
        for ds_id in [d for d, (pl, i) in _WAITING.items() if pl is self and i == index]:
            del _WAITING[ds_id]
        if not self.deferred:
            self._finish()

    def _prefetch_next(self, after: int | None) -> None:
        """Start reading the state (and kept gradient) of the next deferred sub-groups, in the order the forward
        needs them, while they fit in the window (stopping at the first that does not)."""
        st = self.stepper
        for i in self.deferred:
            if i == after:
                continue
            sw, g = st._swapper_group(i)
            if g.slice is None:
                if not st._fits(g):
                    break
                sw.prefetch(g)
            if sw.gradients is not None:
                sw.gradients.prefetch(i)

    def needed_first(self, index: int) -> bool:
        """Sub-group ``index`` is among the first :data:`READ_IN_BACKWARD` whose update the next forward needs
        and that would ride it (its state on the drives).

        [Note: reading ahead for the forward] The first module of the next forward (the embedding) needs the
        first sub-group's update at once. When the step will ride the forward (no speculation in this
        backward), the stepper reads the first sub-groups' state at the end of backward, when their
        gradients arrive and backward is reading their parameters (so fp32 master weights come from those
        reads), in the window the steps inside backward would have used; ``step()`` then finds them in DRAM.
        """
        if not self.enabled or self.opt is None:
            return False
        if self._first is None:
            opt, st = self.opt, self.stepper
            first = []
            for i in range(len(st.subgroups)):
                if opt._swappable_optimizer_subgroup(i) and not st._swapper_group(i)[1].resident:
                    first.append(i)
                if len(first) == READ_IN_BACKWARD:
                    break
            self._first = frozenset(first)
        return index in self._first

    def _finish(self) -> None:
        """Every deferred update ran: DeepSpeed's end of step (``_post_step``) without its persistent gather."""
        opt = self.opt
        self.started = False
        self.norm = None
        self.hyper = {}
        if opt.offload_optimizer:
            opt.reset_cpu_buffers()
        if opt.swap_optimizer:
            opt.optimizer_swapper.log_timers()
        opt.invalidate_secondary_tensor()
        self.stepper.end_step(self.stepped_after)


def ensure_before_gather(params) -> None:
    """Before DeepSpeed gathers ``params`` (any all-gather of a ZeRO-3 parameter): run the deferred updates of
    their sub-groups (the hook on ``Init._ensure_availability_of_partitioned_params``)."""
    if not _WAITING:
        return
    todo: dict = {}
    for p in params:
        hit = _WAITING.get(getattr(p, "ds_id", None))
        if hit is not None:
            todo.setdefault(hit[0], set()).add(hit[1])
    for pipeline, indices in todo.items():
        pipeline.ensure(indices)


def drain_all() -> None:
    """Run every deferred update of the process (process exit, a runtime's flush)."""
    for pipeline in {pl for pl, _ in list(_WAITING.values())}:
        pipeline.drain()


def install(init_cls) -> None:
    """Wrap ``Init._ensure_availability_of_partitioned_params`` with :func:`ensure_before_gather`."""
    orig = init_cls._ensure_availability_of_partitioned_params
    if getattr(orig, "_aidaptiv_wrapped", None) is not None:
        return

    def _ensure_availability_of_partitioned_params(self, params):
        params = list(params)
        ensure_before_gather(params)
        return orig(self, params)

    _ensure_availability_of_partitioned_params._aidaptiv_wrapped = orig
    init_cls._ensure_availability_of_partitioned_params = _ensure_availability_of_partitioned_params


def uninstall(init_cls) -> None:
    cur = init_cls._ensure_availability_of_partitioned_params
    orig = getattr(cur, "_aidaptiv_wrapped", None)
    if orig is not None:
        init_cls._ensure_availability_of_partitioned_params = orig


def forget(pipeline: StepPipeline) -> None:
    """Drop ``pipeline``'s waiting parameters (its engine is destroyed after a drain)."""
    for ds_id in [d for d, (pl, _) in _WAITING.items() if pl is pipeline]:
        del _WAITING[ds_id]


