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
* **several directories** (DeepSpeed's ``checkpoint.use_node_local_storage``, a ``save_dir`` per node):
  every rank creates its ``save_dir`` and the ranks find out which of them share one (a claim per
  save, :func:`discover_layout`); one group keeps the layout above, several save in *parts*, one per
  directory, committed across the nodes by rank 0's commit record, the ranks agreeing between the
  steps so that a node that fails is named on every rank (:func:`_commit_parts`,
  :mod:`aidaptiv_ds.checkpoint.parts`);
* **load** first compares what every rank sees of the tag (:func:`_views`,
  :func:`~aidaptiv_ds.checkpoint.parts.decide`): all ranks load the same save -- in parts, each from
  its own node's part -- or all refuse, naming the node and path at fault. It verifies the tag
  (manifest, ``rank.json``, every file's size and CRC32, DeepSpeed's files included) and refuses an
  incomplete or damaged one by name, offering the complete ones;
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
import time

import torch

from ..checkpoint.deepspeed_compat import FROZEN_FILE, SavedTensorRef, placeholders, subgroup_file
from ..checkpoint.format import ForeignCheckpointError, IncompleteCheckpointError, adopt_root_files, locate_tag, manifest_ranks, \
    offer_complete, publish, read_manifest, recover, staging_dir, staging_root, tag_dir
from ..checkpoint.parts import Part, apply_plan, choose_tag, claim, cleanup_plan, commit_record, decide, finish_part, \
    group_parts, leftover_tags, prepare_part, rank_view, release_claim, stale_claims, switch_part, write_commit
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.reflink import clone_range
from ..checkpoint.space import DEEPSPEED_FILES_ESTIMATE, rank_need, verdict
from ..checkpoint.writer import RankWriter, write_latest, write_manifest
from ..io.buffers import alloc_aligned
from ..io.errors import FileWriteError
from ..io.killpoint import kill_point
from .config import AidaptivConfigError
from .load_weights import check_module_keys, check_shapes, custom_loaded_partitions, load_weights_only
from .optimizer_state import state_of
from .phase import Phase

log = logging.getLogger("aidaptiv_ds")

#: Crash points of a save, in order (``AIDAPTIV_TEST_KILL_AT``, :mod:`aidaptiv_ds.io.killpoint`):
#: ``mid_switch`` exists only where the filesystem cannot exchange two directories atomically.
KILL_POINTS = ("before_deepspeed", "after_deepspeed", "subgroup", "after_rank_state", "before_manifest",
               "before_switch", "mid_switch", "after_switch", "before_latest", "after_latest")
#: Crash points of a save in node-local parts, in order (each on every part's leader but the commit,
#: on rank 0): ``mid_switch`` when the tag's old part is set aside.
PART_KILL_POINTS = ("before_deepspeed", "after_deepspeed", "subgroup", "after_rank_state", "before_manifest",
                    "before_switch", "mid_switch", "after_switch", "before_commit", "after_commit", "before_latest",
                    "after_latest")


def _kill_point(name: str) -> None:
    """Test hook: ``AIDAPTIV_TEST_KILL_AT=<name>[@rank]`` sends SIGKILL to this process here (crash-safety tests)."""
    kill_point(name)


def is_ours(engine) -> bool:
    return state_of(getattr(engine, "optimizer", None)) is not None


def _dist():
    import deepspeed.comm as dist
    return dist


def _names(module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def partition_rank(module, what: str) -> int:
    """This rank's index in the group every ZeRO-3 partition of ``module`` is split over, which a checkpoint's
    files are named and its saved ranges read by (``read_range(name, rank * n, n)``): the world, as in data
    parallelism.

    Raises:
        AidaptivConfigError: a parameter is partitioned over a smaller group (``zero.Init(data_parallel_group=...)``,
            sequence parallelism): its ranks would save and read one another's slices. Named before anything is
            written or changed.
    """
    dist = _dist()
    world = dist.get_world_size()
    sizes: dict[int, int] = {}
    for name, p in module.named_parameters():
        group = getattr(p, "ds_process_group", None)
        if group is None or getattr(p, "ds_tensor", None) is None:
            continue
        size = sizes.setdefault(id(group), dist.get_world_size(group=group))
        if size != world:
            raise AidaptivConfigError(
                f"aidaptiv_ds: {what}: parameter {name!r} is partitioned over a group of {size} ranks, not over "
                f"all {world} (DeepSpeed's zero.Init data_parallel_group or sequence parallelism); the checkpoint "
                f"of such an engine is not supported by the \"aidaptiv\" section. Fix: partition over the whole "
                f"world, or run DeepSpeed's own offload (\"aidaptiv\": {{\"enabled\": false}}).")
    return dist.get_rank()


# ---------------------------------------------------------------------------------------------- save
def save_rank_state(opt, tag_path: str, exclude_frozen: bool = False) -> RankWriter:
    """Write this rank's optimizer sub-groups and frozen partitions under ``tag_path``."""
    rt, sw = opt._aidaptiv.rt, opt.optimizer_swapper
    rt.flush()
    dist = _dist()
    writer = RankWriter(tag_path, dist.get_rank(), dist.get_world_size())
    names = _names(opt._aidaptiv.module)
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
        fname = subgroup_file(i)
        slots = g.valid_slots
        if slots > 1:  # [Note: moment dtype] in optimizer_swapper.py: stored widened to fp32, exactly
            meta["slot_dtypes"] = [str(sl.dtype)[6:] for sl in g.layout.slots[:slots]]
        packed = _packed_layout(g.layout, slots)
        if packed:  # int8 moments: their codes and scales beside the dequantized rows, for an exact resume
            meta["packed_layout"] = packed
        as_stored = g.layout.all_of(torch.float32, slots)  # the extent is the checkpoint's fp32 [slots, numel]
        if g.slice is not None:  # newest bytes in DRAM (resident, cached or dirty)
            buf = sw.wait_slice(g).buf
            writer.write_tensors(fname, _state_tensors(g.layout, buf, slots, packed), {"aidaptiv": meta})
        else:
            key = sw._extent_key(g)
            runs = rt.store.physical_runs(key, 0, sw._span(g, slots))
            if not as_stored or not writer.clone_tensor(fname, "state", "float32", [slots, g.numel], runs,
                                                        {"aidaptiv": meta}, rt.store.alignment):
                buf = alloc_aligned(sw._span(g, slots))
                rt.store.read(key, buf, 0).wait()
                writer.write_tensors(fname, _state_tensors(g.layout, buf, slots, packed), {"aidaptiv": meta})
        subgroups.append(dict(meta, file=fname, params=layout))
        _kill_point("subgroup")
    frozen = []
    if not exclude_frozen:
        fz = [(names[id(p)], p) for p in opt._aidaptiv.module.parameters() if not p.requires_grad and
              getattr(p, "ds_tensor", None) is not None and id(p) in names]
        if fz:
            datas = _read_partitions(rt, [p for _, p in fz])
            writer.write_tensors(FROZEN_FILE, [(n, d) for (n, _), d in zip(fz, datas)])
            frozen = [{"name": n, "numel": p.ds_numel, "shape": list(p.ds_shape), "dtype": str(p.dtype)[6:],
                       "partition_numel": p.ds_tensor.ds_numel} for n, p in fz]
    scaler = {k: v for k, v in vars(getattr(opt, "loss_scaler", object())).items()
              if isinstance(v, (bool, int, float))}
    groups = [param_group_values(pg) for pg in opt.optimizer.param_groups]
    writer.finish({"subgroups": subgroups, "frozen": frozen, "frozen_file": FROZEN_FILE,
                   "loss_scaler": scaler, "param_groups": groups, "optimizer": type(opt.optimizer).__name__})
    return writer


def _packed_layout(layout, slots: int) -> list:
    """The first ``slots`` slots as JSON (name, dtype, offset, numel, block, signed) when one is quantized (int8
    moments, [Note: quantized slots] in ``tiers/unit.py``), else ``[]``."""
    if not any(sl.quantized for sl in layout.slots[:slots]):
        return []
    return [[sl.name, str(sl.dtype)[6:], sl.offset, sl.numel, sl.block, sl.signed] for sl in layout.slots[:slots]]


def _state_tensors(layout, buf: torch.Tensor, slots: int, packed: list) -> list:
    """A sub-group file's tensors: ``state``, fp32 ``[slots, numel]`` (moments widened or dequantized), and for
    quantized moments ``packed``, the unit's bytes as stored (uint8; the reader's exact resume)."""
    out = [("state", layout.widened(buf, slots))]
    if packed:
        out.append(("packed", buf[:layout.prefix_bytes(slots)]))
    return out


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
    rt, sw = opt._aidaptiv.rt, opt.optimizer_swapper
    align = rt.store.alignment
    clone = _clone_possible(rt, save_dir)
    need, nparams = 0, 0
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        g = sw.groups[str(fp32.ds_id)]
        data = 0 if (g.slice is None and clone and g.layout.all_of(torch.float32, g.valid_slots)) \
            else g.valid_slots * g.numel * 4  # fp32 [slots, numel]
        if _packed_layout(g.layout, g.valid_slots):  # int8 moments: their bytes as stored too
            data += g.layout.prefix_bytes(g.valid_slots)
        need += data + 4 * align  # header (params' names and shapes in the metadata), rounding
        nparams += len(opt.fp16_groups[i])
    if not exclude_frozen:
        need += sum(p.ds_tensor.ds_numel * p.element_size() for p in opt._aidaptiv.module.parameters()
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
            ds = sum(f["bytes"] for f in man["deepspeed_files"].values()) // max(len(manifest_ranks(man)), 1) \
                + (1 << 20)
            break
    return need + ds


def check_space(opt, save_dir: str, tag: str, exclude_frozen: bool) -> None:
    """Refuse, on every rank and before anything is written, a save whose parts do not fit the free
    space of their filesystem (the ranks' needs are gathered, so ranks sharing one add up).

    Raises:
        CheckpointSpaceError: naming the directory, the bytes needed and free, the cache paths on
            the same filesystem with what their slabs hold, and dead stores of earlier runs there.
    """
    rt = opt._aidaptiv.rt
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


def _gather(obj) -> list:
    """``obj`` of every rank, by rank (one rank: ``[obj]``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
            torch.distributed.get_world_size() == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _agree(err: str | None, what: str, host: str, payload=None) -> list:
    """Every rank's ``payload``, after every rank reported how its step went: when any failed, every
    rank raises the same error naming each failed rank's node and reason (so no rank waits for one
    that will never come, and none goes on with a save that cannot be committed)."""
    got = _gather((err, host, payload))
    bad = [(r, h, e) for r, (e, h, _) in enumerate(got) if e]
    if bad:
        raise IncompleteCheckpointError(
            f"aidaptiv_ds: checkpoint save failed while {what} on " + "; ".join(f"node {h} (rank {r}): {e}"
                                                                             for r, h, e in bad)
            + ". Nothing was committed: the previous checkpoint is loadable on every node.")
    return [p for _, _, p in got]


def _try(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # reported to every rank by _agree, which raises
        log.error("aidaptiv_ds: checkpoint step failed: %s: %s", type(e).__name__, e)
        return f"{type(e).__name__}: {e}"
    return None


class SaveLayout:
    """Who writes what in one save: the parts (:func:`~aidaptiv_ds.checkpoint.parts.group_parts`), this
    rank's part, the save's ``token`` (its ``save_id``), and the tags with leftovers on any part."""

    def __init__(self, parts: list[Part], mine: Part, token: str, leftovers: list[str]) -> None:
        self.parts, self.mine, self.token, self.leftovers = parts, mine, token, leftovers

    @property
    def whole(self) -> bool:
        return len(self.parts) == 1


def discover_layout(save_dir: str, rank: int, host: str) -> SaveLayout:
    """Collective: create ``save_dir`` on this node, find which ranks share it (:func:`claim`), and
    which tags have leftovers of interrupted saves on any part.

    Raises:
        FileWriteError: on every rank, naming the node and directory that cannot be written.
    """
    token = _broadcast_token()
    err, owner, left = None, -1, []
    try:
        os.makedirs(save_dir, exist_ok=True)
        owner = claim(save_dir, token, rank)
        left = leftover_tags(save_dir)
    except OSError as e:
        err = str(e)
    got = _gather((owner, host, os.path.abspath(save_dir), err, left))
    bad = [(r, g) for r, g in enumerate(got) if g[3]]
    if bad:
        raise FileWriteError(", ".join(g[2] for _, g in bad), 0, None, None,
                             step="creating the checkpoint directory on " + "; ".join(
                                 f"node {g[1]} (rank {r}): {g[3]}" for r, g in bad))
    parts = group_parts([(g[0], g[1], g[2]) for g in got])
    mine = next(p for p in parts if rank in p.ranks)
    if rank == mine.leader:
        release_claim(save_dir, token)
    return SaveLayout(parts, mine, token, sorted({t for g in got for t in g[4]}))


def _broadcast_token() -> str:
    import uuid
    obj = [uuid.uuid4().hex if _dist().get_rank() == 0 else None]
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(obj, src=0)
    return str(obj[0])


def _recover_parts(layout: SaveLayout, save_dir: str, rank: int, host: str) -> None:
    """Collective, before a save in parts: finish or remove what interrupted saves left on every
    part (:func:`~aidaptiv_ds.checkpoint.parts.cleanup_plan` over every part's view of each tag
    with leftovers), and stale claim files."""
    lead = rank == layout.mine.leader
    if lead:
        for f in stale_claims(save_dir, layout.token):
            os.unlink(f)
    if not layout.leftovers:
        return
    views = _gather(rank_view(save_dir, layout.leftovers, rank, host))
    if not lead:
        return
    for tag in layout.leftovers:
        plan = cleanup_plan(views, tag, [save_dir], world=len(views))
        for line in apply_plan(save_dir, tag, plan):
            log.warning("aidaptiv_ds: checkpoint %s: %s (left by an interrupted save)", save_dir, line)


def save_checkpoint(engine, orig, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DS's API
                    exclude_frozen_parameters=False):
    """Replacement of ``DeepSpeedEngine.save_checkpoint`` (see module docstring).

    Raises:
        CheckpointSpaceError: ``save_dir`` lacks the space (nothing written, the old tag untouched).
        FileWriteError: a file could not be written whole (named; never put in place), or a node
            cannot create its ``save_dir``.
        IncompleteCheckpointError: a node's part failed (every rank raises it, naming the node);
            nothing was committed.
    """
    if not is_ours(engine):
        return orig(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    engine.optimizer._aidaptiv_drain()  # updates riding the forward are part of the state saved
    dist = _dist()
    rank, world = partition_rank(engine.module, "save_checkpoint"), dist.get_world_size()
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    rt = engine.optimizer._aidaptiv.rt
    host = rt.namespace.host
    layout = discover_layout(save_dir, rank, host)
    if layout.whole:
        if rank == 0:
            for line in recover(save_dir):  # what an interrupted save left: finished or removed
                log.warning("aidaptiv_ds: checkpoint %s: %s (left by an interrupted save)", save_dir, line)
            for f in stale_claims(save_dir, layout.token):
                os.unlink(f)
    else:
        _recover_parts(layout, save_dir, rank, host)
    if rank == layout.mine.leader:
        shutil.rmtree(staging_dir(save_dir, tag), ignore_errors=True)
    dist.barrier()
    check_space(engine.optimizer, save_dir, tag, exclude_frozen_parameters)
    path = staging_dir(save_dir, tag)
    _kill_point("before_deepspeed")
    with _without_swap_folder_copy(engine), _deepspeed_readable(engine, rank, exclude_frozen_parameters):
        ok = orig(engine, staging_root(save_dir), tag, client_state, False, exclude_frozen_parameters)
    _kill_point("after_deepspeed")
    writer = save_rank_state(engine.optimizer, path, exclude_frozen_parameters)
    _kill_point("after_rank_state")
    dist.barrier()
    module = engine.module
    hf = module.config.to_dict() if hasattr(getattr(module, "config", None), "to_dict") else None
    extra = {"tag": tag, "global_steps": engine.global_steps, "hf_config": hf, "deepspeed_version": _ds_version(),
             "save_id": layout.token}
    if layout.whole:
        if rank == 0:
            _kill_point("before_manifest")
            write_manifest(path, world, extra)
            _kill_point("before_switch")
            how = publish(save_dir, tag, _kill_point)
            _finish_dir(save_dir)
            log.info("aidaptiv_ds: checkpoint %s saved (%s)", tag_dir(save_dir, tag), how)
            _kill_point("before_latest")
            if save_latest:
                write_latest(save_dir, tag)
            _kill_point("after_latest")
    else:
        _commit_parts(layout, save_dir, tag, world, extra, save_latest, rank, host)
    dist.barrier()
    rt.checkpoint_bytes_written += writer.written_bytes
    rt.checkpoint_bytes_cloned += writer.cloned_bytes
    return ok


class _without_swap_folder_copy:
    """DeepSpeed's save without its copy of the optimizer swapper's folder.

    [Note: DeepSpeed's swap-folder copy]: with NVMe optimizer offload, DeepSpeed's save copies the
    swapper's ``swap_folder`` to ``<tag>/offloaded_tensors/rank<NN>`` (``engine.py:4937-4951``),
    ``NN`` the *local* rank under ``checkpoint.use_node_local_storage``. Our swapper keeps nothing
    there (the state is saved in ``<tag>/aidaptiv/``, and our load never reads that copy), and under
    the flag two nodes' ranks sharing one directory both copy to ``rank00`` and the second fails
    (``FileExistsError``). So during DeepSpeed's save the engine's ``zero_nvme_offload_optimizer()``
    answers False, which only skips that copy (its one other use, ``engine.py:5146``, is for AutoEP
    MoE layers, which our backend does not run).
    """

    def __init__(self, engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        self.engine.zero_nvme_offload_optimizer = lambda: False  # instance attribute over the method

    def __exit__(self, *exc) -> None:
        del self.engine.zero_nvme_offload_optimizer


class _deepspeed_readable:
    """DeepSpeed's save with references to this checkpoint's own files where its ``.pt`` files would hold empty
    tensors: each sub-group's fp32 master in ``fp32_flat_groups`` and its moments in the optimizer's state
    (``*_optim_states.pt``), each frozen partition in ``frozen_param_fragments`` (``*_model_states.pt``), so
    ``zero_to_fp32`` and a DeepSpeed engine's load read the checkpoint
    ([Note: what zero_to_fp32 reads] in ``checkpoint/deepspeed_compat.py``). DeepSpeed asks the optimizer's
    ``state_dict()`` (``stage3.py`` ``_rigid_state_dict``) and the engine's ``_get_param_fragment_func`` (per
    frozen parameter, ``engine.py:5025``): both answered here for the save, as instance attributes."""

    def __init__(self, engine, rank: int, exclude_frozen: bool) -> None:
        self.engine, self.rank, self.exclude_frozen = engine, rank, exclude_frozen

    def __enter__(self) -> None:
        engine, opt = self.engine, self.engine.optimizer
        refs = [SavedTensorRef(self.rank, subgroup_file(i), "state", 0)
                for i in range(len(opt.fp32_partitioned_groups_flat))]
        real_state_dict, real_fragment = opt.state_dict, engine._get_param_fragment_func

        sw = opt.optimizer_swapper

        def state_dict():
            sd = real_state_dict()
            sd["fp32_flat_groups"] = refs
            # the moments too (the torch optimizer's state, indexed by sub-group: DeepSpeed sets its param groups to
            # the flat groups first), which the swapped-out sub-groups hold as empty tensors: a DeepSpeed engine
            # loading this checkpoint got the masters and zero moments, silently
            # torch's state_dict() hands out the optimizer's own per-parameter dicts: edit copies, never the live state
            osd = sd.get("optimizer_state_dict")
            if not osd or not osd.get("state"):
                return sd
            sd["optimizer_state_dict"] = osd = dict(osd, state={k: dict(v) for k, v in osd["state"].items()})
            for k, st in osd["state"].items():
                g = sw.groups[str(opt.fp32_partitioned_groups_flat[k].ds_id)]
                for j, name in enumerate(g.state_names[:max(g.valid_slots - 1, 0)]):
                    if name in st:
                        st[name] = SavedTensorRef(self.rank, subgroup_file(k), "state", 1 + j)
            return sd

        names = _names(opt._aidaptiv.module)

        def fragment(param):
            saved = not self.exclude_frozen and not param.requires_grad and id(param) in names and \
                getattr(param, "ds_tensor", None) is not None
            if not saved:
                return real_fragment(param)
            return SavedTensorRef(self.rank, FROZEN_FILE, names[id(param)], None)

        opt.state_dict, engine._get_param_fragment_func = state_dict, fragment

    def __exit__(self, *exc) -> None:
        del self.engine.optimizer.state_dict, self.engine._get_param_fragment_func


def _finish_dir(save_dir: str) -> None:
    """After the switch: DeepSpeed's recovery scripts beside the tags, the empty staging directory gone."""
    adopt_root_files(save_dir)
    try:
        os.rmdir(staging_root(save_dir))  # nothing else staged: leave save_dir as DeepSpeed would
    except OSError:
        pass


def _commit_parts(layout: SaveLayout, save_dir: str, tag: str, world: int, extra: dict, save_latest: bool,
                  rank: int, host: str) -> None:
    """Steps 2-5 of a save in node-local parts (:mod:`aidaptiv_ds.checkpoint.parts`), the ranks
    agreeing between them: each part's manifest, each part switched into place (its old part set
    aside), rank 0's commit record, then on every part the copy of the record, the old part deleted
    and ``latest``."""
    part, lead = layout.mine, rank == layout.mine.leader
    err, crc = None, None
    if lead:
        _kill_point("before_manifest")
        try:
            crc = prepare_part(staging_dir(save_dir, tag), world, extra, part, layout.parts)
        except Exception as e:  # every rank raises it in _agree
            err = f"{type(e).__name__}: {e}"
        _kill_point("before_switch")
    crcs = _agree(err, "writing the parts' manifests", host, crc)
    err = _try(switch_part, save_dir, tag, _kill_point) if lead else None
    stamps = _agree(err, "switching the parts into place", host, time.time())
    record = commit_record(tag, layout.token, world, extra["global_steps"], layout.parts,
                           [crcs[p.leader] for p in layout.parts], created=stamps[0])
    if rank == 0:
        _kill_point("before_commit")
        write_commit(tag_dir(save_dir, tag), record)  # the commit
        _kill_point("after_commit")
    _dist().barrier()
    if lead:
        finish_part(save_dir, tag, None if rank == 0 else record, save_latest, _kill_point)
        log.info("aidaptiv_ds: checkpoint %s saved (part %d of %d, ranks %s; save %s)", tag_dir(save_dir, tag),
                 part.index + 1, len(layout.parts), list(part.ranks), layout.token)


def _ds_version() -> str:
    import deepspeed
    return deepspeed.__version__


def param_group_values(group: dict) -> dict:
    """The hyperparameters of one optimizer param group as the checkpoint's index keeps them (JSON): every entry
    but ``params`` that is a scalar, a string, ``None`` or a sequence of those, and a one-element tensor (torch's
    optimizers take ``lr`` as a tensor) as its number; a larger tensor or another object is left out."""
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            if v.numel() == 1:
                out[k] = v.item()
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
            out[k] = list(v)
    return out


# ---------------------------------------------------------------------------------------------- load
def restore_param_groups(groups: list[dict], saved: list[dict], tag_path: str) -> None:
    """Set each of the optimizer's param groups to its saved hyperparameters (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``None`` settings such as ``foreach``, ...: :func:`param_group_values`), as DeepSpeed's load
    with its CPU offload does with the optimizer's state (``stage3.py:3552``, ``optimizer.load_state_dict``; its
    NVMe load skips it). A sequence comes back as the type the group holds (``betas`` a tuple); a value the group
    holds as a tensor (a tensor ``lr``) is written into that tensor. A learning-rate scheduler
    writes the lr only at its next step, so without this the first step after a load runs at the lr the new
    engine started with, not the saved run's (a changing schedule resumed inexactly; at a warm-up's start, lr 0).

    Raises:
        ValueError: the checkpoint has another number of param groups (saved from another optimizer setup).
    """
    if not saved:
        return  # a checkpoint from before the groups were saved: the engine's own, as before
    if len(saved) != len(groups):
        raise ValueError(f"aidaptiv_ds: checkpoint {tag_path} has {len(saved)} optimizer param group(s), this "
                         f"engine's optimizer {len(groups)}. Fix: load it with the param groups it was saved with, "
                         f"or pass load_optimizer_states=False to keep only the weights")
    for group, values in zip(groups, saved, strict=True):
        for k, v in values.items():
            now = group.get(k)
            if isinstance(now, torch.Tensor) and now.numel() == 1 and isinstance(v, (int, float)):
                now.fill_(v)
            else:
                group[k] = tuple(v) if isinstance(now, tuple) and isinstance(v, list) else v


def load_rank_state(opt, reader: CheckpointReader, load_optimizer_states: bool, rank: int) -> None:
    """Fill this rank's sub-groups (re-partitioned for the current world; ``rank``: :func:`partition_rank`) and
    rebuild the partitions."""
    rt, sw = opt._aidaptiv.rt, opt.optimizer_swapper
    rt.flush()
    dist = _dist()
    names = _names(opt._aidaptiv.module)
    steps = {}
    for idx in reader.ranks:
        for sg in idx["subgroups"]:
            steps.setdefault("step", (sg["step"], sg["step_type"]))
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        g = sw.groups[str(fp32.ds_id)]
        state_names = list(reader.state_names) if load_optimizer_states else []
        slots = 1 + len(state_names)
        if slots > g.slots:
            g.layout = sw.layout(g.numel, slots)
            rt.store.allocate(sw._extent_key(g), sw._span(g, slots))
        buf = alloc_aligned(sw._span(g, g.slots))
        flat = g.layout.widened(buf, slots)  # a view of buf, or fp32 rows packed into narrower slots below
        off = 0
        for p in opt.fp16_groups[i]:
            name = names[id(p)]
            if name not in reader.params:
                raise KeyError(f"aidaptiv_ds: checkpoint {reader.tag_path} has no parameter {name!r}; it was saved "
                               f"from another model")
            n = p.ds_tensor.ds_numel
            flat[:, off:off + n] = reader.read_range(name, rank * n, n, slots=slots)
            off += n
        if not g.layout.all_of(torch.float32, slots):
            g.layout.fill(buf, flat)  # bf16 moments saved widened come back exactly
            packed = _packed_layout(g.layout, slots)
            raw = reader.packed_unit(rank, i, packed) if packed and reader.world_size == dist.get_world_size() \
                else None
            if raw is not None:  # the same ranks and layout: the int8 codes and scales as they were
                buf[:raw.numel()].copy_(raw)
        sw.install_subgroup(g, fp32, buf, state_names, steps.get("step") if load_optimizer_states else None)
    if load_optimizer_states:
        for idx in reader.ranks[:1]:
            for k, v in idx.get("loss_scaler", {}).items():
                if hasattr(opt, "loss_scaler") and hasattr(opt.loss_scaler, k):
                    setattr(opt.loss_scaler, k, v)
            restore_param_groups(opt.optimizer.param_groups, idx.get("param_groups") or [], reader.tag_path)
    # the low-precision partitions are the masters cast down, as DeepSpeed's reset_swap_buffers does
    with opt._aidaptiv.phase.during(Phase.LOADING):
        for i in range(len(opt.fp16_groups)):
            opt._optimizer_states_and_gradient_swap_in(i)
            opt._reassign_or_swap_out_partitioned_parameters(i)
            opt._optimizer_states_and_gradient_swap_out(i)
    load_frozen(opt, reader, names, rank)


def load_frozen(opt, reader: CheckpointReader, names: dict, rank: int) -> None:
    """Write this rank's partitions of the frozen parameters from the checkpoint; a frozen parameter the checkpoint
    lacks (saved with ``exclude_frozen_parameters``) keeps its value. Partitions our swapper holds are written
    through it, the others (below ``min_swap_bytes``, or DeepSpeed's with ``offload_param`` cpu) copied in place."""
    rt = opt._aidaptiv.rt
    psw = opt._aidaptiv_param_swapper()
    frozen = [(names[id(p)], p) for p in opt._aidaptiv.module.parameters()
              if not p.requires_grad and getattr(p, "ds_tensor", None) is not None and id(p) in names]
    items = []
    for name, p in frozen:
        if name in reader.params:
            n = p.ds_tensor.ds_numel
            items.append((p, reader.read_range(name, rank * n, n)[0].to(p.dtype)))
    held, in_place = [], []
    for p, t in items:
        (held if psw is not None and psw.holds(p.ds_id) else in_place).append((p, t))
    if held:
        psw.write_partitions(held)
    for p, t in in_place:
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


def _views(load_dir: str, tag, rank: int, host: str) -> list[dict]:
    """Every rank's :func:`~aidaptiv_ds.checkpoint.parts.rank_view` of ``load_dir`` for ``tag`` (or the
    tags the ranks' ``latest`` files name: a second round when they differ)."""
    views = _gather(rank_view(load_dir, [tag if tag is not None else resolve_tag(load_dir, None)], rank, host))
    if tag is None:
        named = {v["latest"] for v in views} - {None}
        if any(set(v["tags"]) != named for v in views):
            views = _gather(rank_view(load_dir, sorted(named), rank, host))
    return views


def _model_states_file(path: str, rank: int) -> str | None:
    """This rank's DeepSpeed model-states file in ``path`` (what DeepSpeed's own load reads: ZeRO-3
    names it by the data-parallel rank), else rank 0's (another world size), else any."""
    files = sorted(glob.glob(os.path.join(path, "*_model_states.pt")))
    for r in (rank, 0):
        own = [f for f in files if os.path.basename(f).startswith(f"zero_pp_rank_{r}_mp_rank_")]
        if own:
            return own[0]
    return files[0] if files else None


def load_checkpoint(engine, orig, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    """Replacement of ``DeepSpeedEngine.load_checkpoint`` (see module docstring).

    Collective: the ranks exchange what they see of the checkpoint (:func:`_views`) and load the
    same save, or all refuse (:func:`~aidaptiv_ds.checkpoint.parts.decide`).

    Raises:
        IncompleteCheckpointError: the tag's save did not finish (named, with the complete tags); in
            node-local parts: a node's part is missing, incomplete, from another save or of other
            ranks (naming the node and the path), or the world size differs from the save's.
    """
    if not is_ours(engine):
        return orig(engine, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                    load_module_only, custom_load_fn)
    engine.optimizer._aidaptiv_drain()  # nothing of the old state may be written after the load
    dist = _dist()
    rank, world = partition_rank(engine.module, "load_checkpoint"), dist.get_world_size()
    host = engine.optimizer._aidaptiv.rt.namespace.host
    views = _views(load_dir, tag, rank, host)
    tag = choose_tag(views, tag)
    if tag is None:
        log.warning("aidaptiv_ds: no 'latest' file in %s; nothing loaded", load_dir)
        return None, None
    decision = decide(views, tag, world)
    path = decision.paths[rank] if decision.loadable else locate_tag(load_dir, tag)
    err, reader, kind = None, None, IncompleteCheckpointError
    try:
        reader = CheckpointReader(path, require_all=not decision.parts)
    except IncompleteCheckpointError as e:
        kind = type(e)  # DeepSpeed's own checkpoint (ForeignCheckpointError) is complete: no other tag offered
        err = str(e) if decision.parts or isinstance(e, ForeignCheckpointError) else \
            f"{e} {offer_complete(load_dir, tag)}"
    errs = _gather(err)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        raise (kind if err else IncompleteCheckpointError)(
            bad[0][1] if len(bad) == 1 and bad[0][0] == rank or len(views) == 1 else
            "; ".join(f"node {views[r]['host']} (rank {r}): {e}" for r, e in bad))
    assert reader is not None
    ms_file = _model_states_file(path, rank)
    if ms_file is None:
        raise IncompleteCheckpointError(f"aidaptiv_ds: checkpoint {path} has no DeepSpeed model-states file. "
                                        f"{offer_complete(load_dir, tag)}")
    with placeholders():  # the references to our own files in it ([Note: what zero_to_fp32 reads]): not read here
        ms = torch.load(ms_file, map_location="cpu", weights_only=False)
    # DeepSpeed's module.load_state_dict(strict=load_module_strict) raises before anything changes (it is not called
    # where a custom_load_fn is given); a parameter of another shape is refused, strict or not
    check_module_keys(engine.module, list(ms.get("module") or {}), load_module_strict and custom_load_fn is None)
    names = _names(engine.module)
    if custom_load_fn is None:
        check_shapes(engine.module, names, reader)
    fragments = None
    if ms.get("frozen_param_fragments"):  # references to our files, read as placeholders above: the caller gets the
        with torch.no_grad():              # tensors, as from DeepSpeed's own checkpoint (read before anything changes)
            fragments = torch.load(ms_file, map_location="cpu", weights_only=False)["frozen_param_fragments"]
    opt = engine.optimizer
    buffers = {n for n, _ in engine.module.named_buffers()}
    buf_state = {k: v for k, v in (ms.get("module") or {}).items() if k in buffers}
    opt.checkpoint_event_prologue()
    if load_optimizer_states and not load_module_only:
        if custom_load_fn is not None:  # DeepSpeed calls it on the model-states module (its parameters 0-element
            custom_load_fn(src=ms.get("module") or {}, dst=engine.module)  # there), then loads the ZeRO state
        load_rank_state(opt, reader, True, rank)
    else:  # the weights only, the optimizer state kept ([Note: what a weights-only load keeps])
        custom = custom_loaded_partitions(engine.module, names, reader, buf_state, custom_load_fn, rank) \
            if custom_load_fn is not None else None
        load_weights_only(opt, reader, names, rank, custom)
        load_frozen(opt, reader, names, rank)  # DeepSpeed copies the saved frozen fragments over, custom fn or not
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and ms.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(ms["lr_scheduler"])
        engine.global_steps = ms.get("global_steps", 0)
        engine.global_samples = ms.get("global_samples", 0)
        engine.skipped_steps = ms.get("skipped_steps", 0)
    if buf_state and custom_load_fn is None:
        engine.module.load_state_dict(buf_state, strict=False)
    opt.checkpoint_event_epilogue()
    reader.close()
    # what DeepSpeed's _load_checkpoint returns (engine.py:4666-4730): the model-states file it read and every key
    # of it that the load did not consume
    consumed = {"module"} if load_module_only else {
        "module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd"}
    consumed |= {k for k, flag in (("lr_scheduler", load_lr_scheduler_states), ("optimizer", load_optimizer_states))
                 if flag}  # appended in both branches
    client = {k: v for k, v in ms.items() if k not in consumed}
    if fragments is not None and "frozen_param_fragments" in client:
        client["frozen_param_fragments"] = fragments
    given = os.path.join(load_dir, str(tag), os.path.basename(ms_file))  # as DeepSpeed's _get_ckpt_name builds it
    if os.path.abspath(given) == os.path.abspath(ms_file):
        ms_file = given  # the path as the caller gave it (relative stays relative); a node-local part keeps its own
    return ms_file, client


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
    orig_16bit = engine_cls._zero3_consolidated_16bit_state_dict

    def state_dict_16bit(self, *args, **kwargs):
        """DeepSpeed's gathered 16-bit state dict; on our swapper its repartitions write nothing ([Note: the
        16-bit save reads only] in ``param_swapper.py``)."""
        psw = self.optimizer._aidaptiv.rt.param_swapper if is_ours(self) else None
        if psw is None:
            return orig_16bit(self, *args, **kwargs)
        with psw.reads_only():
            return orig_16bit(self, *args, **kwargs)

    state_dict_16bit._aidaptiv = orig_16bit
    engine_cls._zero3_consolidated_16bit_state_dict = state_dict_16bit


def uninstall(engine_cls) -> None:
    if getattr(engine_cls.save_checkpoint, "_aidaptiv", False):
        engine_cls.save_checkpoint = engine_cls.save_checkpoint._aidaptiv
        engine_cls.load_checkpoint = engine_cls.load_checkpoint._aidaptiv
        engine_cls._zero3_consolidated_16bit_state_dict = engine_cls._zero3_consolidated_16bit_state_dict._aidaptiv

