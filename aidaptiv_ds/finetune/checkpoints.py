"""Checkpoints of the main job, with HF ``Trainer``'s names, layout and behaviour.

Flags (``TrainingArguments`` names): ``--save_strategy steps|no``, ``--save_steps N``,
``--save_total_limit K`` and ``--resume_from_checkpoint PATH|latest``. Layout, as HF's Trainer
writes it with DeepSpeed::

    OUTPUT_DIR/checkpoint-N/
        global_stepN/          the engine's checkpoint (engine.save_checkpoint: DeepSpeed's files and,
        latest                 on aidaptiv_ds, every sub-group's master weights and Adam moments)
        rng_state.pth          python / numpy / torch RNG states (rng_state_<rank>.pth with several ranks)
        trainer_state.json     global_step, epoch, log_history, ... ; written last: the completion mark

A checkpoint is *complete* when its ``trainer_state.json`` exists: it is written (temporary name,
fsync, rename, directory fsync) only after every rank finished the engine's save and its RNG file.
Older checkpoints beyond ``--save_total_limit`` are deleted only after a newer one is complete, so
a ``kill -9`` at any moment leaves at least the previous complete checkpoint. ``latest`` resumes
from the highest-numbered complete checkpoint (an incomplete newer one is named and skipped).

Continuation is bit-exact (same losses as a run that was never stopped): the engine restores the
weights, optimizer state and LR scheduler; the loop skips the micro-batches the checkpoint already
trained on in its epoch (the ``DistributedSampler`` order depends only on seed and epoch) and
restores the RNG states at the point where they were saved (:func:`restore_rng`).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import warnings

import torch

from . import distributed

PREFIX = "checkpoint"
TRAINER_STATE = "trainer_state.json"
_RE = re.compile(rf"^{PREFIX}-(\d+)$")
CLIENT_KEY = "aidaptiv_finetune"


def checkpoint_dir(output_dir: str, step: int) -> str:
    """``OUTPUT_DIR/checkpoint-<step>``."""
    return os.path.join(output_dir, f"{PREFIX}-{int(step)}")


def is_complete(path: str) -> bool:
    """True when ``path`` holds a ``trainer_state.json`` that parses (the save finished)."""
    try:
        with open(os.path.join(path, TRAINER_STATE), encoding="utf-8") as f:
            json.load(f)
        return True
    except (OSError, ValueError):
        return False


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` directory under ``output_dir``, oldest step first."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        m = _RE.match(n)
        if m and os.path.isdir(os.path.join(output_dir, n)):
            out.append((int(m.group(1)), os.path.join(output_dir, n)))
    return sorted(out)


def resolve_resume(value: str, output_dir: str) -> str:
    """The checkpoint directory ``--resume_from_checkpoint`` names.

    ``latest``: the highest-numbered complete ``checkpoint-N`` in ``output_dir`` (incomplete newer
    ones are reported on stderr and skipped); a path: that directory, which must be complete.

    Raises:
        FileNotFoundError: no such directory, or ``latest`` found no complete checkpoint (names what it found).
        ValueError: the named checkpoint is incomplete (lists the complete ones to use instead).
    """
    if value == "latest":
        found = list_checkpoints(output_dir)
        complete = [(s, p) for s, p in found if is_complete(p)]
        if not complete:
            seen = ", ".join(os.path.basename(p) for _, p in found) or "none"
            raise FileNotFoundError(f"--resume_from_checkpoint latest: no complete {PREFIX}-N directory in "
                                    f"--output_dir {output_dir} (found: {seen}); start without the flag, or give "
                                    f"a checkpoint path")
        step, path = complete[-1]
        skipped = [os.path.basename(p) for s, p in found if s > step]
        if skipped and distributed.rank() == 0:
            print(f"[finetune] --resume_from_checkpoint latest: skipping {', '.join(skipped)} (incomplete: the save "
                  f"was interrupted, no {TRAINER_STATE}); resuming from {path}", file=sys.stderr, flush=True)
        return path
    path = os.path.expanduser(value)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--resume_from_checkpoint {value!r}: no such directory; give OUTPUT_DIR/{PREFIX}-N "
                                f"or 'latest'")
    if not is_complete(path):
        parent = os.path.dirname(os.path.abspath(path))
        ok = [os.path.basename(p) for _, p in list_checkpoints(parent) if is_complete(p)]
        raise ValueError(f"--resume_from_checkpoint {value!r}: the checkpoint is incomplete (no {TRAINER_STATE}: its "
                         f"save was interrupted); complete checkpoints there: {', '.join(ok) or 'none'}")
    return path


def _rng_file(path: str, rank: int, world: int) -> str:
    return os.path.join(path, "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth")


def rng_states() -> dict:
    """The RNG states HF's Trainer saves: ``python``, ``numpy``, ``cpu`` and (with CUDA) ``cuda``."""
    import numpy as np

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    return out


