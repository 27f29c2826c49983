"""The aidaptiv_ds checkpoint layout: crash-safe, verified, in standard safetensors, readable anywhere.

A tag directory holds DeepSpeed's own files (model states, ZeRO states) and ours::

    <save_dir>/<tag>/*_model_states.pt, *_optim_states.pt    DeepSpeed's files (engine.save_checkpoint)
    <save_dir>/<tag>/aidaptiv/rank00000/sg00000.safetensors  one optimizer sub-group: tensor "state",
                                                             fp32 [slots, numel] = master, exp_avg, ...
    <save_dir>/<tag>/aidaptiv/rank00000/frozen.safetensors  partitions of frozen parameters (if any)
    <save_dir>/<tag>/aidaptiv/rank00000/rank.json           this rank's index, written after its files
    <save_dir>/<tag>/aidaptiv/MANIFEST.json                 written last, by rank 0, once every rank is done

**Verified.** The manifest lists every file of the tag -- ours and DeepSpeed's -- with its size and
CRC32; ``rank.json`` and the manifest carry a CRC32 of their own content (``self_crc32``,
:func:`aidaptiv_ds.io.atomic.dumps_checked`). A tag without a manifest, or any of whose files is
missing, of another size or another CRC32, is *incomplete*: named as such and never loaded.

**All or nothing, also over an existing tag.** A save never writes into ``<save_dir>/<tag>``. The
whole new tag -- DeepSpeed's files included -- is written into ``<save_dir>/.aidaptiv-staging/<tag>``
(every file under a temporary name, checked, fsynced, renamed; :mod:`aidaptiv_ds.io.atomic`), the
manifest last, and only then is it switched into place (:func:`publish`):

* a new tag: one ``rename`` of the complete directory;
* an existing tag: ``renameat2(RENAME_EXCHANGE)`` swaps the old and the new directory atomically
  (the old one is then deleted); where the filesystem cannot exchange, the old directory is first
  renamed to ``<save_dir>/.aidaptiv-retired/<tag>`` and the new one renamed into place; a crash
  between the two renames leaves both complete copies, and :func:`locate_tag` finds the new one;

and only then is ``latest`` replaced. So a ``kill -9`` (or a power cut: every rename is followed by
a directory fsync) at any moment of a save leaves ``<save_dir>/<tag>`` with either the complete old
or the complete new checkpoint, and ``latest`` naming a complete one. Leftovers of an interrupted
save (a partial staging directory, a retired copy) are finished or removed by the next save
(:func:`recover`).

Each ``rank.json`` records, per sub-group, its parameters (name, partition numel, offset in the
sub-group, full numel and shape), so state can be re-partitioned for another world size and
consolidated into whole tensors (:mod:`aidaptiv_ds.checkpoint.reader`).

**Node-local parts (layout 3).** Where the ranks do not all see one ``save_dir`` (DeepSpeed's
``checkpoint.use_node_local_storage``, or a save directory on each node's own disk), each directory
holds the *part* of the tag written by the ranks that see it: their DeepSpeed files, their
``rankNNNNN`` directories and a manifest that lists only those ranks (``"part"``: index, count,
ranks, host), and, once the save is committed on every node, ``aidaptiv/COMMIT.json``: one record
naming every part with its manifest's CRC32. The protocol and how a load checks it are in
:mod:`aidaptiv_ds.checkpoint.parts`.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import zlib

from ..errors import AidaptivError
from ..io.atomic import SELF_CRC, ChecksumMismatch, atomic_write, exchange, fsync_dir, loads_checked, \
    read_json_checked, write_json  # noqa: F401 - atomic_write, write_json: re-exported for the writer
from ..io.errors import FileWriteError

LAYOUT_VERSION = 2  # 2: DeepSpeed's files in the manifest, self-CRC of manifest and rank.json
PARTS_VERSION = 3  # 3: a node-local part: the manifest lists some ranks ("part"), COMMIT.json beside it
DIRNAME = "aidaptiv"
MANIFEST = "MANIFEST.json"
COMMIT = "COMMIT.json"  # <tag>/aidaptiv/COMMIT.json: the commit record of a save in node-local parts
RANK_INDEX = "rank.json"
STAGING = ".aidaptiv-staging"  # <save_dir>/STAGING/<tag>: a save being written
RETIRED = ".aidaptiv-retired"  # <save_dir>/RETIRED/<tag>: the old copy during a two-rename switch
ALIGN = 4096

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int8": "I8",
              "uint8": "U8", "int32": "I32", "int64": "I64"}


class IncompleteCheckpointError(AidaptivError, RuntimeError):
    """A checkpoint whose save did not finish (no manifest, or files missing or damaged)."""


class ForeignCheckpointError(IncompleteCheckpointError):
    """A complete checkpoint of DeepSpeed's own offload (no ``aidaptiv/`` directory): not damaged, not ours to load;
    no other tag is offered in its place."""


#: the weights HF Trainer saves beside a ``global_step*`` tag in its ``checkpoint-N`` directory
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
                   "pytorch_model.bin", "pytorch_model.bin.index.json")


def rank_dirname(rank: int) -> str:
    return f"rank{rank:05d}"


def split_into_shards(items: list, nbytes, shard_bytes: int) -> list[list]:
    """``items`` in order, in consecutive groups of at most ``shard_bytes`` bytes (``nbytes(item)``
    each; an item larger than ``shard_bytes`` is a group of its own): the files of an HF model
    directory of several ``model-0000k-of-0000n.safetensors``."""
    shards: list[list] = []
    cur: list = []
    size = 0
    for it in items:
        n = nbytes(it)
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += n
    if cur:
        shards.append(cur)
    return shards


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


def crc32_file(path: str, chunk: int = 8 << 20, fsync: bool = False) -> int:
    """CRC32 of the whole file ``path`` (read in ``chunk``-byte pieces); with ``fsync``, also make its
    bytes durable first (for files another library wrote without fsync, e.g. DeepSpeed's ``torch.save``)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        if fsync:
            os.fsync(f.fileno())
        while True:
            b = f.read(chunk)
            if not b:
                return crc
            crc = zlib.crc32(b, crc)


def tag_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, str(tag))


