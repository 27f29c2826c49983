"""What aidaptiv_ds keeps on one DeepSpeed Stage-3 optimizer: one record, ``optimizer._aidaptiv``.

The Stage-3 subclass (``stage3.py``) and its mixins (``grad_path.py``, ``backward_step.py``, ``host_step.py``,
``state_api.py``) share this state. It used to be fifteen ``_aidaptiv_*`` attributes set on DeepSpeed's
optimizer at different times; as one record it is created first thing in ``__init__`` (before DeepSpeed's
own constructor calls back into the subclass), its fields are named and typed here, and what is not built
yet is None until the plan builds it (issue 39, "one composed state object on the optimizer").
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from ..tiers.fused_adam import FusedTile

    from .backward_step import BackwardStepper
    from .config import AidaptivConfig
    from .gradients import GradientStore
    from .grad_norms import NormScratch
    from .phase import EnginePhase
    from .runtime import Runtime
    from .step_pipeline import StepPipeline


@dataclasses.dataclass(eq=False)
class AidaptivOptimizerState:
    """One engine's aidaptiv_ds state on its Stage-3 optimizer.

    Attributes:
        cfg: the validated ``"aidaptiv"`` section.
        rt: the process runtime (store, DRAM tier, I/O engine) this engine uses.
        engine_id: distinguishes this engine's extents from another engine's in the same process.
        phase: the engine's phase record ([Note: phases] in ``phase.py``).
        module: the model DeepSpeed wraps (None when DeepSpeed was not given one).
        ds_sub_group_size: ``sub_group_size`` as the config gave it (None: DeepSpeed's default), for the norm
            groups ([Note: norm groups] in ``grad_path.py``).
        max_in_cpu: ``offload_param.max_in_cpu`` in elements where parameters go to nvme (None: no cap;
            [Note: max_in_cpu] in ``stage3.py``).
        grads: the gradient store (built by the plan).
        grad_where: ``ds_id -> (sub-group, element offset)`` of each gradient partition in the store.
        stepper: the steps inside backward (``backward_step.py``); pipeline: updates riding the next forward
            (``step_pipeline.py``).
        working_set: ``(RankState, RankPolicy, RankWorkingSet)`` the budget was cut by (``planner/working_set.py``).
        norm_param_groups: the parameter groups the gradient norm is summed over (DeepSpeed's sub-groups).
        norm_scratch: reused scratch of the gradient norm (``grad_norms.py``).
        listening: the parameter swapper's drop and use listeners are registered for this engine.
        narrow_edits: sub-group index -> ``[(Slot, buf, first element, fp32 rows)]`` a state-API setter changed,
            encoded into the slots at the sub-group's swap-out ([Note: narrow moments in the state API]).
        fused_tile: the compiled tile of the narrow moments the host step uses (``tiers/fused_adam.py``), None: the
            eager tile (fp32 moments, ``"fused_step": "off"``, or no compiler).
        picked: DeepSpeed settings the config left out that this backend chose (``{"sub_group_size": elements,
            "reduce_bucket_size": elements}``, those that apply), named on the start line.
    """
    cfg: AidaptivConfig
    rt: Runtime
    engine_id: int
    phase: EnginePhase
    module: nn.Module | None = None
    ds_sub_group_size: Any = None
    max_in_cpu: int | None = None
    grads: GradientStore | None = None
    grad_where: dict | None = None
    stepper: BackwardStepper | None = None
    pipeline: StepPipeline | None = None
    working_set: tuple | None = None
    norm_param_groups: list | None = None
    norm_scratch: NormScratch | None = None
    listening: bool = False
    narrow_edits: dict = dataclasses.field(default_factory=dict)
    fused_tile: FusedTile | None = None
    picked: dict = dataclasses.field(default_factory=dict)


def state_of(optimizer: Any) -> AidaptivOptimizerState | None:
    """``optimizer``'s aidaptiv_ds state, or None for an optimizer aidaptiv_ds does not drive."""
    st = getattr(optimizer, "_aidaptiv", None)
    return st if isinstance(st, AidaptivOptimizerState) else None
