"""vLLM's paged KV cache, block by block, in and out of the store's block payload.

vLLM 0.32 hands a connector one tensor per attention layer, the logical ``[num_blocks, H, N, C]``
view (``H`` KV heads, ``N`` tokens per vLLM block, ``C = 2 x head_dim``; RFC #42082,
``vllm/v1/kv_cache_layout.py``), whose physical order depends on the layout (``LBHNC`` on CPU,
``LBNHC`` = "NHD" for FlashAttention). What ``C`` holds depends on the backend:

* **split** (``CPU_ATTN``, ``vllm/v1/attention/backends/cpu_attn.py``): the block of one head is
  ``[2N, D]`` rows, the ``N`` key rows, then the ``N`` value rows (``kv_cache.view(B, H, 2N, D)
  .chunk(2, dim=2)``); the rows may be packed for the instruction set (``amx``, ``vec``...), so a
  block is only read back by the same backend (:attr:`PagedKV.kv_format` says which);
* **interleaved** (``FLASH_ATTN``, ``TRITON_ATTN``, ``FLEX_ATTENTION``): each token's row is its key
  then its value (``kv_cache.split(head_dim, dim=-1)``).

Either way a stored block's payload is the canonical order of :class:`~aidaptiv_ds.inference.layout.KVLayout`,
``[layer][key, value][kv_head][token][dim]``, with the tokens of the ``nb`` vLLM blocks of one stored
block one after the other: per layer the payload is ``[2, H, nb, N, D]``, and a vLLM block is the
slice ``[:, :, j]``, i.e. ``[2, H, N, D]`` = the block's ``[H, 2, N, D]`` (split) or ``[H, N, 2, D]``
(interleaved) permuted. Copies are per block and layer on the CPU; on a GPU the blocks are gathered on
the device into one contiguous tensor and copied to pinned host memory in one transfer on the current
stream (and back the same way), ordered after the forward pass that wrote them; the returned CUDA
event tells the writer thread when the bytes are on the host. The batched path is the GPU's and is
tested on CPU tensors too (``batched=True``).
"""
from __future__ import annotations

from ...errors import AidaptivError

import torch

SPLIT = "split"
INTERLEAVED = "interleaved"
#: attention backends by ``get_name()``, and how their ``C`` holds keys and values
BACKENDS = {"CPU_ATTN": SPLIT, "FLASH_ATTN": INTERLEAVED, "TRITON_ATTN": INTERLEAVED, "FLEX_ATTENTION": INTERLEAVED}
#: from a vLLM block's 5-D view to canonical ``[2, H, N, D]`` (one block) / ``[2, H, nb, N, D]`` (a batch)
_PERM = {SPLIT: (1, 0, 2, 3), INTERLEAVED: (2, 0, 1, 3)}
_PERM_BATCH = {SPLIT: (2, 1, 0, 3, 4), INTERLEAVED: (3, 1, 0, 2, 4)}
_UNPERM_BATCH = {SPLIT: (2, 1, 0, 3, 4), INTERLEAVED: (2, 1, 3, 0, 4)}


class UnsupportedKVCacheError(AidaptivError, ValueError):
    """The KV cache tensors are of a kind this connector does not store (another backend, MLA, a
    quantized cache, mixed layers)."""


def family(backend_name: str) -> str:
    """``"split"`` or ``"interleaved"`` for an attention backend name.

    Raises:
        UnsupportedKVCacheError: another backend (MLA, sparse, quantized, ROCm...), naming the ones supported.
    """
    try:
        return BACKENDS[backend_name]
    except KeyError:
        raise UnsupportedKVCacheError(
            f"AidaptivConnector: attention backend {backend_name} is not supported (its KV blocks are laid out "
            f"differently). Fix: run with one of {', '.join(sorted(BACKENDS))} (--attention-backend), or without "
            f"the connector") from None


