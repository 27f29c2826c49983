"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` for engines running on aidaptiv_ds.

DeepSpeed 0.19.8 with NVMe optimizer offload restores the weights on resume but not the Adam
moments, the optimizer step or the loss scaler (the engine skips its ZeRO states file,
``engine.py:4456``), refuses another world size, and its ``zero_to_fp32`` cannot read the result
(``docs/deepspeed-seams.md`` §6). Here, for engines whose optimizer is our Stage-3 subclass:

* **save** runs DeepSpeed's own save (model states, LR scheduler, client state) with
  ``save_latest=False``, then each rank writes its sub-groups' fp32 master weights and optimizer
  state once, straight from DRAM or the slab (or shares the slab's blocks by a copy-on-write clone
  where the filesystem allows), plus frozen parameters and an index; rank 0 writes the manifest
  after every rank finished, and only then ``latest`` (:mod:`aidaptiv_ds.checkpoint.format`);
* **load** refuses an incomplete checkpoint by name, restores engine counters, LR scheduler and
  client state from DeepSpeed's rank-0 model-states file, re-partitions master weights and moments
  for the current world size and sub-groups, restores each sub-group's optimizer ``step`` and the
  loss scaler, and rebuilds the low-precision partitions from the masters.

Engines on DeepSpeed's own swappers go straight to DeepSpeed's methods.
"""
from __future__ import annotations

import glob
import logging
import os

import torch

from ..checkpoint.format import IncompleteCheckpointError, complete_tags, tag_dir
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.writer import RankWriter, write_latest, write_manifest
from ..io.buffers import alloc_aligned

log = logging.getLogger("aidaptiv_ds")

#: Keys of DeepSpeed's model-states file that are not the client's (``engine.py:5017-5038``).
DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
           "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version"}
_KILL_ENV = "AIDAPTIV_TEST_KILL_AT"


def _kill_point(name: str) -> None:
    """Test hook: ``AIDAPTIV_TEST_KILL_AT=<name>`` sends SIGKILL to this process here (crash-safety tests)."""
    if os.environ.get(_KILL_ENV) == name:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def is_ours(engine) -> bool:
    return hasattr(getattr(engine, "optimizer", None), "_aidaptiv_rt")


def _dist():
    import deepspeed.comm as dist
    return dist


def _names(module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


# ---------------------------------------------------------------------------------------------- save
def save_rank_state(opt, tag_path: str, exclude_frozen: bool = False) -> RankWriter:
    """Write this rank's optimizer sub-groups and frozen partitions under ``tag_path``."""
    rt, sw = opt._aidaptiv_rt, opt.optimizer_swapper
    rt.flush()
    dist = _dist()
    writer = RankWriter(tag_path, dist.get_rank(), dist.get_world_size())
    names = _names(opt._aidaptiv_module)
    subgroups = []
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        g = sw.groups[str(fp32.ds_id)]
        layout, off = [], 0
        for p in opt.fp16_groups[i]:
            layout.append({"name": names[id(p)], "ds_id": p.ds_id, "partition_numel": p.ds_tensor.ds_numel,
                           "offset": off, "numel": p.ds_numel, "shape": list(p.ds_shape), "dtype": str(p.dtype)[6:]})
            off += p.ds_tensor.ds_numel
        step = opt.optimizer.state.get(fp32, {}).get("step")
        meta = {"names": ["fp32"] + g.state_names, "numel": g.numel,
                "step": None if step is None else float(step),
                "step_type": None if step is None else (f"tensor:{str(step.dtype)[6:]}" if torch.is_tensor(step)
                                                         else type(step).__name__)}
        fname = f"sg{i:05d}.safetensors"
        slots = g.valid_slots
        nbytes = slots * g.slot_bytes
        if g.slice is not None:  # newest bytes in DRAM (resident, cached or dirty)
            g.slice.wait_ready()
            data = g.slice.buf[:nbytes].view(torch.float32).reshape(slots, g.numel)
            writer.write_tensors(fname, [("state", data)], {"aidaptiv": meta})
        else:
            key = sw._extent_key(g)
            runs = rt.store.physical_runs(key, 0, sw._span(g, slots))
            if not writer.clone_tensor(fname, "state", "float32", [slots, g.numel], runs, {"aidaptiv": meta},
                                       rt.store.alignment):
                buf = alloc_aligned(sw._span(g, slots))
                rt.store.read(key, buf, 0).wait()
                writer.write_tensors(fname, [("state", buf[:nbytes].view(torch.float32).reshape(slots, g.numel))],
                                     {"aidaptiv": meta})
        subgroups.append(dict(meta, file=fname, params=layout))
        _kill_point("subgroup")
    frozen = []
    if not exclude_frozen:
        fz = [(names[id(p)], p) for p in opt._aidaptiv_module.parameters() if not p.requires_grad and
              getattr(p, "ds_tensor", None) is not None and id(p) in names]
        if fz:
            datas = _read_partitions(rt, [p for _, p in fz])
            writer.write_tensors("frozen.safetensors", [(n, d) for (n, _), d in zip(fz, datas)])
            frozen = [{"name": n, "numel": p.ds_numel, "shape": list(p.ds_shape), "dtype": str(p.dtype)[6:],
                       "partition_numel": p.ds_tensor.ds_numel} for n, p in fz]
    scaler = {k: v for k, v in vars(getattr(opt, "loss_scaler", object())).items()
              if isinstance(v, (bool, int, float))}
    groups = [{k: v for k, v in pg.items() if k != "params" and isinstance(v, (bool, int, float, str, list, tuple))}
              for pg in opt.optimizer.param_groups]
    writer.finish({"subgroups": subgroups, "frozen": frozen, "frozen_file": "frozen.safetensors",
                   "loss_scaler": scaler, "param_groups": groups, "optimizer": type(opt.optimizer).__name__})
    return writer


