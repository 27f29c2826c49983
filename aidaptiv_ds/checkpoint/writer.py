"""Writing one rank's part of a checkpoint, crash-safe (see :mod:`aidaptiv_ds.checkpoint.format`)."""
from __future__ import annotations

import os
import time
import zlib

import torch

from .format import DIRNAME, MANIFEST, RANK_INDEX, atomic_write, fsync_dir, rank_dirname, safetensors_header, \
    write_json
from .reflink import clone_range

CHUNK = 64 << 20


class RankWriter:
    """Files of one rank under ``<tag>/aidaptiv/rankNNNNN``; :meth:`finish` writes ``rank.json`` last.

    Attributes:
        files: ``{relative path: {"bytes": n, "crc32": c or None}}`` written so far.
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

    def _begin(self, name: str):
        path = os.path.join(self.dir, name)
        tmp = f"{path}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        return path, tmp, fd

    def _commit(self, name: str, path: str, tmp: str, fd: int, crc: int | None) -> None:
        os.fsync(fd)
        size = os.fstat(fd).st_size
        os.close(fd)
        os.replace(tmp, path)
        self.files[f"{self.rel_dir}/{name}"] = {"bytes": size, "crc32": crc}

    def write_tensors(self, name: str, tensors: list[tuple[str, torch.Tensor]], metadata: dict | None = None) -> None:
        """A safetensors file of CPU tensors (written in ``CHUNK``-byte pieces; CRC32 recorded)."""
        spec = [(n, str(t.dtype).replace("torch.", ""), list(t.shape), t.numel() * t.element_size())
                for n, t in tensors]
        header, offsets = safetensors_header(spec, metadata)
        path, tmp, fd = self._begin(name)
        try:
            os.pwrite(fd, header, 0)
            crc = zlib.crc32(header)
            pos = len(header)
            for (_, t), off in zip(tensors, offsets):
                if off > pos:  # alignment padding between tensors (none with one tensor)
                    pad = b"\0" * (off - pos)
                    os.pwrite(fd, pad, pos)
                    crc = zlib.crc32(pad, crc)
                mv = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
                for s in range(0, len(mv), CHUNK):
                    piece = mv[s:s + CHUNK]
                    os.pwrite(fd, piece, off + s)
                    crc = zlib.crc32(piece, crc)
                pos = off + len(mv)
                self.written_bytes += len(mv)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        self._commit(name, path, tmp, fd, crc)

    def clone_tensor(self, name: str, tensor_name: str, dtype: str, shape: list[int], runs, metadata: dict | None,
                     align: int) -> bool:
        """Try to make a one-tensor safetensors file whose data is cloned from ``runs``
        (``[(src_fd, src_offset, length, offset_in_tensor)]``, block-aligned). False: nothing done."""
        nbytes = 1
        for s in shape:
            nbytes *= s
        nbytes *= 4 if dtype == "float32" else 2
        header, (off,) = safetensors_header([(tensor_name, dtype, shape, nbytes)], metadata, align=align)
        path, tmp, fd = self._begin(name)
        try:
            for src_fd, src_off, length, rel in runs:
                if not clone_range(src_fd, src_off, fd, off + rel, length):
                    os.close(fd)
                    os.unlink(tmp)
                    return False
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, off + nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        self.cloned_bytes += nbytes
        self._commit(name, path, tmp, fd, None)
        return True

    def finish(self, index: dict) -> None:
        """Write ``rank.json`` (the rank's index, listing its files) after all of them."""
        index = dict(index, files=self.files, rank=self.rank, world_size=self.world_size)
        write_json(os.path.join(self.dir, RANK_INDEX), index)
        fsync_dir(self.dir)


def write_manifest(tag_path: str, world_size: int, extra: dict) -> dict:
    """Rank 0, after every rank finished: check each ``rank.json`` and write ``MANIFEST.json`` last.

    Raises:
        FileNotFoundError: a rank's index is missing (that rank's save did not finish).
    """
    import json

    base = os.path.join(tag_path, DIRNAME)
    files = {}
    for r in range(world_size):
        idx_path = os.path.join(base, rank_dirname(r), RANK_INDEX)
        with open(idx_path) as f:
            idx = json.load(f)
        files.update(idx["files"])
        files[f"{rank_dirname(r)}/{RANK_INDEX}"] = {"bytes": os.path.getsize(idx_path), "crc32": None}
    man = dict(extra, version=1, world_size=world_size, files=files, created=time.time())
    write_json(os.path.join(base, MANIFEST), man)
    return man


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``<save_dir>/latest`` at ``tag`` atomically (DeepSpeed's format: the tag as text)."""
    atomic_write(os.path.join(save_dir, "latest"), str(tag).encode())
