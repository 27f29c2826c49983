"""The optimizer step of a host (CPU) sub-group in cache-sized tiles: torch's own Adam/AdamW arithmetic,
run over slices of the flat fp32 partition instead of the whole of it at once.

A mixin of the Stage-3 subclass (:func:`aidaptiv_ds.integration.stage3.make_stage3_class`); DeepSpeed
0.19.8 seam: ``_optimizer_step`` (``stage3.py:1235-1262``), which points the optimizer's param group at the
sub-group's flat fp32 partition and calls ``optimizer.step()`` on all of it.

[Note: why tiles]
torch's single-tensor Adam (``torch/optim/adam.py``, ``_single_tensor_adam``; the CPU path, ``foreach`` and
``fused`` being CUDA-only defaults) makes full passes over the partition and allocates two temporaries of
its size (``exp_avg_sq.sqrt()`` and the division by ``bias_correction2_sqrt``). For a sub-group of 148M
fp32 elements that is 1.2 GB of fresh memory per step, and at a DRAM budget of 0, where no freed heap is
kept (:func:`aidaptiv_ds.io.heap.return_freed_host_memory`), every byte of it page-faults in, and each
pass streams the partition through DRAM again. Stepping tiles of :data:`TILE_NUMEL` elements keeps the
temporaries small (8 MiB each) and the passes over a tile close together in time.

[Note: the tile size]
Each tile costs about a dozen ATen calls (dispatch and an OpenMP fork/join each), so small tiles pay in
overhead what they save in memory traffic. Tiles of 2M elements were fastest inside the 148M fp32 training
step, 1.5x faster than the whole-partition step at either heap policy (the timings of 128K to 4M elements:
``docs/profiling.md``, "The optimizer step's tile size").

[Note: the tiles' temporaries]
Each tile allocates and frees its two temporaries (8 MiB) again. Where they are fresh mappings, each tile
page-faults them in: 89 against 37 ms per 20M-element AdamW step (median of 20 interleaved pairs). Every
heap policy the runtime sets serves blocks of that size from the heap (the budget-0 policy maps only
blocks of 16 MiB and more on their own: ``io/heap.py`` [Note: the return threshold]), so the next tile
reuses them; the planner counts them (:func:`aidaptiv_ds.planner.auto.optimizer_scratch_bytes`).

[Note: bit-identity]
Every operation of the single-tensor path is elementwise (``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``,
``div``, ``add_``, ``addcdiv_``; ``maximum`` for amsgrad; ``add`` / ``mul_`` for weight decay) with
scalars computed from the step count, so a slice's result does not depend on the elements around it.
Each tile gets a copy of the step counter, which ``adam`` increments once; the partition's counter takes
the last copy's value. Probed bit-identical with one whole-partition call on 1e3..24.6M elements, Adam and
AdamW, weight decay, amsgrad, maximize, tiles of 64K/100003/128K, 1-3 threads, ATen AVX512/AVX2/scalar
kernels (``tests/test_host_step.py`` keeps the check).

[Note: narrow moments]
With ``"optimizer_state": {"moments": "bf16"}`` the optimizer's ``exp_avg``/``exp_avg_sq`` are bf16 views of
the sub-group's slots (``optimizer_swapper.py`` [Note: moment dtype]). Each tile then widens its moments to
fp32 (exact), runs the same ``adam`` call on them and rounds them back into the slots (``copy_``:
round-to-nearest-even): the master update is torch's fp32 arithmetic on moments rounded after the previous
step. With ``"int8"`` the tensors are the codes, and the tile is dequantized from and quantized back into the
slot (``tiers/blockwise.py``; tiles are whole blocks of 256). The two widened tiles are 2 x 8 MiB more scratch (the planner's ``widened_states``). Such a state has
no other step: where the tiled path does not apply, :class:`HostStepMixin` raises instead of handing bf16
moments to DeepSpeed's or torch's whole-partition step.

[Note: the fused tile]
With bf16 or int8 moments and ``"fused_step"`` ``"auto"`` (the default) or ``"on"``, each tile is one compiled
loop instead (``tiers/fused_adam.py``: [Note: why a fused tile], [Note: not torch's bits]): torch's formulas, not
its bits; bf16 about 2x faster than the eager fp32 tile, int8 about 2x faster than the eager int8 tile. The step
counter is incremented once, as torch does. int8's fused tile takes whole blocks, two or more: a unit's short
last block (or a last tile of one block) takes the eager tile after it, in the same step. amsgrad and tensor
hyperparameters keep the eager tile.

The tiled path runs only where it is exactly torch's step: the optimizer is ``torch.optim.Adam`` or
``AdamW`` (not a subclass), the partition is a real fp32 CPU tensor with a dense gradient, its state is
initialised by ``_init_group`` as torch does, ``foreach``/``fused`` are off or unset (unset resolves to
off on CPU), ``capturable``/``differentiable`` are off, there is no ``grad_scale``/``found_inf``, no
optimizer step hook, and DeepSpeed would step ``self.optimizer`` (not its GPU ``backup_optimizer``, a
torch-autocast grad scaler, ZenFlow or Muon). Anything else goes to DeepSpeed's ``_optimizer_step``.
"""
from __future__ import annotations

