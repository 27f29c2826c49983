"""A vLLM KV connector on the cache drives: a prefix computed once is loaded, not recomputed, by any
later request of any later server process.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "AidaptivConnector",
        "kv_connector_module_path": "aidaptiv_ds.inference.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cache_paths": ["/mnt/cache0/kv"], "capacity": "200GiB",
                                      "dram_budget": "8GiB"}}'

(the offline ``LLM(model, kv_transfer_config=KVTransferConfig(...))`` takes the same dict). The blocks
live in an aidaptiv_ds store (:mod:`aidaptiv_ds.inference.block_store`: slab on the cache drives with
``O_DIRECT``, CRC32 per block, a header binding the directory to the model's files, KV dtype, layout
and block keys, DRAM tier in front, capacity with least-recently-used eviction, endurance ledger,
owner lock, durable commits that survive ``kill -9``), keyed by vLLM's own block hashes.
``aidaptiv-ds kv-cache --cache DIR`` lists, sizes, verifies or clears it.

Modules: :mod:`.config` (``kv_connector_extra_config``, checked at start), :mod:`.identity` (the
fingerprint), :mod:`.paged` (vLLM's paged cache layouts, CPU and GPU), :mod:`.planner` (scheduler
side), :mod:`.worker` (worker side: copies, the store thread), :mod:`.connector` (the
``KVConnectorBase_V1`` subclass; the only module that imports vLLM, on first use of
``AidaptivConnector``, so this package imports without vLLM installed).
"""
from __future__ import annotations

__all__ = ["AidaptivConnector"]


def __getattr__(name: str):
    """``AidaptivConnector`` (vLLM looks it up by name in ``kv_connector_module_path``): imports vLLM."""
    if name in ("AidaptivConnector", "AidaptivConnectorMetadata", "AidaptivWorkerMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
