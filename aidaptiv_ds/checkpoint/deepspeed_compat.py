"""DeepSpeed's own readers of a ZeRO-3 checkpoint (``zero_to_fp32``) on an aidaptiv_ds checkpoint.

[Note: what zero_to_fp32 reads] ``deepspeed.utils.zero_to_fp32`` (its functions, and the ``zero_to_fp32.py``
DeepSpeed copies beside every save, which HF users run) rebuilds the fp32 weights from each rank's
``*_optim_states.pt`` (``fp32_flat_groups``: the rank's optimizer sub-groups' fp32 master partitions, in order)
and its ``*_model_states.pt`` (``param_shapes``; ``frozen_param_fragments``, each frozen parameter's partition).
With the state on the cache drives both hold empty tensors (the sub-groups and partitions are swapped out when
DeepSpeed's save pickles them): ``ValueError: consumed N numels out of 0``. The bytes are in the checkpoint,
in this package's files (``<tag>/aidaptiv/rankNNNNN/``: each sub-group's ``state`` rows, row 0 the master
weights, and ``frozen.safetensors``). So the save pickles, in their place, a :class:`SavedTensorRef` per tensor:
unpickling it (``torch.load(..., weights_only=False)``, as ``zero_to_fp32`` loads) calls :func:`saved_tensor`,
which maps that tensor from the file beside the ``.pt`` being loaded (copy-on-write, read as it is touched),
so DeepSpeed's tools read the checkpoint without a byte written twice. Our own load does not read them
(:func:`placeholders`).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import struct
import sys
import threading

import torch

from .format import DIRNAME, MANIFEST, crc32_file, rank_dirname

#: safetensors dtype names -> torch dtypes (the ones a checkpoint holds)
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
           "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}

_state = threading.local()

#: File of a rank's frozen partitions in its directory of the checkpoint.
FROZEN_FILE = "frozen.safetensors"


def subgroup_file(index: int) -> str:
    """File of optimizer sub-group ``index`` in a rank's directory of the checkpoint."""
    return f"sg{index:05d}.safetensors"


class SavedTensorRef:
    """Stands for a tensor of the checkpoint's own files in a ``.pt`` DeepSpeed's save pickles: unpickled, it is
    :func:`saved_tensor` of the same arguments ([Note: what zero_to_fp32 reads]).

    Args:
        rank: the rank whose directory holds the file; file: its name there; name: the tensor in it;
        row: the row of a 2-D tensor (a sub-group's ``state``: 0 the fp32 master), or None for all of it.
    No path is kept: the files are found beside the ``.pt`` being loaded, so DeepSpeed's files are the same bytes
    wherever the tag was saved, and a tag moved or copied whole still reads.
    """

    def __init__(self, rank: int, file: str, name: str, row: int | None) -> None:
        self.args = (int(rank), str(file), str(name), row)

    def __reduce__(self):
        return saved_tensor, self.args


@contextlib.contextmanager
def placeholders():
    """Within it, an unpickled :class:`SavedTensorRef` is an empty tensor: for our own load, which reads the
    checkpoint's files itself and needs only the rest of DeepSpeed's ``.pt``."""
    before = getattr(_state, "placeholders", False)
    _state.placeholders = True
    try:
        yield
    finally:
        _state.placeholders = before


