"""The prefix KV blocks on a cache drive, with the DRAM tier in front.

Files, in the store namespace ``(host, "prefix-kv", rank 0)`` under the cache directory
(:mod:`aidaptiv_ds.store.layout`; the owner lock keeps a second process out)::

    <dir>/aidaptiv_ds/<host>/prefix-kv/rank0/kv_header.json   format, version, fingerprint, layout
    <dir>/aidaptiv_ds/<host>/prefix-kv/rank0/kv_blocks.json   per block: parent, depth, crc32, last use
    <dir>/aidaptiv_ds/<host>/prefix-kv/rank0/slab.bin         the blocks, one extent each ("kv/<hash>")
    <dir>/aidaptiv_ds/<host>/prefix-kv/rank0/index.json       the slab store's extent index
    <dir>/aidaptiv_ds/<host>/ledger.json                       endurance ledger (bytes this store wrote)

* **Blocks** are content-addressed (the key is the prefix hash, :mod:`.hashing`): written once,
  never rewritten; a hit writes nothing. Each is one extent of ``round_up(block_nbytes, 4 KiB)``
  bytes written and read with one aligned ``O_DIRECT`` request (split at the engine's block size).
* **Integrity.** The CRC32 of every payload is recorded when it is written and checked on every read
  from the drive; a block that fails (or whose read fails) is dropped with its descendants and the
  caller recomputes from there; it is never used.
* **Budgets.** ``capacity``: bytes of blocks on the drive; past it the least recently used *leaf*
  block goes first (a block whose descendants are cached is kept, since they are useless without
  it; a lookup touches a whole chain at once and deeper blocks go first on ties, as vLLM frees a
  request's blocks tail first). ``dram_budget``: bytes of blocks kept in the DRAM tier
  (:class:`~aidaptiv_ds.tiers.host_tier.HostTier`, least recently used first; a budget of 0 keeps
  none). Blocks being read, and staged for writing (at most ``writeback_limit`` bytes in flight),
  are working memory until done.
* **Restart.** After each commit the blocks are durable (written, slab fsynced) and both indexes are
  saved (temp file, fsync, rename). Evictions are saved *before* their space can be reused, so an
  index never names a block whose bytes were overwritten; a crash leaves at worst extents no block
  names, which the next open frees.
* **Fingerprint.** A header written for another model, dtype, tokenizer or layout is refused
  (:class:`KVCacheMismatchError` naming each field, before anything is opened or written) or, with
  ``on_mismatch="ignore"``, the store stays closed and every lookup misses.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
import zlib

import torch

from ..errors import AidaptivError, AidaptivWarning
from ..io.buffers import alloc_aligned, round_up
from ..io.engine import READ_DEMAND, WRITE_BACK, IOEngine
from ..io.errors import StorageError, StorageFullError
from ..io.futures import combine
from ..store.layout import Namespace, check_cache_path
from ..store.slab import free_bytes
from ..store.store import PathSpec, SlabStore
from ..tiers.host_tier import HostTier
from ..tiers.unit import TieredUnit
from ..units import format_bytes, parse_size
from .fingerprint import Fingerprint, mismatches
from .layout import LAYOUT_DEFAULTS, KVLayout

log = logging.getLogger("aidaptiv_ds")

RUN_NAME = "prefix-kv"
HEADER = "kv_header.json"
BLOCKS = "kv_blocks.json"
FORMAT = "aidaptiv_ds.kv_cache"
VERSION = 1
KEY_PREFIX = "kv/"


class KVCacheMismatchError(AidaptivError, ValueError):
    """The cache directory was written for another model, dtype, tokenizer or block layout."""


class KVCacheWarning(AidaptivWarning):
    """A KV cache directory is ignored, or a block was dropped (corrupt, unreadable, not writable)."""


@dataclasses.dataclass
class BlockRecord:
    """One cached block (``depth`` = its index in the prompt; tokens ``[depth B, (depth + 1) B)``)."""
    hash: str
    parent: str | None
    depth: int
    crc32: int
    last_use: int

    @property
    def key(self) -> str:
        return KEY_PREFIX + self.hash


@dataclasses.dataclass
class LoadedBlock:
    """A block's payload in host memory (valid until :meth:`KVBlockStore.release`)."""
    record: BlockRecord
    payload: torch.Tensor
    source: str  # "dram" | "drive"
    slice: TieredUnit


