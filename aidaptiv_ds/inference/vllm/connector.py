"""``AidaptivConnector``: vLLM's ``KVConnectorBase_V1`` on the aidaptiv_ds store (imports vLLM).

Glue only: the scheduler side is :class:`~.planner.Planner`, the worker side
:class:`~.worker.BlockMover`; they talk through :class:`AidaptivConnectorMetadata` (scheduler to
worker, every step) and :class:`AidaptivWorkerMetadata` (worker to scheduler, with every step's
output). Written against vLLM 0.32's connector API
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``): loads are asynchronous
(``get_num_new_matched_tokens`` returns ``is_async=True``; ``get_finished`` reports them),
saves are copied out in ``wait_for_save`` and written behind (``request_finished`` never holds a
request's blocks). Supported: tensor and pipeline parallel size 1, one KV cache group (decoders whose
layers all keep the full prefix), the backends of :mod:`.paged`.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...errors import AidaptivConfigError
from ..layout import KVLayout, dtype_name
from .config import ConnectorConfig, parse
from .identity import vllm_fingerprint
from .paged import SPLIT, PagedKV, UnsupportedKVCacheError, family
from .planner import Plan, Planner, read_index
from .worker import BlockMover

log = logging.getLogger("aidaptiv_ds")


@dataclasses.dataclass
class AidaptivConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves (:class:`~.planner.Plan`)."""
    plan: Plan = dataclasses.field(default_factory=Plan)


@dataclasses.dataclass
class AidaptivWorkerMetadata(KVConnectorWorkerMetadata):
    """Blocks committed ``(key, parent, depth)``, removed and skipped since the last step."""
    stored: list = dataclasses.field(default_factory=list)
    removed: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    snapshot: dict | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, AidaptivWorkerMetadata)
        snap = self.snapshot if other.snapshot is None else {**(self.snapshot or {}), **other.snapshot}
        return AidaptivWorkerMetadata(self.stored + other.stored, self.removed + other.removed,
                                      self.skipped + other.skipped, snap)


def _check_engine(vllm_config) -> None:
    par = vllm_config.parallel_config
    for key, value in (("tensor_parallel_size", par.tensor_parallel_size),
                       ("pipeline_parallel_size", par.pipeline_parallel_size)):
        if int(value) != 1:
            raise AidaptivConfigError(f"--{key.replace('_', '-')} {value}: the AidaptivConnector supports one worker "
                                      f"(tensor and pipeline parallel size 1). Fix: serve with --{key.replace('_', '-')} "
                                      f"1, or without the connector")


