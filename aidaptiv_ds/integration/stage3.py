"""A ``DeepSpeedZeroOptimizer_Stage3`` subclass that plugs in our optimizer swapper and residency plan.

Installed as ``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3`` (the engine imports the
name at call time, ``engine.py:2747``). Constructing it with a config whose ``"aidaptiv"`` section
is absent or disabled returns an instance of DeepSpeed's own class, untouched.

Overrides (``docs/deepspeed-seams.md`` §2.5, §6.4):

* ``__init__`` sees the raw config dict (the optimizer swapper's constructor does not) and
  validates the section before anything is built;
* ``_configure_tensor_swapping`` builds :class:`AidaptivOptimizerSwapper` instead of DeepSpeed's;
* ``initialize_optimizer_states`` runs DeepSpeed's initialisation in the engine's ``INITIALIZING`` phase
  ([Note: phases] in ``phase.py``): the sub-groups and partitions it swaps in and out there are unchanged,
  so nothing is rewritten; then the residency plan is applied and the store is preflighted for the rest.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import typing
import weakref

import torch
from deepspeed.accelerator import get_accelerator

from ..planner.auto import (
    CPU_REDUCE_BUCKET_NUMEL,
    deepspeed_cpu_rank_bytes,
    live_partition_bytes,
)
from ..planner.working_set import RankPolicy, RankState, rank_working_set
from ..planner.residency import StateSizes, plan_residency
from ..store.packed import ExtentView
from ..tiers.blockwise import quantizer_available
from ..tiers.fused_adam import fused_tile
from ..tiers.unit import MOMENT_FORMATS
from ..units import format_bytes
from .config import AidaptivConfigError, section_enabled, validate
from ..io.errors import StorageFullError
from .backward_step import BackwardStepMixin, BackwardStepper
from .grad_path import GradientPathMixin
from .host_step import TILE_NUMEL, HostStepMixin, narrow_moments_refusal
from .state_api import StateAPIMixin
from .step_pipeline import StepPipeline
from .step_pipeline import forget as forget_pipeline
from .gradients import GradientStore
from .optimizer_state import AidaptivOptimizerState
from .optimizer_swapper import AidaptivOptimizerSwapper, SubgroupFormat, SwapperLinks
from .phase import EnginePhase, Phase
from .runtime import auto_dram_budget, get_runtime
from .trunk import module_gathered_numel

log = logging.getLogger("aidaptiv_ds")


class DeepSpeedHostShare(typing.NamedTuple):
    """DeepSpeed's own ZeRO-3 working set in a CPU rank's host memory, as the planner counts it (bytes)."""

    #: gathered parameters and gradient buckets (:func:`aidaptiv_ds.planner.auto.deepspeed_cpu_rank_bytes`)
    deepspeed_bytes: int
    #: the partitions of the parameters DeepSpeed keeps gathered, where our parameter swapper holds them
    #: (:func:`aidaptiv_ds.planner.auto.live_partition_bytes`): over one rank they are the gathered parameters
    live_partition_bytes: int
    #: ranks of the partition group the parameters are gathered over (the data-parallel size)
    gather_ranks: int


_ENGINE_IDS = itertools.count()


def auto_sub_group_size(ds_config: dict, module, runtime) -> int | None:
    """``zero_optimization.sub_group_size`` to use when the config leaves it out, else None.

    DeepSpeed's default (1e9 elements) makes a model of less than a billion parameters per rank one
    sub-group: its optimizer read, update and write-back cannot overlap, and one sub-group's master
    weights, moments and gradient (16 B/element) are all in host memory at once. Chosen by
    :func:`aidaptiv_ds.planner.auto.auto_sub_group_numel` from this rank's available host memory. Adam is
    elementwise, so the grouping changes no parameter update; only the order in which the gradient norm's
    per-group parts are added (and so a clipping factor's last bits) depends on it.
    """
    zo = (ds_config or {}).get("zero_optimization", {}) if isinstance(ds_config, dict) else {}
    if "sub_group_size" in zo or module is None:
        return None
    from ..planner.auto import auto_sub_group_numel
    from ..telemetry.sysinfo import host_memory
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    avail = int(host_memory().get("available_bytes") or 0) // max(runtime.local_world, 1)
    return auto_sub_group_numel(numel, runtime.world, avail)


def refuse_partitioned_without_swapper(ds_config, module) -> None:
    """Refuse a model whose parameters a ``deepspeed.zero.Init()`` without this config partitioned (no NVMe parameter
    swapper on them) where the config offloads the parameters to nvme: DeepSpeed's Stage 3 would stop in its
    constructor with ``AttributeError: 'NoneType' object has no attribute 'reserve_partitioned_swap_space'``
    (``stage3.py:1018``; its own NVMe offload too), a new-user trial's first sight of the backend.

    Raises:
        AidaptivConfigError: naming the parameter and the fix (give ``zero.Init`` the config).
    """
    zo = (ds_config or {}).get("zero_optimization", {}) if isinstance(ds_config, dict) else {}
    if module is None or str((zo.get("offload_param") or {}).get("device", "")).lower() != "nvme":
        return
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id") and getattr(p, "nvme_swapper", None) is None:
            raise AidaptivConfigError(
                f"aidaptiv_ds: parameter {name} was partitioned by a deepspeed.zero.Init() that was not given this "
                f"config (its parameters have no NVMe swapper), while zero_optimization.offload_param.device is "
                f"\"nvme\". Fix: build the model under `deepspeed.zero.Init(config_dict_or_path=ds_config)` (HF: "
                f"create TrainingArguments(deepspeed=...) or HfDeepSpeedConfig(ds_config) before from_pretrained), "
                f"or without zero.Init")


def auto_reduce_bucket_size(ds_config: dict) -> int | None:
    """``zero_optimization.reduce_bucket_size`` to use on a CPU rank when the config leaves it out, else None.

    On a GPU DeepSpeed's bucket (5e8 elements by default) is VRAM; on a CPU rank it is host memory
    outside the DRAM budget, three times over while a bucket is reduced over several ranks (the bucket, the
    interleaved copy ``reduce_scatter_coalesced`` makes, gloo's reduce-scatter buffer: ``docs/gradients.md``;
    one rank skips the reduce-scatter, ``integration/grad_path.py``): 6 GB
    in fp32, a quarter of a 24 GiB machine. A bucket batches collectives; on a CPU rank 2e7 elements
    (80 MB in fp32) already makes each one long against its fixed cost, and the 5.8 GB saved go to
    the budget. A gradient larger than the bucket is reduced on its own, without a copy (DeepSpeed
    leaves it out of the contiguous buffer, ``stage3.py:1626``). The reduction of every element is the
    same for any bucketing (a division by the world size, one sum per element), so the arithmetic is
    DeepSpeed's: the oracle tests run with it.
    """
    zo = (ds_config or {}).get("zero_optimization", {}) if isinstance(ds_config, dict) else {}
    if "reduce_bucket_size" in zo or get_accelerator().device_name() != "cpu":
        return None
    return CPU_REDUCE_BUCKET_NUMEL


def _weak_method(method):
    """``method`` as a callback that does not keep its object alive (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        fn = ref()
        if fn is not None:
            fn(*args)
    return call


def make_stage3_class(base: type) -> type:
    """Subclass DeepSpeed's Stage-3 optimizer class ``base`` (kept as ``AidaptivStage3.__base__``)."""

    class AidaptivZeroOptimizer_Stage3(StateAPIMixin, BackwardStepMixin, HostStepMixin, GradientPathMixin, base):
        """DeepSpeed ZeRO-3 optimizer whose NVMe offload runs on aidaptiv_ds (see module docstring)."""

        _aidaptiv_deepspeed_class = base

        def __new__(cls, *args, **kwargs):
            ds_config = kwargs.get("ds_config")
            if not section_enabled(ds_config if isinstance(ds_config, dict) else None):
                return base(*args, **kwargs)  # DeepSpeed's own class, untouched
            return super().__new__(cls)

        def __init__(self, *args, **kwargs):
            ds_config = kwargs.get("ds_config")
            cfg = validate(ds_config)
            refuse_partitioned_without_swapper(ds_config, kwargs.get("module", args[0] if args else None))
            # one record of this engine's state (optimizer_state.py), before DeepSpeed's constructor calls back
            self._aidaptiv = AidaptivOptimizerState(cfg=cfg, rt=get_runtime(cfg), engine_id=next(_ENGINE_IDS),
                                                    phase=EnginePhase(),  # [Note: phases] in phase.py
                                                    module=kwargs.get("module", args[0] if args else None))
            auto = auto_sub_group_size(ds_config, self._aidaptiv.module, self._aidaptiv.rt)
            # the sub-groups DeepSpeed would make: the gradient norm is summed over those ([Note: norm groups])
            self._aidaptiv.ds_sub_group_size = kwargs.get("sub_group_size")
            if auto is not None and "sub_group_size" in kwargs:
                if self._aidaptiv.rt.rank == 0:
                    log.info("aidaptiv_ds: zero_optimization.sub_group_size not set: using %.3g elements instead of "
                             "DeepSpeed's 1e9 (so the optimizer's read, update and write-back of sub-groups overlap "
                             "and its working set stays small); set it in the config to choose", auto)
                kwargs["sub_group_size"] = self._aidaptiv.picked["sub_group_size"] = auto
            bucket = auto_reduce_bucket_size(ds_config)
            if bucket is not None and int(kwargs.get("reduce_bucket_size", bucket)) > bucket:
                if self._aidaptiv.rt.rank == 0:
                    log.info("aidaptiv_ds: zero_optimization.reduce_bucket_size not set on a CPU rank: using %.3g "
                             "elements instead of DeepSpeed's %.3g (its reduce path holds up to three buckets "
                             "of host memory outside the DRAM budget); set it in the config to choose", bucket,
                             float(kwargs["reduce_bucket_size"]))
                kwargs["reduce_bucket_size"] = self._aidaptiv.picked["reduce_bucket_size"] = bucket
            super().__init__(*args, **kwargs)
            self._aidaptiv_group_norms_as_deepspeed()

        def destroy(self):
            """DeepSpeed's ``destroy`` (hooks removed), then this engine's optimizer state leaves the tiers and the
            store; a runtime left with nothing closes ([Note: several engines in a process] in ``runtime.py``)."""
            try:
                self._aidaptiv_drain()
                super().destroy()
            finally:
                if self._aidaptiv.pipeline is not None:
                    forget_pipeline(self._aidaptiv.pipeline)
                self._aidaptiv.rt.detach_engine(self._aidaptiv.engine_id)

        def _configure_offloading(self, offload_optimizer_config, offload_param_config):
            """DeepSpeed's, except that ``offload_param.max_in_cpu`` does not move parameter partitions into
            DeepSpeed's own CPU buffers (outside the DRAM budget): it caps the parameter bytes the residency
            plan may keep in DRAM instead ([Note: max_in_cpu])."""
            super()._configure_offloading(offload_optimizer_config, offload_param_config)
            self._aidaptiv.max_in_cpu = int(self.max_params_in_cpu) if self.params_in_nvme_and_cpu else None
            self.max_params_in_cpu = 0

        def _configure_tensor_swapping(self, offload_optimizer_config, aio_config):
            rt = self._aidaptiv.rt
            # this engine's section (a runtime shared with an earlier zero.Init or engine keeps the first config)
            moments = MOMENT_FORMATS[self._aidaptiv.cfg.optimizer_state.moments]
            master = self.master_weights_and_grads_dtype
            fmt = SubgroupFormat.of(self.optimizer, master,
                                    moments if moments.bytes_per_element < master.itemsize else None)
            why = narrow_moments_refusal(self.optimizer) if fmt.narrow else None
            if why is not None:  # before step 1 creates any state ([Note: narrow moments] in host_step.py)
                raise AidaptivConfigError(
                    f"aidaptiv.optimizer_state.moments is \"{moments.name}\", but {why}: {moments.name} moments are "
                    f"stepped only by the tiled torch Adam/AdamW step. Fix: remove that setting, or set \"moments\": "
                    f"\"fp32\"")
            if moments.block:
                quantizer_available()  # torchao imports (else the fix is named) before any state exists
            if fmt.narrow:  # compiled and probed on this thread, before any state exists
                self._aidaptiv.fused_tile = fused_tile(moments.name, self._aidaptiv.cfg.optimizer_state.fused_step)
            links = self._aidaptiv_plan(fmt)
            # the swapper is built with what it works with (the plan, the gradient store, the stepper's choices)
            self.optimizer_swapper = sw = AidaptivOptimizerSwapper(
                rt, self.optimizer, master, self._aidaptiv.engine_id, phase=self._aidaptiv.phase,
                links=links, owner=weakref.ref(self), fmt=fmt)
            rt.attach_engine(self._aidaptiv.engine_id, sw, self._aidaptiv.stepper)

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
                                                  not psw.holds(p.ds_id) for p in params):
                    continue
                sw.set_alias(g, psw.alias_to_master(params, ExtentView(self._aidaptiv.rt.store, sw._extent_key(g),
                                                                       g.slot_bytes)))
            if not self._aidaptiv.listening:  # weakly: the swapper outlives engines
                self._aidaptiv.listening = True
                psw.drop_listeners.append(_weak_method(sw.take_master_bytes))
                psw.use_listeners.append(_weak_method(self._aidaptiv_params_used))
            # the partitions' first copy, written by zero.Init, is not read again
            freed = psw.release_dead_chunks(in_use=[p.ds_id for p in self._aidaptiv.module.parameters()
                                                    if hasattr(p, "ds_id")] if self._aidaptiv.module is not None
                                            else None)
            if freed and self._aidaptiv.rt.rank == 0:
                log.info("aidaptiv_ds: fp32 parameters are read from their master slots; %s of their first copy "
                         "given back to the cache paths", format_bytes(freed))

        def _aidaptiv_alias_ids(self, plan) -> list[int]:
            """ds_ids of the partitions :meth:`_aidaptiv_alias_params` will move to master slots under ``plan``
            (the same rule: fp32, sub-group not resident, every partition swapped by ours)."""
            psw = self._aidaptiv_param_swapper()
            if psw is None or plan.params_resident:
                return []
            out = []
            for i, group in enumerate(self.fp16_groups):
                if i in plan.resident_subgroups or any(getattr(p.ds_tensor, "final_location", None) is None or
                                                       not psw.holds(p.ds_id) for p in group):
                    continue
                out += [p.ds_id for p in group]
            return out

        def initialize_optimizer_states(self):
            psw = self._aidaptiv_param_swapper()  # one per runtime: engines on the same paths share it
            was = psw.phase if psw is not None else None
            if psw is not None:
                psw.phase = self._aidaptiv.phase
            try:
                with self._aidaptiv.phase.during(Phase.INITIALIZING):
                    super().initialize_optimizer_states()
            finally:
                if psw is not None:
                    psw.phase = was
            # initialisation streamed every sub-group through host buffers once; give their pages back
            # before DeepSpeed allocates its flat gradient buffer (stage3.py:791) on top of them
            self._aidaptiv.rt.release_host_memory()

        def _aidaptiv_param_swapper(self):
            for group in self.fp16_groups:
                for p in group:
                    s = getattr(p, "nvme_swapper", None)
                    if s is not None:
                        return s
            return None

        def _aidaptiv_deepspeed_host_share(self, module_params) -> DeepSpeedHostShare:
            """DeepSpeed's own working set in host memory on a CPU rank and the part of it that is our swap buffers,
            from this engine's knobs (:class:`DeepSpeedHostShare`); all 0 (one rank) on an accelerator, where
            DeepSpeed's working set is VRAM."""
            if get_accelerator().device_name() != "cpu":
                return DeepSpeedHostShare(0, 0, 1)
            offload = getattr(self, "parameter_offload", None)
            model_numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in module_params)
            gathered = module_gathered_numel(self._aidaptiv.module, getattr(
                offload, "_max_available_parameters_in_numel", 0) or 0, getattr(
                offload, "_max_reuse_distance_in_numel", 0) or 0) if self._aidaptiv.module is not None else 0
            import deepspeed.comm as dist
            ranks = dist.get_world_size(group=self.dp_process_group)
            ds = deepspeed_cpu_rank_bytes(gathered, model_numel, self.dtype.itemsize,
                                          int(getattr(self, "reduce_bucket_size", 0) or 0),
                                          self.gradient_accumulation_dtype.itemsize, partition_ranks=ranks)
            live = live_partition_bytes(gathered, model_numel, self.dtype.itemsize, partition_ranks=ranks) \
                if self._aidaptiv_param_swapper() is not None else 0
            return DeepSpeedHostShare(ds, live, ranks)

        def _aidaptiv_param_cap(self, module_params) -> int | None:
            """``offload_param.max_in_cpu`` as bytes of this rank's parameter partitions (None: no cap).

            [Note: max_in_cpu] DeepSpeed moves the partitions of the first sub-groups, up to ``max_in_cpu``
            elements (default 1e9), into CPU buffers of its own for good (``stage3.py:886-910``): host memory
            outside any budget. With aidaptiv_ds the DRAM budget decides what stays in host memory, and
            ``max_in_cpu`` bounds the parameter share of it: the residency plan keeps the parameters in DRAM
            only when they fit in the budget *and* under ``max_in_cpu`` (``max_in_cpu: 0`` keeps them on the
            cache tier whatever the budget). Where a partition lives changes no arithmetic.
            """
            cap = self._aidaptiv.max_in_cpu
            if cap is None:
                return None
            parts = [p for p in module_params if getattr(p, "ds_tensor", None) is not None]
            numel = sum(int(p.ds_tensor.ds_numel) for p in parts)
            nbytes = sum(int(p.ds_tensor.ds_numel) * p.element_size() for p in parts)
            return nbytes if cap >= numel else cap * (nbytes // max(numel, 1))

        def _aidaptiv_plan(self, sw: SubgroupFormat) -> SwapperLinks:
            """Choose what stays in DRAM, build the gradient store, preflight the store for the rest,
            load resident parameters; returns what the optimizer swapper is built with.

            Args:
                sw: the sub-groups' layout (the optimizer swapper's, before it exists).

            Raises:
                StorageFullError: the cache paths cannot hold the optimizer state and gradients.
            """
            rt = self._aidaptiv.rt
            psw = self._aidaptiv_param_swapper()
            if psw is not None and rt.cfg.from_unpacked:  # before DeepSpeed reads partitions for the masters
                psw.adopt_unpacked(self._aidaptiv.module)
            numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
            align = rt.store.alignment
            module_params = list(self._aidaptiv.module.parameters()) if self._aidaptiv.module is not None else []
            alias = (psw is not None and sw.dtype == torch.float32
                     and all(p.dtype == torch.float32 for group in self.fp16_groups for p in group))
            accum = self.gradient_accumulation_dtype
            grad_numels, expected, self._aidaptiv.grad_where = self._aidaptiv_grad_layout()
            def partition_bytes(p) -> int:  # this rank's partition of the parameter ``p``
                return p.ds_tensor.ds_numel * p.element_size()

            subgroup_param_bytes = [sum(map(partition_bytes, group)) for group in self.fp16_groups]
            # the planner calls the same function with the same records; only the facts come from DeepSpeed's
            # optimizer here ([Note: what each side knows] in planner/working_set.py)
            state = RankState(
                subgroup_numels=tuple(numels), grad_numels=tuple(grad_numels),
                largest_partition_numel=max((p.partition_numel() for group in self.fp16_groups for p in group),
                                            default=0),
                param_bytes=sum(partition_bytes(p) for p in module_params if getattr(p, "ds_tensor", None) is not None),
                largest_subgroup_param_bytes=max(subgroup_param_bytes, default=0),
                staging_partition_bytes=psw.largest_partition_bytes() if psw is not None else 0,
                accum_elsize=accum.itemsize, state_elsize=sw.elsize, states=sw.expected_states, alignment=align,
                alias=alias, moments=sw.moments.name if sw.narrow else None)
            grad_slices = state.grad_slice_bytes()
            # parameters not on our swapper (offload_param "cpu" or left out) are DeepSpeed's: none of our bytes
            ours = psw is not None
            # and of ours a step writes only the partitions the optimizer owns that went through the store (not a
            # frozen one, not one below min_swap_bytes that DeepSpeed keeps in host memory)
            written = sum(partition_bytes(p) for group in self.fp16_groups for p in group if psw.holds(p.ds_id)) \
                if ours else 0
            sizes = StateSizes(param_bytes=state.param_bytes if ours else 0, param_write_bytes=written,
                               grad_bytes=sum(grad_slices),
                               subgroup_bytes=[sw.layout(n, 1 + sw.expected_states).prefix_bytes() for n in numels],
                               alias_params=alias, subgroup_param_bytes=subgroup_param_bytes,
                               subgroup_grad_bytes=grad_slices,
                               param_resident_cap=self._aidaptiv_param_cap(module_params))
            cpu_rank = get_accelerator().device_name() == "cpu"
            ds_bytes, live_parts, gather_ranks = self._aidaptiv_deepspeed_host_share(module_params)
            policy = RankPolicy(
                cpu_rank=cpu_rank, step_in_backward=rt.cfg.step_in_backward,
                step_rides_forward=rt.cfg.step_rides_forward, fp16=self.dtype == torch.float16,
                hpz=int(getattr(self, "zero_hpz_partition_size", 1) or 1) > 1,
                readahead_bytes=psw.prefetch_window() if psw is not None and cpu_rank else 0, deepspeed_bytes=ds_bytes,
                live_partition_bytes=live_parts, gather_ranks=gather_ranks,
                activation_bytes=0,  # the sequence length is not known yet: the safety margin holds them
                step_tile_numel=TILE_NUMEL)

            def cut_budget(policy: RankPolicy):
                """The working set under ``policy``, and the ``"auto"`` budget cut by it."""
                rank_ws = rank_working_set(state, policy)
                # what the budget was cut by, and from what (tests/test_working_set.py compares it with the plan)
                self._aidaptiv.working_set = (state, policy, rank_ws)
                if rt.cfg.dram_budget == "auto":  # now the working set is known: take it out of the budget
                    held = rt.tier.resident_bytes() + rt.tier.cached_bytes()  # ours: in use now, the plan's to give
                    rt.set_budget(auto_dram_budget(working_set_bytes=rank_ws.total - held))
                    rt.release_host_memory()  # what the smaller budget evicted goes back to the OS
                return rank_ws

            rank_ws = cut_budget(policy)
            clip = float(getattr(self, "clip_grad", 0.0) or 0.0) > 0.0
            state_bytes = sum(state.opt_slice_bytes(n) for n in numels)
            sw_span_max = rank_ws.largest_opt_slice
            speculate = rank_ws.may_step_in_backward
            while True:
                sizes.grads_transient = speculate and not clip
                sizes.steps_in_backward = speculate
                # partial gradient sums between micro-batches ([Note: partial gradients between micro-batches])
                sizes.grad_accum = int(getattr(self, "gradient_accumulation_steps", 1) or 1)
                plan = plan_residency(sizes, rt.budget)
                grads_stored = sum(b for i, b in enumerate(grad_slices) if i not in plan.resident_grad_subgroups)
                shadows = sum(state.opt_slice_bytes(numels[i]) for i in range(len(numels))
                              if i not in plan.resident_subgroups) if speculate else 0
                later = shadows + (grads_stored if sizes.grads_stored else 0)  # extents allocated after init
                if alias:  # the fp32 partitions' first copy is given back once they alias their masters (after
                    # the master slots are allocated): only what comes later can use that space, and per hole the
                    # allocator's first fit may leave up to one extent unused
                    later = max(later - psw.reclaimable_bytes(self._aidaptiv_alias_ids(plan), slack=sw_span_max), 0)
                need = state_bytes + later
                what = "the optimizer state" + (", a second copy of it for steps inside backward" if speculate else "") \
                    + (" and the gradients" if sizes.grads_stored and grads_stored else "")
                try:
                    rt.store.preflight(need, what)
                    break
                except StorageFullError:
                    if not speculate or rt.cfg.step_in_backward is True:
                        raise
                    speculate = False  # "auto": step after backward, which needs no second copy
                    if rt.rank == 0:
                        log.warning("aidaptiv_ds: the cache paths lack room for a second copy of the optimizer "
                                    "state, so optimizer steps run after backward (step_in_backward: \"auto\")")
                    # [Note: the budget follows the resolved path] Steps after backward hold neither the in-backward
                    # window nor the master hold, so the "auto" budget is cut again without them (a fixed budget
                    # stays). planner/plan.py resolves the same path from the drives' size and plans this budget.
                    # Cut by the speculating working set, a 4.05B fp32 run on a drive without room for the second
                    # copy left 2.6 GiB of its RAM unused (4.8 GiB budget, steps 13% under the plan).
                    policy = dataclasses.replace(policy, step_in_backward=False)
                    rank_ws = cut_budget(policy)
            grad_window, rides, pool_bytes = rank_ws.grad_window, rank_ws.rides, rank_ws.pool_bytes
            ws, overhead, in_backward_window = rank_ws.total, rank_ws.overhead, rank_ws.in_backward_window
            rt.settle_host_memory_reuse(ws - overhead, plan.cache_bytes, pool_bytes, rides=rides)
            device_sync = None
            if not get_accelerator().is_synchronized_device() and self.reduce_and_partition_stream is not None:
                device_sync = self.reduce_and_partition_stream.synchronize  # gradient copies run on that stream
            self._aidaptiv.grads = grad_store = GradientStore(
                rt, self._aidaptiv.engine_id, accum, grad_numels, expected, window_bytes=grad_window,
                resident_bytes=sum(grad_slices[i] for i in plan.resident_grad_subgroups), device_sync=device_sync,
                resident_subgroups=plan.resident_grad_subgroups)
            self._aidaptiv.stepper = BackwardStepper(self, enabled=speculate, keep_gradients=clip,
                                                     inflight_limit=in_backward_window)
            self._aidaptiv.pipeline = StepPipeline(self, self._aidaptiv.stepper, enabled=rides)
            self._aidaptiv.stepper.pipeline = self._aidaptiv.pipeline
            rt.preflight_checkpoints(sum(n * 4 * (1 + sw.expected_states) + 4 * align for n in numels))
            if psw is not None and plan.params_resident:
                psw.make_resident()
            self.aidaptiv_plan = plan
            self.aidaptiv_sizes = sizes
            if rt.rank == 0:
                grads = ("consumed inside backward" if not sizes.grads_stored else
                         f"of {len(plan.resident_grad_subgroups)}/{len(grad_slices)} sub-groups in DRAM")
                log.info("aidaptiv_ds: DRAM budget %s -> gradients %s, parameters %s, %d/%d optimizer sub-groups in "
                         "DRAM; optimizer steps %s; %s written to the cache tier per step", format_bytes(rt.budget),
                         grads, "in DRAM" if plan.params_resident else "on the cache tier", len(plan.resident_subgroups),
                         len(numels), "inside backward (speculative" + (", redone when clipping)" if clip else ")")
                         if speculate else "after backward", format_bytes(plan.write_bytes_per_step))
            return SwapperLinks(plan=plan, gradients=grad_store, wanted=self._aidaptiv.stepper.wanted,
                                holds_master=self._aidaptiv_holds_master,
                                master_hold_limit=rank_ws.master_hold if speculate else 0)

    AidaptivZeroOptimizer_Stage3.__qualname__ = "AidaptivZeroOptimizer_Stage3"
    return AidaptivZeroOptimizer_Stage3
