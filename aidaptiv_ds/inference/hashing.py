"""Block hash chains: the key of a KV block is the hash of the whole token prefix up to its end.

As in vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``
hashes the parent block's hash with the block's token ids) and LMCache's chunk keys: block ``i``
covers tokens ``[i B, (i + 1) B)`` of a prompt and its key is

    h_0 = H(root || tokens of block 0),   h_i = H(h_{i-1} || tokens of block i)

so two prompts share block ``i`` only when they agree on every token before its end (the keys and
values of a token depend on all tokens before it), and the longest reusable prefix is found by
walking the chain from block 0 until a key is missing. ``root`` binds the chain to the cache's
fingerprint (model, dtype, tokenizer, layout), so blocks of another model can never match.
``H`` is BLAKE2b with a 16-byte digest (collision odds ~2^-64 at 2^32 blocks; hashlib, no dependency);
token ids enter as little-endian int64.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16


def chain_root(fingerprint_digest: str, block_tokens: int) -> bytes:
    """The parent hash of block 0: the cache fingerprint's digest and the block size."""
    return hashlib.blake2b(f"aidaptiv_ds.kv/1|{fingerprint_digest}|{int(block_tokens)}".encode(),
                           digest_size=DIGEST_BYTES).digest()


def block_hashes(token_ids: Sequence[int], block_tokens: int, root: bytes) -> list[str]:
    """Hex keys of the *full* blocks of ``token_ids`` (a trailing partial block has none).

    Args:
        token_ids: the prompt's token ids (a list, a 1-D tensor or array of integers).
        block_tokens: tokens per block.
        root: :func:`chain_root` of the cache.

    Returns:
        ``len(token_ids) // block_tokens`` hex strings; entry ``i`` keys tokens ``[0, (i + 1) B)``.
    """
    ids = np.asarray(token_ids, dtype="<i8").reshape(-1)
    out = []
    parent = root
    for i in range(len(ids) // block_tokens):
        h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
        h.update(ids[i * block_tokens:(i + 1) * block_tokens].tobytes())
        parent = h.digest()
        out.append(parent.hex())
    return out
