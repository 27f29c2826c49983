"""The trunk of a model: the sequence of blocks a layer-major step runs one at a time (``layer_major.py``).

Found as HF Accelerate's ``device_map`` and FSDP's transformer auto-wrap policy find a model's blocks: by
the class names in ``_no_split_modules``. No DeepSpeed here.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .config import AidaptivConfigError
from .zero_params import frozen_numel, full_numel, largest_fetch_numel, persistent_numel_of

#: the fix every refusal of a layer-major step names
FIX = ("Fix: train it micro-batch by micro-batch (engine(batch); engine.backward(loss); engine.step()), "
       "which needs no trunk.")



@dataclasses.dataclass(frozen=True)
class Trunk:
    """The sequence of blocks a layer-major step runs one at a time.

    Attributes:
        name: the ``ModuleList`` 's qualified name in the model (``model.layers``).
        blocks: its elements, in the order the model calls them.
    """
    name: str
    blocks: tuple[torch.nn.Module, ...]

    @functools.cached_property
    def block_param_ids(self) -> tuple[frozenset[int], ...]:
        """Per block, the ``id`` s of its parameters."""
        return tuple(frozenset(id(p) for p in b.parameters()) for b in self.blocks)

    @functools.cached_property
    def param_ids(self) -> frozenset[int]:
        """The ``id`` s of every parameter of the trunk."""
        return frozenset().union(*self.block_param_ids)


def find_trunk(model: torch.nn.Module) -> Trunk:
    """The model's trunk: the ``ModuleList`` whose elements are the model's non-splittable blocks.

    The blocks are found as HF Accelerate's ``device_map`` and FSDP's transformer auto-wrap policy find
    them: by the class names in ``_no_split_modules`` (``LlamaDecoderLayer``, ...) of the model or of a
    module inside it (an HF model wrapped in a module of the user's). Of the
    ``ModuleList`` s made only of such blocks, the one holding the most parameters.

    Raises:
        AidaptivConfigError: the model names no ``_no_split_modules``, or no ``ModuleList`` is made of
            them, or a parameter is shared between blocks or between a block and the rest of the model.
    """
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    if not names:
        raise AidaptivConfigError(
            f"aidaptiv_ds: layer-major training (engine.train_batch) needs a model whose trunk is a sequence of "
            f"blocks, found as HF models name them (_no_split_modules); {type(model).__name__} names none. "
            + FIX)
    best, best_numel = None, -1
    for qual, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0 and \
                all(type(b).__name__ in names for b in mod):
            numel = sum(full_numel(p) for p in mod.parameters())
            if numel > best_numel:
                best, best_numel = (qual, mod), numel
    if best is None:
        raise AidaptivConfigError(
            f"aidaptiv_ds: layer-major training (engine.train_batch): {type(model).__name__} has no ModuleList of "
            f"its blocks ({', '.join(sorted(names))}). " + FIX)
    trunk = Trunk(best[0], tuple(best[1]))
    owner: dict[int, int] = {}
    for i, block in enumerate(trunk.blocks):
        for p in block.parameters():
            if owner.setdefault(id(p), i) != i:
                raise AidaptivConfigError(
                    f"aidaptiv_ds: layer-major training (engine.train_batch): a parameter is shared by blocks "
                    f"{owner[id(p)]} and {i} of {trunk.name}; its gradients would be summed in another order "
                    f"than DeepSpeed's. " + FIX)
    inside = set(owner)
    for qual, p in model.named_parameters(remove_duplicate=False):
        if id(p) in inside and not qual.startswith(trunk.name + "."):
            raise AidaptivConfigError(
                f"aidaptiv_ds: layer-major training (engine.train_batch): parameter {qual} is also used inside "
                f"{trunk.name}; its gradients would be summed in another order than DeepSpeed's. " + FIX)
    return trunk


def held_layer_numel(model: torch.nn.Module | None) -> int:
    """Elements of one layer DeepSpeed's coordinator does not bound, which the gathered-parameter plan counts
    ([Note: what bounds the gathered parameters] in ``planner/auto.py``): a layer-major step holds a whole block
    of the trunk gathered (:class:`~aidaptiv_ds.integration.train_batch.EnginePieces` ``hold``, outside the
    coordinator), and a recompute keeps the frozen parameters of the region it recomputes gathered until that
    region's backward ends. For a model with a trunk (which ``engine.train_batch`` may run, and whose blocks HF
    checkpoints one at a time) the largest block covers both; for a model without one, whose checkpointed regions
    are not known (a ``ModuleDict`` of blocks, ``checkpoint_sequential`` segments of several layers), all its
    frozen parameters (:func:`.zero_params.frozen_numel`). HF's ``every_n_layers`` above 1 recomputes
    several blocks at once: not counted.
    """
    if model is None:
        return 0
    try:
        trunk = find_trunk(model)
    except AidaptivConfigError:
        return frozen_numel(model)
    return max(sum(full_numel(p) for p in b.parameters()) for b in trunk.blocks)


def module_gathered_numel(model: torch.nn.Module, max_live_numel: int, max_reuse_numel: int) -> int:
    """Elements DeepSpeed keeps gathered for the built ``model`` (ZeRO-3 parameters or plain ones), from its module
    tree: :func:`aidaptiv_ds.planner.auto.deepspeed_gathered_numel` with its largest fetch, its persistent
    parameters and the layer it may hold. The runtime's and the fine-tuning job's one count."""
    from ..planner.auto import deepspeed_gathered_numel

    params = list(model.parameters())
    return deepspeed_gathered_numel(max_live_numel, max_reuse_numel, largest_fetch_numel(model),
                                    sum(full_numel(p) for p in params), persistent_numel_of(params),
                                    held_layer_numel(model))


def tied_outside(model: torch.nn.Module, trunk: Trunk) -> list[torch.nn.Parameter]:
    """Parameters outside the trunk that more than one module holds (tied input and output embeddings)."""
    inside = trunk.param_ids
    seen: dict[int, int] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            if id(p) not in inside:
                seen[id(p)] = seen.get(id(p), 0) + 1
                params[id(p)] = p
    return [params[i] for i, n in seen.items() if n > 1]


def active_dropout(model: torch.nn.Module) -> list[str]:
    """Names of the modules of ``model`` that draw dropout masks as it is now (training mode): a
    ``torch.nn.Dropout*`` with ``p > 0``, or an HF attention module whose ``attention_dropout`` (a probability
    it passes to the attention function) is above 0. Layer-major training replays them in its recompute but
    draws them in another order than micro-batch by micro-batch ([Note: dropout in the recompute] in
    ``layer_major.py``)."""
    out = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        p = m.p if isinstance(m, torch.nn.modules.dropout._DropoutNd) else getattr(m, "attention_dropout", 0.0)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
            out.append(name)
    return out