class PagedKV:
    """The per-layer paged caches of one worker, as blocks.

    Args:
        caches: per attention layer (in model order) the ``[num_blocks, H, N, 2 D]`` tensor vLLM gave
            :meth:`register_kv_caches` (any strides with ``C`` contiguous; split also needs ``[N, C]``
            contiguous, as ``LBHNC`` has it).
        kind: ``"split"`` or ``"interleaved"`` (:func:`family`).

    Raises:
        UnsupportedKVCacheError: tensors of another rank, mixed shapes/dtypes/devices, an odd ``C``,
            a dtype the store does not hold (fp8 caches), or strides the view cannot take.
    """

    def __init__(self, caches: list[torch.Tensor], kind: str) -> None:
        if kind not in _PERM:
            raise ValueError(f"PagedKV: kind {kind!r} is not {SPLIT!r} or {INTERLEAVED!r}")
        if not caches:
            raise UnsupportedKVCacheError("AidaptivConnector: the model has no attention layer with a KV cache")
        first = caches[0]
        if first.dim() != 4 or first.shape[-1] % 2:
            raise UnsupportedKVCacheError(f"AidaptivConnector: a KV cache of shape {tuple(first.shape)}; expected the "
                                          f"[num_blocks, kv_heads, block_size, 2 x head_dim] view of vLLM 0.32")
        if first.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise UnsupportedKVCacheError(f"AidaptivConnector: KV cache dtype {first.dtype}; the store holds float32, "
                                          f"bfloat16 or float16 caches. Fix: run with --kv-cache-dtype auto")
        for c in caches:
            if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
                raise UnsupportedKVCacheError(f"AidaptivConnector: KV caches of different shapes or dtypes "
                                              f"({tuple(c.shape)} {c.dtype} vs {tuple(first.shape)} {first.dtype}); "
                                              f"hybrid models are not supported")
        self.kind = kind
        self.num_blocks, self.kv_heads, self.block_size, c2 = (int(x) for x in first.shape)
        self.head_dim = c2 // 2
        self.dtype = first.dtype
        self.device = first.device
        self.layers = len(caches)
        self.views5 = [self._view5(c) for c in caches]

    def _view5(self, c: torch.Tensor) -> torch.Tensor:
        s0, s1, s2, s3 = c.stride()
        n, d = self.block_size, self.head_dim
        if s3 != 1:
            raise UnsupportedKVCacheError(f"AidaptivConnector: KV cache strides {c.stride()}: the last dimension is not "
                                          f"contiguous")
        if self.kind == SPLIT:
            if s2 != 2 * d:
                raise UnsupportedKVCacheError(f"AidaptivConnector: KV cache strides {c.stride()}: a split (CPU) cache "
                                              f"needs each head's block contiguous")
            return c.as_strided((self.num_blocks, self.kv_heads, 2, n, d), (s0, s1, n * d, d, 1), c.storage_offset())
        return c.as_strided((self.num_blocks, self.kv_heads, n, 2, d), (s0, s1, s2, d, 1), c.storage_offset())

    @property
    def block_nbytes(self) -> int:
        """Bytes of one vLLM block over all layers (``layers x 2 x H x N x D x elsize``)."""
        return self.layers * 2 * self.kv_heads * self.block_size * self.head_dim * self.dtype.itemsize

    def canonical(self, payload: torch.Tensor, nb: int) -> torch.Tensor:
        """``[layers, 2, H, nb, N, D]`` view of the first ``nb`` blocks' bytes of ``payload`` (a uint8 tensor)."""
        n = nb * self.block_nbytes
        if payload.dtype != torch.uint8 or payload.numel() < n:
            raise ValueError(f"PagedKV: a payload of {payload.numel()} {payload.dtype} elements; {n} bytes of uint8 needed")
        return payload[:n].view(self.dtype).view(self.layers, 2, self.kv_heads, nb, self.block_size, self.head_dim)

    def gather(self, block_ids: list[int], payload: torch.Tensor, batched: bool | None = None):
        """Copy vLLM blocks ``block_ids`` (in token order) into ``payload`` (host, uint8).

        Returns:
            a CUDA event recorded after the device-to-host copy (wait on it before reading
            ``payload``), or None when the copy is complete (CPU).
        """
        dst = self.canonical(payload, len(block_ids))
        batched = self.device.type != "cpu" if batched is None else batched
        if not batched:
            perm = _PERM[self.kind]
            for layer, v5 in enumerate(self.views5):
                for j, b in enumerate(block_ids):
                    dst[layer, :, :, j].copy_(v5[b].permute(perm))
            return None
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        perm = _PERM_BATCH[self.kind]
        stage = torch.stack([v5.index_select(0, idx).permute(perm) for v5 in self.views5])  # on the device
        if self.device.type == "cuda":  # guarded: the GPU path (pinned destination, async copy, event)
            dst.copy_(stage, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            return ev
        dst.copy_(stage)
        return None

    def scatter(self, block_ids: list[int], payload: torch.Tensor, first: int = 0, batched: bool | None = None) -> None:
        """Copy blocks ``first, first + 1, ...`` of ``payload`` (a stored block's bytes) into vLLM blocks
        ``block_ids``. On a GPU the copy is queued on the current stream (ordered before the next forward)."""
        nb = first + len(block_ids)
        src = self.canonical(payload, nb)[:, :, :, first:nb]
        batched = self.device.type != "cpu" if batched is None else batched
        if not batched:
            perm = _PERM[self.kind]
            for layer, v5 in enumerate(self.views5):
                for j, b in enumerate(block_ids):
                    v5[b].permute(perm).copy_(src[layer, :, :, j])
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        dev = src.to(self.device, non_blocking=True) if self.device.type == "cuda" else src
        unperm = _UNPERM_BATCH[self.kind]
        for layer, v5 in enumerate(self.views5):
            v5.index_copy_(0, idx, dev[layer].permute(unperm))
