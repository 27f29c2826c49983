"""The Stage-3 optimizer's gradient path on the gradient store (:mod:`aidaptiv_ds.integration.gradients`).

A mixin of the Stage-3 subclass (:func:`aidaptiv_ds.integration.stage3.make_stage3_class`). DeepSpeed
0.19.8 seams it overrides (``docs/deepspeed-surface.md``):

* ``_setup_for_real_optimizer`` (``stage3.py:761-805``): the same steps without allocating the flat
  host gradient buffer (``grad_partitions_flat_buffer``); ``__param_id_to_grad_partition`` becomes a
  :class:`NoFlatGradientBuffer` that names the unsupported DeepSpeed feature that reaches for it;
* ``partition_grads`` (``stage3.py:2006-2052``): DeepSpeed's copy/add arithmetic into the
  sub-group's accumulation slice, DeepSpeed's per-parameter norms at the boundary, and the
  in-backward step of every sub-group whose gradient became final;
* ``_finalize_offload_gradient_accumulation`` (unmanaged accumulation), ``independent_gradient_partition_epilogue``
  (end of a backward), ``reset_cpu_buffers`` (after a step or an overflow), ``has_overflow`` (fp16);
* ``__avg_scatter_grads`` (``stage3.py:1912-1949``): on a partition group of one rank the reduce-scatter
  is the identity, so the bucket's gradients become their partitions without
  ``reduce_scatter_coalesced``'s interleaved copy and gloo's buffer (:func:`single_rank_grad_partitions`);
* ``_constant_buffered_norm2`` (``stage3.py:1960-1967``): the fp64 copy of a host partition goes to a
  reusable scratch (:class:`aidaptiv_ds.integration.grad_norms.NormScratch`), same arithmetic;
* ``offload_states`` refuses with the reason.
"""
from __future__ import annotations

import torch
from deepspeed.accelerator import get_accelerator

from .config import AidaptivConfigError
from .grad_norms import NormScratch


class NoFlatGradientBuffer(dict):
    """Stands in for DeepSpeed's ``__param_id_to_grad_partition`` (views of its flat host gradient
    buffer, which an engine on aidaptiv_ds does not allocate): every access names the problem."""

    def __getitem__(self, ds_id):
        raise AidaptivConfigError(
            f"aidaptiv_ds: a DeepSpeed code path asked for the flat host gradient buffer of parameter ds_id={ds_id}; "
            f"an engine on aidaptiv_ds keeps gradients in its gradient store instead, so that feature (ZenFlow, "
            f"DeepCompile, SuperOffload, Muon on offloaded state) is not supported with the \"aidaptiv\" section. "
            f"Fix: disable it, or run DeepSpeed's own offload (\"aidaptiv\": {{\"enabled\": false}}).")

    def __contains__(self, ds_id) -> bool:
        return False


def accumulate_gradient(buf: torch.Tensor, grad_partition: torch.Tensor, first: bool, accum: torch.dtype
                        ) -> torch.Tensor:
    """Copy or add one gradient partition into its accumulation view ``buf`` (host memory), with
    DeepSpeed's operations (``partition_grads``, ``stage3.py:2024-2039``); returns the tensor DeepSpeed
    takes the partition's norm of (``buf``, or its device copy when the gradient is on a GPU).

    Args:
        buf: the partition's view in its sub-group's gradient slice (``accum`` dtype, ``grad_partition.numel()``).
        grad_partition: the reduced gradient partition (any float dtype; CPU or an accelerator).
        first: the partition's first gradient of the accumulation window (copy instead of add).
        accum: the gradient-accumulation dtype.
    """
    if first:
        buf.copy_(grad_partition, non_blocking=True)
        return buf if get_accelerator().on_accelerator(buf) else grad_partition.to(accum)
    if get_accelerator().on_accelerator(buf):
        buf.add_(grad_partition.to(accum).view(buf.shape))
        return buf
    dev = buf.to(grad_partition.device, non_blocking=True)  # adding on the host is slow (DeepSpeed's comment)
    dev.add_(grad_partition.to(accum).view(dev.shape))
    buf.copy_(dev, non_blocking=True)
    return dev



