"""DeepSpeed's public ZeRO-3 state API (``deepspeed.utils.safe_get_full_fp32_param``, ``safe_set_full_grad``,
``safe_get_local_optimizer_state`` ...) on an engine whose optimizer state lives in aidaptiv_ds's tiers.

A mixin of the Stage-3 subclass (:func:`aidaptiv_ds.integration.stage3.make_stage3_class`). The functions of
``deepspeed/utils/tensor_fragment.py`` call the optimizer's ``get_full_hp_param``, ``set_full_hp_param``,
``get_fp32_grad_for_param``, ``set_fp32_grad_for_param``, their ``local`` variants,
``update_fp32_grad_for_param_vectorized`` and ``get_hp_param_device`` (``stage3.py:3120-3317``), which swap
the parameter's sub-group in (``_optimizer_states_and_gradient_swap_in``), read or change a slice of it,
and swap it out or release it. Each of them runs here inside :meth:`StateAPIMixin._aidaptiv_state_access`.

[Note: the state API]
Between backward and ``step()`` a caller must see the state *before* the step, as with DeepSpeed: the
weights, moments and gradients the step will use, and what it changes there is what the step uses. With
``step_in_backward`` some sub-groups were already stepped, speculatively, into a second copy of their state
(``backward_step.py``). So a state-API call on such a sub-group first undoes that speculation
(:meth:`BackwardStepper.reopen`): the first copy still holds the state before the step, the gradient was
kept, and DeepSpeed's own loop steps the sub-group after the call, from whatever the call left. A
speculation consumes its gradient only when clipping is off, and not in the first optimizer step nor once
the state API was used in the process; a call that meets a consumed gradient raises
:class:`~aidaptiv_ds.integration.errors.GradientConsumedError` before anything changes.

[Note: narrow moments in the state API]
With ``optimizer_state.moments`` ``"bf16"`` or ``"int8"`` the optimizer's ``exp_avg``/``exp_avg_sq`` are bf16
or uint8-code views of the sub-group's slots, and DeepSpeed's getters would hand those out as they are (the
codes as numbers) and its setters would ``copy_`` fp32 values into them. So for a moment stored narrow,
:meth:`StateAPIMixin._get_fp32_opt_state_partition` returns the parameter's range decoded to fp32
(``tiers/unit.py`` ``Slot.read``; for int8 the whole blocks around it), and a setter's edit of it is encoded
back into the slot before the sub-group is swapped out (rounded, or re-quantized block by block: the blocks the
range touches, neighbours' elements included, get new scales).

The swap-out that ends a setter (``set_full_hp_param`` writes the sub-group back with
``_optimizer_states_and_gradient_swap_out``, the gradient setters with ``_writeback_swap_state``) writes the
changed state back but is not an optimizer step: the gradient stays for the step
(the engine's ``STATE_API`` phase, [Note: phases] in ``phase.py``).
"""
from __future__ import annotations

import contextlib

from ..spans import span
from .phase import Phase