def staging_root(save_dir: str) -> str:
    """``<save_dir>/.aidaptiv-staging``: the ``save_dir`` DeepSpeed's own save writes into."""
    return os.path.join(save_dir, STAGING)


def staging_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, STAGING, str(tag))


def retired_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, RETIRED, str(tag))


def _damaged(tag_path: str, what: str) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(f"aidaptiv_ds: checkpoint {tag_path} is damaged: {what}. It will not be loaded.")


def read_rank_index(tag_path: str, rank: int, version: int = LAYOUT_VERSION) -> dict:
    """Rank ``rank``'s ``rank.json`` of a tag directory, its self-CRC verified (layout 2).

    Raises:
        IncompleteCheckpointError: missing, not JSON, or changed since it was written.
    """
    path = os.path.join(tag_path, DIRNAME, rank_dirname(rank), RANK_INDEX)
    try:
        return read_json_checked(path, required=version >= 2)
    except FileNotFoundError:
        raise _damaged(tag_path, f"{path} is missing") from None
    except ChecksumMismatch as e:
        raise _damaged(tag_path, str(e)) from None


def manifest_ranks(man: dict) -> list[int]:
    """The ranks whose state a manifest's directory holds: all ``world_size`` of them, or, in a
    node-local part (layout 3), the part's ``ranks``."""
    part = man.get("part")
    return [int(r) for r in part["ranks"]] if part else list(range(int(man["world_size"])))