def single_rank_grad_partitions(grads: list[torch.Tensor], *, model_dtype: torch.dtype,
                                communication_dtype: torch.dtype, accumulation_dtype: torch.dtype,
                                postscale: bool, predivide: float, averaging_world_size: int
                                ) -> list[torch.Tensor]:
    """DeepSpeed's ``__avg_scatter_grads`` (``stage3.py:1912-1949``) for a partition group of one rank.

    [Note: the reduce-scatter of one rank]
    ``reduce_scatter_coalesced`` (``runtime/comm/coalesced_collectives.py``) copies the bucket's
    gradients into a new flat tensor (``torch.cat`` of the interleaved partitions), divides it in
    place by the world size, and hands it to ``reduce_scatter_tensor``, whose gloo implementation
    works on a buffer of its own; the partitions it returns are views of the flat copy. With one rank
    the division is by 1.0 and the reduction a sum of one term, both exact in every float format, and
    rank 0's partition of a tensor is all of it. So the partitions are the gradients themselves,
    flattened: the same values bit for bit, without two bucket-sized copies per bucket (on a CPU
    rank two fresh host buffers per bucket, every backward: 148M fp32, 8 buckets, about 90k page
    faults and 0.1 s of system time per step, measured with getrusage around the call). The other
    steps (communication dtype, pre/post-division, expert averaging, accumulation dtype) are
    DeepSpeed's, in its order.

    Args:
        grads: the bucket's full gradients (``param.grad``, each of ``ds_numel`` elements, any shape),
            in DeepSpeed's order (sorted by ``ds_id``).
        model_dtype: the optimizer's ``dtype`` (that of the gradients as produced).
        communication_dtype: the bucket's communication dtype.
        accumulation_dtype: ``gradient_accumulation_dtype``.
        postscale: ``postscale_gradients``; predivide: ``gradient_predivide_factor``.
        averaging_world_size: ``_gradient_averaging_world_size(params, 1)`` (1 unless expert parallel).

    Returns:
        One 1-D tensor per gradient, ``ds_numel`` elements, ``accumulation_dtype``: a view of the
        gradient where no conversion or scaling applies (the caller copies it out before the bucket
        is reused, as DeepSpeed's ``partition_grads`` does).
    """
    full = list(grads)
    if communication_dtype != model_dtype:
        full = [g.to(communication_dtype) for g in full]
    if postscale and predivide != 1.0:
        full = [g.div(predivide) for g in full]
    parts = [g.reshape(-1) for g in full]  # reduce_scatter_coalesced on one rank (note above)
    if postscale and predivide != 1.0:  # DeepSpeed: and predivide != the group's size, 1
        parts = [g.mul(predivide) for g in parts]
    if averaging_world_size != 1:
        scale = 1 / float(averaging_world_size)
        parts = [g.mul(scale) for g in parts]
    if communication_dtype != accumulation_dtype:
        parts = [g.to(accumulation_dtype) for g in parts]
    return parts


