"""The prefix KV cache for HF ``generate``: reuse the keys and values of a prompt prefix seen before.

A thin wrapper around ``model.generate`` (rather than a ``Cache`` subclass: transformers' own
``DynamicCache`` already accepts pre-filled layers, and ``generate`` then runs the prefill only on
the tokens after them, ``GenerationMixin._cache_dependant_input_preparation``)::

    with PrefixKVCache("/mnt/cache0/kv", model, tokenizer) as kv:
        out = kv.generate(model, input_ids, max_new_tokens=64)    # greedy unless you say otherwise
        out.sequences, out.ttft_s, out.kv_source, out.prefix_tokens_reused

1. **lookup**: the prompt's full blocks are hashed as a chain (:mod:`.hashing`); the longest chain
   prefix in the store is loaded (DRAM tier first, else one read per block from the drive, all in
   flight at once, each checked against its CRC32) into a ``DynamicCache``. At least one prompt
   token is always left to compute (``generate`` needs its logits), so at most
   ``floor((n - 1) / B)`` blocks are reused for an ``n``-token prompt.
2. **generate** runs on the whole prompt with that cache; its prefill covers only the rest.
3. **commit**: the prompt's full blocks that were not reused are taken from the cache ``generate``
   filled (tokens ``[0, n)`` of every layer are the prompt's) and written (:meth:`KVBlockStore.put`).
   Generated tokens are not cached.

Output equality: the reused keys and values are the bytes the same model computed for the same
token prefix in the same dtype, so greedy decoding picks the same tokens as without the cache (the
tests check it token for token); the logits of the computed suffix may differ in the last bits,
since the prefill kernels see a shorter query (the same holds for vLLM's and LMCache's reuse).

TTFT (``ttft_s``): wall time from the call to the first generated token (lookup and loads included).
Batch size 1 (one prompt per call), decoder-only models with full attention in every layer.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .block_store import KVBlockStore
from .fingerprint import Fingerprint, fingerprint
from .hashing import block_hashes, chain_root
from .layout import KVLayout


def _cache_kwarg() -> str:
    """``generate``'s keyword for a cache object: ``cache`` from transformers 5.x on (``past_key_values``
    is deprecated there), ``past_key_values`` before."""
    import dataclasses as dc

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return "cache" if "cache" in {f.name for f in dc.fields(GenerateDecoderOnlyOutput)} else "past_key_values"


def _new_cache(config, kv=None):
    """A ``DynamicCache`` for ``config``, holding ``kv`` (per layer ``(keys, values)``) when given.

    The layers take the tensors as they are (``DynamicLayer.lazy_initialization`` then its ``keys`` /
    ``values``, the attributes transformers documents as ``cache.layers[i].keys``): filling through
    ``DynamicCache(kv)`` would copy every layer once more (``update`` concatenates onto an empty
    tensor), 94 MB for a 2,048-token SmolLM2-135M prefix in fp32. Falls back to that where a layer
    does not have this shape of API.
    """
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    if kv is None:
        return cache
    layers = getattr(cache, "layers", None)
    if layers is not None and len(layers) == len(kv) and all(hasattr(layer, "lazy_initialization") for layer in layers):
        for layer, (k, v) in zip(layers, kv):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        if cache.get_seq_length() == kv[0][0].shape[-2]:
            return cache
    try:
        return DynamicCache(kv, config=config)
    except TypeError:
        return DynamicCache(kv)


def _layers_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RuntimeError("KV cache: this transformers version's Cache has no .layers (needs transformers >= 4.56)")
    return [(layer.keys, layer.values) for layer in layers]


def prompt_ids(input_ids) -> torch.Tensor:
    """``input_ids`` (a list of ints, a 1-D tensor or a ``[1, n]`` tensor) as a ``[1, n]`` int64 tensor.

    Raises:
        ValueError: a batch of more than one prompt, or an empty prompt.
    """
    t = torch.as_tensor(input_ids, dtype=torch.long)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[0] != 1:
        raise ValueError(f"PrefixKVCache: input_ids of shape {tuple(t.shape)}; one prompt at a time (batch 1). Fix: "
                         f"call it once per prompt")
    if t.shape[1] == 0:
        raise ValueError("PrefixKVCache: the prompt is empty")
    return t


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The floating-point dtype of ``model``'s parameters (the dtype its keys and values are computed in)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


@dataclasses.dataclass
class PrefixHit:
    """What :meth:`PrefixKVCache.lookup` found for one prompt.

    Attributes:
        cache: a ``DynamicCache`` holding the reused tokens (None when nothing was reused).
        tokens: prompt tokens reused (a multiple of the block size).
        source: ``"computed"`` (nothing reused), ``"dram"`` (every block from DRAM) or ``"drive"``
            (at least one block read from the drive).
        hashes: keys of the prompt's full blocks; blocks_reused: how many of them were loaded.
        load_s: seconds spent finding, reading and assembling the blocks.
    """
    cache: object | None
    tokens: int
    source: str
    hashes: list[str]
    blocks_reused: int
    load_s: float


@dataclasses.dataclass
class PrefixGeneration:
    """One :meth:`PrefixKVCache.generate` call.

    Attributes:
        sequences: ``[1, n + new]`` prompt and generated ids; output_ids: the generated ids.
        ttft_s: seconds from the call to the first generated token; total_s: to the end of commit.
        kv_source, prefix_tokens_reused, load_s: from the :class:`PrefixHit`.
        blocks_written: blocks of this prompt stored by the commit.
        output: what ``generate`` returned.
    """
    sequences: torch.Tensor
    output_ids: list[int]
    ttft_s: float
    total_s: float
    kv_source: str
    prefix_tokens_reused: int
    load_s: float
    blocks_written: int
    output: object = None


class FirstTokenClock:
    """A ``generate`` streamer recording when the first generated token arrives (the first ``put``
    is the prompt); forwards every call to ``inner`` when given."""

    def __init__(self, inner=None) -> None:
        self.inner = inner
        self.first: float | None = None
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen and self.first is None:
            self.first = time.perf_counter()
        self._prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


class PrefixKVCache:
    """A prefix KV cache on a cache drive for one model (see the module docstring).

    Args:
        path: the cache directory (on the cache drive).
        model: the causal LM (``PreTrainedModel``; ZeRO-3 partitioned models work too).
        tokenizer: its tokenizer (part of the fingerprint; None if you pass token ids only).
        block_tokens: tokens per block (default 64: a 2,048-token context is 32 blocks, and at most
            63 tokens of a shared prefix are recomputed).
        capacity, dram_budget, on_mismatch, threads, direct: see :class:`KVBlockStore`.
        dtype: the KV dtype (default: the model's parameter dtype).
        model_id: an extra identity for the fingerprint (e.g. a checkpoint hash).

    Raises:
        KVCacheMismatchError: the directory belongs to another model, dtype, tokenizer or layout.
        StoreInUseError: another process has it open. ValueError: the model is not supported.
    """

    def __init__(self, path: str, model: torch.nn.Module, tokenizer=None, *, block_tokens: int = 64,
                 capacity="auto", dram_budget="1GiB", dtype: torch.dtype | None = None, model_id: str | None = None,
                 on_mismatch: str = "error", threads: int = 4, direct: bool = True) -> None:
        dtype = dtype or model_dtype(model)
        self.config = model.config
        self.layout = KVLayout.from_model_config(model.config, dtype, block_tokens)
        reader = None
        if any(getattr(p, "ds_id", None) is not None for p in model.parameters()):
            from ..integration.inference import full_parameter
            reader = full_parameter
        self.fingerprint: Fingerprint = fingerprint(model, tokenizer, dtype, model_id, reader)
        self.root = chain_root(self.fingerprint.digest(), self.layout.block_tokens)
        self.store = KVBlockStore(path, self.fingerprint, self.layout, capacity=capacity, dram_budget=dram_budget,
                                  on_mismatch=on_mismatch, threads=threads, direct=direct)
        self._cache_kw = _cache_kwarg()
        from ..telemetry import counters
        self._provider = f"aidaptiv_ds.kv_cache.{id(self)}"
        counters.register_provider(self._provider, self._counters)

    @property
    def enabled(self) -> bool:
        """False when the directory was ignored (``on_mismatch="ignore"``): every lookup misses."""
        return self.store.enabled

    def _counters(self) -> dict:
        st = self.store.stats()
        return {"bytes_read": {"kv_cache": st.bytes_read}, "bytes_written": {"kv_cache": st.bytes_written},
                "dram_bytes": st.dram_bytes}

    # ------------------------------------------------------------------ lookup / commit
    def lookup(self, input_ids) -> PrefixHit:
        """Load the longest cached block prefix of the prompt (see the module docstring)."""
        t0 = time.perf_counter()
        ids = prompt_ids(input_ids)[0]
        B = self.layout.block_tokens
        hashes = block_hashes(ids.tolist(), B, self.root)
        usable = (ids.numel() - 1) // B
        loaded = self.store.load(self.store.longest_prefix(hashes[:usable]))
        if not loaded:
            return PrefixHit(None, 0, "computed", hashes, 0, time.perf_counter() - t0)
        try:
            n = len(loaded) * B
            L, H, D = self.layout.layers, self.layout.kv_heads, self.layout.head_dim
            kv = [(torch.empty(1, H, n, D, dtype=self.layout.torch_dtype),
                   torch.empty(1, H, n, D, dtype=self.layout.torch_dtype)) for _ in range(L)]
            for i, b in enumerate(loaded):
                for (k, v), (bk, bv) in zip(kv, self.layout.views(b.payload)):
                    k[0, :, i * B:(i + 1) * B, :].copy_(bk)
                    v[0, :, i * B:(i + 1) * B, :].copy_(bv)
            source = "drive" if any(b.source == "drive" for b in loaded) else "dram"
        finally:
            self.store.release(loaded)
        return PrefixHit(_new_cache(self.config, kv), n, source, hashes, len(loaded), time.perf_counter() - t0)

    def commit(self, hit: PrefixHit, cache) -> int:
        """Store the prompt's full blocks after the reused ones, from ``cache`` (the cache ``generate``
        filled for this prompt; its first tokens are the prompt's). Returns the blocks written."""
        if not self.store.enabled or hit.blocks_reused >= len(hit.hashes):
            return 0
        kv = _layers_kv(cache)
        B = self.layout.block_tokens
        chain = [(hit.hashes[i], hit.hashes[i - 1] if i else None, i) for i in range(hit.blocks_reused, len(hit.hashes))]
        return self.store.put(chain, lambda depth, payload: self.layout.pack(payload, kv, depth * B))

    # ------------------------------------------------------------------ generate
    def generate(self, model, input_ids, **generate_kwargs) -> PrefixGeneration:
        """``model.generate`` on one prompt with its cached prefix; greedy unless ``generate_kwargs``
        say otherwise (``do_sample`` ...). Returns a :class:`PrefixGeneration`.

        Raises:
            ValueError: a batch, a padded ``attention_mask``, or a cache passed by the caller.
        """
        t0 = time.perf_counter()
        ids = prompt_ids(input_ids)
        mask = generate_kwargs.pop("attention_mask", None)
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise ValueError("PrefixKVCache.generate: the attention_mask masks tokens; padded prompts are not supported "
                             "(one unpadded prompt per call)")
        for k in ("cache", "past_key_values"):
            if generate_kwargs.get(k) is not None:
                raise ValueError(f"PrefixKVCache.generate: {k}= is managed by the prefix cache; do not pass one")
            generate_kwargs.pop(k, None)
        generate_kwargs.setdefault("do_sample", False)
        hit = self.lookup(ids)
        cache = hit.cache if hit.cache is not None else _new_cache(self.config)
        clock = FirstTokenClock(generate_kwargs.pop("streamer", None))
        ids_dev = ids.to(getattr(model, "device", "cpu"))
        with torch.no_grad():
            out = model.generate(ids_dev, attention_mask=torch.ones_like(ids_dev), streamer=clock,
                                 return_dict_in_generate=True, use_cache=True, **{self._cache_kw: cache},
                                 **generate_kwargs)
        ttft = (clock.first if clock.first is not None else time.perf_counter()) - t0
        seqs = out.sequences if hasattr(out, "sequences") else out
        final = getattr(out, self._cache_kw, None)
        final = cache if final is None else final
        written = self.commit(hit, final)
        return PrefixGeneration(seqs, seqs[0, ids.shape[1]:].tolist(), ttft, time.perf_counter() - t0, hit.source,
                                hit.tokens, hit.load_s, written, out)

    # ------------------------------------------------------------------ lifetime
    def stats(self):
        return self.store.stats()

    def close(self) -> None:
        from ..telemetry import counters
        counters.unregister_provider(self._provider)
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