def read_manifest(tag_path: str, verify_crc: bool = False) -> dict:
    """The manifest of a checkpoint tag directory, after checking that every file it lists is intact.

    Always checked: the manifest's own CRC, each ``rank.json``'s CRC, and the size of every file it
    lists (ours and DeepSpeed's). With ``verify_crc``: also the CRC32 of every file's bytes. A
    node-local part (layout 3) is checked for the ranks it holds (:func:`manifest_ranks`).

    Raises:
        IncompleteCheckpointError: naming the checkpoint and what is missing or damaged.
    """
    base = os.path.join(tag_path, DIRNAME)
    path = os.path.join(base, MANIFEST)
    if not os.path.isfile(path):
        have = sorted(os.listdir(base)) if os.path.isdir(base) else []
        if not os.path.isdir(base) and glob.glob(os.path.join(glob.escape(tag_path), "*_model_states.pt")):
            save_dir = os.path.dirname(os.path.abspath(tag_path))
            hf = [f for f in HF_WEIGHT_FILES if os.path.isfile(os.path.join(save_dir, f))]
            weights = (f"`from_pretrained({save_dir!r})` (HF Trainer saved its weights there: {hf[0]}) before "
                       f"deepspeed.initialize / the Trainer, without resume_from_checkpoint" if hf else
                       f"`python {os.path.join(save_dir, 'zero_to_fp32.py')} {save_dir} OUT_DIR` and load "
                       f"OUT_DIR/pytorch_model.bin into the model before deepspeed.initialize")
            raise ForeignCheckpointError(
                f"aidaptiv_ds: checkpoint {tag_path} was saved by DeepSpeed's own ZeRO offload (its files, no "
                f"{DIRNAME}/ directory), not by aidaptiv_ds; it is complete, but an engine on aidaptiv_ds loads only "
                f"its own checkpoints (and DeepSpeed's NVMe offload saves no optimizer state to resume from). Fix: "
                f"resume it with the configuration that saved it, or start from its weights (a new optimizer "
                f"state): {weights}.")
        raise IncompleteCheckpointError(
            f"aidaptiv_ds: checkpoint {tag_path} is incomplete: {path} is missing (the save did not finish; found "
            f"{have or 'no aidaptiv files'}). It will not be loaded.")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        man = loads_checked(raw, path, required=False)
    except ChecksumMismatch as e:
        raise _damaged(tag_path, str(e)) from None
    version = int(man.get("version", 1))
    if version >= 2 and SELF_CRC not in json.loads(raw):
        raise _damaged(tag_path, f"{path} has no {SELF_CRC}")
    groups = [(base, man.get("files", {})), (tag_path, man.get("deepspeed_files", {}))]
    for root, files in groups:
        for rel, info in files.items():
            p = os.path.join(root, rel)
            if not os.path.isfile(p) or os.path.getsize(p) != info["bytes"]:
                got = f"{os.path.getsize(p)} bytes" if os.path.isfile(p) else "no such file"
                raise _damaged(tag_path, f"{p} should hold {info['bytes']} bytes, found {got}")
            metadata = rel.endswith("/" + RANK_INDEX)
            if (verify_crc or metadata) and info.get("crc32") is not None and crc32_file(p) != info["crc32"]:
                raise _damaged(tag_path, f"the CRC32 of {p} does not match the manifest")
    for r in manifest_ranks(man):
        read_rank_index(tag_path, r, version)
    return man


def list_tags(save_dir: str) -> list[str]:
    """Names of the tag directories under ``save_dir`` (not our staging/retired directories)."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(t for t in os.listdir(save_dir) if not t.startswith(".aidaptiv-") and
                  os.path.isdir(os.path.join(save_dir, t, DIRNAME)))


def complete_tags(save_dir: str, exclude=()) -> list[str]:
    """Tags under ``save_dir`` with a complete aidaptiv checkpoint, oldest first (by manifest time),
    leaving out ``exclude`` (e.g. a tag just refused). Checked: manifests, ``rank.json`` files and
    every file's size (:func:`read_manifest` without the data CRCs, which the load verifies)."""
    out = []
    for t in list_tags(save_dir):
        if t in exclude:
            continue
        try:
            man = read_manifest(os.path.join(save_dir, t))
        except (IncompleteCheckpointError, OSError, ValueError, KeyError):
            continue
        out.append((man.get("created", 0), t))
    return [t for _, t in sorted(out)]


def is_complete(tag_path: str) -> bool:
    try:
        read_manifest(tag_path)
        return True
    except (IncompleteCheckpointError, OSError, ValueError, KeyError):
        return False


def locate_tag(save_dir: str, tag: str) -> str:
    """The directory that holds checkpoint ``tag`` of ``save_dir``: ``<save_dir>/<tag>``, except in
    the moment of a two-rename switch (:func:`publish`) interrupted by a crash, when it is missing:
    then the complete new copy in the staging directory, else the complete old one set aside.
    Read-only (the next save moves it back into place, :func:`recover`)."""
    final = tag_dir(save_dir, tag)
    if os.path.isdir(final):
        return final
    for cand in (staging_dir(save_dir, tag), retired_dir(save_dir, tag)):
        if is_complete(cand):
            return cand
    return final


# ---------------------------------------------------------------------------------------------- switching
def _rmtree(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)


