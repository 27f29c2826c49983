"""The aidaptiv_ds checkpoint layout: crash-safe files in standard safetensors, readable anywhere.

Beside DeepSpeed's own files of a tag (model states, ZeRO states, ``latest``)::

    <save_dir>/<tag>/aidaptiv/rank00000/sg00000.safetensors  one optimizer sub-group: tensor "state",
                                                             fp32 [slots, numel] = master, exp_avg, ...
    <save_dir>/<tag>/aidaptiv/rank00000/frozen.safetensors  partitions of frozen parameters (if any)
    <save_dir>/<tag>/aidaptiv/rank00000/rank.json           this rank's index, written after its files
    <save_dir>/<tag>/aidaptiv/MANIFEST.json                 written last, by rank 0, once every rank is done

Every file is written under a temporary name, fsynced, renamed, and its directory fsynced; the
``latest`` file is replaced only after the manifest exists. A checkpoint without a manifest, or
whose files do not match it (missing, wrong size, wrong CRC32), is *incomplete*: it is named as
such and never loaded. A ``kill -9`` at any moment of a save therefore leaves the previous
checkpoint as the latest, loadable one.

Each ``rank.json`` records, per sub-group, its parameters (name, partition numel, offset in the
sub-group, full numel and shape), so state can be re-partitioned for another world size and
consolidated into whole tensors (:mod:`aidaptiv_ds.checkpoint.reader`).
"""
from __future__ import annotations

import json
import os
import struct
import zlib

from ..errors import AidaptivError

LAYOUT_VERSION = 1
DIRNAME = "aidaptiv"
MANIFEST = "MANIFEST.json"
RANK_INDEX = "rank.json"
ALIGN = 4096

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int8": "I8",
              "uint8": "U8", "int32": "I32", "int64": "I64"}


class IncompleteCheckpointError(AidaptivError, RuntimeError):
    """A checkpoint whose save did not finish (no manifest, or files missing or damaged)."""


def rank_dirname(rank: int) -> str:
    return f"rank{rank:05d}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync, rename and directory fsync."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json(path: str, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def safetensors_header(tensors: list[tuple[str, str, list[int], int]], metadata: dict | None = None,
                       align: int = ALIGN) -> tuple[bytes, list[int]]:
    """Header bytes of a safetensors file whose data starts at a multiple of ``align`` bytes.

    Args:
        tensors: ``[(name, torch dtype name e.g. "float32", shape, nbytes), ...]`` in file order.
        metadata: string-to-string ``__metadata__`` (values that are not strings are JSON-encoded).

    Returns:
        ``(header, offsets)``: the 8-byte length prefix + JSON (space-padded, as the format allows)
        and each tensor's absolute byte offset in the file.
    """
    entries = {}
    pos = 0
    for name, dtype, shape, nbytes in tensors:
        entries[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    if metadata:
        entries["__metadata__"] = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    body = json.dumps(entries, separators=(",", ":")).encode()
    start = -(-(8 + len(body)) // align) * align
    body += b" " * (start - 8 - len(body))
    header = struct.pack("<Q", len(body)) + body
    return header, [start + e["data_offsets"][0] for e in entries.values() if "data_offsets" in e]


def crc32_file(path: str, chunk: int = 8 << 20) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(chunk)
            if not b:
                return crc
            crc = zlib.crc32(b, crc)


def tag_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, str(tag))


def read_manifest(tag_path: str, verify_crc: bool = False) -> dict:
    """The manifest of a checkpoint tag directory, after checking that every file it lists is intact.

    Raises:
        IncompleteCheckpointError: naming the checkpoint and what is missing or damaged.
    """
    base = os.path.join(tag_path, DIRNAME)
    path = os.path.join(base, MANIFEST)
    if not os.path.isfile(path):
        have = sorted(os.listdir(base)) if os.path.isdir(base) else []
        raise IncompleteCheckpointError(
            f"aidaptiv_ds: checkpoint {tag_path} is incomplete: {path} is missing (the save was interrupted; found "
            f"{have or 'no aidaptiv files'}). It will not be loaded. Fix: load an earlier tag (the 'latest' file "
            f"still names the last complete one) and delete this directory.")
    with open(path) as f:
        man = json.load(f)
    for rel, info in man["files"].items():
        p = os.path.join(base, rel)
        if not os.path.isfile(p) or os.path.getsize(p) != info["bytes"]:
            got = os.path.getsize(p) if os.path.isfile(p) else "missing"
            raise IncompleteCheckpointError(
                f"aidaptiv_ds: checkpoint {tag_path} is damaged: {p} should hold {info['bytes']} bytes, found {got}. "
                f"It will not be loaded. Fix: load an earlier tag.")
        if verify_crc and info.get("crc32") is not None and crc32_file(p) != info["crc32"]:
            raise IncompleteCheckpointError(
                f"aidaptiv_ds: checkpoint {tag_path} is damaged: CRC32 of {p} does not match the manifest. It will "
                f"not be loaded. Fix: load an earlier tag.")
    return man


def complete_tags(save_dir: str) -> list[str]:
    """Tags under ``save_dir`` with a complete aidaptiv checkpoint, oldest first (by manifest time)."""
    out = []
    for t in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        try:
            man = read_manifest(os.path.join(save_dir, t))
        except (IncompleteCheckpointError, OSError, ValueError):
            continue
        out.append((man.get("created", 0), t))
    return [t for _, t in sorted(out)]