@dataclasses.dataclass
class KVStats:
    """Counters of one open store (cumulative since it opened, except the sizes)."""
    blocks: int
    tokens: int
    bytes_on_drive: int
    capacity_bytes: int
    dram_bytes: int
    dram_budget_bytes: int
    blocks_from_dram: int
    blocks_from_drive: int
    blocks_written: int
    blocks_evicted: int
    blocks_corrupt: int
    bytes_read: int
    bytes_written: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def namespace(path: str | list[str]) -> Namespace:
    """The store namespace of the KV cache under directory ``path`` (or striped over the directories of
    a list: the indexes live under the first one, each holds a part of the slab).

    Raises:
        CachePathError: a path is missing, not a directory or not writable.
    """
    paths = [path] if isinstance(path, str) else list(path)
    if not paths:
        raise ValueError("KV cache: no cache path given")
    return Namespace([check_cache_path(p, "kv_cache_path") for p in paths], RUN_NAME, 0)


def read_header(ns: Namespace) -> dict | None:
    """The header of the cache in ``ns`` (None when there is none yet).

    Raises:
        KVCacheMismatchError: the file is not a KV cache header of a version this code reads.
    """
    p = os.path.join(ns.rank_dir(0), HEADER)
    try:
        with open(p) as f:
            h = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise KVCacheMismatchError(f"KV cache {p}: the header cannot be read ({e}). Fix: use another --kv_cache_path, "
                                   f"or remove this one with `aidaptiv-ds kv-cache --cache DIR --clear`") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT or h.get("version") != VERSION:
        raise KVCacheMismatchError(f"KV cache {p}: not a {FORMAT} header of version {VERSION} (found "
                                   f"{str(h)[:120]}). Fix: use another --kv_cache_path, or clear this one with "
                                   f"`aidaptiv-ds kv-cache --cache DIR --clear`")
    return h


def _atomic_json(path: str, data: dict) -> int:
    payload = json.dumps(data, separators=(",", ":")).encode()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(payload)