def _file_being_loaded() -> str | None:
    """The path ``torch.load`` was given, from its frame (the ``.pt`` whose unpickling calls us), if a path."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "load" and frame.f_globals.get("__name__") == "torch.serialization":
            f = frame.f_locals.get("f")
            if isinstance(f, (str, os.PathLike)):
                return os.fspath(f)
        frame = frame.f_back
    return None


def saved_tensor(rank: int, file: str, name: str, row: int | None) -> torch.Tensor:
    """Tensor ``name`` of ``<tag>/aidaptiv/rankNNNNN/<file>`` (its row ``row`` when given), mapped copy-on-write
    from the file (pages read as they are touched). ``<tag>`` is the directory of the ``.pt`` being unpickled, and
    only where that tag's manifest lists the ``.pt`` with its size and CRC32, so the files read are of the save
    that wrote it (not a tag saved over since).

    Raises:
        FileNotFoundError: the ``.pt`` was not loaded from a path, or its tag's own files of that save are not
            beside it (copied without its ``aidaptiv/`` directory, or saved over since): names it and the fix.
    """
    if getattr(_state, "placeholders", False):
        return torch.empty(0)
    loading = _file_being_loaded()
    tag = os.path.dirname(os.path.abspath(loading)) if loading else None
    path = os.path.join(tag, DIRNAME, rank_dirname(rank), file) if tag else None
    if path and os.path.isfile(path) and _lists(tag, os.path.abspath(loading)):
        return _map(path, name, row)
    raise FileNotFoundError(f"aidaptiv_ds: this DeepSpeed checkpoint file ({loading or 'not loaded from a path'}) "
                            f"refers to {name!r} in {os.path.join('<tag>', DIRNAME, rank_dirname(rank), file)} of "
                            f"the save that wrote it, not found beside it. Fix: load it from its tag directory, "
                            f"copied whole (with its {DIRNAME}/ directory), or convert the tag with `aidaptiv-ds "
                            f"export <tag dir> --output DIR`")


def _lists(tag: str, pt: str) -> bool:
    """The manifest under ``tag`` lists DeepSpeed's file ``pt`` (by name) with its size and CRC32: ``pt`` and the
    tag's files are of one save. The manifest is parsed once per version (a rank's ``.pt`` holds a reference per
    sub-group, moment and frozen tensor: thousands on a large model)."""
    try:
        manifest = os.path.join(tag, DIRNAME, MANIFEST)
        mst = os.stat(manifest)
        info = _deepspeed_files(manifest, mst.st_ino, mst.st_mtime_ns).get(os.path.basename(pt))
        st = os.stat(pt)
        return bool(info) and st.st_size == info["bytes"] and \
            info.get("crc32") in (None, _crc32(pt, st.st_ino, st.st_mtime_ns))
    except (OSError, ValueError, KeyError):
        return False


@functools.lru_cache(maxsize=16)
def _deepspeed_files(manifest: str, inode: int, mtime_ns: int) -> dict:
    """The ``deepspeed_files`` record of the manifest ``manifest`` (keyed by its inode and mtime: a tag saved over
    writes a new one)."""
    with open(manifest, encoding="utf-8") as f:
        return json.load(f).get("deepspeed_files") or {}


@functools.lru_cache(maxsize=256)
def _crc32(path: str, inode: int, mtime_ns: int) -> int:
    """CRC32 of the file ``path`` (DeepSpeed's ``.pt`` files of a tag are small: references, not tensors)."""
    return crc32_file(path)


def _map(path: str, name: str, row: int | None) -> torch.Tensor:
    st = os.stat(path)  # the file as it is now (a tag saved over replaces it)
    n, header = _header(path, st.st_ino, st.st_mtime_ns)
    e = header[name]
    dtype = _DTYPES[e["dtype"]]
    begin, end = e["data_offsets"]
    start = 8 + n + begin
    if start % dtype.itemsize:  # not aligned for a view of its dtype (a file of mixed dtypes): read a copy
        with open(path, "rb") as f:
            f.seek(start)
            t = torch.frombuffer(bytearray(f.read(end - begin)), dtype=dtype).reshape(e["shape"])
    else:
        t = _mapped(path, st.st_size, st.st_ino, st.st_mtime_ns)[start:start + end - begin].view(dtype) \
            .reshape(e["shape"])
    return t[row] if row is not None else t


@functools.lru_cache(maxsize=64)
def _header(path: str, inode: int, mtime_ns: int) -> tuple[int, dict]:
    """The safetensors header of ``path``: its length in bytes and the parsed JSON, once per file version."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


@functools.lru_cache(maxsize=64)
def _mapped(path: str, size: int, inode: int, mtime_ns: int) -> torch.Tensor:
    """``path`` mapped copy-on-write as uint8, once per file version (a rank's references share its mapping)."""
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