class AidaptivConnector(KVConnectorBase_V1):
    """Prefix KV blocks on the cache drives for vLLM (see the package docstring)."""

    _cache_hit_source = CacheHitSource.DISK

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost hand-off

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg: ConnectorConfig = parse(self._kv_transfer_config.kv_connector_extra_config)
        _check_engine(vllm_config)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise AidaptivConfigError(f"AidaptivConnector: the model has {len(kv_cache_config.kv_cache_groups)} KV cache "
                                      f"groups (sliding-window or hybrid layers); only models whose layers all keep "
                                      f"the full prefix are supported. Fix: serve it without the connector")
        cache = vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.hash_block_size = self.block_size
        if kv_cache_config is not None:
            try:
                from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

                _, self.hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
            except (ImportError, AssertionError, ValueError):
                pass
        self.chunk_tokens = self.cfg.chunk_tokens(self.block_size)
        # [Note: load failures] a block that fails its CRC is never copied into vLLM's cache; what vLLM then
        # does with the request follows kv_load_failure_policy, read by the scheduler right after it built us
        self._kv_transfer_config.kv_load_failure_policy = self.cfg.on_load_error
        self.planner: Planner | None = None
        self.mover: BlockMover | None = None
        self._failed: set[int] = set()
        self._done: set[str] = set()
        if role == KVConnectorRole.SCHEDULER:
            self.planner = Planner(self.chunk_tokens, self.block_size, self.hash_block_size,
                                   read_index(list(self.cfg.cache_paths)))
            log.info("AidaptivConnector (scheduler): %d blocks of %d tokens on %s", len(self.planner.index),
                     self.chunk_tokens, ", ".join(self.cfg.cache_paths))

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = list(self._kv_cache_config.kv_cache_groups[0].layer_names) if self._kv_cache_config else list(kv_caches)
        caches = [kv_caches[n] for n in names if n in kv_caches]
        num_blocks = int(self._kv_cache_config.num_blocks) if self._kv_cache_config else caches[0].shape[0]
        if caches and (caches[0].shape[0] != num_blocks or caches[0].shape[2] != self.block_size):
            raise UnsupportedKVCacheError(f"AidaptivConnector: KV cache of shape {tuple(caches[0].shape)} for {num_blocks} "
                                          f"blocks of {self.block_size} tokens (kernel blocks smaller than vLLM's blocks "
                                          f"are not supported). Fix: serve with --block-size equal to the kernel's")
        backends = {b.get_name() for b in get_current_attn_backends(self._vllm_config)}
        if len(backends) != 1:
            raise UnsupportedKVCacheError(f"AidaptivConnector: several attention backends {sorted(backends)}")
        backend = backends.pop()
        kind = family(backend)
        paged = PagedKV(caches, kind)
        fmt = "vllm"
        if kind == SPLIT:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            fmt = f"vllm-cpu_attn/{_get_attn_isa(paged.dtype, self.block_size, paged.head_dim)}/{self.block_size}"
        layout = KVLayout(paged.layers, paged.kv_heads, paged.head_dim, dtype_name(paged.dtype), self.chunk_tokens, fmt)
        mc = self._vllm_config.model_config
        fp = vllm_fingerprint(mc.model, getattr(mc, "revision", None), layout.dtype,
                              self._vllm_config.cache_config.prefix_caching_hash_algo, self.hash_block_size,
                              getattr(mc, "quantization", None), self.cfg.model_id)
        self.mover = BlockMover(self.cfg, fp, layout, paged)
        log.info("AidaptivConnector (worker): %s, backend %s (%s), %s", self.mover.store.describe()
                 if self.mover.enabled else "store disabled: " + self.mover.store.disabled_reason, backend, fmt,
                 f"{self.mover.extent_bytes} bytes per {self.chunk_tokens}-token block")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.mover is None or not isinstance(meta, AidaptivConnectorMetadata):
            return
        for req_id, chunks in meta.plan.loads:
            self.mover.load(req_id, chunks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits for them, the forward never does

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # all layers are copied at once in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.mover is None or not isinstance(meta, AidaptivConnectorMetadata):
            return
        for chunks in meta.plan.saves:
            self.mover.save(chunks)

    def _poll(self) -> None:
        if self.mover is not None:
            done, failed = self.mover.poll()
            self._done |= done
            self._failed |= failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._poll()
        done, self._done = self._done, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def build_connector_worker_meta(self) -> AidaptivWorkerMetadata | None:
        if self.mover is None:
            return None
        ev = self.mover.take_events()
        return AidaptivWorkerMetadata(ev.stored, ev.removed, ev.skipped, ev.snapshot) if ev else None

    def shutdown(self) -> None:
        if self.mover is not None:
            self.mover.close()

    # ================================================================== scheduler side
    def on_new_request(self, request) -> None:
        if self.planner is not None:
            self.planner.add(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.planner is None or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        return self.planner.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.planner is not None and num_external_tokens > 0:
            self.planner.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> AidaptivConnectorMetadata:
        if self.planner is None:
            return AidaptivConnectorMetadata()
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        scheduled = []
        new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        for req_id, groups, resumed in yield_req_data(scheduler_output):
            scheduled.append((req_id, groups[0] if groups else None, resumed or req_id in new_ids))
        plan = self.planner.plan(scheduled, dict(scheduler_output.num_scheduled_tokens),
                                 set(scheduler_output.finished_req_ids or ()))
        return AidaptivConnectorMetadata(plan)

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self.planner is not None and isinstance(meta, AidaptivWorkerMetadata):
            self.planner.on_events(meta.stored, meta.removed, meta.skipped, meta.snapshot)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None  # saves were copied out when their blocks completed: nothing holds the blocks

    def has_pending_push_work(self) -> bool:
        return bool(self.planner is not None and self.planner.pending)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return None
