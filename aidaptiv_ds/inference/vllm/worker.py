"""The worker side: stored blocks in and out of vLLM's paged cache, the store behind one thread.

One :class:`BlockMover` per vLLM worker (tensor parallel size 1). It owns the
:class:`~aidaptiv_ds.inference.block_store.KVBlockStore` (slab on the cache drives, DRAM tier, CRC per
block, fingerprint header, capacity and LRU eviction, ledger, owner lock) and one thread, the only one
that calls it (the store is not thread-safe):

* **save** (:meth:`BlockMover.save`, from ``wait_for_save`` after the forward that computed the
  blocks): the vLLM blocks of each completed stored block are copied into an aligned host buffer
  (:meth:`PagedKV.gather`; on a GPU an async device-to-host copy), and the buffer goes to the thread.
  That copy is all a request waits for; writing, fsync and index commits happen behind it, one
  commit per batch of whatever queued up meanwhile. vLLM's blocks can be reused as soon as the copy
  is done, so requests never hold blocks for the drive. Past ``save_buffer`` bytes waiting, new
  blocks are skipped (counted as ``saves_skipped``) rather than waited for. A block already stored is
  never written again (the scheduler does not plan it, and :meth:`KVBlockStore.put` skips it).
* **load** (:meth:`BlockMover.load`, from ``start_load_kv``): the thread reads the blocks (DRAM tier
  first, else all reads in flight at once, each checked against its CRC32) while the engine runs
  other requests; :meth:`BlockMover.poll` (from ``get_finished``) copies the finished ones into the
  request's vLLM blocks (:meth:`PagedKV.scatter`) and reports the request done. A block that is
  gone or fails its CRC is never copied: its vLLM blocks and those after it are reported as load
  errors and vLLM recomputes them.
* **events**: blocks committed, blocks removed (evicted, corrupt) and saves skipped go back to the
  scheduler through the worker metadata (:meth:`BlockMover.take_events`), which keeps its index of
  what can be loaded.

Counters (``stats``) are written to ``kv_connector_stats.json`` beside the index after each commit and
each finished load (``aidaptiv-ds kv-cache`` shows them).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time

import torch

from ...io.buffers import alloc_aligned
from ..block_store import KVBlockStore, _atomic_json
from ..fingerprint import Fingerprint
from ..layout import KVLayout
from .config import ConnectorConfig
from .paged import PagedKV

log = logging.getLogger("aidaptiv_ds")
STATS = "kv_connector_stats.json"


@dataclasses.dataclass
class SaveChunk:
    """One stored block to write: its key, its parent's key, its index in the prompt, and the vLLM
    block ids holding its tokens (in order)."""
    key: str
    parent: str | None
    depth: int
    block_ids: list[int]


@dataclasses.dataclass
class LoadChunk:
    """One stored block to load: its key, the first of its vLLM blocks to fill (a prefix already
    computed locally is skipped) and the vLLM block ids to fill from there."""
    key: str
    first: int
    block_ids: list[int]


@dataclasses.dataclass
class Events:
    """What changed in the store since the last :meth:`BlockMover.take_events`."""
    stored: list[tuple[str, str | None, int]] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    #: the whole index ``{key: (parent, depth)}`` (the first events after the store opened: the
    #: scheduler's copy, read from the file, is replaced by what the worker really opened)
    snapshot: dict | None = None

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.skipped or self.snapshot is not None)


class BlockMover:
    """See the module docstring.

    Args:
        cfg: the connector settings; fingerprint, layout: what the blocks are (the store's header).
        paged: the worker's paged caches; ``layout.block_tokens`` must be a multiple of its block size.

    Raises:
        KVCacheMismatchError, StoreInUseError, CachePathError: from opening the store.
    """

    def __init__(self, cfg: ConnectorConfig, fingerprint: Fingerprint, layout: KVLayout, paged: PagedKV) -> None:
        if layout.block_tokens % paged.block_size:
            raise ValueError(f"BlockMover: {layout.block_tokens}-token blocks are not whole vLLM blocks of "
                             f"{paged.block_size}")
        self.paged = paged
        self.per_chunk = layout.block_tokens // paged.block_size
        self.save_buffer = cfg.save_buffer
        self._pin = paged.device.type == "cuda"
        self._lock = threading.Lock()
        self._staged = 0  # bytes of buffers handed to the thread and not yet written
        self._q: queue.Queue = queue.Queue()
        self._loaded: queue.Queue = queue.Queue()  # (req_id, chunks, loaded blocks | None per chunk, t0) from the thread
        self._events = Events()
        self.stats = {"saves_requested": 0, "blocks_written": 0, "saves_skipped": 0, "save_copy_s": 0.0,
                      "loads": 0, "blocks_loaded": 0, "blocks_load_failed": 0, "tokens_loaded": 0,
                      "load_wait_s": 0.0, "commits": 0, "write_s": 0.0}
        opened: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, args=(cfg, fingerprint, layout, opened), name="aidaptiv-kv-store", daemon=True)
        self._thread.start()
        got = opened.get()
        if isinstance(got, BaseException):
            self._thread.join()
            self._thread = None
            raise got
        self.store: KVBlockStore = got
        self.enabled = self.store.enabled
        self.extent_bytes = getattr(self.store, "extent_bytes", 0)
        self._stats_path = os.path.join(self.store.ns.rank_dir(0), STATS) if self.enabled else None
        if not self.enabled:
            self._q.put(("stop",))
            self._thread.join()
            self._thread = None
        self._events.snapshot = self.known()

    # ------------------------------------------------------------------ main thread
    def known(self) -> dict[str, tuple[str | None, int]]:
        """``{key: (parent, depth)}`` of the blocks stored now (call before the thread has work)."""
        if not self.enabled:
            return {}
        return {r.hash: (r.parent, r.depth) for r in self.store.blocks.values()}

    def save(self, chunks: list[SaveChunk]) -> int:
        """Copy ``chunks`` (consecutive blocks of one request, parents first) out of vLLM's cache and
        queue them for writing; returns how many were queued (the rest are skipped: the save buffer is
        full, or the store is off)."""
        if not chunks:
            return 0
        self.stats["saves_requested"] += len(chunks)
        if not self.enabled:
            self._skip(chunks)
            return 0
        t0 = time.perf_counter()
        bufs: dict[int, torch.Tensor] = {}
        chain = []
        events = []
        for i, c in enumerate(chunks):
            with self._lock:
                full = self._staged + self.extent_bytes > self.save_buffer
                if not full:
                    self._staged += self.extent_bytes
            if full:
                self._skip(chunks[i:])
                break
            buf = alloc_aligned(self.extent_bytes, pin=self._pin)
            events.append(self.paged.gather(c.block_ids, buf))
            bufs[c.depth] = buf
            chain.append((c.key, c.parent, c.depth))
        self.stats["save_copy_s"] += time.perf_counter() - t0
        if chain:
            self._q.put(("save", chain, bufs, [e for e in events if e is not None]))
        return len(chain)

    def _skip(self, chunks: list[SaveChunk]) -> None:
        self.stats["saves_skipped"] += len(chunks)
        with self._lock:
            self._events.skipped.extend(c.key for c in chunks)

    def load(self, req_id: str, chunks: list[LoadChunk]) -> None:
        """Start loading ``chunks`` (a chain from the request's first block not computed locally) for
        ``req_id``; :meth:`poll` reports it done."""
        self.stats["loads"] += 1
        if self._thread is None:  # the store is off (ignored directory, closed): nothing can be loaded
            self._loaded.put((req_id, chunks, [None] * len(chunks), time.perf_counter()))
            return
        self._q.put(("load", req_id, chunks, time.perf_counter()))

    def poll(self) -> tuple[set[str], set[int]]:
        """Copy finished loads into vLLM's cache; returns ``(request ids done, vLLM block ids that
        failed to load)``."""
        done: set[str] = set()
        failed: set[int] = set()
        while True:
            try:
                req_id, chunks, payloads, t0 = self._loaded.get_nowait()
            except queue.Empty:
                break
            ok = True
            for c, b in zip(chunks, payloads):
                if ok and b is not None:
                    self.paged.scatter(c.block_ids, b.payload, first=c.first)
                    self.stats["blocks_loaded"] += 1
                    self.stats["tokens_loaded"] += len(c.block_ids) * self.paged.block_size
                else:
                    ok = False
                    failed.update(c.block_ids)
                    self.stats["blocks_load_failed"] += 1
            if self._thread is not None:
                self._q.put(("release", [b for b in payloads if b is not None]))
            self.stats["load_wait_s"] += time.perf_counter() - t0
            done.add(req_id)
        return done, failed

    def take_events(self) -> Events:
        with self._lock:
            ev, self._events = self._events, Events()
        return ev

    def pending(self) -> bool:
        """Work queued or in flight (saves not yet committed, loads not yet read)."""
        with self._lock:
            return self._staged > 0 or not self._q.empty()

    def close(self) -> None:
        """Finish the queued writes, commit, close the store (idempotent)."""
        if self._thread is not None:
            self._q.put(("stop",))
            self._thread.join()
            self._thread = None
        if self.enabled:
            self.enabled = False
            self._write_stats()
            self.store.close()  # the I/O threads end with it

    # ------------------------------------------------------------------ the store thread
    def _run(self, cfg: ConnectorConfig, fingerprint: Fingerprint, layout: KVLayout, opened: queue.Queue) -> None:
        # [Note: off the compute core] vLLM's CPU worker binds its threads to the compute cores (OpenMP
        # binding; one core of two here) and keeps one for the server. This thread and the store's I/O
        # threads (started by it, so they inherit its mask) ask for every core: CRCs, commits and I/O
        # submission then run beside the forward pass instead of taking turns with it. Where a cpuset
        # forbids that, the mask stays as it was.
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except (OSError, ValueError):
            pass
        try:
            store = KVBlockStore(list(cfg.cache_paths), fingerprint, layout, capacity=cfg.capacity,
                                 dram_budget=cfg.dram_budget, on_mismatch=cfg.on_mismatch, threads=cfg.threads,
                                 direct=cfg.direct, writeback_limit=cfg.save_buffer)
        except BaseException as e:  # noqa: BLE001 - raised again in the constructor's thread
            opened.put(e)
            return
        store.removed_log = []  # evictions and drops go back to the scheduler's index
        opened.put(store)
        while True:
            batch = [self._q.get()]
            while True:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = False
            released = False
            for m in batch:  # releases and loads first: a load is waited for by a request, a save by nobody
                if m[0] == "release":
                    released = True
                    self._guard(self.store.release, m[1])
            for m in batch:
                if m[0] == "load":
                    self._do_load(*m[1:])
            saves = [m for m in batch if m[0] == "save"]
            if saves:
                self._do_saves(saves)
            # [Note: counters on the drive] A release follows the poll that counted the loaded blocks, a
            # save batch its commit: the file is written after each, so it never lags what vLLM reports
            # (a server stopped by a signal may end before :meth:`close` writes it once more).
            if released or saves or time.time() - self._stats_at > 1.0:
                self._write_stats()
            stop = any(m[0] == "stop" for m in batch)
            if stop:
                return

    def _guard(self, fn, *a):
        try:
            return fn(*a)
        except Exception:  # noqa: BLE001 - the thread must go on; the failure is logged with its traceback
            log.exception("AidaptivConnector: %s failed", getattr(fn, "__name__", fn))
            return None

    def _do_load(self, req_id: str, chunks: list[LoadChunk], t0: float) -> None:
        payloads: list = [None] * len(chunks)
        try:
            recs = []
            for c in chunks:
                r = self.store.record(c.key)
                if r is None:
                    break
                recs.append(r)
            loaded = self.store.load(recs)  # stops before a block that is corrupt or unreadable (dropped)
            for i, b in enumerate(loaded):
                payloads[i] = b
        except Exception:  # noqa: BLE001 - reported as a failed load: vLLM recomputes
            log.exception("AidaptivConnector: loading %d blocks for request %s failed", len(chunks), req_id)
        self._drain_removed()
        self._loaded.put((req_id, chunks, payloads, t0))  # the main thread copies, then sends them back to release

    def _do_saves(self, saves: list) -> None:
        t0 = time.perf_counter()
        stored: list[tuple[str, str | None, int]] = []
        lost: list[str] = []
        for _, chain, bufs, events in saves:
            for e in events:
                e.synchronize()  # the device-to-host copy has landed
            try:
                self.store.put(chain, buffers=bufs, commit=False)
            except Exception:  # noqa: BLE001 - the blocks are not stored; the next request may store them
                log.exception("AidaptivConnector: storing %d blocks failed", len(chain))
            for h, parent, depth in chain:
                (stored.append((h, parent, depth)) if self.store.record(h) is not None else lost.append(h))
        self._guard(self.store.commit)
        self.stats["commits"] += 1
        self.stats["write_s"] += time.perf_counter() - t0
        self.stats["blocks_written"] = self.store.counts["written"] if self.enabled else 0
        with self._lock:
            self._staged -= sum(len(m[1]) for m in saves) * self.extent_bytes
            self._events.stored.extend(stored)
            self._events.skipped.extend(lost)
        self._drain_removed()

    def _drain_removed(self) -> None:
        gone = self.store.take_removed()
        if gone:
            with self._lock:
                self._events.removed.extend(gone)

    _stats_at = 0.0

    def _write_stats(self) -> None:
        self._stats_at = time.time()
        if self._stats_path is None:
            return
        try:
            st = self.store.stats().as_dict()
            n = _atomic_json(self._stats_path, {"connector": dict(self.stats), "store": st, "time": time.time()})
            self.store.store.count_metadata_write(n)  # the ledger counts every byte written to the drive
        except OSError as e:
            log.warning("AidaptivConnector: %s not written (%s)", self._stats_path, e)