class GradientPathMixin:
    """Gradient-path overrides of the Stage-3 subclass (see the module docstring)."""

    def _setup_for_real_optimizer(self):
        """DeepSpeed's ``_setup_for_real_optimizer`` (``stage3.py:761-805``) without its flat host
        gradient buffer: the gradient partitions accumulate in :class:`GradientStore` instead."""
        import deepspeed.comm as dist
        self._create_fp32_partitions()
        dist.barrier()
        self._create_next_swappable_fp32_groups()
        self.initialize_optimizer_states()
        dist.barrier()
        if self.contiguous_gradients:
            for dtype, bucket in self.ipg_buckets.items():
                bucket.buffer = torch.empty(self.reduce_bucket_size, dtype=dtype,
                                            device=get_accelerator().current_device_name())
        self.grad_partitions_flat_buffer = None
        setattr(self, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", NoFlatGradientBuffer())

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, communication_data_type):
        """DeepSpeed's ``__avg_scatter_grads`` (``stage3.py:1912-1949``; the name as Python mangles it),
        without the reduce-scatter's copies on a partition group of one rank
        (:func:`single_rank_grad_partitions`); any other group goes to DeepSpeed's."""
        import deepspeed.comm as dist
        self._assert_same_partition_group(params_to_reduce)
        group = self._get_param_partition_group(params_to_reduce[0])
        if (dist.get_world_size(group=group) != 1
                or (self.all2all_process_group is not None  # DeepSpeed's test for its all-to-all, nodes > 1
                    and dist.get_world_size() // max(get_accelerator().device_count(), 1) > 1)):
            return super()._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params_to_reduce, communication_data_type)
        return single_rank_grad_partitions(
            [p.grad for p in params_to_reduce], model_dtype=self.dtype, communication_dtype=communication_data_type,
            accumulation_dtype=self.gradient_accumulation_dtype, postscale=self.postscale_gradients,
            predivide=self.gradient_predivide_factor,
            averaging_world_size=self._gradient_averaging_world_size(params_to_reduce, 1))

    def _aidaptiv_group_norms_as_deepspeed(self) -> None:
        """Record the sub-groups DeepSpeed would have made with the config's ``sub_group_size`` where ours
        differ (:func:`~aidaptiv_ds.integration.stage3.auto_sub_group_size`), for :meth:`_get_norm_groups`.

        [Note: norm groups] The global gradient norm is ``vector_norm`` of one norm per optimizer sub-group
        (``_get_norm_groups`` -> ``combine_grad_norm_groups``, ``stage3.py:2573, utils.py:891``), each the
        square root of its parameters' squared norms summed in fp64 and rounded to fp32: so the norm's last
        bits depend on where the sub-groups end, and with them the clipping factor (``gradient_clipping``,
        1.0 unless the config says otherwise) and every parameter. The sub-groups are also the unit of our
        optimizer I/O, so where the config leaves ``sub_group_size`` out we use smaller ones; the norm is then
        taken over DeepSpeed's own grouping (its ``_create_fp16_sub_groups`` with the config's value), from the
        same per-parameter norms: the same bits as DeepSpeed, whatever our sub-groups. Adam is elementwise, so
        nothing else depends on the grouping.
        """
        want = self._aidaptiv.ds_sub_group_size
        if want is None or int(want) == int(self.sub_group_size):
            return
        import types
        base = self._aidaptiv_deepspeed_class  # DeepSpeed's DeepSpeedZeroOptimizer_Stage3
        proxy = types.SimpleNamespace(sub_group_size=want)
        self._aidaptiv.norm_param_groups = [sub for group in self.trainable_param_groups
                                            for sub in base._create_fp16_sub_groups(proxy, group["params"])]

    def _get_norm_groups(self):
        """DeepSpeed's per-sub-group norms over DeepSpeed's own sub-groups ([Note: norm groups])."""
        groups = self._aidaptiv.norm_param_groups
        if groups is None or not self.offload_optimizer:
            return super()._get_norm_groups()
        return [self.complete_grad_norm_calculation_for_cpu_offload(params) for params in groups]

    def _aidaptiv_grad_layout(self) -> tuple[list[int], list[int], dict[int, tuple[int, int]]]:
        """Per sub-group: elements and partitions that receive gradients; per ``ds_id``: (sub-group,
        offset). The layout of DeepSpeed's ``grad_position`` (``set_grad_positions``, stage3.py:1948)."""
        numels, expected, where = [], [], {}
        for i, group in enumerate(self.fp16_groups):
            off, n_exp = 0, 0
            for p in group:
                where[p.ds_id] = (i, off)
                real = p.partition_numel() * self._get_param_partition_rank(p) < p.ds_numel
                n_exp += int(p.requires_grad and real)
                off += p.partition_numel()
            numels.append(off)
            expected.append(n_exp)
        return numels, expected, where

    def partition_grads(self, params_to_release, grad_partitions):
        """DeepSpeed's ``partition_grads`` (``stage3.py:2006-2052``) on the gradient store: the same
        copy/add arithmetic into per-sub-group slices, the same per-parameter norms at the boundary;
        nothing is handed to the swapper here (the optimizer swap-in takes the gradient from the store).
        At the boundary, a sub-group whose gradient became final is stepped now
        (:meth:`BackwardStepMixin._aidaptiv_gradient_final`), and one that starts receiving gradients
        has its optimizer state read ahead."""
        grads = self._aidaptiv.grads
        boundary = self.is_gradient_accumulation_boundary()
        accum = self.gradient_accumulation_dtype
        buffers = []
        for param, grad_partition in zip(params_to_release, grad_partitions):
            if not param.partition_numel() * self._get_param_partition_rank(param) < param.ds_numel:
                param.grad = None  # this rank's partition of the parameter is padding only
                continue
            self._offload_boundary_param_ids.add(param.ds_id)
            i, off = self._aidaptiv.grad_where[param.ds_id]
            self._aidaptiv_gradient_arriving(i, param)
            g = grads.open(i)
            view = grads.view(g, off, grad_partition.numel())
            first = grads.arrive(g, param.ds_id)
            norm_source = accumulate_gradient(view, grad_partition, first, accum)
            grads.check_finite(g, norm_source)  # fp16 only
            buffers.append(view)
            if boundary:
                self.norm_for_param_grads[self.get_param_id(param)] = self._constant_buffered_norm2(norm_source)
                if len(g.arrived_now) == 1:
                    self._aidaptiv_gradient_started(i)
            if not get_accelerator().is_synchronized_device() and param.grad is not None:
                param.grad.record_stream(get_accelerator().current_stream())
            param.grad = None
            if g.complete_now:  # at once: a bucket can span many sub-groups, whose slices would spill meanwhile
                if boundary:
                    self._aidaptiv_gradient_final(i)  # may step it (and consume its gradient) right here
                grads.close(i)
        return buffers

    def _aidaptiv_flush_reduce_buckets(self) -> None:
        """Reduce and partition what DeepSpeed's reduce buckets hold now, as its epilogue does
        (``independent_gradient_partition_epilogue``, ``stage3.py:1409-1410``), without ending the
        backward: a layer-major step (``layer_major.py``) hands each parameter one gradient per piece,
        and a bucket may hold a parameter's gradient only once."""
        from deepspeed.runtime.torch_autocast import sort_dtypes
        reduce = getattr(self, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")
        for comm_dtype in sort_dtypes(self.ipg_buckets.keys()):
            reduce(comm_dtype)
        if not get_accelerator().resolves_data_dependency():
            self.reduce_and_partition_stream.synchronize()

    def _constant_buffered_norm2(self, input, buffer_size=250000000):
        """DeepSpeed's per-partition norm (``stage3.py:1960-1967``); a host partition's fp64 copy goes to
        :class:`NormScratch` (same arithmetic, no fresh buffer per partition)."""
        from deepspeed.runtime.zero.utils import get_norm_dtype
        if self._aidaptiv.norm_scratch is None:
            self._aidaptiv.norm_scratch = NormScratch()
        norm = self._aidaptiv.norm_scratch.norm2(input, buffer_size, get_norm_dtype())
        return super()._constant_buffered_norm2(input, buffer_size) if norm is None else norm

    def _aidaptiv_release_norm_scratch(self) -> None:
        if self._aidaptiv.norm_scratch is not None:
            self._aidaptiv.norm_scratch.release()

    def has_overflow(self, partition_gradients=True):
        """fp16: DeepSpeed's overflow check (``stage3.py:3009-3044``) over the gradient store instead of
        its flat buffer: the slices' inf/NaN flags, kept while accumulating, reduced as DeepSpeed does."""
        if not partition_gradients:
            return super().has_overflow(partition_gradients)
        import deepspeed.comm as dist
        overflow = get_accelerator().ByteTensor([int(self._aidaptiv.grads.any_nonfinite())])
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=overflow, op=dist.ReduceOp.MAX)
        return bool(overflow[0].item())

    def _finalize_offload_gradient_accumulation(self):
        """Unmanaged gradient accumulation (``managed_gradient_accumulation: false``): every
        ``step()`` is the boundary; the norms come from the accumulated partitions, as DeepSpeed's
        ``_finalize_offload_gradient_accumulation`` (``stage3.py:1467-1482``) takes them."""
        grads = self._aidaptiv.grads
        for group in self.fp16_groups:
            for param in group:
                if param.ds_id not in self._offload_boundary_param_ids:
                    continue
                i, off = self._aidaptiv.grad_where[param.ds_id]
                g = grads.open(i)
                t = grads.view(g, off, param.partition_numel())
                if not get_accelerator().on_accelerator(t):
                    if grads.device_sync is not None:
                        grads.device_sync()
                    t = t.to(get_accelerator().current_device_name(), non_blocking=True)
                self.norm_for_param_grads[self.get_param_id(param)] = self._constant_buffered_norm2(t)
        self._aidaptiv_release_norm_scratch()
        grads.end_backward()

    def independent_gradient_partition_epilogue(self):
        super().independent_gradient_partition_epilogue()
        if self.is_gradient_accumulation_boundary():
            self._aidaptiv_norms_of_earlier_gradients()
        self._aidaptiv_release_norm_scratch()  # the norms of this backward are taken
        self._aidaptiv.grads.end_backward()
        if self.is_gradient_accumulation_boundary():
            self._aidaptiv.rt.end_of_step()  # the activations are freed: return them before the step

    def _aidaptiv_norms_of_earlier_gradients(self) -> None:
        """At the boundary: the norm of every partition that got gradients in earlier micro-steps of
        the window but none in the last one. DeepSpeed takes norms only of partitions reduced in the
        boundary micro-step (``_offload_grad_partition_at_boundary``), so such a gradient would be
        applied but left out of the clipping norm; here it counts, as it would had it been a zero
        gradient added in the last micro-step."""
        grads = self._aidaptiv.grads
        params = None
        for g in grads.groups:
            late = g.arrived - g.arrived_now
            if not late:
                continue
            if params is None:
                params = {p.ds_id: p for group in self.fp16_groups for p in group}
            was_open = g.index in grads._open
            grads.open(g.index)
            for ds_id in sorted(late, key=lambda d: self._aidaptiv.grad_where[d][1]):
                p = params[ds_id]
                _, off = self._aidaptiv.grad_where[ds_id]
                view = grads.view(g, off, p.partition_numel())
                if not get_accelerator().on_accelerator(view):
                    if grads.device_sync is not None:
                        grads.device_sync()
                    view = view.to(get_accelerator().current_device_name())
                self.norm_for_param_grads[self.get_param_id(p)] = self._constant_buffered_norm2(view)
            if not was_open:
                grads.close(g.index)

    def reset_cpu_buffers(self):
        """After every step and after an fp16 overflow (``_overflow_clean_up``): the window's
        gradients are consumed or thrown away."""
        super().reset_cpu_buffers()
        self._aidaptiv_release_norm_scratch()
        self._aidaptiv.grads.discard_all()

    def offload_states(self, *args, **kwargs):
        raise AidaptivConfigError(
            "aidaptiv_ds: engine.offload_states() moves DeepSpeed's flat host gradient buffer and fp32 "
            "partitions, which an engine on aidaptiv_ds does not have (its state is in the DRAM tier and on "
            "the cache drives already). Fix: do not call offload_states() with the \"aidaptiv\" section "
            "enabled; lower aidaptiv.dram_budget instead to keep less in host memory.")

