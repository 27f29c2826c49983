"""Parameter swapper: DeepSpeed's ``AsyncPartitionedParameterSwapper`` contract on our store and tier.

Contract (``docs/deepspeed-seams.md`` §1.3-1.5, DeepSpeed 0.19.8), and how it is met here:

* partitions live packed in creation order in a :class:`PackedRegion` per dtype, so a module's
  partitions are one contiguous range and one fetch is one sequential read. The dtype is the
  partition's own (``param.dtype``): DeepSpeed 0.19.8 on a CPU accelerator hands swappers a model
  dtype of bf16 for fp32 models (``partition_parameters.py:409``: ``is_bf16_supported`` is not
  called), which would silently round fp32 weights to bf16;
* ``swap_in`` de-duplicates its list (the coordinator passes duplicates); partitions already in a
  host slice are served from it, the rest are read as coalesced slices; a synchronous call
  completes *all* pending reads (``partition_parameters.py:1717-1720`` relies on it);
* ``remove_partition_and_release_buffers`` is a clean drop: the copy below is authoritative,
  nothing is written, and the DRAM tier may keep the bytes;
* ``swap_out_and_release`` and ``swap_out_partitioned_params`` carry new content: it is staged
  once (cast from fp32 master weights straight into the write buffer), written at write-back
  priority, and the staging buffer becomes the host copy of those partitions, so no read of them
  can see older bytes; pending reads of the written partitions are cancelled first;
* host buffers are never recycled by hand: each slice owns a fresh buffer released to the
  allocator, whose pinned-memory cache on CUDA holds a block until copies out of it are done;
* a not-resident partition's ``ds_tensor.data`` is a 0-dim placeholder (zenflow checks ``dim() == 0``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import enum
import itertools
import logging
import weakref
from typing import NamedTuple

import torch

from ..io.buffers import REGISTRY, alloc_aligned
from ..io.engine import READ_DEMAND, READ_PREFETCH, WRITE_BACK
from ..io.futures import wait_all
from ..store.packed import PackedRegion
from ..tiers.host_tier import HostTier
from ..tiers.unit import TieredUnit
from ..errors import AidaptivConfigError
from ..spans import spanned
from .errors import DeepSpeedContractError
from .phase import EnginePhase, Phase
from .runtime import Runtime

log = logging.getLogger("aidaptiv_ds")

#: Unrequested bytes a coalesced read may include between two wanted partitions.
GAP_BYTES = 256 << 10
#: Most bytes one coalesced read (one host slice) spans, unless a single partition is larger: a read
#: ahead of many modules is then several slices that complete one after another, so compute starts on
#: the first module while the rest is still arriving, and each slice is released on its own.
MAX_RUN_BYTES = 32 << 20


def _status():
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
    return PartitionedParamStatus


def _read_done(s: TieredUnit) -> bool:
    """``s`` holds its bytes: no read, or a read that completed without error (never waits)."""
    return s.ready is None or (s.ready.done() and s.ready.exception() is None)


def _gathered_status():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return ZeroParamStatus


class _Loc(NamedTuple):
    region: PackedRegion
    start: int  # byte offset in the region
    numel: int
    dtype: torch.dtype
    elsize: int
    readonly: bool = False  # an unpacked partition: the first write relocates it (the unpacked copy stays)
    aliased: bool = False  # an fp32 partition read from its master slot: writes are the master's write-back

    @property
    def nbytes(self) -> int:
        return self.numel * self.elsize

    @property
    def end(self) -> int:
        return self.start + self.numel * self.elsize


class PartitionState(enum.Enum):
    """Where a partition's current bytes are, as the swapper sees them (see :class:`PartitionRecord`)."""
    ON_DRIVE = "on drive"  # only the store has them
    READING = "reading"  # a read into a host slice is in flight
    IN_DRAM = "in DRAM"  # a host slice has them: read ahead, cached by the budget, resident, or a written copy
    PUBLISHED = "published"  # ds_tensor (INFLIGHT/AVAILABLE) views the host slice and pins it


