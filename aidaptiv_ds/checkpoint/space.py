"""Space for checkpoints: refuse a save that cannot fit, before anything is written (issue 11.8).

A save writes the whole new tag beside the old one until it is complete
(:mod:`aidaptiv_ds.checkpoint.format`), so it needs the full size of the new tag free, whether or
not the tag exists. Each rank states what its part needs (:class:`RankNeed`); the ranks' parts on
one filesystem are added up and compared with that filesystem's free space. When the checkpoint
directory shares its filesystem with a cache path, the error says how much of it the slabs hold,
and, when dead stores of earlier runs fill it, how to remove them (``aidaptiv-ds gc``).
"""
from __future__ import annotations

import dataclasses
import os
import socket

from ..io.errors import StorageError, StorageFullError
from ..store.layout import dead_store_hint
from ..units import format_bytes

#: DeepSpeed's own files of one rank (ZeRO-3 model states hold placeholders and buffers, its
#: optimizer-states file the partition bookkeeping), when no earlier tag shows their size.
DEEPSPEED_FILES_ESTIMATE = 4 << 20


class CheckpointSpaceError(StorageFullError):
    """The checkpoint directory's filesystem lacks the space a save needs. Raised before any byte of
    the save is written: the previous checkpoint (of this tag or another) is unchanged."""

    def __init__(self, save_dir: str, tag: str, needed: int, free: int, detail: str = "") -> None:
        self.path, self.needed, self.free, self.save_dir, self.tag = save_dir, needed, free, save_dir, tag
        StorageError.__init__(
            self,
            f"aidaptiv_ds: saving checkpoint {tag!r} to {save_dir} needs {format_bytes(needed)} ({needed} bytes: the "
            f"new tag is written whole beside any old one until it is complete) but its filesystem has "
            f"{format_bytes(free)} ({free} bytes) free.{detail} Nothing was written; the previous checkpoints are "
            f"unchanged. Fix: free space there (e.g. delete checkpoints you no longer need, keeping the latest), or "
            f"save to another filesystem.")


@dataclasses.dataclass
class RankNeed:
    """One rank's view of a save: the filesystem of ``save_dir`` (``fs``: host and device, or the
    filesystem id), its free bytes, the bytes this rank's part of the checkpoint needs, and the
    cache paths of this rank on the same filesystem with the bytes its slabs hold there."""
    fs: str
    free: int
    need: int
    shared_cache_paths: list
    slab_bytes: int


def filesystem_id(path: str) -> str:
    """A name for the filesystem holding ``path``: its ``statvfs`` filesystem id when it has one
    (the same for every client of a network filesystem on most systems), else host and device."""
    st = os.statvfs(path)
    fsid = getattr(st, "f_fsid", 0)
    return f"fsid:{fsid}" if fsid else f"{socket.gethostname()}:{os.stat(path).st_dev}"


def rank_need(save_dir: str, need: int, cache_paths: list[str], slab_bytes: list[int]) -> RankNeed:
    """This rank's :class:`RankNeed` for a save of ``need`` bytes into ``save_dir`` (which exists).

    Args:
        cache_paths / slab_bytes: this rank's cache paths and the bytes its slab holds on each.
    """
    st = os.statvfs(save_dir)
    fs = filesystem_id(save_dir)
    shared = [(p, b) for p, b in zip(cache_paths, slab_bytes) if filesystem_id(p) == fs]
    return RankNeed(fs, st.f_bavail * st.f_frsize, int(need), [p for p, _ in shared], sum(b for _, b in shared))


@dataclasses.dataclass
class _Short:
    """A filesystem where the ranks' needs exceed its free space."""
    need: int  # bytes, summed over the ranks writing there
    free: int  # bytes, the smallest free space any of them sees
    shared_cache_paths: list[str]  # cache paths on that filesystem (sorted)
    slab_bytes: int  # bytes the slabs of those ranks hold there


def _first_short_filesystem(ranks: list[RankNeed]) -> _Short | None:
    """The first filesystem (in sorted order of its id) whose ranks need more than it has free, or
    None. Deterministic in ``ranks``, so every rank finds the same one from the same gathered list."""
    by_fs: dict[str, list[RankNeed]] = {}
    for r in ranks:
        by_fs.setdefault(r.fs, []).append(r)
    for fs in sorted(by_fs):
        group = by_fs[fs]
        need, free = sum(r.need for r in group), min(r.free for r in group)
        if need > free:
            return _Short(need, free, sorted({p for r in group for p in r.shared_cache_paths}),
                          sum(r.slab_bytes for r in group))
    return None


def verdict(save_dir: str, tag: str, ranks: list[RankNeed]) -> CheckpointSpaceError | None:
    """The error every rank raises when the ranks' needs on one filesystem exceed its free space
    (the smallest free space any of them sees), else None. Deterministic in ``ranks``, so every rank
    computes the same answer from the same gathered list."""
    short = _first_short_filesystem(ranks)
    if short is None:
        return None
    need, free, paths = short.need, short.free, short.shared_cache_paths
    detail = ""
    if paths:
        many = len(paths) > 1
        detail = (f" The cache path{'s' if many else ''} {', '.join(paths)} {'are' if many else 'is'} on the same "
                  f"filesystem; the slabs of this run hold {format_bytes(short.slab_bytes)} there (the state plus "
                  f"its margin).")
        for p in paths:
            detail += dead_store_hint(p, need, free)
    return CheckpointSpaceError(save_dir, tag, need, free, detail)


def preflight_verdict(checkpoint_dir: str, ranks: list[RankNeed]) -> StorageFullError | None:
    """At start (``aidaptiv.checkpoint_dir`` set): the error when one checkpoint of every rank that
    shares a filesystem with ``checkpoint_dir`` does not fit in what is free there now -- after the
    slabs reserved the state, so when a cache path shares the filesystem the numbers are state +
    checkpoint against its free space. None when it fits."""
    short = _first_short_filesystem(ranks)
    if short is None:
        return None
    need, free, paths, held = short.need, short.free, short.shared_cache_paths, short.slab_bytes
    if paths:
        detail = (f"; it shares its filesystem with the cache path{'s' if len(paths) > 1 else ''} "
                  f"{', '.join(paths)}, where the slabs already reserved {format_bytes(held)} for the training "
                  f"state (and its margin), so state + checkpoint need {format_bytes(held + need)} of the "
                  f"{format_bytes(held + free)} there.")
        detail += "".join(dead_store_hint(p, need, free) for p in paths)
    else:
        detail = "."
    return CheckpointPreflightError(checkpoint_dir, need, free, detail)


class CheckpointPreflightError(StorageFullError):
    """At start: ``aidaptiv.checkpoint_dir`` cannot hold one checkpoint (see :func:`preflight_verdict`)."""

    def __init__(self, checkpoint_dir: str, needed: int, free: int, detail: str) -> None:
        self.path, self.needed, self.free = checkpoint_dir, needed, free
        StorageError.__init__(
            self,
            f"aidaptiv_ds: aidaptiv.checkpoint_dir {checkpoint_dir} needs {format_bytes(needed)} ({needed} bytes) for "
            f"one checkpoint of the ranks writing there but has {format_bytes(free)} ({free} bytes) free{detail} "
            f"Nothing was trained or saved yet. Fix: free space there, save checkpoints to another filesystem, or "
            f"add a cache path on another drive so the slabs leave room.")