def publish(save_dir: str, tag: str, kill_point=lambda name: None, keep_old: bool = False) -> str:
    """Put the complete staging directory of ``tag`` at ``<save_dir>/<tag>`` (see module docstring).

    Args:
        keep_old: leave an existing ``<save_dir>/<tag>`` set aside at
            ``<save_dir>/.aidaptiv-retired/<tag>`` instead of deleting it (a node-local part: the
            old part stays until the new save is committed on every node,
            :mod:`aidaptiv_ds.checkpoint.parts`).

    Returns:
        How: ``"new"`` (rename), ``"exchanged"`` (atomic swap with the old tag), ``"two renames"``,
        or ``"old set aside"`` (``keep_old``).

    Raises:
        FileWriteError: a rename or directory fsync failed, naming the paths (the old tag is intact
            or set aside complete; :func:`locate_tag` finds a complete copy either way).
    """
    src, dst = staging_dir(save_dir, tag), tag_dir(save_dir, tag)
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    if not os.path.lexists(dst):
        _rename(src, dst)
        fsync_dir(parent)
        fsync_dir(os.path.dirname(os.path.abspath(src)))
        kill_point("after_switch")
        return "new"
    if keep_old:
        _set_aside_and_rename(save_dir, tag, kill_point)
        return "old set aside"
    if exchange(src, dst):  # now src holds the old tag
        fsync_dir(parent)
        fsync_dir(os.path.dirname(os.path.abspath(src)))
        kill_point("after_switch")
        _rmtree(src)
        return "exchanged"
    _rmtree(_set_aside_and_rename(save_dir, tag, kill_point))
    return "two renames"


def _set_aside_and_rename(save_dir: str, tag: str, kill_point) -> str:
    """Move the old ``<save_dir>/<tag>`` to its retired directory, then the staging one into its place,
    each rename made durable before the next (kill points ``mid_switch``, ``after_switch``). Returns
    the retired directory."""
    src, dst = staging_dir(save_dir, tag), tag_dir(save_dir, tag)
    parent = os.path.dirname(os.path.abspath(dst))
    old = retired_dir(save_dir, tag)
    os.makedirs(os.path.dirname(old), exist_ok=True)
    _rmtree(old)
    _rename(dst, old)
    fsync_dir(os.path.dirname(old))
    fsync_dir(parent)
    kill_point("mid_switch")
    _rename(src, dst)
    fsync_dir(parent)
    kill_point("after_switch")
    return old


def _rename(a: str, b: str) -> None:
    try:
        os.rename(a, b)
    except OSError as e:
        raise FileWriteError(f"{a} -> {b}", 0, None, e.errno, step="renaming the checkpoint directory") from e


def recover(save_dir: str) -> list[str]:
    """Finish or undo what interrupted saves left in ``save_dir`` (rank 0, before a save).

    For each staged or retired tag: when ``<save_dir>/<tag>`` is missing (a two-rename switch was
    cut between its renames) the complete copy is moved back into place, the new one first; other
    leftovers (partial staging directories, old copies of tags now in place) are deleted.
    Returns what was done, one line per directory.
    """
    done = []
    for root in (STAGING, RETIRED):
        base = os.path.join(save_dir, root)
        if not os.path.isdir(base):
            continue
        for name in sorted(os.listdir(base)):
            cand = os.path.join(base, name)
            if not os.path.isdir(cand):
                continue  # DeepSpeed's recovery scripts: publish() moves them
            final = tag_dir(save_dir, name)
            if not os.path.isdir(final) and is_complete(cand):
                _rename(cand, final)
                fsync_dir(save_dir)
                done.append(f"restored {final} from {cand}")
            else:
                _rmtree(cand)
                done.append(f"removed {cand}")
    return done


def adopt_root_files(save_dir: str) -> list[str]:
    """Move the files DeepSpeed's save put beside the staged tag (its ``zero_to_fp32.py`` recovery
    scripts, which it writes into the ``save_dir`` it is given) to ``save_dir``, where DeepSpeed
    puts them. Returns the paths moved."""
    base, moved = staging_root(save_dir), []
    if not os.path.isdir(base):
        return moved
    for name in sorted(os.listdir(base)):
        src = os.path.join(base, name)
        if os.path.isfile(src):
            os.replace(src, os.path.join(save_dir, name))
            moved.append(os.path.join(save_dir, name))
    if moved:
        fsync_dir(save_dir)
    return moved


def offer_complete(save_dir: str, refused: str) -> str:
    """The fix part of an error about a refused tag: the *other* complete tags (oldest first) and
    how to load the newest, or that there is none."""
    good = complete_tags(save_dir, exclude={str(refused)})
    if not good:
        return (f"There is no other complete checkpoint in {save_dir}. Fix: start without loading it, or restore "
                f"{tag_dir(save_dir, refused)} from a copy.")
    return (f"Complete checkpoints in {save_dir} (oldest first): {good}. Fix: load one of them, e.g. "
            f"engine.load_checkpoint({save_dir!r}, tag={good[-1]!r}), and delete or repair "
            f"{tag_dir(save_dir, refused)}.")
