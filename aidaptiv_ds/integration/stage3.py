"""A ``DeepSpeedZeroOptimizer_Stage3`` subclass that plugs in our optimizer swapper and residency plan.

Installed as ``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3`` (the engine imports the
name at call time, ``engine.py:2747``). Constructing it with a config whose ``"aidaptiv"`` section
is absent or disabled returns an instance of DeepSpeed's own class, untouched.

Overrides (``docs/deepspeed-seams.md`` §2.5, §6.4):

* ``__init__`` sees the raw config dict (the optimizer swapper's constructor does not) and
  validates the section before anything is built;
* ``_configure_tensor_swapping`` builds :class:`AidaptivOptimizerSwapper` instead of DeepSpeed's;
* ``initialize_optimizer_states`` runs DeepSpeed's initialisation with both swappers in their init
  phase: the sub-groups and partitions it swaps in and out there are unchanged, so nothing is
  rewritten; then the residency plan is applied and the store is preflighted for the rest.
"""
from __future__ import annotations

import itertools
import logging

import torch
from deepspeed.accelerator import get_accelerator

from ..planner.auto import host_working_set
from ..planner.residency import StateSizes, plan_residency
from ..store.packed import ExtentView
from ..units import format_bytes
from .config import section_enabled, validate
from .optimizer_swapper import AidaptivOptimizerSwapper
from .runtime import auto_dram_budget, get_runtime

log = logging.getLogger("aidaptiv_ds")
_ENGINE_IDS = itertools.count()


