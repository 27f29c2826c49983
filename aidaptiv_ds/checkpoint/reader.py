"""Reading an aidaptiv_ds checkpoint at any world size: whole parameters, or any element range.

ZeRO-3 splits each parameter of ``ds_numel`` elements into ``W`` partitions of
``P = ceil(ds_numel / W)`` elements (DeepSpeed pads the tail, ``partition_parameters.py``
``_aligned_size``/``_padding_size``); rank ``q`` holds elements ``[q P, (q + 1) P)``. Each rank's
``rank.json`` says where every partition sits in its sub-group files, so an element range of a
parameter maps to slices of those files, whatever world size wrote them and whatever world size
reads them (:meth:`CheckpointReader.read_range`). Reads go through ``safetensors`` slices: one
parameter range at a time is in memory.

A checkpoint saved in node-local parts (:mod:`aidaptiv_ds.checkpoint.parts`) is read from the
directories of its parts together (``export`` gathers them), or from one part alone where only that
part's ranks' elements are asked for (a rank resuming on its own node).
"""
from __future__ import annotations

import dataclasses
import os

import torch
from safetensors import safe_open

from .format import DIRNAME, IncompleteCheckpointError, manifest_ranks, rank_dirname, read_manifest, read_rank_index


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
    """A complete checkpoint tag directory, or the directories of its node-local parts (raises
    ``IncompleteCheckpointError`` otherwise).

    Opening it verifies each manifest, every ``rank.json`` and every file's size, and with
    ``verify_crc`` (the default) every file's CRC32, DeepSpeed's included
    (:func:`~aidaptiv_ds.checkpoint.format.read_manifest`).

    Args:
        tag_path: a tag directory, or a list of them: the parts of one save (the same ``save_id``).
        require_all: every rank's part must be among them (else only elements of the ranks present
            can be read: :meth:`read_range` names the missing part).

    Attributes:
        world_size: ranks that wrote it; manifest: the (first) manifest dict; ranks: the index of
            each rank present, by rank (``rank_ids``).
        params: ``{name: ParamInfo}`` in the order of the lowest rank's sub-groups, then frozen parameters.
        state_names: names of the optimizer state slots after the fp32 master (e.g. exp_avg, exp_avg_sq).
    """

    def __init__(self, tag_path: str | list[str], verify_crc: bool = True, require_all: bool = True) -> None:
        paths = [tag_path] if isinstance(tag_path, str) else list(tag_path)
        self.tag_path = paths[0]
        self.tag_paths = paths
        manifests = [read_manifest(p, verify_crc=verify_crc) for p in paths]
        self.manifest = manifests[0]
        self.world_size = int(self.manifest["world_size"])
        where: dict[int, str] = {}
        for p, man in zip(paths, manifests):
            if int(man["world_size"]) != self.world_size or man.get("save_id") != self.manifest.get("save_id"):
                raise IncompleteCheckpointError(
                    f"aidaptiv_ds: {p} and {paths[0]} are not parts of one save (save ids {man.get('save_id')} and "
                    f"{self.manifest.get('save_id')}, {man['world_size']} and {self.world_size} ranks). Fix: give the "
                    f"directories of one save's parts (the same tag, saved by one job).")
            for r in manifest_ranks(man):
                if r in where:
                    raise IncompleteCheckpointError(f"aidaptiv_ds: rank {r}'s state is in both {where[r]} and {p}; "
                                                    f"give each part's directory once")
                where[r] = p
        self.rank_ids = sorted(where)
        self.rank_paths = where
        self.missing_ranks = sorted(set(range(self.world_size)) - set(where))
        if require_all and self.missing_ranks:
            raise IncompleteCheckpointError(f"aidaptiv_ds: checkpoint {paths[0]} lacks the state of ranks "
                                            f"{self.missing_ranks}: {self.missing_parts()}")
        version = max(int(m.get("version", 1)) for m in manifests)
        self.ranks = [read_rank_index(where[r], r, version) for r in self.rank_ids]
        self.params: dict[str, ParamInfo] = {}
        names = set()
        for r, idx in zip(self.rank_ids, self.ranks):
            base = os.path.join(where[r], DIRNAME)
            for sg in idx["subgroups"]:
                names.add(tuple(sg["names"]))
                path = os.path.join(base, rank_dirname(r), sg["file"])
                for p in sg["params"]:
                    info = self.params.setdefault(p["name"], ParamInfo(p["name"], p["numel"], p["shape"],
                                                                       p.get("dtype", "float32"), True))
                    info.parts.append(_Part(r, path, p["offset"], p["partition_numel"], "state"))
            for p in idx.get("frozen", []):
                info = self.params.setdefault(p["name"], ParamInfo(p["name"], p["numel"], p["shape"], p["dtype"],
                                                                   False))
                info.parts.append(_Part(r, os.path.join(base, rank_dirname(r), idx["frozen_file"]), 0,
                                        p["partition_numel"], p["name"]))
        if len(names) > 1:
            raise ValueError(f"checkpoint {tag_path}: sub-groups hold different state slots {sorted(names)}")
        self.slot_names = list(next(iter(names))) if names else ["fp32"]
        self.state_names = self.slot_names[1:]
        for info in self.params.values():
            info.parts.sort(key=lambda p: p.rank)
        self._handles: dict[str, object] = {}

    def missing_parts(self) -> str:
        """Which parts hold the missing ranks, from the manifests' list of parts (node-local saves)."""
        parts = self.manifest.get("parts") or []
        gone = [p for p in parts if set(p["ranks"]) & set(self.missing_ranks)]
        if not gone:
            return (f"the save wrote them elsewhere; give every directory the save wrote (have: "
                    f"{', '.join(self.tag_paths)})")
        return ("they are in " + "; ".join(f"the part of node {p['host']} (ranks {p['ranks']}), which it saved to "
                                           f"{p['save_dir']} on that node" for p in gone)
                + f". Fix: give those directories too (copied or mounted here); have: {', '.join(self.tag_paths)}")

    def _open(self, path: str):
        h = self._handles.get(path)
        if h is None:
            h = self._handles[path] = safe_open(path, framework="pt")
        return h

    def read_range(self, name: str, start: int, length: int, slots: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the flattened parameter ``name``; ``slots``: only the first
        that many rows are read (1: the master weights alone, a third of the bytes with Adam's two moments).

        Returns:
            For a trained parameter: fp32 ``[slots, length]`` (row 0 the master weights, then
            :attr:`state_names`); for a frozen one: ``[1, length]`` in its dtype. Elements past the
            parameter's end (partition padding) are zero.
        """
        info = self.params[name]
        rows = (len(self.slot_names) if slots is None else max(1, min(int(slots), len(self.slot_names)))) \
            if info.trainable else 1
        dtype = torch.float32 if info.trainable else getattr(torch, info.dtype)
        out = torch.zeros(rows, length, dtype=dtype)
        end = min(start + length, info.numel)
        pos = start
        by_rank = {p.rank: p for p in info.parts}
        step = info.parts[0].numel
        while pos < end:
            part = by_rank.get(pos // step)
            if part is None:
                raise IncompleteCheckpointError(
                    f"aidaptiv_ds: elements {pos}.. of {name} were saved by rank {pos // step}, whose state is not in "
                    f"{', '.join(self.tag_paths)}: {self.missing_parts()}")
            local = pos - part.rank * part.numel
            take = min(part.numel - local, end - pos)
            sl = self._open(part.file).get_slice(part.tensor)
            if info.trainable:
                out[:, pos - start:pos - start + take] = sl[:rows, part.offset + local:part.offset + local + take]
            else:
                out[0, pos - start:pos - start + take] = sl[local:local + take]
            pos += take
        return out

    def packed_unit(self, rank: int, index: int, layout: list) -> torch.Tensor | None:
        """The bytes of sub-group ``index`` of ``rank`` as its extent stored them (uint8, tensor ``packed``), when
        that rank is present and saved it with the same slot ``layout`` (the JSON ``packed_layout``: int8 moments,
        whose codes and scales a dequantize-quantize round trip would not give back exactly); else None."""
        if rank not in self.rank_ids:
            return None
        subgroups = self.ranks[self.rank_ids.index(rank)]["subgroups"]
        if not 0 <= index < len(subgroups) or subgroups[index].get("packed_layout") != layout:
            return None
        path = os.path.join(self.rank_paths[rank], DIRNAME, rank_dirname(rank), subgroups[index]["file"])
        h = self._open(path)
        return h.get_tensor("packed") if "packed" in h.keys() else None

    def full(self, name: str, slot: int = 0) -> torch.Tensor:
        """The whole parameter ``name`` in its original shape: slot 0 = fp32 master (or the frozen values)."""
        info = self.params[name]
        return self.read_range(name, 0, info.numel, slots=slot + 1)[slot].reshape(info.shape)

    def close(self) -> None:
        self._handles.clear()