class KVBlockStore:
    """Prefix KV blocks under a cache directory (see the module docstring).

    Args:
        path: the cache directory (on the cache drive; must exist and be writable), or a list of them
            (one per drive: the blocks are striped over all, the indexes live in the first).
        fingerprint: what the blocks are computed by; layout: their shape.
        capacity: bytes of blocks on the drive: an int, ``"8GiB"``, or ``"auto"`` (a quarter of the
            filesystem's free space at open plus what the cache already holds).
        dram_budget: bytes of blocks kept in DRAM (an int or a size string; 0 keeps none).
        on_mismatch: ``"error"`` (raise :class:`KVCacheMismatchError`) or ``"ignore"`` (warn; the store
            stays closed, :attr:`enabled` is False and every lookup misses).
        threads: I/O worker threads for the drive; direct: ``O_DIRECT`` where the filesystem allows.
        writeback_limit: most bytes of block writes in flight.

    Raises:
        KVCacheMismatchError: see ``on_mismatch``; CachePathError: a bad ``path``;
        StoreInUseError: another live process has this cache open; ValueError: a bad size or option.
    """

    def __init__(self, path: str | list[str], fingerprint: Fingerprint, layout: KVLayout, capacity="auto",
                 dram_budget="1GiB", on_mismatch: str = "error", threads: int = 4, direct: bool = True,
                 writeback_limit: int = 256 << 20) -> None:
        if on_mismatch not in ("error", "ignore"):
            raise ValueError(f"on_mismatch: {on_mismatch!r} must be 'error' or 'ignore'")
        self.paths = [os.path.abspath(p) for p in ([path] if isinstance(path, str) else path)]
        self.path = self.paths[0]
        self.fingerprint = fingerprint
        self.layout = layout
        self.enabled = False
        self.disabled_reason = ""
        self.removed_log: list[str] | None = None
        self.dram_budget = parse_size(dram_budget, "kv_cache dram_budget")
        want_capacity = capacity if isinstance(capacity, str) and capacity.strip().lower() == "auto" else \
            parse_size(capacity, "kv_cache capacity")
        self.ns = namespace(self.paths)
        self._header = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint.as_dict(),
                        "layout": layout.as_dict(), "cache_paths": self.paths}  # paths: not compared
        problems = self._problems(read_header(self.ns))
        if problems:
            msg = (f"KV cache {self.path} was written for something else and is not used:\n  - " + "\n  - ".join(problems)
                   + f"\nFix: give this model its own --kv_cache_path, or clear this one (`aidaptiv-ds kv-cache --cache "
                     f"{self.path} --clear`)")
            if on_mismatch == "error":
                raise KVCacheMismatchError(msg)
            warnings.warn(msg, KVCacheWarning, stacklevel=2)
            log.warning(msg)
            self.disabled_reason = msg
            return
        self.engine = IOEngine(threads_per_drive=threads, direct=direct)
        try:
            self.store = SlabStore(self.ns, [PathSpec(p) for p in self.ns.cache_paths], engine=self.engine, keep=True)
        except BaseException:
            self.engine.close()
            raise
        try:
            problems = self._problems(read_header(self.ns))  # again, now that we own the directory
            if problems:
                raise KVCacheMismatchError(f"KV cache {self.path} changed while opening: " + "; ".join(problems))
            self.align = self.store.alignment
            self.extent_bytes = round_up(layout.block_nbytes, self.align)
            self.blocks: dict[str, BlockRecord] = {}
            self.children: dict[str, set[str]] = {}
            self.clock = 0
            self._load_blocks()
            if want_capacity == "auto":
                want_capacity = (sum(free_bytes(p) for p in self.paths) + self.bytes_on_drive()) // 4
            self.capacity = int(want_capacity)
            self.tier = HostTier(self.dram_budget, writeback_limit=writeback_limit)
            self.counts = {"dram": 0, "drive": 0, "written": 0, "evicted": 0, "corrupt": 0}
            self.writeback_limit = int(writeback_limit)
            hdr = os.path.join(self.ns.rank_dir(0), HEADER)
            if not os.path.exists(hdr):
                self.store.count_metadata_write(_atomic_json(hdr, self._header))
            if self._evict_to(self.capacity, protect=set()):  # a smaller capacity than last time
                self._save_blocks()
                self.store.save_index()
            self.enabled = True
        except BaseException:
            self.store.close()
            self.engine.close()
            raise

    # ------------------------------------------------------------------ header and index
    def _problems(self, stored: dict | None) -> list[str]:
        if stored is None:
            return []
        out = mismatches(Fingerprint.from_dict(stored.get("fingerprint") or {}), self.fingerprint)
        theirs = stored.get("layout") or {}
        for k, v in self.layout.as_dict().items():
            if theirs.get(k, LAYOUT_DEFAULTS.get(k)) != v:  # a field added later: its default for older headers
                out.append(f"layout.{k}: written as {theirs.get(k)!r}, this run uses {v!r}")
        return out

    def _blocks_path(self) -> str:
        return os.path.join(self.ns.rank_dir(0), BLOCKS)

    def _load_blocks(self) -> None:
        """Read the block index and reconcile it with the store's extents (see the module docstring)."""
        try:
            with open(self._blocks_path()) as f:
                data = json.load(f)
        except FileNotFoundError:
            data = {}
        except (OSError, json.JSONDecodeError) as e:
            log.warning("KV cache %s: block index unreadable (%s); starting empty", self._blocks_path(), e)
            data = {}
        self.clock = int(data.get("clock", 0))
        raw = data.get("blocks", {}) if isinstance(data.get("blocks"), dict) else {}
        dropped = 0
        for h, v in sorted(raw.items(), key=lambda kv: kv[1][1] if isinstance(kv[1], list) and len(kv[1]) == 4
                           else 1 << 60):
            try:
                parent, depth, crc, last = v
                rec = BlockRecord(str(h), parent if parent is None else str(parent), int(depth), int(crc), int(last))
            except (TypeError, ValueError):
                dropped += 1
                continue
            ext = self.store.extent(rec.key)
            parent_ok = (rec.parent is None and rec.depth == 0) or (
                rec.parent in self.blocks and self.blocks[rec.parent].depth == rec.depth - 1)
            if ext is None or ext.nbytes < self.extent_bytes or not parent_ok:
                dropped += 1
                continue
            self._add_record(rec)
        orphans = [k for k in self.store.keys() if k.startswith(KEY_PREFIX) and k[len(KEY_PREFIX):] not in self.blocks]
        for k in orphans:
            self.store.free(k)
        if dropped or orphans:
            log.info("KV cache %s: %d index entries without their block and %d blocks without an entry dropped",
                     self.path, dropped, len(orphans))
            self._save_blocks()
            self.store.save_index()

    def _save_blocks(self) -> None:
        data = {"format": FORMAT, "version": VERSION, "clock": self.clock,
                "blocks": {r.hash: [r.parent, r.depth, r.crc32, r.last_use] for r in self.blocks.values()}}
        self.store.count_metadata_write(_atomic_json(self._blocks_path(), data))

    def _add_record(self, rec: BlockRecord) -> None:
        self.blocks[rec.hash] = rec
        self.children.setdefault(rec.hash, set())
        if rec.parent is not None:
            self.children.setdefault(rec.parent, set()).add(rec.hash)

    # ------------------------------------------------------------------ sizes
    def bytes_on_drive(self) -> int:
        return len(self.blocks) * self.extent_bytes

    def stats(self) -> KVStats:
        io = {"bytes_read": 0, "bytes_written": 0}
        if self.enabled:
            for c in self.store.io_counters().values():
                io = {k: io[k] + c[k] for k in io}
        c = self.counts if self.enabled else dict.fromkeys(("dram", "drive", "written", "evicted", "corrupt"), 0)
        return KVStats(len(self.blocks) if self.enabled else 0,
                       len(self.blocks) * self.layout.block_tokens if self.enabled else 0,
                       self.bytes_on_drive() if self.enabled else 0, getattr(self, "capacity", 0),
                       self.tier.held_bytes if self.enabled else 0, self.dram_budget, c["dram"], c["drive"],
                       c["written"], c["evicted"], c["corrupt"], io["bytes_read"], io["bytes_written"])

    # ------------------------------------------------------------------ lookup and load
    def longest_prefix(self, hashes: list[str]) -> list[BlockRecord]:
        """The cached blocks of the chain ``hashes`` from block 0 on, up to the first one missing."""
        out: list[BlockRecord] = []
        if not self.enabled:
            return out
        parent = None
        for h in hashes:
            r = self.blocks.get(h)
            if r is None or r.parent != parent:
                break
            out.append(r)
            parent = h
        return out

    def load(self, records: list[BlockRecord]) -> list[LoadedBlock]:
        """Payloads of ``records`` (a chain from block 0), from DRAM or read from the drive (all reads
        issued at once), in order; stops before the first block that is corrupt or unreadable (dropped
        with its descendants: the caller recomputes from there). Call :meth:`release` when done.
        """
        if not self.enabled or not records:
            return []
        pending = []
        for r in records:
            s = self.tier.get(("kv", r.hash))
            if s is not None:
                self.tier.acquire(s)
                pending.append((r, s, "dram", None))
                continue
            buf = alloc_aligned(self.extent_bytes)
            got: list[int] = []
            view = buf[: self.layout.block_nbytes]
            fut = self.store.read(r.key, buf, 0, READ_DEMAND)
            fut = combine([fut], self.extent_bytes, finalizer=lambda v=view, g=got: g.append(zlib.crc32(v.numpy())),
                          keepalive=buf)
            s = TieredUnit(("kv", r.hash), buf, kind="kv", ready=fut, prefetched=True)
            self.tier.add(s)
            self.tier.acquire(s)
            pending.append((r, s, "drive", got))
        out: list[LoadedBlock] = []
        broken = None
        for r, s, src, got in pending:
            if broken is None:
                try:
                    s.wait_ready()
                    if got is not None and (not got or got[0] != r.crc32):
                        broken = (r, f"checksum mismatch (stored crc32 {r.crc32:#010x}, read "
                                     f"{(got or [0])[0]:#010x})")
                except StorageError as e:
                    broken = (r, f"read failed: {e}")
            if broken is None:
                out.append(LoadedBlock(r, s.buf, src, s))
                self.counts[src] += 1
            else:
                if s.ready is not None:
                    try:
                        s.wait_ready()
                    except StorageError:
                        pass
                self.tier.release(s)
                self.tier.drop(s)
        if broken is not None:
            r, why = broken
            msg = (f"KV cache {self.path}: block {r.hash[:16]} (tokens {r.depth * self.layout.block_tokens}-"
                   f"{(r.depth + 1) * self.layout.block_tokens}) {why}; it is dropped and recomputed")
            log.warning(msg)
            warnings.warn(msg, KVCacheWarning, stacklevel=2)
            self.counts["corrupt"] += 1
            self._drop_subtree(r.hash)
            self._save_blocks()
            self.store.save_index()
        t = self._tick()
        for b in out:
            b.record.last_use = t
        return out

    def release(self, loaded: list[LoadedBlock]) -> None:
        """Drop the compute references :meth:`load` took; the blocks may then be evicted from DRAM."""
        for b in loaded:
            self.tier.release(b.slice)
        self.tier.enforce_budget()

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    # ------------------------------------------------------------------ store
    def put(self, chain: list[tuple[str, str | None, int]], fill=None, *, buffers: dict | None = None,
            commit: bool = True) -> int:
        """Write the blocks of ``chain`` that are not cached yet; returns how many were written.

        Args:
            chain: ``[(hash, parent hash or None, depth), ...]`` consecutive blocks of one prompt; the
                first one's parent must be cached (or it is block 0).
            fill: ``fill(depth, payload)`` writes block ``depth``'s keys and values into ``payload``
                (uint8, :attr:`KVLayout.block_nbytes` bytes).
            buffers: instead of ``fill``: ``{depth: buffer}``, each an aligned uint8 host tensor of
                :attr:`extent_bytes` bytes holding the block's payload (written as it is, no copy; it
                then becomes the block's DRAM copy, so the caller must not change it).
            commit: make the blocks durable before returning (see below); False leaves that to a later
                :meth:`commit` (one commit for several chains: a write-behind batch).

        With ``commit`` the blocks are durable when this returns (written, slab fsynced, indexes saved)
        and counted in the ledger. When the capacity cannot take a block (every other block is an
        ancestor of this chain) or the drive is full, the chain is stored up to there. A block already
        cached is never written again.
        """
        if (fill is None) == (buffers is None):
            raise ValueError("KVBlockStore.put: give exactly one of fill and buffers")
        if not self.enabled or not chain:
            return 0
        protect = {h for h, _, _ in chain} | set(self._ancestors(chain[0][1]))
        todo = [c for c in chain if c[0] not in self.blocks]
        if not todo:
            return 0
        first_parent = todo[0][1]
        if first_parent is not None and first_parent not in self.blocks:
            return 0
        need = len(todo) * self.extent_bytes
        if self._evict_to(self.capacity - need, protect):
            self._save_blocks()  # evictions are on record before their space can be reused
        room = max(self.capacity - self.bytes_on_drive(), 0) // self.extent_bytes
        todo = todo[:room]
        t = self._tick()
        issued: list[tuple[BlockRecord, torch.Tensor, object]] = []
        inflight = 0
        for h, parent, depth in todo:
            rec = BlockRecord(h, parent, int(depth), 0, t)
            try:
                self.store.allocate(rec.key, self.extent_bytes)
            except StorageFullError as e:
                log.warning("KV cache %s: the drive is full (%s); %d of %d blocks stored", self.path, e, len(issued),
                            len(todo))
                break
            while issued and inflight + self.extent_bytes > self.writeback_limit:  # bound the staging in flight
                oldest = next((f for _, _, f in issued if not f.done()), None)
                if oldest is None:
                    inflight = 0
                    break
                try:
                    oldest.wait()
                except StorageError:
                    pass
                inflight = sum(self.extent_bytes for _, _, f in issued if not f.done())
            if buffers is not None:
                buf = buffers[int(depth)]
                if buf.dtype != torch.uint8 or buf.numel() < self.extent_bytes or buf.data_ptr() % self.align:
                    raise ValueError(f"KVBlockStore.put: the buffer of block {depth} is not an aligned uint8 tensor "
                                     f"of {self.extent_bytes} bytes")
                buf = buf[: self.extent_bytes]
            else:
                buf = alloc_aligned(self.extent_bytes, zero=True)
                fill(int(depth), buf[: self.layout.block_nbytes])
            rec.crc32 = zlib.crc32(buf[: self.layout.block_nbytes].numpy())
            issued.append((rec, buf, self.store.write(rec.key, buf, 0, WRITE_BACK)))
            inflight += self.extent_bytes
        ok: list[tuple[BlockRecord, torch.Tensor]] = []
        failed = None
        for rec, buf, fut in issued:  # every write is waited for, so nothing is in flight below a freed extent
            try:
                fut.wait()
                if failed is None:
                    ok.append((rec, buf))
            except StorageError as e:
                failed = failed or (rec, e)
        if failed is not None:  # the first failed block and all after it: their descendants would be unreachable
            rec, e = failed
            msg = f"KV cache {self.path}: writing block {rec.hash[:16]} failed ({e}); the prompt is cached up to there"
            log.warning(msg)
            warnings.warn(msg, KVCacheWarning, stacklevel=2)
            for r, _, _ in issued[len(ok):]:
                self.store.free(r.key)
        for rec, buf in ok:
            self._add_record(rec)
            old = self.tier.peek(("kv", rec.hash))
            if old is not None:
                self.tier.drop(old)
            self.tier.add(TieredUnit(("kv", rec.hash), buf, kind="kv"))  # clean: kept while the DRAM budget allows
        for r in self._chain_records(first_parent):
            r.last_use = t
        self.counts["written"] += len(ok)
        self._uncommitted = True
        if commit:
            self.commit()
        return len(ok)

    def commit(self) -> None:
        """Make the blocks written since the last commit durable: slab fsynced, then the extent index,
        then the block index saved (each temp file, fsync, rename), then the ledger booked. A crash
        before the block index is saved loses only those blocks (their extents are freed at the next
        open); a block the index names has its bytes on the drive."""
        if not self.enabled or not getattr(self, "_uncommitted", False):
            return
        self.store.save_index()  # fsyncs the slab first
        self._save_blocks()
        self.store.flush_ledger()
        self._uncommitted = False

    def record(self, h: str) -> BlockRecord | None:
        """The cached block ``h`` (None when not cached)."""
        return self.blocks.get(h) if self.enabled else None

    def verify(self) -> list[tuple[str, str]]:
        """Read every block from the drive (not the DRAM tier) and check its CRC32: ``[(hash, why), ...]``
        of the blocks that fail (nothing is dropped; :meth:`load` drops a block that fails when it is
        used). For ``aidaptiv-ds kv-cache --verify`` and the crash tests."""
        bad: list[tuple[str, str]] = []
        if not self.enabled:
            return bad
        buf = alloc_aligned(self.extent_bytes)
        for r in sorted(self.blocks.values(), key=lambda r: r.depth):
            try:
                self.store.read(r.key, buf, 0, READ_DEMAND).wait()
            except StorageError as e:
                bad.append((r.hash, f"read failed: {e}"))
                continue
            got = zlib.crc32(buf[: self.layout.block_nbytes].numpy())
            if got != r.crc32:
                bad.append((r.hash, f"crc32 {got:#010x}, recorded {r.crc32:#010x}"))
        return bad

    def _ancestors(self, h: str | None) -> list[str]:
        out = []
        while h is not None and h in self.blocks:
            out.append(h)
            h = self.blocks[h].parent
        return out

    def _chain_records(self, h: str | None) -> list[BlockRecord]:
        return [self.blocks[x] for x in self._ancestors(h)]

    # ------------------------------------------------------------------ eviction
    def _evict_to(self, limit: int, protect: set[str]) -> bool:
        """Evict least recently used leaf blocks (not in ``protect``) until at most ``limit`` bytes
        remain; returns True when something was evicted (the caller saves the index)."""
        evicted = False
        while self.bytes_on_drive() > max(limit, 0):
            leaves = [r for r in self.blocks.values() if not self.children.get(r.hash) and r.hash not in protect]
            if not leaves:
                break
            victim = min(leaves, key=lambda r: (r.last_use, -r.depth))
            self._remove(victim.hash)
            self.counts["evicted"] += 1
            evicted = True
        return evicted

    def take_removed(self) -> list[str]:
        """Hashes of the blocks removed (evicted, dropped as corrupt, cleared) since the last call, when
        :attr:`removed_log` is a list (a caller that mirrors the index sets it; None records nothing)."""
        if self.removed_log is None:
            return []
        out, self.removed_log = self.removed_log, []
        return out

    def _remove(self, h: str) -> None:
        rec = self.blocks.pop(h)
        if self.removed_log is not None:
            self.removed_log.append(h)
        self.children.pop(h, None)
        if rec.parent is not None and rec.parent in self.children:
            self.children[rec.parent].discard(h)
        s = self.tier.peek(("kv", h))
        if s is not None:
            self.tier.drop(s)  # a holder of a reference keeps its own tensor
        self.store.free(rec.key)

    def _drop_subtree(self, h: str) -> None:
        for c in list(self.children.get(h, ())):
            self._drop_subtree(c)
        if h in self.blocks:
            self._remove(h)

    def clear(self) -> int:
        """Remove every block (the files stay, empty); returns how many were removed."""
        if not self.enabled:
            return 0
        n = len(self.blocks)
        for r in sorted(self.blocks.values(), key=lambda r: -r.depth):
            self._remove(r.hash)
        self._save_blocks()
        self.store.save_index()
        return n

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Save the indexes, book the ledger, release the directory (the blocks stay on the drive)."""
        if not self.enabled:
            return
        try:
            self.commit()
        finally:
            self.enabled = False
        try:
            self._save_blocks()  # last uses
        finally:
            self.store.close()  # keep=True: saves the extent index, books the ledger, releases the lock
            self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def describe(self) -> str:
        st = self.stats()
        return (f"{st.blocks} blocks ({st.tokens} tokens, {format_bytes(st.bytes_on_drive)} of "
                f"{format_bytes(st.capacity_bytes)}) in {self.path}")