def restore_rng(path: str) -> bool:
    """Set this rank's RNG states from checkpoint ``path``; False (with a warning) when its file is
    absent, e.g. after resuming at another world size (training goes on, not bit-exact)."""
    import numpy as np

    f = _rng_file(path, distributed.rank(), distributed.world_size())
    if not os.path.isfile(f):
        warnings.warn(f"{f} not found (saved at another world size?): the RNG states are not restored, so "
                      f"dropout draws differ from the run that saved {path}", stacklevel=2)
        return False
    st = torch.load(f, weights_only=False)
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.random.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(st["cuda"])
    return True


def _atomic_json(path: str, obj: dict) -> None:
    from ..checkpoint.format import atomic_write  # temporary name, fsync, rename, directory fsync

    atomic_write(path, json.dumps(obj, indent=1).encode())


def save(engine, output_dir: str, step: int, trainer_state: dict, client_state: dict,
         save_total_limit: int | None) -> str:
    """Save ``OUTPUT_DIR/checkpoint-<step>`` (collective: every rank calls it); returns its path.

    Order: an earlier ``trainer_state.json`` of the same step is removed first (the directory is
    then incomplete until this save ends); ``engine.save_checkpoint`` (DeepSpeed's tag
    ``global_step<N>``, ``client_state`` under :data:`CLIENT_KEY`); each rank's RNG file; a barrier;
    rank 0 writes ``trainer_state.json`` and then deletes the oldest checkpoints beyond
    ``save_total_limit`` (never the new one).
    """
    rank, world = distributed.rank(), distributed.world_size()
    path = checkpoint_dir(output_dir, step)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        try:
            os.unlink(os.path.join(path, TRAINER_STATE))
        except FileNotFoundError:
            pass
    distributed.barrier()
    # [Note: the optimizer's learning rate.] The LR scheduler's state is restored by load_checkpoint, but
    # a DeepSpeed scheduler writes the optimizer's lr only in its next step(), and DeepSpeed's own NVMe
    # offload does not restore the optimizer's param_groups, so the first resumed step would use the
    # scheduler's initial lr. aidaptiv_ds's load restores them (integration/checkpointing.py,
    # restore_param_groups); for the job's runs on DeepSpeed's own offload the lr of every param group is
    # saved here and set again by load().
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    engine.save_checkpoint(path, client_state={CLIENT_KEY: {**client_state, "param_group_lrs": lrs}})
    torch.save(rng_states(), _rng_file(path, rank, world))
    distributed.barrier()
    if rank == 0:
        _atomic_json(os.path.join(path, TRAINER_STATE), trainer_state)
        if save_total_limit is not None and save_total_limit > 0:
            rotate(output_dir, save_total_limit, keep=path)
    distributed.barrier()
    return path


def rotate(output_dir: str, limit: int, keep: str) -> list[str]:
    """Delete the oldest ``checkpoint-N`` directories until at most ``limit`` remain (``keep`` never);
    returns the deleted paths. Incomplete ones count and go first among equals (oldest step first)."""
    found = list_checkpoints(output_dir)
    doomed = [p for _, p in found if os.path.abspath(p) != os.path.abspath(keep)][:max(len(found) - limit, 0)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def load(engine, path: str) -> dict:
    """Load checkpoint ``path`` into ``engine`` (collective); returns the loop state saved with it
    (the ``client_state`` of :func:`save`).

    Raises:
        ValueError: the checkpoint was not written by this job (no loop state in it).
    """
    _, client = engine.load_checkpoint(path)
    state = (client or {}).get(CLIENT_KEY)
    if state is None:
        raise ValueError(f"--resume_from_checkpoint {path}: the engine checkpoint holds no fine-tuning loop state "
                         f"(not saved by launch/finetune.py); load it with engine.load_checkpoint in your own script")
    lrs = state.get("param_group_lrs")
    if lrs is not None and len(lrs) == len(engine.optimizer.param_groups):
        for g, lr in zip(engine.optimizer.param_groups, lrs):
            g["lr"] = lr
    return state
