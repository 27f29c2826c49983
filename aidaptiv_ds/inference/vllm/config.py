"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked before anything is opened.

Every key is checked when vLLM builds the connector (at server start, in the worker and in the
scheduler); a bad one stops the start with :class:`~aidaptiv_ds.errors.AidaptivConfigError` naming
the key, the value and the fix, before the cache directory is touched. Unknown keys are refused too
(a typo would otherwise silently fall back to a default).

======================  ===========  ============================================================
key                     default      meaning
======================  ===========  ============================================================
``cache_paths``         (required)   directories on the cache drives (a list, or one string); the
                                     blocks are striped over all, the indexes live in the first
``capacity``            ``"auto"``   bytes of blocks on the drives (``"auto"``: a quarter of the
                                     free space at start plus what the cache holds); least recently
                                     used blocks go first past it
``dram_budget``         ``"1GiB"``   bytes of blocks kept in host memory in front of the drives
``block_tokens``        auto         tokens per stored block: a multiple of vLLM's block size
                                     (default: the smallest multiple >= 128; 128 on CPU, 8 x 16 on GPU)
``save_buffer``         ``"256MiB"`` most bytes of blocks copied out and waiting to be written; past
                                     it new blocks are skipped (counted), a request never waits
``threads``             4            I/O worker threads per drive
``direct``              true         ``O_DIRECT`` where the filesystem allows
``on_mismatch``         ``"error"``  a directory written for another model/dtype/layout: ``"error"``
                                     stops the start, ``"ignore"`` runs without the cache
``on_load_error``       ``"recompute"``  a block that fails its CRC or read: vLLM recomputes it
                                     (``"fail"``: the request fails); sets vLLM's
                                     ``kv_load_failure_policy``
``model_id``            none         extra identity for the fingerprint (e.g. a commit hash)
======================  ===========  ============================================================
"""
from __future__ import annotations

import dataclasses
import os

from ...errors import AidaptivConfigError
from ...units import parse_size

PREFIX = "kv_connector_extra_config"
KEYS = ("cache_paths", "capacity", "dram_budget", "block_tokens", "save_buffer", "threads", "direct", "on_mismatch",
        "on_load_error", "model_id")


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """The checked ``kv_connector_extra_config`` (see the module docstring for each field)."""
    cache_paths: tuple[str, ...]
    capacity: int | str = "auto"
    dram_budget: int = 1 << 30
    block_tokens: int | None = None
    save_buffer: int = 256 << 20
    threads: int = 4
    direct: bool = True
    on_mismatch: str = "error"
    on_load_error: str = "recompute"
    model_id: str | None = None

    def chunk_tokens(self, vllm_block_size: int) -> int:
        """Tokens per stored block for vLLM's block size ``vllm_block_size``.

        Raises:
            AidaptivConfigError: ``block_tokens`` is not a multiple of it.
        """
        bs = int(vllm_block_size)
        if self.block_tokens is None:
            return bs * max(1, -(-128 // bs))
        if self.block_tokens % bs:
            raise AidaptivConfigError(
                f"{PREFIX}.block_tokens: {self.block_tokens} is not a multiple of vLLM's block size {bs}. Fix: give a "
                f"multiple of {bs} (e.g. {bs * max(1, self.block_tokens // bs)}), or leave it out")
        return self.block_tokens


def _fail(key: str, value, why: str, fix: str) -> AidaptivConfigError:
    return AidaptivConfigError(f"{PREFIX}.{key}: {value!r} {why}. Fix: {fix}")


def parse(extra: dict | None) -> ConnectorConfig:
    """Check vLLM's ``kv_connector_extra_config`` and return the settings.

    Raises:
        AidaptivConfigError: naming the key, the value and the fix (a missing, unknown or bad key; a
            cache path that is missing, not a directory or not writable).
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise AidaptivConfigError(f"{PREFIX}: unknown key(s) {', '.join(map(repr, unknown))}. Fix: use only "
                                  f"{', '.join(KEYS)} (see aidaptiv_ds.inference.vllm.config)")
    if "cache_paths" not in extra:
        raise AidaptivConfigError(f"{PREFIX}.cache_paths: missing. Fix: name the directories on the cache drives, "
                                  f"e.g. \"cache_paths\": [\"/mnt/cache0/kv\"]")
    raw = extra["cache_paths"]
    paths = [raw] if isinstance(raw, str) else raw
    if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise _fail("cache_paths", raw, "is not a list of directories", "give e.g. [\"/mnt/cache0/kv\"]")
    for p in paths:
        if not os.path.isdir(p):
            raise _fail("cache_paths", p, "does not exist or is not a directory",
                        f"create it on the cache drive (mkdir -p {p}) or name another")
        if not os.access(p, os.W_OK | os.X_OK):
            raise _fail("cache_paths", p, "is not writable by this process", "give the server's user write access")
    if len({os.path.realpath(p) for p in paths}) != len(paths):
        raise _fail("cache_paths", raw, "names a directory twice", "list each directory once")
    out: dict = {"cache_paths": tuple(os.path.abspath(p) for p in paths)}
    cap = extra.get("capacity", "auto")
    if isinstance(cap, str) and cap.strip().lower() == "auto":
        out["capacity"] = "auto"
    else:
        out["capacity"] = _size(cap, "capacity", minimum=1)
    if "dram_budget" in extra:
        out["dram_budget"] = _size(extra["dram_budget"], "dram_budget", minimum=0)
    if "save_buffer" in extra:
        out["save_buffer"] = _size(extra["save_buffer"], "save_buffer", minimum=1)
    if extra.get("block_tokens") is not None:
        out["block_tokens"] = _whole(extra["block_tokens"], "block_tokens", "a multiple of vLLM's block size, "
                                     "e.g. 128")
    if "threads" in extra:
        out["threads"] = _whole(extra["threads"], "threads", "a whole number >= 1, e.g. 4")
    if "direct" in extra:
        if not isinstance(extra["direct"], bool):
            raise _fail("direct", extra["direct"], "is not true or false", "give true (O_DIRECT) or false")
        out["direct"] = extra["direct"]
    for key, choices in (("on_mismatch", ("error", "ignore")), ("on_load_error", ("recompute", "fail"))):
        if key in extra:
            if extra[key] not in choices:
                raise _fail(key, extra[key], f"is not one of {', '.join(choices)}", f"give {' or '.join(choices)}")
            out[key] = extra[key]
    if extra.get("model_id") is not None:
        if not isinstance(extra["model_id"], str) or not extra["model_id"]:
            raise _fail("model_id", extra["model_id"], "is not a non-empty string", "give e.g. the model's commit hash")
        out["model_id"] = extra["model_id"]
    return ConnectorConfig(**out)


def _size(value, key: str, minimum: int) -> int:
    try:
        n = parse_size(value, f"{PREFIX}.{key}")
    except AidaptivConfigError as e:
        raise AidaptivConfigError(f"{e}. Fix: give bytes or a size such as \"8GiB\"") from None
    if n < minimum:
        raise _fail(key, value, f"is below {minimum} bytes", "give a size such as \"8GiB\"")
    return n


def _whole(value, key: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(key, value, "is not a whole number >= 1", f"give {fix}")
    return value