import torch
from torch.optim.adam import adam

from ..errors import AidaptivConfigError
from ..planner.auto import OPTIMIZER_TILE_NUMEL
from ..spans import span
from ..tiers import blockwise
from ..tiers.fused_adam import FusedTile, adam_kwargs, step_scalars

#: elements per tile: 8 MiB of fp32 (see [Note: the tile size]); the planner counts its temporaries
#: (:func:`aidaptiv_ds.planner.auto.optimizer_scratch_bytes`)
TILE_NUMEL = OPTIMIZER_TILE_NUMEL


def tiled_adam_step(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor,
                    tile_numel: int | None = None, slots: dict | None = None,
                    fused: FusedTile | None = None) -> bool:
    """One Adam/AdamW step of ``param`` (the only tensor of ``group``) in tiles of ``tile_numel`` elements.

    Args:
        optimizer: a ``torch.optim.Adam`` or ``torch.optim.AdamW`` whose ``group`` holds ``param`` alone.
        group: the param group (``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``...).
        param: a flat fp32 CPU tensor with ``param.grad`` set (a sub-group's partition, shape ``(n,)``).
        tile_numel: elements per tile (> 0; default :data:`TILE_NUMEL`, read at the call; rounded down to whole
            blocks of a quantized slot).
        slots: ``{state name: (Slot, buf)}`` of states stored in another format (``tiers/unit.py``; the swapper's
            ``moment_slots``): each tile is read from and written to the slot ([Note: narrow moments]). Needed for
            int8 moments, whose state tensors are the codes; bf16 moments are widened from their tensors without it.
        fused: the fused tile of the moments' format (``tiers/fused_adam.py``,
            :func:`~aidaptiv_ds.tiers.fused_adam.fused_tile`) or None. Given, bf16 or int8 moments step in it instead
            of the eager widened tile, where the group is one it computes (no amsgrad, number hyperparameters):
            [Note: the fused tile].

    Returns:
        True when the step ran here (tiled); False when it did not and nothing was changed, so the caller
        steps the usual way (see the module docstring for when).
    """
    tile_numel = int(TILE_NUMEL if tile_numel is None else tile_numel)
    if not is_torch_adam(optimizer) or not _plain_group(group):
        return False
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False
    if _has_step_hooks(optimizer) or len(group["params"]) != 1 or group["params"][0] is not param:
        return False
    g = param.grad
    narrow = narrow_moments(optimizer, param)
    if (g is None or param.device.type != "cpu" or param.dtype != torch.float32 or param.dim() != 1
            or g.is_sparse or g.dtype != param.dtype or g.shape != param.shape
            or (param.numel() <= tile_numel and not narrow)):
        return False
    params, grads, m, v, vmax, steps = [], [], [], [], [], []
    with torch.no_grad():
        if optimizer._init_group(group, params, grads, m, v, vmax, steps):  # torch's own state init; complex: no
            return False
        step = steps[0]
        if step.device.type != "cpu" or step.dim() != 0:
            return False
        kw = adam_kwargs(group)
        tensors = [params[0].detach(), grads[0], m[0], v[0]] + ([vmax[0]] if group["amsgrad"] else [])
        if any(t.shape != param.shape or t.dtype not in (torch.float32,) + NARROW_MOMENT_DTYPES
               for t in tensors[2:]):
            return False
        names = {id(v): k for k, v in optimizer.state[param].items() if torch.is_tensor(v)}
        codecs = [(slots or {}).get(names.get(id(t))) for t in tensors[2:]]
        if any(t.dtype == torch.uint8 and c is None for t, c in zip(tensors[2:], codecs)):
            return False  # int8 codes without their slot: nothing to decode them with
        block = max([c[0].block for c in codecs if c is not None] + [1])
        tile_numel = max(block, tile_numel // block * block)  # [Note: tiles and blocks] in tiers/blockwise.py
        n, last = param.numel(), step
        start = 0  # elements before it were stepped by the fused tile ([Note: the fused tile])
        usable = fused is not None and fused.usable
        moments = _fused_moments(fused, group, tensors, codecs) if usable else None
        if moments is not None:
            with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
                scalars = step_scalars(group, step.item() + 1)  # after torch's increment, once per step
                start = _fused_tiles(fused, tensors[:2], moments, n, tile_numel, scalars)
            if start == n:
                step.add_(1)
                optimizer._opt_called = True
                return True
        scratch = [torch.empty(min(n - start, tile_numel)) if t.dtype != torch.float32 else None for t in tensors[2:]]
        index = torch.empty(min(n - start, tile_numel), dtype=torch.int32) if block > 1 else None  # codes' map indices
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
            for a in range(start, n, tile_numel):
                sl = [t[a:a + tile_numel] for t in tensors]
                states = [_read_tile(t, c, a, o, index)  # [Note: narrow moments]
                          for t, c, o in zip(sl[2:], codecs, scratch)]
                last = step.clone()
                adam([sl[0]], [sl[1]], [states[0]], [states[1]], states[2:], [last], **kw)
                for t, c, w in zip(sl[2:], codecs, states):
                    if c is not None:
                        c[0].write(c[1], w, a, overwrite=True)  # w is the scratch tile: quantized in its memory
                    elif t is not w:
                        t.copy_(w)
            step.copy_(last)
    optimizer._opt_called = True  # what torch's lr_scheduler step wrapper records (its order warning)
    return True


def _fused_moments(fused: FusedTile, group: dict, tensors: list, codecs: list) -> list | None:
    """What the fused tile steps in place: the two bf16 moment tensors (the slot's own view where the swapper handed
    the slot, else the state tensor), or the int8 slots' ``(codes, scales)``; None where it does not compute this
    step: moments of another format than the tile's (the first step's moments are still torch's fp32), amsgrad,
    or a tensor hyperparameter."""
    if (len(tensors) != 4 or group["amsgrad"] or any(torch.is_tensor(group[k]) for k in ("lr", "eps", "weight_decay"))
            or any(torch.is_tensor(b) for b in group["betas"])):
        return None
    if fused.moments == "int8":
        if any(c is None or not c[0].quantized or c[0].numel != tensors[0].numel() for c in codecs):
            return None
        return [(c[0].view(c[1]), c[0].scales(c[1])) for c in codecs]
    out = [t if c is None else c[0].view(c[1]) for t, c in zip(tensors[2:], codecs)]
    if any(t.dtype != torch.bfloat16 or t.shape != tensors[0].shape for t in out):
        return None
    return out


def _fused_tiles(fused: FusedTile, pg: list, moments: list, n: int, tile_numel: int, scalars: torch.Tensor) -> int:
    """Step tiles ``[0, end)`` of the partition with the fused tile; returns ``end``, where the eager tile takes
    over. ``pg``: the partition and its gradient ``(n,)``; ``moments``: :func:`_fused_moments`. bf16 takes every
    tile of two elements or more; int8 its whole blocks, at least ``fused.min_numel`` elements, so only the last
    tile's remainder (the unit's short last block, or a last tile of one block) is left. A call that fails has
    written nothing: the eager tile takes over from it ([Note: a failure inside the step] in
    ``tiers/fused_adam.py``)."""
    block = blockwise.BLOCK if fused.moments == "int8" else 1
    for a in range(0, n, tile_numel):
        whole = min(tile_numel, n - a) // block * block
        if whole < fused.min_numel:
            return a
        b = a + whole
        if fused.moments == "int8":
            (cm, sm), (cv, sv) = moments
            args = (cm[a:b], sm[a // block:b // block], cv[a:b], sv[a // block:b // block])
        else:
            args = tuple(t[a:b] for t in moments)
        try:
            fused(pg[0][a:b], pg[1][a:b], *args, scalars)
        except Exception as e:  # nothing of this tile was written: the eager tile takes it from here
            fused.failed(e)
            return a
        if b < n and whole < tile_numel:
            return b
    return n


def _read_tile(t: torch.Tensor, codec, start: int, out: torch.Tensor | None,
               index: torch.Tensor | None = None) -> torch.Tensor:
    """A tile of a state as fp32: decoded from its slot (``codec``: ``(Slot, buf)``; ``index``: the call's int32
    scratch for the codes' map indices) or widened into ``out`` (the call's scratch tile, reused by every tile: a
    fresh tensor per tile costs more in page faults than the widening, docs/profiling.md "Narrow moments"), or
    ``t`` itself when it is fp32."""
    if codec is not None:
        return codec[0].read(codec[1], start, t.numel(), out=out, index=index)
    if t.dtype == torch.float32:
        return t
    return out[:t.numel()].copy_(t)


#: moment dtypes the tiled step widens or decodes per tile ([Note: narrow moments]; uint8: int8 codes)
NARROW_MOMENT_DTYPES = (torch.bfloat16, torch.uint8)


def narrow_moments(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """Whether ``param``'s optimizer state holds a per-element tensor narrower than fp32 (bf16 moments)."""
    state = optimizer.state.get(param)
    return bool(state) and any(torch.is_tensor(v) and v.dim() > 0 and v.dtype in NARROW_MOMENT_DTYPES
                               for v in state.values())


def narrow_moments_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` could not step narrow moments in tiles (checked before the first step, so nothing is
    created first), or None. The conditions that do not change during training: torch's Adam/AdamW, plain param
    groups (no ``foreach``/``fused``/``capturable``/``differentiable``), no optimizer step hook."""
    if not is_torch_adam(optimizer):
        return f"the optimizer is {type(optimizer).__module__}.{type(optimizer).__name__}, not torch's Adam or AdamW"
    bad = [k for g in optimizer.param_groups for k in ("foreach", "fused", "capturable", "differentiable")
           if g.get(k)]
    if bad or not all(_plain_group(g) for g in optimizer.param_groups):
        return f"its param groups set {', '.join(sorted(set(bad))) or 'options torch Adam lacks'}"
    if _has_step_hooks(optimizer):
        return "an optimizer step hook is registered"
    return None


def is_torch_adam(optimizer) -> bool:
    """``optimizer`` is torch's own Adam or AdamW (not a subclass): the only optimizer the tiled step runs, and so
    the only one whose moments may be stored narrower than fp32."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)


def _plain_group(group: dict) -> bool:
    return (not group.get("foreach") and not group.get("fused") and not group.get("capturable")
            and not group.get("differentiable") and "decoupled_weight_decay" in group)


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as _opt
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or _opt._global_optimizer_pre_hooks or _opt._global_optimizer_post_hooks)


class HostStepMixin:
    """``_optimizer_step`` of a CPU sub-group in tiles (:func:`tiled_adam_step`) where that is exactly
    DeepSpeed's step; DeepSpeed's ``_optimizer_step`` otherwise."""

    def _optimizer_step(self, sub_group_id):
        with span("aidaptiv::optimizer_step", lane="optimizer", subgroup=int(sub_group_id)):
            return self._aidaptiv_optimizer_step(sub_group_id)

    def _aidaptiv_optimizer_step(self, sub_group_id):
        fp32_param = self.fp32_partitioned_groups_flat[sub_group_id]
        if not self._aidaptiv_tiled_step_applies(sub_group_id):
            self._aidaptiv_refuse_narrow(sub_group_id, fp32_param)
            return super()._optimizer_step(sub_group_id)
        gid = self.sub_group_to_group_id[sub_group_id]
        group = self.optimizer.param_groups[gid]
        group["params"] = [fp32_param]  # DeepSpeed's protocol (stage3.py:1252-1254)
        sw = getattr(self, "optimizer_swapper", None)
        slots = sw.moment_slots(sub_group_id) if hasattr(sw, "moment_slots") else None
        try:
            if not tiled_adam_step(self.optimizer, group, fp32_param, slots=slots, fused=self._aidaptiv.fused_tile):
                self._aidaptiv_refuse_narrow(sub_group_id, fp32_param)
                return super()._optimizer_step(sub_group_id)
        finally:
            group["params"] = []
        return None

    def _aidaptiv_refuse_narrow(self, sub_group_id, param) -> None:
        """Raise where a sub-group with narrow moments would go to a whole-partition step ([Note: narrow
        moments]): nothing has changed yet."""
        if narrow_moments(self.optimizer, param):
            raise AidaptivConfigError(
                f"aidaptiv_ds: optimizer sub-group {sub_group_id} keeps its moments in bf16 or int8 "
                f"(aidaptiv.optimizer_state.moments), which only the tiled torch Adam/AdamW step supports, and this "
                f"step cannot run tiled (an optimizer step hook, a grad scaler, foreach/fused/capturable, or a "
                f"sub-group off the host). Fix: set \"moments\": \"fp32\", or remove what stops the tiled step")

    def _aidaptiv_tiled_step_applies(self, sub_group_id) -> bool:
        """The branch of DeepSpeed's ``_optimizer_step`` that plainly calls ``self.optimizer.step()``."""
        if getattr(self, "torch_autocast_gradscaler", None) or getattr(self, "zenflow", False):
            return False
        if getattr(self, "use_muon", False) and self.sub_groups_using_muon[sub_group_id]:
            return False
        if self.offload_optimizer and self.subgroup_to_device[sub_group_id] != "cpu":
            return False
        return self.fp32_partitioned_groups_flat[sub_group_id].device.type == "cpu"
