"""Writing one rank's part of a checkpoint, crash-safe (see :mod:`aidaptiv_ds.checkpoint.format`).

Every file goes through :class:`aidaptiv_ds.io.atomic.AtomicFile`: each ``pwrite`` is checked (a
short write is continued, one that fails or makes no progress raises
:class:`~aidaptiv_ds.io.errors.FileWriteError` naming the file and the bytes written of the bytes
expected), the file is fsynced and must have its expected size before it is renamed into place.
"""
from __future__ import annotations

import os
import time

import torch

from ..io.atomic import AtomicFile, atomic_write, fsync_dir
from .format import DIRNAME, LAYOUT_VERSION, MANIFEST, PARTS_VERSION, RANK_INDEX, crc32_file, rank_dirname, \
    read_rank_index, safetensors_header, write_json
from .reflink import clone_range

CHUNK = 64 << 20


class RankWriter:
    """Files of one rank under ``<tag>/aidaptiv/rankNNNNN``; :meth:`finish` writes ``rank.json`` last.

    Attributes:
        files: ``{relative path: {"bytes": n, "crc32": c}}`` written so far.
        written_bytes / cloned_bytes: bytes written to the drive vs shared by copy-on-write clones.
    """

    def __init__(self, tag_path: str, rank: int, world_size: int) -> None:
        self.base = os.path.join(tag_path, DIRNAME)
        self.rel_dir = rank_dirname(rank)
        self.dir = os.path.join(self.base, self.rel_dir)
        os.makedirs(self.dir, exist_ok=True)
        self.rank, self.world_size = rank, world_size
        self.files: dict[str, dict] = {}
        self.written_bytes = 0
        self.cloned_bytes = 0

    def write_tensors(self, name: str, tensors: list[tuple[str, torch.Tensor]], metadata: dict | None = None) -> None:
        """A safetensors file of CPU tensors (written in ``CHUNK``-byte pieces; CRC32 recorded).

        Raises:
            FileWriteError: a write failed or came up short (disk full, quota, EIO), naming the file and
                the bytes written of the bytes expected; nothing is renamed into place.
        """
        spec = [(n, str(t.dtype).replace("torch.", ""), list(t.shape), t.numel() * t.element_size())
                for n, t in tensors]
        header, offsets = safetensors_header(spec, metadata)
        size = offsets[-1] + spec[-1][3] if offsets else len(header)
        path = os.path.join(self.dir, name)
        with AtomicFile(path, expected=size, crc=True) as f:
            f.write(header)
            for (_, t), off in zip(tensors, offsets):
                if off > f.pos:  # alignment padding between tensors (none with one tensor)
                    f.write(b"\0" * (off - f.pos))
                mv = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
                for s in range(0, len(mv), CHUNK):
                    f.write(mv[s:s + CHUNK])
                self.written_bytes += len(mv)
        self.files[f"{self.rel_dir}/{name}"] = {"bytes": size, "crc32": f.crc32}

    def clone_tensor(self, name: str, tensor_name: str, dtype: str, shape: list[int], runs, metadata: dict | None,
                     align: int) -> bool:
        """Try to make a one-tensor safetensors file whose data is cloned from ``runs``
        (``[(src_fd, src_offset, length, offset_in_tensor)]``, block-aligned). False: nothing done.

        The cloned file's CRC32 is computed by reading it back (reads only: the point of cloning is
        not writing the bytes again), so a load verifies it like any other file.
        """
        nbytes = 1
        for s in shape:
            nbytes *= s
        nbytes *= 4 if dtype == "float32" else 2
        header, (off,) = safetensors_header([(tensor_name, dtype, shape, nbytes)], metadata, align=align)
        path = os.path.join(self.dir, name)
        f = AtomicFile(path, expected=off + nbytes)
        try:
            for src_fd, src_off, length, rel in runs:
                if not clone_range(src_fd, src_off, f.fd, off + rel, length):
                    f.abort()
                    return False
            f.pwrite(header, 0)
            f.truncate(off + nbytes)
            os.fsync(f.fd)
            crc = crc32_file(f.tmp)
        except BaseException:
            f.abort()
            raise
        f.commit()
        self.cloned_bytes += nbytes
        self.files[f"{self.rel_dir}/{name}"] = {"bytes": off + nbytes, "crc32": crc}
        return True

    def finish(self, index: dict) -> None:
        """Write ``rank.json`` (the rank's index, listing its files, with its own CRC) after all of them."""
        index = dict(index, files=self.files, rank=self.rank, world_size=self.world_size, version=LAYOUT_VERSION)
        write_json(os.path.join(self.dir, RANK_INDEX), index, checked=True)
        fsync_dir(self.dir)
        fsync_dir(self.base)


def deepspeed_files(tag_path: str) -> dict[str, dict]:
    """Every file of the tag directory outside ``aidaptiv/`` (DeepSpeed's own), fsynced, with its
    size and CRC32: ``{path relative to the tag directory: {"bytes": n, "crc32": c}}``.

    DeepSpeed writes them with ``torch.save`` without fsync; the fsync here makes them as durable
    as ours before the manifest that lists them exists.
    """
    out = {}
    for root, dirs, files in os.walk(tag_path):
        rel_root = os.path.relpath(root, tag_path)
        if rel_root == DIRNAME or rel_root.startswith(DIRNAME + os.sep):
            dirs[:] = []
            continue
        if rel_root == ".":
            dirs[:] = [d for d in dirs if d != DIRNAME]
        for name in files:
            p = os.path.join(root, name)
            rel = os.path.normpath(os.path.join(rel_root, name))
            out[rel] = {"bytes": os.path.getsize(p), "crc32": crc32_file(p, fsync=True)}
        fsync_dir(root)
    return out


def write_manifest(tag_path: str, world_size: int, extra: dict, ranks: list[int] | None = None) -> dict:
    """Rank 0 (or, for a node-local part, the part's leader), after every rank finished: check each
    ``rank.json``, list DeepSpeed's files with their CRC32, and write ``MANIFEST.json`` last (with
    its own CRC).

    Args:
        ranks: the ranks whose state this directory holds (default: all ``world_size``); a manifest
            with ``extra["part"]`` is a node-local part (layout 3, :mod:`aidaptiv_ds.checkpoint.parts`).

    Raises:
        IncompleteCheckpointError: a rank's index is missing or damaged (that rank's save did not finish).
    """
    base = os.path.join(tag_path, DIRNAME)
    files = {}
    for r in (range(world_size) if ranks is None else ranks):
        idx = read_rank_index(tag_path, r)
        files.update(idx["files"])
        idx_path = os.path.join(base, rank_dirname(r), RANK_INDEX)
        files[f"{rank_dirname(r)}/{RANK_INDEX}"] = {"bytes": os.path.getsize(idx_path), "crc32": crc32_file(idx_path)}
    version = PARTS_VERSION if extra.get("part") else LAYOUT_VERSION
    man = dict(extra, version=version, world_size=world_size, files=files, deepspeed_files=deepspeed_files(tag_path),
               created=time.time())
    write_json(os.path.join(base, MANIFEST), man, checked=True)
    fsync_dir(tag_path)
    return man


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``<save_dir>/latest`` at ``tag`` atomically (DeepSpeed's format: the tag as text)."""
    atomic_write(os.path.join(save_dir, "latest"), str(tag).encode())

