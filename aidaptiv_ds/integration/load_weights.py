"""The weights-only loads of ``engine.load_checkpoint`` and its ``load_module_strict``/``custom_load_fn``, as
DeepSpeed 0.19.8 does them under ZeRO-3 (``engine.py`` ``load_checkpoint``/``_load_checkpoint``/
``load_module_state_dict``; ``docs/deepspeed-surface.md``).

[Note: what a weights-only load keeps] With ``load_optimizer_states=False`` DeepSpeed loads the checkpoint's
fp32 weights into the module (gathered, ``module.load_state_dict`` or the caller's ``custom_load_fn``), then sets
every fp32 master from the module's own partitions (``_restore_from_bit16_weights``): a bf16 model's masters are
the loaded weights rounded to bf16, a parameter the checkpoint lacks (a non-strict load) keeps its value, and the
engine's Adam moments and step are left as they were (an engine that trained keeps its own). The same here,
sub-group by sub-group without gathering the model: each sub-group's state is swapped in, its masters set to the
checkpoint's rows cast to the parameters' dtype and back (or to what ``custom_load_fn`` left in the gathered
module), its partitions rebuilt from them and the state swapped out with its moments. ``load_module_only=True``
loads the weights the same way: DeepSpeed 0.19.8 takes them from the model-states file there, whose partitioned
parameters are 0-element tensors, and keeps its own weights (README).

[Note: strict] DeepSpeed's ``module.load_state_dict(checkpoint['module'], strict=load_module_strict)`` compares
the module's keys with those the save recorded (``exclude_frozen_parameters=True`` leaves the frozen ones out): a
strict load with a key missing or unexpected raises PyTorch's ``RuntimeError`` before anything is changed.
"""
from __future__ import annotations

import torch

from .phase import Phase


def check_module_keys(module, saved_keys, strict: bool) -> None:
    """Raise PyTorch's ``load_state_dict`` error where a strict load would ([Note: strict]).

    Args:
        module: the engine's module.
        saved_keys: the keys of the checkpoint's ``module`` state dict (DeepSpeed's model-states file).
        strict: ``load_module_strict``.

    Raises:
        RuntimeError: ``strict`` and a key of the module is not saved or a saved key is not the module's; the
            message is PyTorch's ("Error(s) in loading state_dict for <class>: Missing key(s) in state_dict: ...").
    """
    if not strict:
        return
    expected = list(module.state_dict(keep_vars=True))  # the module's own keys; nothing is gathered
    saved, own = set(saved_keys), set(expected)
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved_keys if k not in own]
    errors = []
    if missing:
        errors.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if unexpected:
        errors.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(type(module).__name__,
                                                                                "\n\t".join(errors)))


def _partition_of(full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """This rank's ``n``-element partition of the flattened ``full`` (DeepSpeed pads the last one with zeros)."""
    flat = full.reshape(-1)
    out = torch.zeros(n, dtype=flat.dtype)
    part = flat[rank * n:(rank + 1) * n]
    out[:part.numel()] = part
    return out


def custom_loaded_partitions(module, names: dict, reader, buffers: dict, custom_load_fn, rank: int) -> dict:
    """Run ``custom_load_fn(src=state_dict, dst=module)`` as DeepSpeed does with ``load_optimizer_states=False``:
    ``src`` the checkpoint's fp32 weights (each parameter whole, in its shape; a tied one under each of its names,
    as ``zero_to_fp32`` gives it) and saved buffers, ``dst`` the module with every parameter gathered, and what
    rank 0 left is what every rank gets (DeepSpeed's ``modifier_rank=0``). ``rank``: this rank's partition index
    (``checkpointing.partition_rank``: the partitions are split over the world). Returns this rank's partition of
    each trainable parameter afterwards (``id(p)`` -> tensor of the parameter's dtype), to set the masters from
    (:func:`load_weights_only`). The gathered copies are released unchanged (nothing is written: the partitions
    are rebuilt from the masters), and frozen parameters come from the checkpoint afterwards, as DeepSpeed copies
    its ``frozen_param_fragments`` over what the function left."""
    import deepspeed
    from deepspeed import comm as dist

    src = {name: reader.full(name) for name in reader.params}
    src.update(buffers)
    for name, p in module.named_parameters(remove_duplicate=False):  # a tied parameter under each of its names,
        if name not in src and names.get(id(p)) in src:               # as zero_to_fp32's shared_params give it
            src[name] = src[names[id(p)]]
    params = list(module.parameters())
    out = {}
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        custom_load_fn(src=src, dst=module)
        for p in params:
            if getattr(p, "ds_tensor", None) is None or id(p) not in names or not p.requires_grad:
                continue
            if dist.get_world_size() > 1:  # rank 0's result, as GatheredParameters(modifier_rank=0)
                dist.broadcast(p.data, src=0)
            out[id(p)] = _partition_of(p.data.detach(), rank, p.ds_tensor.ds_numel).to(p.dtype)
    return out


def check_shapes(module, names: dict, reader) -> None:
    """Raise PyTorch's size-mismatch error where a parameter the checkpoint holds has another shape in the module
    (a resized vocabulary, another width): DeepSpeed's gathered ``load_state_dict`` raises it, strict or not;
    reading its flat ranges would scramble the weights.

    Raises:
        RuntimeError: "Error(s) in loading state_dict for <class>: size mismatch for <name>: ...".
    """
    errors = []
    for p in module.parameters():
        name = names.get(id(p))
        info = reader.params.get(name) if name is not None else None
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if info is not None and tuple(info.shape) != shape:
            errors.append(f"size mismatch for {name}: copying a param with shape {torch.Size(info.shape)} from "
                          f"checkpoint, the shape in current model is {torch.Size(shape)}.")
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(type(module).__name__,
                                                                                "\n\t".join(errors)))


def load_weights_only(opt, reader, names: dict, rank: int, custom: dict | None = None) -> None:
    """Set the engine's weights from the checkpoint, keeping its optimizer state ([Note: what a weights-only load
    keeps]).

    Args:
        opt: our Stage-3 optimizer.
        reader: the tag's :class:`~aidaptiv_ds.checkpoint.reader.CheckpointReader`.
        names: ``id(parameter)`` -> its name in the module.
        rank: this rank in the data-parallel group.
        custom: the partitions :func:`custom_loaded_partitions` returned, instead of the checkpoint's rows.
    """
    rt = opt._aidaptiv.rt
    rt.flush()
    with opt._aidaptiv.phase.during(Phase.LOADING):
        for i, group in enumerate(opt.fp16_groups):
            opt._optimizer_states_and_gradient_swap_in(i)
            masters = opt.fp32_partitioned_groups_flat[i].data
            off = 0
            for p in group:
                n = p.ds_tensor.ds_numel
                name = names.get(id(p))
                if custom is not None and id(p) in custom:
                    masters[off:off + n] = custom[id(p)].float()
                elif custom is None and name in reader.params:
                    masters[off:off + n] = reader.read_range(name, rank * n, n, slots=1)[0].to(p.dtype).float()
                elif p.dtype != torch.float32:  # DeepSpeed's masters come from the 16-bit partitions
                    masters[off:off + n] = masters[off:off + n].to(p.dtype).float()
                off += n
            opt._reassign_or_swap_out_partitioned_parameters(i)
            opt.optimizer_swapper.mark_changed(opt.fp32_partitioned_groups_flat[i])  # new masters: written back
            opt._optimizer_states_and_gradient_swap_out(i)
    rt.flush()
