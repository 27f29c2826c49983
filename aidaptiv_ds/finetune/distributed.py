"""Process-group plumbing: single-process defaults, rank queries and small cross-rank reductions.

``python launch/finetune.py`` runs without a launcher: :func:`ensure_env` fills ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (a free local port) when they
are absent, which is what ``deepspeed.init_distributed`` and ``deepspeed.zero.Init`` read. Under
the ``deepspeed`` launcher or ``torchrun`` they are already set and left alone.
"""
from __future__ import annotations

import os

from ..ports import ensure_env  # noqa: F401 (re-exported: distributed.ensure_env())


def init() -> None:
    """Initialise the default process group through DeepSpeed (gloo/ccl on CPU, nccl on CUDA)."""
    import deepspeed

    deepspeed.init_distributed()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def sum_floats(values: list[float]) -> list[float]:
    """Element-wise sum of a list of floats over all ranks (float64; identity with one rank)."""
    import torch
    import torch.distributed as dist

    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` with one rank)."""
    import torch.distributed as dist

    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    import torch.distributed as dist

    if world_size() > 1:
        dist.barrier()
