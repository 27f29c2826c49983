"""Inference from the cache drives: a prefix KV cache that cuts time-to-first-token.

:class:`PrefixKVCache` keeps the keys and values of prompts it has seen, per token block (all
layers of ``block_tokens`` tokens in one extent) and keyed by the hash of the token prefix up to the
block's end (block hash chains, as vLLM's automatic prefix caching and LMCache do), in an
aidaptiv_ds slab store on a cache drive with the DRAM tier in front. A later prompt that shares a
prefix loads those blocks instead of recomputing them and runs the prefill only on the rest. The
cache survives a restart of the process; a directory written for another model, dtype or tokenizer
is refused (or ignored), and a block that fails its checksum is recomputed, never used.

Modules: :mod:`.layout` (what a block holds), :mod:`.hashing` (block keys), :mod:`.fingerprint`
(what a directory is bound to), :mod:`.block_store` (blocks on the store and the DRAM tier: budgets,
eviction, index, checksums), :mod:`.prefix_cache` (HF ``generate``). ZeRO-Inference (the weights on
the cache drives) is :mod:`aidaptiv_ds.integration.inference`; both combine.
"""
from .block_store import KVBlockStore, KVCacheMismatchError, KVCacheWarning, KVStats
from .fingerprint import Fingerprint, fingerprint
from .layout import KVLayout
from .prefix_cache import PrefixGeneration, PrefixHit, PrefixKVCache

__all__ = ["Fingerprint", "KVBlockStore", "KVCacheMismatchError", "KVCacheWarning", "KVLayout", "KVStats",
           "PrefixGeneration", "PrefixHit", "PrefixKVCache", "fingerprint"]
