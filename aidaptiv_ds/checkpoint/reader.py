"""Reading an aidaptiv_ds checkpoint at any world size: whole parameters, or any element range.

ZeRO-3 splits each parameter of ``ds_numel`` elements into ``W`` partitions of
``P = ceil(ds_numel / W)`` elements (DeepSpeed pads the tail, ``partition_parameters.py``
``_aligned_size``/``_padding_size``); rank ``q`` holds elements ``[q P, (q + 1) P)``. Each rank's
``rank.json`` says where every partition sits in its sub-group files, so an element range of a
parameter maps to slices of those files, whatever world size wrote them and whatever world size
reads them (:meth:`CheckpointReader.read_range`). Reads go through ``safetensors`` slices: one
parameter range at a time is in memory.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from safetensors import safe_open

from .format import DIRNAME, rank_dirname, read_manifest, read_rank_index


@dataclasses.dataclass
class _Part:
    rank: int
    file: str
    offset: int  # element offset of the partition in the file's tensor (columns)
    numel: int  # partition numel P
    tensor: str


@dataclasses.dataclass
class ParamInfo:
    """One parameter of the checkpoint: full ``numel`` and ``shape``, whether it is trained, its parts."""
    name: str
    numel: int
    shape: list
    dtype: str
    trainable: bool
    parts: list = dataclasses.field(default_factory=list)


class CheckpointReader:
    """A complete checkpoint tag directory (raises ``IncompleteCheckpointError`` otherwise).

    Opening it verifies the manifest, every ``rank.json`` and every file's size, and with
    ``verify_crc`` (the default) every file's CRC32, DeepSpeed's included
    (:func:`~aidaptiv_ds.checkpoint.format.read_manifest`).

    Attributes:
        world_size: ranks that wrote it; manifest: the manifest dict; ranks: each rank's index.
        params: ``{name: ParamInfo}`` in the order of rank 0's sub-groups, then frozen parameters.
        state_names: names of the optimizer state slots after the fp32 master (e.g. exp_avg, exp_avg_sq).
    """

    def __init__(self, tag_path: str, verify_crc: bool = True) -> None:
        self.tag_path = tag_path
        self.manifest = read_manifest(tag_path, verify_crc=verify_crc)
        self.world_size = int(self.manifest["world_size"])
        base = os.path.join(tag_path, DIRNAME)
        version = int(self.manifest.get("version", 1))
        self.ranks = [read_rank_index(tag_path, r, version) for r in range(self.world_size)]
        self.params: dict[str, ParamInfo] = {}
        names = set()
        for r, idx in enumerate(self.ranks):
            for sg in idx["subgroups"]:
                names.add(tuple(sg["names"]))
                path = os.path.join(base, rank_dirname(r), sg["file"])
                for p in sg["params"]:
                    info = self.params.setdefault(p["name"], ParamInfo(p["name"], p["numel"], p["shape"],
                                                                       p.get("dtype", "float32"), True))
                    info.parts.append(_Part(r, path, p["offset"], p["partition_numel"], "state"))
            for p in idx.get("frozen", []):
                info = self.params.setdefault(p["name"], ParamInfo(p["name"], p["numel"], p["shape"], p["dtype"], False))
                info.parts.append(_Part(r, os.path.join(base, rank_dirname(r), idx["frozen_file"]), 0,
                                        p["partition_numel"], p["name"]))
        if len(names) > 1:
            raise ValueError(f"checkpoint {tag_path}: sub-groups hold different state slots {sorted(names)}")
        self.slot_names = list(next(iter(names))) if names else ["fp32"]
        self.state_names = self.slot_names[1:]
        for info in self.params.values():
            info.parts.sort(key=lambda p: p.rank)
        self._handles: dict[str, object] = {}

    def _open(self, path: str):
        h = self._handles.get(path)
        if h is None:
            h = self._handles[path] = safe_open(path, framework="pt")
        return h

    def read_range(self, name: str, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the flattened parameter ``name``.

        Returns:
            For a trained parameter: fp32 ``[slots, length]`` (row 0 the master weights, then
            :attr:`state_names`); for a frozen one: ``[1, length]`` in its dtype. Elements past the
            parameter's end (partition padding) are zero.
        """
        info = self.params[name]
        rows = len(self.slot_names) if info.trainable else 1
        dtype = torch.float32 if info.trainable else getattr(torch, info.dtype)
        out = torch.zeros(rows, length, dtype=dtype)
        end = min(start + length, info.numel)
        pos = start
        while pos < end:
            part = info.parts[pos // info.parts[0].numel]
            local = pos - part.rank * part.numel
            take = min(part.numel - local, end - pos)
            sl = self._open(part.file).get_slice(part.tensor)
            if info.trainable:
                out[:, pos - start:pos - start + take] = sl[:, part.offset + local:part.offset + local + take]
            else:
                out[0, pos - start:pos - start + take] = sl[local:local + take]
            pos += take
        return out

    def full(self, name: str, slot: int = 0) -> torch.Tensor:
        """The whole parameter ``name`` in its original shape: slot 0 = fp32 master (or the frozen values)."""
        info = self.params[name]
        return self.read_range(name, 0, info.numel)[slot].reshape(info.shape)

    def close(self) -> None:
        self._handles.clear()