class StateAPIMixin:
    """The public state API of DeepSpeed's Stage-3 optimizer, run under :meth:`_aidaptiv_state_access`."""

    @contextlib.contextmanager
    def _aidaptiv_state_access(self, params, what: str):
        """Around one state-API call on ``params`` (one parameter or a list): undo speculative steps of their
        sub-groups ([Note: the state API]) and mark the optimizer swapper's swap-outs as state writes."""
        params = params if isinstance(params, (list, tuple)) else [params]
        self._aidaptiv_drain()  # updates riding the forward first (step_pipeline.py)
        self._aidaptiv.phase.check_opens(Phase.STATE_API)  # before a speculative step is undone
        st = self._aidaptiv.stepper
        groups = sorted({self.grad_position[self.get_param_id(p)][0] for p in params
                         if p.requires_grad and self.get_param_id(p) in self.grad_position})
        if st is not None:
            for i in groups:
                st.reopen(i, what)
        sw = self.optimizer_swapper
        refs = {i: sw.refs(self.fp32_partitioned_groups_flat[i]) for i in groups
                if self._swappable_optimizer_subgroup(i)}  # those DeepSpeed keeps in host buffers hold nothing
        with self._aidaptiv.phase.during(Phase.STATE_API), span("aidaptiv::state_api", lane="optimizer", call=what):
            try:
                yield
            except BaseException:
                # DeepSpeed's call swapped the sub-group in and raised before releasing it (a moment asked for
                # before the first step: KeyError, as on CPU offload): let go of what it took, unwritten, so that
                # the slice is not pinned for good (a later load or step found it half-held)
                for i in refs:
                    if sw.refs(self.fp32_partitioned_groups_flat[i]) > refs[i]:
                        self._aidaptiv.narrow_edits.pop(i, None)  # a setter's decoded rows: not written
                        self._release_swap_buffers(i)
                raise

    def _get_fp32_opt_state_partition(self, param, release_swap_buffers, optim_state_key=None):
        """DeepSpeed's (``stage3.py:3150``), but a moment stored narrow comes back as fp32 ([Note: narrow moments
        in the state API]): ``(fp32 tensor of the parameter's partition, sub-group index)``."""
        sw = self.optimizer_swapper
        if optim_state_key is None or not getattr(sw, "narrow", False):
            return super()._get_fp32_opt_state_partition(param, release_swap_buffers, optim_state_key)
        group_idx, offset, numel = self.grad_position[self.get_param_id(param)]
        part, _ = super()._get_fp32_opt_state_partition(param, False, optim_state_key)
        slot, buf = sw.moment_slots(group_idx).get(optim_state_key, (None, None))
        if slot is None:  # kept in the master dtype (a state past Adam's two moments)
            wide = part
        else:
            block = max(slot.block, 1)
            lo, hi = offset // block * block, min(-(-(offset + numel) // block) * block, slot.numel)
            rows = slot.read(buf, lo, hi - lo)
            wide = rows[offset - lo:offset - lo + numel]
            if not release_swap_buffers:  # a setter: encoded back before the swap-out
                self._aidaptiv.narrow_edits.setdefault(group_idx, []).append((slot, buf, lo, rows))
        if release_swap_buffers and self._swappable_optimizer_subgroup(group_idx):
            self._release_swap_buffers(group_idx)
        return wide, group_idx

    def _optimizer_states_and_gradient_swap_out(self, sub_group_id, timer_names=None):
        for slot, buf, lo, rows in self._aidaptiv.narrow_edits.pop(sub_group_id, ()):  # [Note: narrow moments
            slot.write(buf, rows, lo)                                                # in the state API]
        return super()._optimizer_states_and_gradient_swap_out(sub_group_id, timer_names)

    def get_full_hp_param(self, param, optim_state_key=None):
        with self._aidaptiv_state_access(param, "get_full_hp_param (safe_get_full_fp32_param/optimizer_state)"):
            return super().get_full_hp_param(param, optim_state_key)

    def set_full_hp_param(self, value, param, optim_state_key=None):
        with self._aidaptiv_state_access(param, "set_full_hp_param (safe_set_full_fp32_param/optimizer_state)"):
            return super().set_full_hp_param(value, param, optim_state_key)

    def get_fp32_grad_for_param(self, param):
        with self._aidaptiv_state_access(param, "get_fp32_grad_for_param (safe_get_full_grad)"):
            return super().get_fp32_grad_for_param(param)

    def set_fp32_grad_for_param(self, value, param):
        with self._aidaptiv_state_access(param, "set_fp32_grad_for_param (safe_set_full_grad)"):
            return super().set_fp32_grad_for_param(value, param)

    def get_local_fp32_grad_for_param(self, param):
        with self._aidaptiv_state_access(param, "get_local_fp32_grad_for_param (safe_get_local_grad)"):
            return super().get_local_fp32_grad_for_param(param)

    def set_local_grad_for_param(self, value, param):
        with self._aidaptiv_state_access(param, "set_local_grad_for_param (safe_set_local_grad)"):
            return super().set_local_grad_for_param(value, param)

    def get_local_fp32_param(self, param, optim_state_key=None):
        with self._aidaptiv_state_access(param, "get_local_fp32_param (safe_get_local_fp32_param/optimizer_state)"):
            return super().get_local_fp32_param(param, optim_state_key)

    def set_local_hp_param(self, value, param, optim_state_key=None):
        with self._aidaptiv_state_access(param, "set_local_hp_param (safe_set_local_fp32_param/optimizer_state)"):
            return super().set_local_hp_param(value, param, optim_state_key)

    def update_fp32_grad_for_param_vectorized(self, update_func, param_list):
        with self._aidaptiv_state_access(list(param_list), "update_fp32_grad_for_param_vectorized "
                                                           "(safe_update_full_grad_vectorized)"):
            return super().update_fp32_grad_for_param_vectorized(update_func, param_list)

    def get_hp_param_device(self, param, optim_state_key=None):
        with self._aidaptiv_state_access(param, "get_hp_param_device"):
            return super().get_hp_param_device(param, optim_state_key)