def _read_partitions(rt, params) -> list[torch.Tensor]:
    out = []
    for p in params:
        if rt.param_swapper is not None and p.ds_id in rt.param_swapper._loc:
            out.append(rt.param_swapper.read_partitions([p.ds_id])[0])
        else:
            out.append(p.ds_tensor.data.detach().reshape(-1)[: p.ds_tensor.ds_numel].clone())
    return out


def save_checkpoint(engine, orig, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DS's API
                    exclude_frozen_parameters=False):
    """Replacement of ``DeepSpeedEngine.save_checkpoint`` (see module docstring)."""
    if not is_ours(engine):
        return orig(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    dist = _dist()
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    path = tag_dir(save_dir, tag)
    rank_dir = os.path.join(path, "offloaded_tensors", f"rank{dist.get_rank():02d}")
    if os.path.isdir(rank_dir) and not os.listdir(rank_dir):  # ours is always empty: let a re-save of the tag pass
        os.rmdir(rank_dir)
    _kill_point("before_deepspeed")
    ok = orig(engine, save_dir, tag, client_state, False, exclude_frozen_parameters)
    _kill_point("after_deepspeed")
    writer = save_rank_state(engine.optimizer, path, exclude_frozen_parameters)
    dist.barrier()
    if dist.get_rank() == 0:
        module = engine.module
        hf = module.config.to_dict() if hasattr(getattr(module, "config", None), "to_dict") else None
        _kill_point("before_manifest")
        write_manifest(path, dist.get_world_size(), {"tag": tag, "global_steps": engine.global_steps,
                                                     "hf_config": hf, "deepspeed_version": _ds_version()})
        _kill_point("before_latest")
        if save_latest:
            write_latest(save_dir, tag)
    dist.barrier()
    rt = engine.optimizer._aidaptiv_rt
    rt.checkpoint_bytes_written += writer.written_bytes
    rt.checkpoint_bytes_cloned += writer.cloned_bytes
    return ok


def _ds_version() -> str:
    import deepspeed
    return deepspeed.__version__


# ---------------------------------------------------------------------------------------------- load
def load_rank_state(opt, reader: CheckpointReader, load_optimizer_states: bool) -> None:
    """Fill this rank's sub-groups (re-partitioned for the current world) and rebuild the partitions."""
    rt, sw = opt._aidaptiv_rt, opt.optimizer_swapper
    rt.flush()
    dist = _dist()
    rank = dist.get_rank()
    names = _names(opt._aidaptiv_module)
    steps = {}
    for idx in reader.ranks:
        for sg in idx["subgroups"]:
            steps.setdefault("step", (sg["step"], sg["step_type"]))
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        g = sw.groups[str(fp32.ds_id)]
        state_names = list(reader.state_names) if load_optimizer_states else []
        slots = 1 + len(state_names)
        if slots > g.slots:
            g.slots = slots
            rt.store.allocate(sw._extent_key(g), sw._span(g, slots))
        buf = alloc_aligned(sw._span(g, g.slots))
        flat = buf[: slots * g.slot_bytes].view(torch.float32).reshape(slots, g.numel)
        off = 0
        for p in opt.fp16_groups[i]:
            name = names[id(p)]
            if name not in reader.params:
                raise KeyError(f"aidaptiv_ds: checkpoint {reader.tag_path} has no parameter {name!r}; it was saved "
                               f"from another model")
            n = p.ds_tensor.ds_numel
            flat[:, off:off + n] = reader.read_range(name, rank * n, n)[:slots]
            off += n
        sw.install_subgroup(g, fp32, buf, state_names, steps.get("step") if load_optimizer_states else None)
    if load_optimizer_states:
        for idx in reader.ranks[:1]:
            for k, v in idx.get("loss_scaler", {}).items():
                if hasattr(opt, "loss_scaler") and hasattr(opt.loss_scaler, k):
                    setattr(opt.loss_scaler, k, v)
    # the low-precision partitions are the masters cast down, as DeepSpeed's reset_swap_buffers does
    psw = opt._aidaptiv_param_swapper()
    sw.init_phase = True
    try:
        for i in range(len(opt.fp16_groups)):
            opt._optimizer_states_and_gradient_swap_in(i)
            opt._reassign_or_swap_out_partitioned_parameters(i)
            opt._optimizer_states_and_gradient_swap_out(i)
    finally:
        sw.init_phase = False
    frozen = [(names[id(p)], p) for p in opt._aidaptiv_module.parameters()
              if not p.requires_grad and getattr(p, "ds_tensor", None) is not None and id(p) in names]
    items = []
    for name, p in frozen:
        if name in reader.params:
            n = p.ds_tensor.ds_numel
            items.append((p, reader.read_range(name, rank * n, n)[0].to(p.dtype)))
    if items:
        if psw is not None:
            psw.write_partitions(items)
        else:
            for p, t in items:
                p.ds_tensor.data.copy_(t)
    rt.flush()


def resolve_tag(load_dir: str, tag) -> str | None:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def load_checkpoint(engine, orig, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    """Replacement of ``DeepSpeedEngine.load_checkpoint`` (see module docstring).

    Raises:
        IncompleteCheckpointError: the tag's save did not finish (named, with the complete tags).
    """
    if not is_ours(engine):
        return orig(engine, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                    load_module_only, custom_load_fn)
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        log.warning("aidaptiv_ds: no 'latest' file in %s; nothing loaded", load_dir)
        return None, None
    path = tag_dir(load_dir, tag)
    try:
        reader = CheckpointReader(path)
    except IncompleteCheckpointError as e:
        good = complete_tags(load_dir)
        raise IncompleteCheckpointError(f"{e} Complete checkpoints in {load_dir}: {good or 'none'}.") from None
    files = sorted(glob.glob(os.path.join(path, "*_model_states.pt")))
    ms_file = next((f for f in files if "zero_pp_rank_0_" in os.path.basename(f)), files[0] if files else None)
    if ms_file is None:
        raise IncompleteCheckpointError(f"aidaptiv_ds: checkpoint {path} has no DeepSpeed model-states file")
    ms = torch.load(ms_file, map_location="cpu", weights_only=False)
    opt = engine.optimizer
    opt.checkpoint_event_prologue()
    load_rank_state(opt, reader, load_optimizer_states and not load_module_only)
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and ms.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(ms["lr_scheduler"])
        engine.global_steps = ms.get("global_steps", 0)
        engine.global_samples = ms.get("global_samples", 0)
        engine.skipped_steps = ms.get("skipped_steps", 0)
    buffers = {n for n, _ in engine.module.named_buffers()}
    buf_state = {k: v for k, v in (ms.get("module") or {}).items() if k in buffers}
    if buf_state:
        engine.module.load_state_dict(buf_state, strict=False)
    opt.checkpoint_event_epilogue()
    reader.close()
    client = {k: v for k, v in ms.items() if k not in DS_KEYS}
    return path, client


def install(engine_cls) -> None:
    """Wrap ``save_checkpoint``/``load_checkpoint`` of DeepSpeed's engine class (idempotent)."""
    if getattr(engine_cls.save_checkpoint, "_aidaptiv", False):
        return
    orig_save, orig_load = engine_cls.save_checkpoint, engine_cls.load_checkpoint

    def save(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):  # noqa: B006
        return save_checkpoint(self, orig_save, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
             load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        return load_checkpoint(self, orig_load, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, custom_load_fn)

    save.__doc__, load.__doc__ = orig_save.__doc__, orig_load.__doc__
    save._aidaptiv, load._aidaptiv = orig_save, orig_load
    engine_cls.save_checkpoint, engine_cls.load_checkpoint = save, load


def uninstall(engine_cls) -> None:
    if getattr(engine_cls.save_checkpoint, "_aidaptiv", False):
        engine_cls.save_checkpoint = engine_cls.save_checkpoint._aidaptiv
        engine_cls.load_checkpoint = engine_cls.load_checkpoint._aidaptiv

