"""What a vLLM server's KV blocks are bound to: the model's files, the KV dtype, the block keys.

The connector has no handle on the loaded weights, so the model part of the fingerprint
(:class:`~aidaptiv_ds.inference.fingerprint.Fingerprint`) comes from the checkpoint on disk, as
:func:`~aidaptiv_ds.inference.fingerprint.model_digest` samples the weights of a module: BLAKE2b of
the config (without bookkeeping keys), then per weight file (``*.safetensors``, ``*.bin``, ``*.pt``,
``*.gguf``, sorted by name) its name, size and 64 x 64 bytes at evenly spaced offsets (plus its
first 64 KiB, which hold a safetensors header: every tensor's name, dtype, shape and place). A
fine-tune changes the sampled bytes; reading whole files would cost a pass over the checkpoint at
every start. The revision, the quantization and ``model_id`` are hashed in when set.

The keys (the ``tokenizer`` field, which for :class:`~aidaptiv_ds.inference.PrefixKVCache` binds the
text-to-ids mapping) are vLLM's block hashes: the hash function and the seed of the chain's root
(``NONE_HASH``, ``vllm/v1/core/kv_cache_utils.py``) decide them. A non-cryptographic hash without
``PYTHONHASHSEED`` gets a random root per process, so nothing written would ever be found again:
:func:`key_scheme` refuses that at start.
"""
from __future__ import annotations

import hashlib
import json
import os

from ...errors import AidaptivConfigError
from ..fingerprint import _VOLATILE, Fingerprint

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
HEAD_BYTES = 64 << 10
SAMPLES = 64
SAMPLE_BYTES = 64
NON_CRYPTO = ("xxhash", "xxhash_cbor")


def model_files_digest(model_dir: str, extra: str = "") -> str:
    """Digest of the checkpoint in ``model_dir`` (see the module docstring).

    Raises:
        FileNotFoundError: ``model_dir`` holds no weight file.
    """
    h = hashlib.blake2b(digest_size=16)
    cfg_path = os.path.join(model_dir, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE and not k.startswith("_")}
        h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    files = sorted(n for n in os.listdir(model_dir) if n.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no weight file ({', '.join(WEIGHT_SUFFIXES)})")
    for name in files:
        p = os.path.join(model_dir, name)
        size = os.path.getsize(p)
        h.update(f"|{name}|{size}|".encode())
        with open(p, "rb") as f:
            h.update(f.read(HEAD_BYTES))
            for i in range(SAMPLES):
                f.seek(max(size - SAMPLE_BYTES, 0) * i // max(SAMPLES - 1, 1))
                h.update(f.read(SAMPLE_BYTES))
    if extra:
        h.update(b"|" + extra.encode())
    return h.hexdigest()


def resolve_model_dir(model: str, revision: str | None = None) -> str | None:
    """The local directory of ``model`` (a path, or a hub id already in the local HF cache), else None."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache, no hub library: the caller falls back
        return None


def key_scheme(hash_algo: str, block_size: int) -> tuple[str, str]:
    """``(digest, description)`` of vLLM's block keys for ``hash_algo`` (``prefix_caching_hash_algo``).

    Raises:
        AidaptivConfigError: a non-cryptographic hash without ``PYTHONHASHSEED`` (keys differ in every
            process, so a restart would find nothing).
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if hash_algo in NON_CRYPTO and seed is None:
        raise AidaptivConfigError(
            f"--prefix-caching-hash-algo {hash_algo}: without PYTHONHASHSEED vLLM seeds these block hashes at random in "
            f"every process, so the KV blocks the AidaptivConnector stores would never be found after a restart. Fix: "
            f"use sha256 (the default) or sha256_cbor, or set PYTHONHASHSEED to the same value for every start")
    root = seed if seed is not None else "vllm-none-hash"
    d = hashlib.blake2b(f"vllm-block-hash|{hash_algo}|{root}|{int(block_size)}".encode(), digest_size=16).hexdigest()
    return d, f"vLLM block hashes ({hash_algo}, {block_size}-token blocks)"


def vllm_fingerprint(model: str, revision: str | None, dtype: str, hash_algo: str, block_size: int,
                     quantization: str | None = None, model_id: str | None = None) -> Fingerprint:
    """The :class:`Fingerprint` of a vLLM server's KV blocks.

    Args:
        model: ``--model`` (a directory or a hub id); revision: its revision.
        dtype: the KV cache dtype name (``"bfloat16"``...); hash_algo, block_size: vLLM's prefix-caching
            hash and block size (the keys are hashes of whole vLLM blocks).
        quantization: ``--quantization`` when set; model_id: an extra identity (config ``model_id``).

    Raises:
        AidaptivConfigError: see :func:`key_scheme`; or the model's files cannot be found and no
            ``model_id`` stands in for them.
    """
    keys, keys_desc = key_scheme(hash_algo, block_size)
    extra = "|".join(str(x) for x in (revision, quantization, model_id) if x)
    where = resolve_model_dir(model, revision)
    if where is None:
        if not model_id:
            raise AidaptivConfigError(
                f"AidaptivConnector: the files of model {model!r} are not on this machine, so the KV cache cannot be "
                f"bound to its weights. Fix: give kv_connector_extra_config.model_id (e.g. the model's commit hash), "
                f"or serve a local directory")
        digest = hashlib.blake2b(f"{model}|{extra}".encode(), digest_size=16).hexdigest()
    else:
        digest = model_files_digest(where, extra)
    return Fingerprint(digest, dtype, keys, model_name=model, tokenizer_class=keys_desc)