def make_stage3_class(base: type) -> type:
    """Subclass DeepSpeed's Stage-3 optimizer class ``base`` (kept as ``AidaptivStage3.__base__``)."""

    class AidaptivZeroOptimizer_Stage3(base):
        """DeepSpeed ZeRO-3 optimizer whose NVMe offload runs on aidaptiv_ds (see module docstring)."""

        def __new__(cls, *args, **kwargs):
            ds_config = kwargs.get("ds_config")
            if not section_enabled(ds_config if isinstance(ds_config, dict) else None):
                return base(*args, **kwargs)  # DeepSpeed's own class, untouched
            return super().__new__(cls)

        def __init__(self, *args, **kwargs):
            ds_config = kwargs.get("ds_config")
            self._aidaptiv_module = kwargs.get("module", args[0] if args else None)
            self._aidaptiv_cfg = validate(ds_config)
            self._aidaptiv_rt = get_runtime(self._aidaptiv_cfg)
            self._aidaptiv_engine_id = next(_ENGINE_IDS)
            super().__init__(*args, **kwargs)

        def _configure_tensor_swapping(self, offload_optimizer_config, aio_config):
            rt = self._aidaptiv_rt
            self.optimizer_swapper = sw = AidaptivOptimizerSwapper(rt, self.optimizer,
                                                                   self.master_weights_and_grads_dtype,
                                                                   self._aidaptiv_engine_id)
            rt.optimizer_swappers.append(sw)
            self._aidaptiv_plan()

        def _create_fp32_partitions(self):
            super()._create_fp32_partitions()
            self._aidaptiv_alias_params()

        def _aidaptiv_alias_params(self) -> None:
            """fp32 parameters are their master slot, byte for byte: read them from it and stop writing
            them separately (sub-groups kept in DRAM, and resident parameters, keep their own copy)."""
            sw, psw = self.optimizer_swapper, self._aidaptiv_param_swapper()
            plan = self.aidaptiv_plan
            if psw is None or plan.params_resident or not self.aidaptiv_sizes.alias_params:
                return
            for i, fp32 in enumerate(self.fp32_partitioned_groups_flat):
                g = sw.groups.get(str(fp32.ds_id))
                params = self.fp16_groups[i]
                if g is None or g.resident or any(getattr(p.ds_tensor, "final_location", None) is None or
                                                  p.ds_id not in psw._loc for p in params):
                    continue
                psw.alias_to_master(params, ExtentView(self._aidaptiv_rt.store, sw._extent_key(g), g.slot_bytes))

        def _offload_grad_partition_at_boundary(self, param, grad_buffer, offload_fp32_gradients,
                                                offload_fp32_offsets):
            """DeepSpeed converts each gradient partition to fp32 here and hands the copies to the swapper.
            When ``grad_buffer`` is a view of DeepSpeed's flat host gradient buffer (CPU accelerator),
            hand the view itself instead: the swapper keeps it (no copy, no I/O) and converts to fp32
            at the sub-group's swap-in, the same ``Tensor.to`` DeepSpeed would have run here."""
            flat = getattr(self, "grad_partitions_flat_buffer", None)
            i, dest_offset, _ = self.grad_position[self.get_param_id(param)]
            if (flat is None or grad_buffer.device.type != "cpu" or not self._swappable_optimizer_subgroup(i)
                    or grad_buffer.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()):
                return super()._offload_grad_partition_at_boundary(param, grad_buffer, offload_fp32_gradients,
                                                                   offload_fp32_offsets)
            self.optimizer_swapper.host_grad_buffer = flat
            self.norm_for_param_grads[self.get_param_id(param)] = self._constant_buffered_norm2(grad_buffer)
            offload_fp32_gradients.setdefault(i, []).append(grad_buffer)
            offload_fp32_offsets.setdefault(i, []).append(dest_offset)

        def initialize_optimizer_states(self):
            sw = self.optimizer_swapper
            psw = self._aidaptiv_param_swapper()
            sw.init_phase = True
            if psw is not None:
                psw.init_phase = True
            try:
                super().initialize_optimizer_states()
            finally:
                sw.init_phase = False
                if psw is not None:
                    psw.init_phase = False
            # initialisation streamed every sub-group through host buffers once; give their pages back
            # before DeepSpeed allocates its flat gradient buffer (stage3.py:791) on top of them
            self._aidaptiv_rt.release_host_memory()

        def _aidaptiv_param_swapper(self):
            for group in self.fp16_groups:
                for p in group:
                    s = getattr(p, "nvme_swapper", None)
                    if s is not None:
                        return s
            return None

        def _aidaptiv_plan(self) -> None:
            """Choose what stays in DRAM, preflight the store for the rest, load resident parameters.

            Raises:
                StorageFullError: the cache paths cannot hold the optimizer state and gradients.
            """
            rt = self._aidaptiv_rt
            sw = self.optimizer_swapper
            psw = self._aidaptiv_param_swapper()
            if psw is not None and rt.cfg.from_unpacked:  # before DeepSpeed reads partitions for the masters
                psw.adopt_unpacked(self._aidaptiv_module)
            numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
            align = rt.store.alignment
            slots = 1 + sw.expected_states
            module_params = list(self._aidaptiv_module.parameters()) if self._aidaptiv_module is not None else []
            alias = (psw is not None and sw.dtype == torch.float32
                     and all(p.dtype == torch.float32 for group in self.fp16_groups for p in group))
            # DeepSpeed's flat host gradient buffer (allocated after this, stage3.py:786-800); on CPU ranks
            # the gradients reach the swapper as views of it (_offload_grad_partition_at_boundary)
            accum_elsize = torch.empty((), dtype=self.gradient_accumulation_dtype).element_size()
            cpu_ranks = get_accelerator().device_name() == "cpu"
            sizes = StateSizes(param_bytes=sum(p.ds_tensor.ds_numel * p.element_size() for p in module_params
                                               if getattr(p, "ds_tensor", None) is not None),
                               grad_bytes=sum(numels) * 4,
                               subgroup_bytes=[n * sw.elsize * slots for n in numels], alias_params=alias,
                               subgroup_param_bytes=[sum(p.ds_tensor.ds_numel * p.element_size() for p in group)
                                                     for group in self.fp16_groups],
                               grads_in_host_buffer=cpu_ranks)
            ws = host_working_set(
                largest_slice_partition_bytes=psw.largest_partition_bytes() if psw is not None else 0,
                largest_subgroup_numel=max(numels, default=0),
                moment_bytes_per_param=sw.elsize * sw.expected_states,
                local_ranks=1, host_grad_buffer_bytes=sum(numels) * accum_elsize)
            rt.settle_host_memory_reuse(sizes.total + ws)
            if rt.cfg.dram_budget == "auto":  # now the working set is known: take it out of the budget
                held = rt.tier.resident_bytes() + rt.tier.cached_bytes()  # ours: in use now, but the plan's to give
                rt.set_budget(auto_dram_budget(working_set_bytes=ws - held))
                rt.release_host_memory()  # what the smaller budget evicted goes back to the OS
            plan = plan_residency(sizes, rt.budget)
            sw.plan = plan
            sw.grads_in_host_buffer = sizes.grads_in_host_buffer
            store_bytes = sum(-(-n * sw.elsize * slots // align) * align
                              + (0 if plan.grads_resident else -(-n * 4 // align) * align) for n in numels)
            rt.store.preflight(store_bytes, "the optimizer state" if plan.grads_resident
                               else "the optimizer state and gradients")
            if psw is not None and plan.params_resident:
                psw.make_resident()
            self.aidaptiv_plan = plan
            self.aidaptiv_sizes = sizes
            if rt.rank == 0:
                log.info("aidaptiv_ds: DRAM budget %s -> gradients %s, parameters %s, %d/%d optimizer sub-groups in "
                         "DRAM; %s written to the cache tier per step",
                         format_bytes(rt.budget), "in DeepSpeed's host buffer" if sizes.grads_in_host_buffer
                         else "in DRAM" if plan.grads_resident else "on the cache tier",
                         "in DRAM" if plan.params_resident else "on the cache tier", len(plan.resident_subgroups),
                         len(numels), format_bytes(plan.write_bytes_per_step))

    AidaptivZeroOptimizer_Stage3.__qualname__ = "AidaptivZeroOptimizer_Stage3"
    return AidaptivZeroOptimizer_Stage3