@dataclasses.dataclass(eq=False)
class PartitionRecord:
    """One parameter partition of this rank: where it is stored, which host slice holds its current
    bytes, and which slice its published ``ds_tensor`` pins.

    [Note: partition states] ``ON_DRIVE`` → ``READING`` (:meth:`AidaptivParamSwapper._read_slices`)
    → ``IN_DRAM`` (the read completed) → ``PUBLISHED`` (``swap_in`` / ``promote_ready``: the
    ``ds_tensor`` views the slice, which takes a reference, so the DRAM tier cannot evict it) →
    ``IN_DRAM`` (DeepSpeed releases it: ``remove_partition_and_release_buffers``) → ``ON_DRIVE`` (the
    tier evicts the slice: ``_on_drop``). A write (``swap_out_*``) makes the staging buffer the host
    slice (``IN_DRAM``) or, without ``keep``, leaves ``ON_DRIVE``; :meth:`detach_host` is the one way a
    record lets go of a slice that still holds other partitions. ``loc`` changes only by relocation:
    an unpacked partition's first write, :meth:`~AidaptivParamSwapper.adopt_unpacked`,
    :meth:`~AidaptivParamSwapper.alias_to_master`.
    """
    ds_id: int
    loc: _Loc  # where its bytes are stored
    owner: weakref.ref | None = None  # its parameter, while anything holds it
    host: TieredUnit | None = None  # the host slice holding its current bytes
    pinned: TieredUnit | None = None  # the slice its published ds_tensor references
    unadopted: bool = False  # a first partition not written: its bytes come from the unpacked store
    home: _Loc | None = None  # an fp32 partition edited away from its master slot: that slot ([Note: edits of aliased partitions])

    @property
    def state(self) -> PartitionState:
        if self.pinned is not None:
            return PartitionState.PUBLISHED
        if self.host is None:
            return PartitionState.ON_DRIVE
        if self.host.ready is not None and not self.host.ready.done():
            return PartitionState.READING
        return PartitionState.IN_DRAM

    def alive(self) -> bool:
        """False once the parameter is gone (garbage collected: e.g. an output embedding ``zero.Init``
        partitioned and the model then replaced by the tied input embedding)."""
        return self.owner is None or self.owner() is not None

    def detach_host(self, tier: HostTier) -> None:
        """Stop using the host slice (its bytes are no longer this partition's current ones).

        [Note: a slice no partition reads] A slice read ahead (or the master copies the step left for the next
        forward) is working memory until its first use, and the budget never evicts working memory. When its
        last partition detaches before that use (an fp32 parameter aliased to its master gets a new copy each
        step), nobody will use it: it stops being read-ahead, so the next budget check evicts it. Before, each
        step left one such slice behind: the DRAM tier's working memory grew by a sub-group's parameters per
        step at budget 0 (issue 34: 1.50 GiB at step 1 to 4.8 GiB at step 18 for SmolLM2-135M fp32).
        """
        old, self.host = self.host, None
        if old is not None:
            tier.set_members(old, [m for m in old.members if m != self.ds_id])
            if not old.members:
                tier.mark_used(old)


