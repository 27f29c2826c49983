"""What ZeRO-3 attaches to a model's parameters and to its optimizer, for code outside the adapter.

``deepspeed.zero.Init`` replaces each parameter's data by its partition (or an empty placeholder) and
records the whole tensor's size and shape on the parameter (``param.ds_numel``, ``param.ds_shape``)
and, with NVMe offload, the swapper that holds its partition (``param.nvme_swapper``); DeepSpeed's
Stage-3 optimizer keeps its optimizer swapper as ``optimizer.optimizer_swapper``. Those are DeepSpeed
attributes (``docs/deepspeed-surface.md``), so the exporter, the fingerprint and the benchmarks read
them through these functions. Each works on a plain (unpartitioned) parameter too.
"""
from __future__ import annotations

import torch


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter: ``ds_numel`` under ZeRO-3, else ``numel()``."""
    return int(getattr(param, "ds_numel", param.numel()))


def full_shape(param: torch.Tensor) -> torch.Size:
    """Shape of the whole parameter: ``ds_shape`` under ZeRO-3, else its own shape."""
    shape = getattr(param, "ds_shape", None)
    return param.shape if shape is None else shape


def swapper_of(param: torch.Tensor):
    """The parameter swapper holding ``param``'s partition (DeepSpeed's or aidaptiv_ds's), or None
    (no NVMe offload of parameters, or no ZeRO-3)."""
    return getattr(param, "nvme_swapper", None)


def optimizer_swapper_of(optimizer):
    """The optimizer swapper of a ZeRO-3 optimizer (DeepSpeed's or aidaptiv_ds's), or None."""
    return getattr(optimizer, "optimizer_swapper", None)


def largest_fetch_numel(module: torch.nn.Module | None) -> int:
    """Elements one ZeRO-3 fetch gathers for the largest module of ``module``'s tree: a module's own parameters,
    a ZeRO-3 leaf module's whole subtree (``deepspeed.utils.set_z3_leaf_modules``; ``fetch_sub_module`` gathers
    it at once, ``parameter_offload.py:546``); 0 without a module. The ``largest_module_numel`` of
    :func:`aidaptiv_ds.planner.auto.deepspeed_gathered_numel`."""
    if module is None:
        return 0
    from deepspeed.utils import z3_leaf_module

    return max((sum(full_numel(p) for p in m.parameters(recurse=z3_leaf_module(m))) for m in module.modules()),
               default=0)


def persistent_numel_of(params) -> int:
    """Elements of the parameters among ``params`` that ZeRO-3 keeps gathered for good (``param.ds_persist``,
    set by ``mark_persistent_parameters`` from ``stage3_param_persistence_threshold``); 0 for plain parameters."""
    return sum(full_numel(p) for p in params if getattr(p, "ds_persist", False))


def frozen_numel(module: torch.nn.Module | None) -> int:
    """Elements of the frozen parameters (``requires_grad`` False) of ``module``, all of them: under activation
    checkpointing DeepSpeed keeps the frozen parameters a recompute gathers until the recomputed region's backward
    ends ([Note: what bounds the gathered parameters] in ``planner/auto.py``), and the regions a script checkpoints
    are not known here (a layer, a ``ModuleDict``'s block, a ``checkpoint_sequential`` segment of several). 0 when
    nothing is frozen. Counted whether or not the run checkpoints: the engine cannot tell before the first
    backward. A model with an HF trunk is counted by its blocks instead (:func:`.trunk.held_layer_numel`)."""
    if module is None:
        return 0
    return sum(full_numel(p) for p in module.parameters() if not p.requires_grad)
