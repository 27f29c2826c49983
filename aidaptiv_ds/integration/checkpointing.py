"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` for engines running on aidaptiv_ds.

DeepSpeed 0.19.8 with NVMe optimizer offload restores the weights on resume but not the Adam
moments, the optimizer step or the loss scaler (the engine skips its ZeRO states file,
``engine.py:4456``), refuses another world size, and its ``zero_to_fp32`` cannot read the result
(``docs/deepspeed-seams.md`` §6). Here, for engines whose optimizer is our Stage-3 subclass:

* **save** writes the whole tag into a staging directory, ``<save_dir>/.aidaptiv-staging/<tag>``:
  DeepSpeed's own save (model states, LR scheduler, client state; ``save_latest=False``), then each
  rank's sub-groups' fp32 master weights and optimizer state, once, straight from DRAM or the slab
  (or sharing the slab's blocks by a copy-on-write clone where the filesystem allows), frozen
  parameters and an index; rank 0 writes the manifest (every file, DeepSpeed's included, with its
  CRC32) after every rank finished, switches the complete directory into ``<save_dir>/<tag>`` in
  one atomic step -- over an existing tag too -- and only then writes ``latest``
  (:mod:`aidaptiv_ds.checkpoint.format`). A ``kill -9`` at any moment leaves the complete old or the
  complete new checkpoint, never a mix. Before anything is written, the free space of ``save_dir``
  is checked against what the save needs (:func:`check_space`);
* **load** verifies the tag (manifest, ``rank.json``, every file's size and CRC32, DeepSpeed's
  files included) and refuses an incomplete or damaged one by name, offering the complete ones;
  restores engine counters, LR scheduler and client state from DeepSpeed's rank-0 model-states
  file, re-partitions master weights and moments for the current world size and sub-groups,
  restores each sub-group's optimizer ``step`` and the loss scaler, and rebuilds the low-precision
  partitions from the masters.

Engines on DeepSpeed's own swappers go straight to DeepSpeed's methods.
"""
from __future__ import annotations

import glob
import logging
import os
import shutil

import torch

from ..checkpoint.format import IncompleteCheckpointError, adopt_root_files, locate_tag, offer_complete, publish, \
    read_manifest, recover, staging_dir, staging_root, tag_dir
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.reflink import clone_range
from ..checkpoint.space import DEEPSPEED_FILES_ESTIMATE, rank_need, verdict
from ..checkpoint.writer import RankWriter, write_latest, write_manifest
from ..io.buffers import alloc_aligned
from ..io.killpoint import kill_point

log = logging.getLogger("aidaptiv_ds")

#: Keys of DeepSpeed's model-states file that are not the client's (``engine.py:5017-5038``).
DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
           "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version"}
#: Crash points of a save, in order (``AIDAPTIV_TEST_KILL_AT``, :mod:`aidaptiv_ds.io.killpoint`):
#: ``mid_switch`` exists only where the filesystem cannot exchange two directories atomically.
KILL_POINTS = ("before_deepspeed", "after_deepspeed", "subgroup", "after_rank_state", "before_manifest",
               "before_switch", "mid_switch", "after_switch", "before_latest", "after_latest")


def _kill_point(name: str) -> None:
    """Test hook: ``AIDAPTIV_TEST_KILL_AT=<name>[@rank]`` sends SIGKILL to this process here (crash-safety tests)."""
    kill_point(name)


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
            data = sw.wait_slice(g).buf[:nbytes].view(torch.float32).reshape(slots, g.numel)
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


_CLONES: dict[tuple, bool] = {}  # (save_dir's device, slab path) -> whether a copy-on-write clone works there


def _clone_possible(rt, save_dir: str) -> bool:
    """Whether sub-groups on the slab would be cloned into ``save_dir`` (same filesystem, and it
    clones: probed once with one block into a temporary file there)."""
    slab = rt.store.slabs[0]
    dev = os.stat(save_dir).st_dev
    key = (dev, slab.path)
    if key not in _CLONES:
        ok = False
        if dev == os.stat(slab.path).st_dev and slab.size >= rt.store.alignment:
            probe = os.path.join(save_dir, f".aidaptiv-clone-probe.{os.getpid()}")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                ok = clone_range(slab.fh.fileno(), 0, fd, 0, rt.store.alignment)
            except OSError:
                ok = False
            finally:
                os.close(fd)
                os.unlink(probe)
        _CLONES[key] = ok
    return _CLONES[key]


def save_bytes(opt, save_dir: str, tag: str, exclude_frozen: bool) -> int:
    """Bytes this rank's part of a save of ``tag`` into ``save_dir`` needs on its filesystem:
    each sub-group's fp32 master and optimizer state (none for sub-groups on the slab that a
    copy-on-write clone will share), headers, frozen partitions, the index, and DeepSpeed's files
    (their size in this tag saved before, or in the tag ``latest`` names, plus 1 MiB; else
    :data:`DEEPSPEED_FILES_ESTIMATE`)."""
    rt, sw = opt._aidaptiv_rt, opt.optimizer_swapper
    align = rt.store.alignment
    clone = _clone_possible(rt, save_dir)
    need, nparams = 0, 0
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        g = sw.groups[str(fp32.ds_id)]
        data = 0 if (g.slice is None and clone) else g.valid_slots * g.slot_bytes
        need += data + 4 * align  # header (params' names and shapes in the metadata), rounding
        nparams += len(opt.fp16_groups[i])
    if not exclude_frozen:
        need += sum(p.ds_tensor.ds_numel * p.element_size() for p in opt._aidaptiv_module.parameters()
                    if not p.requires_grad and getattr(p, "ds_tensor", None) is not None)
    need += 64 * 1024 + 512 * nparams  # rank.json
    ds = DEEPSPEED_FILES_ESTIMATE
    for earlier in (tag, resolve_tag(save_dir, None)):  # this tag saved before, else the one `latest` names
        try:
            man = read_manifest(tag_dir(save_dir, earlier)) if earlier and os.path.isdir(tag_dir(save_dir, earlier)) \
                else None
        except (IncompleteCheckpointError, OSError, ValueError, KeyError):
            man = None
        if man and man.get("deepspeed_files"):
            ds = sum(f["bytes"] for f in man["deepspeed_files"].values()) // max(int(man["world_size"]), 1) + (1 << 20)
            break
    return need + ds


def check_space(opt, save_dir: str, tag: str, exclude_frozen: bool) -> None:
    """Refuse, on every rank and before anything is written, a save whose parts do not fit the free
    space of their filesystem (the ranks' needs are gathered, so ranks sharing one add up).

    Raises:
        CheckpointSpaceError: naming the directory, the bytes needed and free, the cache paths on
            the same filesystem with what their slabs hold, and dead stores of earlier runs there.
    """
    rt = opt._aidaptiv_rt
    mine = rank_need(save_dir, save_bytes(opt, save_dir, tag, exclude_frozen), rt.namespace.cache_paths,
                     [s.allocated_bytes() for s in rt.store.slabs])
    ranks = [mine]
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
    err = verdict(save_dir, tag, ranks)
    if err is not None:
        raise err


def _read_partitions(rt, params) -> list[torch.Tensor]:
    out = []
    for p in params:
        if rt.param_swapper is not None and rt.param_swapper.holds(p.ds_id):
            out.append(rt.param_swapper.read_partitions([p.ds_id])[0])
        else:
            out.append(p.ds_tensor.data.detach().reshape(-1)[: p.ds_tensor.ds_numel].clone())
    return out


def save_checkpoint(engine, orig, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DS's API
                    exclude_frozen_parameters=False):
    """Replacement of ``DeepSpeedEngine.save_checkpoint`` (see module docstring).

    Raises:
        CheckpointSpaceError: ``save_dir`` lacks the space (nothing written, the old tag untouched).
        FileWriteError: a file could not be written whole (named; never put in place).
    """
    if not is_ours(engine):
        return orig(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        for line in recover(save_dir):  # what an interrupted save left: finished or removed
            log.warning("aidaptiv_ds: checkpoint %s: %s (left by an interrupted save)", save_dir, line)
        shutil.rmtree(staging_dir(save_dir, tag), ignore_errors=True)
    dist.barrier()
    rt = engine.optimizer._aidaptiv_rt
    check_space(engine.optimizer, save_dir, tag, exclude_frozen_parameters)
    path = staging_dir(save_dir, tag)
    _kill_point("before_deepspeed")
    ok = orig(engine, staging_root(save_dir), tag, client_state, False, exclude_frozen_parameters)
    _kill_point("after_deepspeed")
    writer = save_rank_state(engine.optimizer, path, exclude_frozen_parameters)
    _kill_point("after_rank_state")
    dist.barrier()
    if rank == 0:
        module = engine.module
        hf = module.config.to_dict() if hasattr(getattr(module, "config", None), "to_dict") else None
        _kill_point("before_manifest")
        write_manifest(path, world, {"tag": tag, "global_steps": engine.global_steps, "hf_config": hf,
                                     "deepspeed_version": _ds_version()})
        _kill_point("before_switch")
        how = publish(save_dir, tag, _kill_point)
        adopt_root_files(save_dir)
        try:
            os.rmdir(staging_root(save_dir))  # nothing else staged: leave save_dir as DeepSpeed would
        except OSError:
            pass
        log.info("aidaptiv_ds: checkpoint %s saved (%s)", tag_dir(save_dir, tag), how)
        _kill_point("before_latest")
        if save_latest:
            write_latest(save_dir, tag)
        _kill_point("after_latest")
    dist.barrier()
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
    path = locate_tag(load_dir, tag)
    try:
        reader = CheckpointReader(path)
    except IncompleteCheckpointError as e:
        raise IncompleteCheckpointError(f"{e} {offer_complete(load_dir, tag)}") from None
    files = sorted(glob.glob(os.path.join(path, "*_model_states.pt")))
    ms_file = next((f for f in files if "zero_pp_rank_0_" in os.path.basename(f)), files[0] if files else None)
    if ms_file is None:
        raise IncompleteCheckpointError(f"aidaptiv_ds: checkpoint {path} has no DeepSpeed model-states file. "
                                        f"{offer_complete(load_dir, tag)}")
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