class AidaptivParamSwapper:
    """One per process; shared by every ``zero.Init`` (DeepSpeed builds one swapper per ``Init``).

    Args:
        runtime: the process runtime (store, tier, engine).
    """

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.min_swap_bytes = int(runtime.cfg.min_swap_bytes)
        self._regions: dict[torch.dtype, PackedRegion] = {}
        self._parts: dict[int, PartitionRecord] = {}  # ds_id -> its record
        self._by_tensor: dict[int, int] = {}  # id(param.ds_tensor) -> ds_id (fast_init hands us ds_tensors)
        self._inflight: list = []  # params INFLIGHT, published at synchronize_reads
        self._seq = itertools.count()
        self._placeholder = torch.tensor(1).half()
        self._reserved_numel = 0
        self._reserved: list[torch.Tensor] = []
        self._window: int | None = None
        #: the phase of the engine initialising now ([Note: phases] in ``phase.py``; the Stage-3 subclass lends
        #: it for the call): in ``INITIALIZING`` DeepSpeed rewrites unchanged partitions. This swapper is
        #: shared by the engines of a runtime, so it asks nothing else of the record
        self.phase = EnginePhase()
        #: inside :meth:`reads_only`: a repartition "with an update" rewrites no partition
        self.reading_only = False
        self.from_unpacked = bool(runtime.cfg.from_unpacked)
        self.aliased_skipped_bytes = 0  # parameter writes saved by reading fp32 partitions from their masters
        #: the optimizer update riding the forward (step_pipeline.py) is running: keep a copy of the new bytes of
        #: fp32 partitions read from their master slot, so the forward that needs them next does not read them
        #: back from the slot just written ([Note: the updated parameters stay for the forward])
        self.keep_master_copies = False
        self.master_copies_bytes = 0  # bytes of those copies (each saved one read of the same bytes)
        self.skipped_init_bytes = 0
        self.swap_folder = runtime.namespace.rank_dir(0)
        #: ``fn(ds_id, uint8 bytes)`` called for each fp32 partition read from a master slot whose host
        #: slice leaves the DRAM tier with its bytes current (the optimizer swappers fill master slots)
        self.drop_listeners: list = []
        #: ``fn(ds_ids)`` called with the partitions each ``swap_in`` publishes (the Stage-3 optimizer
        #: starts reading the state of their sub-groups inside the boundary backward)
        self.use_listeners: list = []

    # ------------------------------------------------------------------ layout
    def _region(self, dtype: torch.dtype) -> PackedRegion:
        r = self._regions.get(dtype)
        if r is None:
            r = self._regions[dtype] = PackedRegion(self.rt.store, "params/" + str(dtype).replace("torch.", ""))
        return r

    def _register(self, param, numel: int) -> PartitionRecord:
        rec = self._parts.get(param.ds_id)
        if rec is None:
            dtype = param.dtype
            elsize = dtype.itemsize
            region = self._region(dtype)
            start = region.append(numel * elsize, align=elsize)
            rec = self._parts[param.ds_id] = PartitionRecord(param.ds_id, _Loc(region, start, int(numel), dtype, elsize),
                                                             owner=weakref.ref(param))
        elif rec.loc.numel != numel:
            raise DeepSpeedContractError(f"aidaptiv_ds: parameter ds_id={param.ds_id} was partitioned with "
                                         f"{rec.loc.numel} elements and now {numel}; re-partitioning with another "
                                         f"size is not supported")
        return rec

    def live_partitions(self) -> int:
        """Partitions whose parameter is still alive (a model that may be gathered or trained again)."""
        return sum(1 for r in self._parts.values() if r.alive())

    def holds(self, ds_id: int) -> bool:
        """True when partition ``ds_id`` was swapped out through this swapper."""
        return ds_id in self._parts

    def record(self, ds_id: int) -> PartitionRecord:
        """The record of partition ``ds_id`` (``KeyError`` when :meth:`holds` is False)."""
        return self._parts[ds_id]

    def partition_bytes(self) -> int:
        """Bytes of all partitions this swapper holds (this rank)."""
        return sum(r.loc.nbytes for r in self._parts.values())

    def largest_partition_bytes(self) -> int:
        return max((r.loc.nbytes for r in self._parts.values()), default=0)

    def _partition_bytes(self, s: TieredUnit, ds_id: int) -> torch.Tensor:
        """Partition ``ds_id`` 's bytes in host slice ``s`` (uint8, a view)."""
        loc = self._parts[ds_id].loc
        off = loc.start - s.key[2]
        return s.buf[off:off + loc.nbytes]

    def _view(self, s: TieredUnit, ds_id: int) -> torch.Tensor:
        return self._partition_bytes(s, ds_id).view(self._parts[ds_id].loc.dtype)

    # ------------------------------------------------------------------ DeepSpeed API
    def swappable_tensor(self, param=None, numel=None) -> bool:
        """True when a partition goes through the store (its bytes >= ``aidaptiv.min_swap_bytes``)."""
        if param is not None:
            nbytes = param.ds_tensor.ds_numel * param.element_size()
        else:  # DeepSpeed asks with a partition size only; judge it at the widest element (fp32)
            nbytes = int(numel) * 4
        return nbytes >= self.min_swap_bytes

    def available_swap_in_buffers(self) -> int:
        """No fixed pool: reads are bounded by the prefetch window, not a buffer count."""
        return 1 << 30

    def get_buffer(self, param, numel: int) -> torch.Tensor:
        """A zeroed host buffer of ``numel`` elements of ``param.dtype`` for a first partition."""
        first = param.ds_id not in self._parts
        rec = self._register(param, int(numel))
        if self.from_unpacked and first:  # its bytes will come from the unpacked store
            rec.unadopted = True
        return alloc_aligned(rec.loc.nbytes, dtype=rec.loc.dtype, zero=True)[: rec.loc.numel]

    @spanned("aidaptiv::swap_out")
    def swap_out_and_release(self, params, async_op: bool = False, force_buffer_release: bool = False) -> None:
        """Persist each partition's current ``ds_tensor.data`` and release it (synchronous).

        Used at first partition and after an in-place modification (``GatheredParameters``); inside
        :meth:`reads_only` a registered partition is released clean instead (nothing changed it).
        """
        if self.reading_only and all(p.ds_id in self._parts for p in params):
            self.remove_partition_and_release_buffers(params)
            return
        S = _status()
        items = []
        for p in params:
            numel = p.ds_tensor.ds_numel
            first = p.ds_id not in self._parts
            rec = self._register(p, numel)
            self._by_tensor[id(p.ds_tensor)] = p.ds_id
            if self.from_unpacked and (first or rec.unadopted):
                rec.unadopted = True  # initial content comes from the unpacked store: nothing to write
                continue
            items.append((p, p.ds_tensor.data.detach().reshape(-1)[:numel]))
        futs = self._write(items, keep=False, edit=True)
        with self.rt.io_wait:
            wait_all(futs)
        for p in params:
            self._unpublish(p)
            p.ds_tensor.data = self._placeholder.data
            p.ds_tensor.status = S.NOT_AVAILABLE

    @contextlib.contextmanager
    def reads_only(self):
        """Within it, DeepSpeed's repartition after ``GatheredParameters(modifier_rank=0)`` releases each partition
        clean instead of writing it again ([Note: the 16-bit save reads only]).

        [Note: the 16-bit save reads only] ``engine.save_16bit_model`` (HF Trainer's ``save_model`` under ZeRO-3
        with ``stage3_gather_16bit_weights_on_model_save``) gathers the model module by module with
        ``GatheredParameters(..., modifier_rank=0)`` (``engine.py``, ``_zero3_consolidated_16bit_state_dict``):
        rank 0 only copies the weights to the CPU, but the exit broadcasts them and repartitions "updated", and
        DeepSpeed's NVMe path writes every partition back (found by a new-user trial: 1.4 MB written to the
        drive per save of a 264K-parameter model, the whole model each time, with no step between). The bytes
        broadcast are the gathered partitions themselves, so nothing changed: released clean, nothing written.
        """
        before, self.reading_only = self.reading_only, True
        try:
            yield
        finally:
            self.reading_only = before

    def remove_partition_and_release_buffers(self, params) -> None:
        """Clean drop: the stored copy is authoritative; the DRAM tier may keep the bytes.

        [Note: a release under a gather] DeepSpeed's coordinator releases the partitions of persistent
        parameters (``stage3_param_persistence_threshold``) right after *issuing* their all-gather
        (``partitioned_param_coordinator.py:615-620``): on a GPU the gather reads a device copy, but on a
        CPU rank the gather's input is the partition itself, and an asynchronous gloo all-gather reads it
        later. Dropping it then hands the collective our 0-dim placeholder (a size mismatch, or the
        wrong dtype in the next matmul). A parameter still ``INFLIGHT`` keeps its partition published
        here (it is small: it is persistent); its next partitioning releases it (DeepSpeed never
        partitions an ``INFLIGHT`` parameter).
        """
        S = _status()
        inflight = _gathered_status().INFLIGHT
        for p in params:
            if p.ds_tensor is None:
                continue
            if getattr(p, "ds_status", None) == inflight:  # a gather may still read it ([Note: a release under a gather])
                continue
            self._unpublish(p)
            self._inflight = [q for q in self._inflight if q is not p]
            p.ds_tensor.data = self._placeholder.data
            p.ds_tensor.status = S.NOT_AVAILABLE

    @spanned("aidaptiv::swap_in")
    def swap_in(self, params, async_op: bool = True, swap_in_buffers=None) -> None:
        """Make partitions available: INFLIGHT after an async call, AVAILABLE after a sync one."""
        S = _status()
        seen = set()
        todo = []
        for p in params:
            if p.ds_id in seen or p.ds_tensor.status != S.NOT_AVAILABLE:
                continue
            if p.ds_id not in self._parts:
                raise DeepSpeedContractError(f"aidaptiv_ds: parameter ds_id={p.ds_id} was never swapped out; nothing to read")
            seen.add(p.ds_id)
            todo.append(p)
        for p in todo:  # pin what DRAM holds first: the reads below may evict unpinned cached slices
            if self._parts[p.ds_id].host is not None:
                self._publish(p)
        missing = [p.ds_id for p in todo if self._parts[p.ds_id].host is None]
        if missing:
            self._read_slices(missing, READ_PREFETCH if async_op else READ_DEMAND)
        for p in todo:
            self._publish(p)
            p.ds_tensor.status = S.INFLIGHT
            self._inflight.append(p)
        if todo:
            for fn in self.use_listeners:
                fn([p.ds_id for p in todo])
        if not async_op:
            self.synchronize_reads()

    def synchronize_reads(self) -> None:
        """Complete every pending read and publish all INFLIGHT partitions as AVAILABLE."""
        S = _status()
        pending, self._inflight = self._inflight, []
        with self.rt.io_wait:
            for p in pending:
                self._parts[p.ds_id].pinned.wait_ready()
        for p in pending:
            p.ds_tensor.status = S.AVAILABLE

    def synchronize_writes(self) -> None:
        """Wait for every partition write issued so far: the swap-outs, and the write-backs of parameter slices
        the host tier decided (a dirty eviction, a resident slice's flush)."""
        with self.rt.io_wait:
            for r in self._regions.values():
                r.flush()
            self.rt.tier.wait_writes(kind="param")

    def swap_into_buffer(self, param, dest_buffer: torch.Tensor) -> None:
        """Synchronously copy a partition into a caller-owned buffer (DeepSpeed then keeps it in CPU)."""
        S = _status()
        dest_buffer.data.copy_(self.read_partitions([param.ds_id])[0])
        param.ds_tensor.status = S.NOT_AVAILABLE

    def get_path(self, param, must_exist: bool = False) -> str:
        """The slab of the first cache path (informational: our optimizer swapper reads partitions
        through :meth:`read_partition_tensors`, never by path)."""
        return self.rt.namespace.slab_path(0)

    def reserve_partitioned_swap_space(self, partition_num_elems) -> None:
        self._reserved_numel = max(self._reserved_numel, int(sum(partition_num_elems)))

    def reserve_available_buffers(self) -> list[torch.Tensor]:
        """Staging for ``offload_optimizer.fast_init``: one fp32 buffer of the largest sub-group's numel."""
        n = max(self._reserved_numel, 1)
        self._reserved = [alloc_aligned(n * 4, dtype=torch.float32, register=True)[:n]]
        return self._reserved

    def release_reserved_buffers(self) -> None:
        for b in self._reserved:
            REGISTRY.remove(b)
        self._reserved = []

    @spanned("aidaptiv::swap_out")
    def swap_out_partitioned_params(self, dst_fp16_params, src_fp32_params) -> None:
        """Write fp32 master slices cast to each partition's dtype as its new content."""
        S = _status()
        if self.phase.open(Phase.INITIALIZING):  # DeepSpeed re-writes partitions from masters just made from them
            self.skipped_init_bytes += sum(p.ds_tensor.ds_numel * p.element_size() for p in dst_fp16_params)
            for p in dst_fp16_params:
                p.ds_tensor.status = S.NOT_AVAILABLE
            return
        ids = {p.ds_id for p in dst_fp16_params}
        self._inflight = [q for q in self._inflight if q.ds_id not in ids]  # never publish the old bytes
        for p in dst_fp16_params:
            pinned = self._parts[p.ds_id].pinned
            if pinned is not None:
                pinned.wait_ready()
                self._unpublish(p)
            p.ds_tensor.data = self._placeholder.data
        self._write(list(zip(dst_fp16_params, src_fp32_params)), keep=True)
        for p in dst_fp16_params:
            p.ds_tensor.status = S.NOT_AVAILABLE

    # ------------------------------------------------------------------ scheduling
    def prefetch_window(self) -> int:
        """Bytes that may be read ahead and not used yet (see :meth:`Runtime.prefetch_bytes`)."""
        if self._window is None:
            self._window = self.rt.prefetch_bytes(2 * self.largest_partition_bytes())
        return self._window

    @spanned("aidaptiv::prefetch")
    def prefetch(self, ds_ids: list[int], window: int) -> int:
        """Keep the next ``window`` bytes of the coordinator's queue read ahead: walk ``ds_ids`` (the
        partitions DeepSpeed fetches next, in order, without duplicates) counting the bytes already held
        for them ahead of use (read and not published yet, or published ``INFLIGHT`` by
        :meth:`promote_ready` before DeepSpeed fetched them), and start reads of the ones not in DRAM
        until the next one would not fit. Partitions held by the DRAM budget (resident or cached)
        cost the window nothing. Returns bytes issued.

        [Note: why published partitions count] DeepSpeed's coordinator moves every published
        partition to ``AVAILABLE`` at its next ``synchronize_reads``, long before it uses them; counting
        only unpublished reads let the read-ahead refill behind them until the whole model was in DRAM.
        """
        used, take = 0, []
        for i in ds_ids:
            rec = self._parts.get(i)
            if rec is None:
                continue
            loc, s = rec.loc, rec.host
            if s is not None:
                if s.resident or not (s.prefetched or rec.pinned is not None):
                    continue  # in DRAM on the budget's account
                used += loc.nbytes
                if used >= window:
                    break
                continue
            if used + loc.nbytes > window:
                break
            used += loc.nbytes
            take.append(i)
        if take:
            self._read_slices(take, READ_PREFETCH)
        return sum(self._parts[i].loc.nbytes for i in take)

    def promote_ready(self, params, numel_limit: int | None = None) -> None:
        """Publish (INFLIGHT) leading partitions of ``params`` (queue order), so DeepSpeed's all-gather
        prefetch, which stops at the first partition on NVMe that is not available, runs on over them.

        ``numel_limit`` None (one rank): those whose reads are done, stopping at the first one that is
        still on the drive or being read, or when the bytes published ahead of DeepSpeed's fetch
        (partition published, parameter not gathered yet) would pass :meth:`prefetch_window` (at least
        one partition is published). ``numel_limit`` given (several ranks): the partitions among
        the queue entries that start within the first ``numel_limit`` elements (DeepSpeed's own NVMe
        prefetch rule, at least one entry), read or not; a later ``synchronize_reads`` waits for them.
        With several ranks the set must not depend on timing: the all-gathers DeepSpeed then issues
        are collective, and ranks that published different sets (one rank's reads finished sooner)
        all-gather different parameters: a crash on a size mismatch, or silently exchanged wrong
        bytes when the sizes agree.

        [Note: published partitions are pinned] A published partition holds a reference on its host
        slice, and the DRAM tier evicts only slices nobody references. Without the window bound, a
        rank whose budget caches most of the parameters published every cached partition of the queue
        at each call (all their "reads" are done), so from step 2 on (the first step with a complete
        trace) the cached parameters could not be evicted for the gradients backward adds: the 2.7B
        fp32 run at ``auto`` held 10 GiB of pinned parameter slices at the step boundary against a
        9.6 GiB budget, and peaked 6 GiB above step 1. DeepSpeed's all-gather prefetch takes at most
        ``stage3_prefetch_bucket_size`` elements ahead anyway.
        """
        S = _status()
        take = []
        considered = 0
        if numel_limit is not None:
            for p in params:
                if considered > numel_limit:
                    break
                considered += p.ds_numel
                if p.ds_tensor.status == S.NOT_AVAILABLE:
                    take.append(p)
            if take:
                self.swap_in(take, async_op=True)
            return
        Z = _gathered_status()
        window = self.prefetch_window()
        ahead, seen = 0, set()
        for p in params:
            if p.ds_id in seen:
                continue
            seen.add(p.ds_id)
            rec = self._parts.get(p.ds_id)
            if p.ds_tensor.status != S.NOT_AVAILABLE:
                if rec is not None and rec.pinned is not None and p.ds_status == Z.NOT_AVAILABLE:
                    ahead += rec.loc.nbytes  # published by an earlier call, not fetched yet
                continue
            s = rec.host if rec is not None else None
            if s is None or (s.ready is not None and not s.ready.done()):  # on the drive or still being read
                break
            nbytes = rec.loc.nbytes
            if (take or ahead) and ahead + nbytes > window:
                break
            ahead += nbytes
            take.append(p)
        if take:
            self.swap_in(take, async_op=True)

    # ------------------------------------------------------------------ internals
    def _publish(self, p) -> None:
        rec = self._parts[p.ds_id]
        s = rec.host
        if rec.pinned is not s:
            self._unpublish(p)
            self.rt.tier.acquire(s)
            rec.pinned = s
        p.ds_tensor.data = self._view(s, p.ds_id)

    def _unpublish(self, p) -> None:
        rec = self._parts.get(p.ds_id)
        if rec is not None and rec.pinned is not None:
            s, rec.pinned = rec.pinned, None
            self.rt.tier.release(s)

    def _runs(self, ids, gap: int) -> list[list[int]]:
        """Group ids by region, then into runs at most ``gap`` bytes apart (sorted by offset), each
        spanning at most :data:`MAX_RUN_BYTES` (a single larger partition is a run of its own)."""
        runs: list[list[int]] = []
        last_region, begin, end = None, -1, -1
        for i in sorted(set(ids), key=lambda i: (id(self._parts[i].loc.region), self._parts[i].loc.start)):
            loc = self._parts[i].loc
            if runs and loc.region is last_region and loc.start - end <= gap and \
                    max(end, loc.end) - begin <= MAX_RUN_BYTES:
                runs[-1].append(i)
                end = max(end, loc.end)
            else:
                runs.append([i])
                last_region, begin, end = loc.region, loc.start, loc.end
        return runs

    def _span(self, run: list[int]) -> tuple[PackedRegion, int, int]:
        """Region and bytes ``[start, end)`` covered by the partitions of ``run``."""
        locs = [self._parts[i].loc for i in run]
        return locs[0].region, min(x.start for x in locs), max(x.end for x in locs)

    def _read_slices(self, ids, priority: int) -> list[TieredUnit]:
        """Read coalesced slices for ``ids`` (none of which may be mapped already) into the tier."""
        out = []
        for run in self._runs(ids, GAP_BYTES):
            region, start, end = self._span(run)
            a, _ = region.aligned(start, end)
            fut, buf, _ = region.read(start, end, priority=priority)
            s = TieredUnit(("p", region.name, a, next(self._seq)), buf, members=run, kind="param", ready=fut,
                           prefetched=True, on_drop=self._on_drop)  # working memory until first used
            for i in run:
                self._parts[i].host = s
            self.rt.tier.add(s)
            out.append(s)
        return out

    def _on_drop(self, s: TieredUnit) -> None:
        listen = self.drop_listeners and _read_done(s)
        for i in s.members:
            rec = self._parts.get(i)
            if rec is not None and rec.host is s:
                if listen and rec.loc.aliased:
                    src = self.host_bytes(i)
                    for fn in self.drop_listeners:
                        fn(i, src)
                rec.host = None

    def _write(self, items: list, keep: bool, edit: bool = False) -> list:
        """Stage and write ``[(param, source tensor), ...]``; exact neighbours share one write.

        Partitions held by a resident slice are updated in DRAM instead (no write). With ``keep``
        the staging buffer becomes the host slice of the written partitions; any older host copy
        of them stops being used. ``edit``: the bytes are not the fp32 master's (a DeepSpeed API changed
        the parameter: ``GatheredParameters(modifier_rank=...)``, a checkpoint's frozen weights), so a
        partition read from its master slot moves to a place of its own ([Note: edits of aliased
        partitions]); without it the bytes are the master's cast (the optimizer step).
        """
        src, copies = {}, {}
        for p, t in items:
            rec = self._parts[p.ds_id]
            loc = rec.loc
            if loc.aliased and edit:  # the parameter now differs from its master: give it a place of its own
                region = self._region(loc.dtype)
                rec.home = loc
                rec.loc = loc = _Loc(region, region.append(loc.nbytes, align=loc.elsize), loc.numel, loc.dtype,
                                     loc.elsize)
                rec.detach_host(self.rt.tier)
            elif rec.home is not None and not edit:  # the step rewrote it from its master: one copy again
                rec.loc, rec.home = rec.home, None
                loc = rec.loc
            if loc.aliased:  # the same bytes reach the drive with the master's write-back: drop old copies
                rec.detach_host(self.rt.tier)
                self.aliased_skipped_bytes += loc.nbytes
                if keep and self.keep_master_copies:
                    copies[p.ds_id] = t
                continue
            if loc.readonly:  # keep the unpacked copy: the new bytes get a place of their own
                region = self._region(loc.dtype)
                rec.loc = _Loc(region, region.append(loc.nbytes, align=loc.elsize), loc.numel, loc.dtype, loc.elsize)
                rec.detach_host(self.rt.tier)
            s = rec.host
            if s is not None and s.resident:
                self._view(s, p.ds_id).copy_(t.reshape(-1))
                self.rt.tier.mark_dirty(s)
            else:
                src[p.ds_id] = t
        futs = []
        for run in self._runs(src, 0):
            region, start, end = self._span(run)

            def fill(view, run=run, start=start):
                for i in run:
                    loc = self._parts[i].loc
                    view[loc.start - start:loc.end - start].view(loc.dtype).copy_(src[i].reshape(-1))

            self.rt.tier.reserve_write(end - start)
            fut, staging, skip = region.write(start, end - start, fill, priority=WRITE_BACK)
            futs.append(fut)
            for i in run:
                self._parts[i].detach_host(self.rt.tier)
            if keep:
                s = TieredUnit(("p", region.name, start - skip, next(self._seq)), staging, members=run, kind="param",
                               on_drop=self._on_drop)
                for i in run:
                    self._parts[i].host = s
                self.rt.tier.add_writing(s, fut)
            else:
                self.rt.tier.track_write(fut, end - start)
        for run in self._runs(copies, 0):  # the next forward reads them at once: serve it from DRAM
            region, start, end = self._span(run)
            buf = alloc_aligned(end - start)
            for i in run:
                loc = self._parts[i].loc
                buf[loc.start - start:loc.end - start].view(loc.dtype).copy_(copies[i].reshape(-1))
            s = TieredUnit(("p", region.name, start, next(self._seq)), buf, members=run, kind="param", prefetched=True,
                           on_drop=self._on_drop)  # clean: its bytes are the master's, which its write-back carries
            for i in run:
                self._parts[i].host = s
            self.rt.tier.add(s)
            self.master_copies_bytes += end - start
        return futs

    def make_resident(self) -> None:
        """Read every partition into one resident slice per dtype (the plan keeps parameters in DRAM)."""
        self.synchronize_writes()
        self.rt.tier.wait_writes()
        for region in self._regions.values():
            ids = [i for i, r in self._parts.items() if r.loc.region is region and r.alive()]
            if not ids or all(self._parts[i].host is not None and self._parts[i].host.resident for i in ids):
                continue
            fut, buf = region.read_all(priority=READ_DEMAND)  # chunks given back (release_dead_chunks) are skipped
            with self.rt.io_wait:
                fut.wait()

            def writeback(sl, region=region):
                return region.write_all(sl.buf)

            s = TieredUnit(("p", region.name, 0, next(self._seq)), buf, members=ids, kind="param", resident=True,
                           on_drop=self._on_drop, writeback=writeback)
            for i in ids:  # the newest bytes of a partition may sit in a host slice, not yet below
                old = self._parts[i].host
                if old is not None:
                    old.wait_ready()
                    self._view(s, i).copy_(self._view(old, i))
            stale = {id(r.host): r.host for r in self._parts.values() if r.host is not None and r.host.refs == 0}
            for i in ids:
                self._parts[i].host = s
            self.rt.tier.add(s)
            for x in stale.values():
                self.rt.tier.drop(x)
            for r in self._parts.values():
                if r.pinned is not None and r.loc.region is region:
                    self.rt.tier.release(r.pinned)
                    self.rt.tier.acquire(s)
                    r.pinned = s

    def adopt_unpacked(self, module) -> int:
        """Point every partition of ``module`` at its place in the unpacked store of this rank
        (:mod:`aidaptiv_ds.checkpoint.unpack`); returns the bytes adopted.

        Raises:
            FileNotFoundError: the namespace was not unpacked.
            ValueError: the unpacked model does not match (world size, a missing tensor, a size or dtype).
        """
        from ..checkpoint.unpack import read_manifest, region_name

        man = read_manifest(self.rt.namespace.rank_dir(0))
        if man["world_size"] != self.rt.world:
            raise AidaptivConfigError(f"aidaptiv.from_unpacked: the store was unpacked for world size {man['world_size']}, "
                             f"this run has {self.rt.world}. Fix: unpack again with --world-size {self.rt.world}")
        dtype = getattr(torch, man["dtype"])
        region = PackedRegion(self.rt.store, region_name(dtype))
        region.reopen(man["region_size"])
        elsize = dtype.itemsize
        problems, adopted = [], 0
        for name, p in module.named_parameters():
            if getattr(p, "ds_tensor", None) is None or p.ds_id not in self._parts:
                continue
            e = man["tensors"].get(name)
            if e is None:
                problems.append(f"{name}: not in the unpacked model")
            elif e["numel"] != p.ds_numel or e["partition_numel"] != p.ds_tensor.ds_numel or dtype != p.dtype:
                problems.append(f"{name}: unpacked {e['numel']} elements ({man['dtype']}), the model has "
                                f"{p.ds_numel} ({str(p.dtype)[6:]})")
            else:
                rec = self._parts[p.ds_id]
                rec.detach_host(self.rt.tier)
                rec.loc = _Loc(region, e["start"], e["partition_numel"], dtype, elsize, readonly=True)
                rec.unadopted = False
                adopted += e["partition_numel"] * elsize
        # partitions of parameters the model no longer has (e.g. an output embedding created, then tied to the
        # input one) are never used: nothing to adopt, nothing to write
        in_model = {p.ds_id for p in module.parameters() if getattr(p, "ds_id", None) is not None}
        unadopted = [r for r in self._parts.values() if r.unadopted and r.ds_id in in_model]
        for r in self._parts.values():
            r.unadopted = r.unadopted and r.ds_id in in_model
        if unadopted and not problems:
            problems.append(f"{len(unadopted)} partitions were created but belong to no parameter of the model")
        if problems:
            raise AidaptivConfigError(f"aidaptiv.from_unpacked: the store unpacked from {man['source']} does not match this "
                             f"model:\n  " + "\n  ".join(problems[:10]) + "\nFix: unpack the model you train "
                             f"(`aidaptiv-ds unpack MODEL_DIR ...`), or remove \"from_unpacked\"")
        return adopted

    def alias_to_master(self, params, view) -> list[tuple[int, int, int]]:
        """Read ``params`` (one sub-group's fp32 partitions, in sub-group order) from ``view``, the
        master slot of their sub-group, and never write them on their own; returns ``(ds_id, byte
        offset in the slot, bytes)`` per partition.

        [Note: edits of aliased partitions] A DeepSpeed API may give a parameter new bytes that are not
        its master's: ``GatheredParameters(params, modifier_rank=r)`` broadcasts an in-place edit and
        repartitions with ``has_been_updated=True`` (``partition_parameters.py:2520-2525, 1807-1893``), which
        writes the edited partition through ``swap_out_and_release``. DeepSpeed keeps that edit in the
        parameter only: its fp32 master (and moments) stay as they were until the next optimizer step
        casts the master onto the parameter again. So the edited partition leaves its master slot for a
        place of its own in the parameter region (``PartitionRecord.home`` remembers the slot), the
        optimizer's master fill stops taking bytes from it (:meth:`host_bytes`, :meth:`is_master_alias`),
        and the next write from the master (``swap_out_partitioned_params``) makes it an alias again.
        The master slot is never written from an edit.

        Raises:
            DeepSpeedContractError: a partition is not fp32 or the partitions do not fill the view in order.
        """
        off, out = 0, []
        for p in params:
            rec = self._parts.get(p.ds_id)
            if rec is None or rec.loc.dtype != torch.float32:
                raise DeepSpeedContractError(f"aidaptiv_ds: parameter ds_id={p.ds_id} cannot alias an fp32 master slot")
            loc = rec.loc
            rec.detach_host(self.rt.tier)
            rec.loc = _Loc(view, off, loc.numel, loc.dtype, loc.elsize, aliased=True)
            rec.home = None
            rec.unadopted = False
            out.append((p.ds_id, off, loc.nbytes))
            off += loc.nbytes
        if off != view.size:
            raise DeepSpeedContractError(f"aidaptiv_ds: partitions of {view.name} cover {off} bytes, its master slot {view.size}")
        return out

    def host_bytes(self, ds_id: int) -> torch.Tensor | None:
        """The master-slot bytes (uint8, a view: copy before the next swap call) of partition ``ds_id`` when it
        is read from its fp32 master slot and a host slice holds them with its read complete; None when
        they are only on the drive, still being read, or the partition is not its master's bytes (never waits)."""
        rec = self._parts.get(ds_id)
        s = rec.host if rec is not None and rec.loc.aliased else None
        return self._partition_bytes(s, ds_id) if s is not None and _read_done(s) else None

    def is_master_alias(self, ds_id: int) -> bool:
        """Partition ``ds_id`` is read from its fp32 master slot now (its bytes are the master weights)."""
        rec = self._parts.get(ds_id)
        return rec is not None and rec.loc.aliased

    def _dead_chunks(self, leaving: set[int]) -> dict[torch.dtype, list[int]]:
        """Per dtype, the chunks of our own regions that hold no partition of a live parameter once the
        partitions ``leaving`` have moved elsewhere (an unpacked store is never among them: it is the
        user's)."""
        out = {}
        for dtype, region in self._regions.items():
            live = [(r.loc.start, r.loc.end) for r in self._parts.values()
                    if r.loc.region is region and r.ds_id not in leaving and r.alive()]
            chunks = region.unreferenced_chunks(live)
            if chunks:
                out[dtype] = chunks
        return out

    def reclaimable_bytes(self, leaving, slack: int = 0) -> int:
        """Drive bytes :meth:`release_dead_chunks` would give back once the partitions ``leaving``
        (ds_ids) no longer live in our regions, e.g. after :meth:`alias_to_master`, that later extents
        can use: per hole the released chunks leave in the store (adjacent extents merged), its bytes
        less ``slack`` (the part a first fit of extents up to ``slack`` bytes may leave unused)."""
        exts = sorted(e for d, c in self._dead_chunks(set(leaving)).items() for e in self._regions[d].chunk_extents(c))
        holes: list[list[int]] = []
        for off, n in exts:
            if holes and holes[-1][0] + holes[-1][1] == off:
                holes[-1][1] += n
            else:
                holes.append([off, n])
        return sum(max(n - slack, 0) for _, n in holes)

    def release_dead_chunks(self, in_use=None) -> int:
        """Give the chunks of our regions that no partition uses any more back to the store; returns
        the bytes (4 B per fp32 parameter after :meth:`alias_to_master`).

        A parameter the model let go of (an output embedding that weight tying replaced) can sit in a reference
        cycle until the collector runs, and until then its partition counts as live; so the collector runs first
        where a partition still counts as live without being one of ``in_use`` (ds_ids: the engine's module's
        parameters; None: always). When it runs on its own depends on every allocation of the process: with torchao
        importable (transformers imports it), the 260K stories Llama's last ``zero.Init`` parameter was still
        uncollected here and kept a 4 MiB chunk of the store (``tests/test_plan_vs_measurement.py``). A collection
        costs about 0.2 s in a process with torch, DeepSpeed and transformers loaded, so it is not run otherwise.
        """
        used = None if in_use is None else set(in_use)
        if used is None or any(r.ds_id not in used and r.alive() for r in self._parts.values()):
            gc.collect()
        return sum(self._regions[d].release_chunks(c) for d, c in self._dead_chunks(set()).items())

    def write_partitions(self, items: list) -> None:
        """Replace partitions' stored bytes: ``[(param, tensor of ds_numel elements)]`` (synchronous)."""
        futs = self._write(items, keep=False, edit=True)
        with self.rt.io_wait:
            wait_all(futs)

    def read_partition_tensors(self, ds_tensors) -> list[torch.Tensor]:
        """Current bytes of the partitions behind ``param.ds_tensor`` objects (copies, synchronous)."""
        return self.read_partitions([self._by_tensor[id(t)] for t in ds_tensors])

    def read_partitions(self, ds_ids: list[int]) -> list[torch.Tensor]:
        """Current bytes of the partitions ``ds_ids`` (copies in their dtype; nothing is published)."""
        missing = [i for i in ds_ids if self._parts[i].host is None]
        if missing:
            self._read_slices(missing, READ_DEMAND)
        out = []
        for i in ds_ids:
            s = self._parts[i].host
            with self.rt.io_wait:
                s.wait_ready()
            out.append(self._view(s, i).clone())
            self.rt.tier.mark_used(s)
        self.rt.tier.enforce_budget()
        return out
