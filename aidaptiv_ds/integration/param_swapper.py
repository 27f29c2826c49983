"""Parameter swapper: DeepSpeed's ``AsyncPartitionedParameterSwapper`` contract on our store and tier.

Contract (``deepspeed-seams.md`` §1.3-1.5, DeepSpeed 0.19.8), and how it is met here:

* partitions live packed in creation order in a :class:`PackedRegion` (one per dtype), so a
  module's partitions are one contiguous range and one fetch is one sequential read;
* ``swap_in`` de-duplicates its list (the coordinator passes duplicates); partitions already in a
  host slice are served from it, the rest are read as coalesced slices; a synchronous call
  completes *all* pending reads (``partition_parameters.py:1717-1720`` relies on it);
* ``remove_partition_and_release_buffers`` is a clean drop: the copy below is authoritative,
  nothing is written, and the DRAM tier may keep the bytes;
* ``swap_out_and_release`` and ``swap_out_partitioned_params`` carry new content: it is staged
  once (cast from fp32 master weights straight into the write buffer), written at write-back
  priority, and the staging buffer becomes the host copy of those partitions, so no read of them
  can see older bytes; pending reads of the written partitions are completed first;
* host buffers are never recycled by hand: each slice owns a fresh buffer released to the
  allocator, whose pinned-memory cache on CUDA holds a block until copies out of it are done;
* a not-resident partition's ``ds_tensor.data`` is a 0-dim placeholder (zenflow checks ``dim() == 0``).
"""
from __future__ import annotations

import itertools
import logging

import torch

from ..io.buffers import alloc_aligned
from ..io.engine import READ_DEMAND, READ_PREFETCH, WRITE_BACK
from ..io.futures import wait_all
from ..store.packed import PackedRegion
from ..tiers.host_tier import Slice
from .runtime import Runtime

log = logging.getLogger("aidaptiv_ds")

#: Unrequested bytes a coalesced read may include between two wanted partitions.
GAP_BYTES = 256 << 10


def _status():
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
    return PartitionedParamStatus


class AidaptivParamSwapper:
    """One per (process, model dtype); shared by every ``zero.Init`` of that dtype.

    Args:
        runtime: the process runtime (store, tier, engine).
        dtype: model dtype of the partitions (bf16, fp16 or fp32).
    """

    def __init__(self, runtime: Runtime, dtype: torch.dtype) -> None:
        self.rt = runtime
        self.dtype = dtype
        self.elsize = torch.empty((), dtype=dtype).element_size()
        self.region = PackedRegion(runtime.store, f"params/{str(dtype).replace('torch.', '')}")
        self.min_swap_bytes = int(runtime.cfg.min_swap_bytes)
        self._loc: dict[int, tuple[int, int]] = {}  # ds_id -> (byte offset in region, numel)
        self._by_tensor: dict[int, int] = {}  # id(param.ds_tensor) -> ds_id (fast_init hands us ds_tensors)
        self._slice_of: dict[int, Slice] = {}  # ds_id -> host slice holding its current bytes
        self._published: dict[int, Slice] = {}  # ds_id -> slice referenced by an AVAILABLE/INFLIGHT partition
        self._inflight: list = []  # params INFLIGHT, published at synchronize_reads
        self._seq = itertools.count()
        self._placeholder = torch.tensor(1).half()
        self._reserved_numel = 0
        self._reserved: list[torch.Tensor] = []
        self.resident = False
        self.init_phase = False  # set by the Stage-3 subclass while DeepSpeed rewrites unchanged partitions
        self.skipped_init_bytes = 0
        self.swap_folder = runtime.namespace.rank_dir(0)

    # ------------------------------------------------------------------ layout
    def _register(self, param, numel: int) -> tuple[int, int]:
        loc = self._loc.get(param.ds_id)
        if loc is None:
            start = self.region.append(numel * self.elsize, align=self.elsize)
            loc = self._loc[param.ds_id] = (start, numel)
        elif loc[1] != numel:
            raise RuntimeError(f"aidaptiv_ds: parameter ds_id={param.ds_id} was partitioned with {loc[1]} elements "
                               f"and now {numel}; re-partitioning with another size is not supported")
        return loc

    def partition_bytes(self) -> int:
        """Bytes of all partitions this swapper holds (this rank)."""
        return sum(n for _, n in self._loc.values()) * self.elsize

    def largest_partition_bytes(self) -> int:
        return max((n for _, n in self._loc.values()), default=0) * self.elsize

    def _view(self, s: Slice, base: int, ds_id: int) -> torch.Tensor:
        start, numel = self._loc[ds_id]
        off = start - base
        return s.buf[off:off + numel * self.elsize].view(self.dtype)

    def _slice_base(self, s: Slice) -> int:
        return s.key[1]

    # ------------------------------------------------------------------ DeepSpeed API
    def swappable_tensor(self, param=None, numel=None) -> bool:
        """True when a partition of ``numel`` elements goes through the store (>= ``min_swap_bytes``)."""
        if param is not None:
            numel = param.ds_tensor.ds_numel
        return int(numel) * self.elsize >= self.min_swap_bytes

    def available_swap_in_buffers(self) -> int:
        """No fixed pool: reads are bounded by the prefetch window, not a buffer count."""
        return 1 << 30

    def get_buffer(self, param, numel: int) -> torch.Tensor:
        """A zeroed host buffer of ``numel`` elements (model dtype) for a first partition."""
        self._register(param, int(numel))
        return alloc_aligned(int(numel) * self.elsize, dtype=self.dtype, zero=True)[: int(numel)]

    def swap_out_and_release(self, params, async_op: bool = False, force_buffer_release: bool = False) -> None:
        """Persist each partition's current ``ds_tensor.data`` and release it (synchronous).

        Used at first partition and after an in-place modification (``GatheredParameters``).
        """
        S = _status()
        items = []
        for p in params:
            numel = p.ds_tensor.ds_numel
            self._register(p, numel)
            self._by_tensor[id(p.ds_tensor)] = p.ds_id
            items.append((p, p.ds_tensor.data.detach().reshape(-1)[:numel]))
        futs = self._write(items, keep=False)
        with self.rt.io_wait:
            wait_all(futs)
        for p in params:
            self._unpublish(p)
            p.ds_tensor.data = self._placeholder.data
            p.ds_tensor.status = S.NOT_AVAILABLE

    def remove_partition_and_release_buffers(self, params) -> None:
        """Clean drop: the stored copy is authoritative; the DRAM tier may keep the bytes."""
        S = _status()
        for p in params:
            if p.ds_tensor is None:
                continue
            self._unpublish(p)
            if p in self._inflight:
                self._inflight = [q for q in self._inflight if q is not p]
            p.ds_tensor.data = self._placeholder.data
            p.ds_tensor.status = S.NOT_AVAILABLE

    def swap_in(self, params, async_op: bool = True, swap_in_buffers=None) -> None:
        """Make partitions available: INFLIGHT after an async call, AVAILABLE after a sync one."""
        S = _status()
        seen = set()
        todo = []
        for p in params:
            if p.ds_id in seen or p.ds_tensor.status != S.NOT_AVAILABLE:
                continue
            if p.ds_id not in self._loc:
                raise RuntimeError(f"aidaptiv_ds: parameter ds_id={p.ds_id} was never swapped out; nothing to read")
            seen.add(p.ds_id)
            todo.append(p)
        missing = [p for p in todo if p.ds_id not in self._slice_of]
        if missing:
            self._read_slices([p.ds_id for p in missing], READ_DEMAND if not async_op else READ_PREFETCH)
        for p in todo:
            self._publish(p)
            p.ds_tensor.status = S.INFLIGHT
            self._inflight.append(p)
        if not async_op:
            self.synchronize_reads()

    def synchronize_reads(self) -> None:
        """Complete every pending read and publish all INFLIGHT partitions as AVAILABLE."""
        S = _status()
        pending, self._inflight = self._inflight, []
        with self.rt.io_wait:
            for p in pending:
                self._published[p.ds_id].wait_ready()
        for p in pending:
            p.ds_tensor.status = S.AVAILABLE

    def synchronize_writes(self) -> None:
        """Wait for every partition write issued so far."""
        with self.rt.io_wait:
            self.region.flush()

    def swap_into_buffer(self, param, dest_buffer: torch.Tensor) -> None:
        """Synchronously copy a partition into a caller-owned buffer; it leaves the store's care."""
        S = _status()
        if param.ds_id not in self._slice_of:
            self._read_slices([param.ds_id], READ_DEMAND)
        s = self._slice_of[param.ds_id]
        with self.rt.io_wait:
            s.wait_ready()
        dest_buffer.data.copy_(self._view(s, self._slice_base(s), param.ds_id))
        param.ds_tensor.status = S.NOT_AVAILABLE

    def get_path(self, param, must_exist: bool = False) -> str:
        """The slab of the first cache path (informational: our optimizer swapper reads partitions
        through :meth:`read_partitions`, never by path)."""
        return self.rt.namespace.slab_path(0)

    def reserve_partitioned_swap_space(self, partition_num_elems) -> None:
        self._reserved_numel = max(self._reserved_numel, int(sum(partition_num_elems)))

    def reserve_available_buffers(self) -> list[torch.Tensor]:
        """Staging for ``offload_optimizer.fast_init``: one buffer of the largest sub-group's numel."""
        n = max(self._reserved_numel, 1)
        self._reserved = [alloc_aligned(n * self.elsize, dtype=self.dtype, register=True)[:n]]
        return self._reserved

    def release_reserved_buffers(self) -> None:
        from ..io.buffers import REGISTRY
        for b in self._reserved:
            REGISTRY.remove(b)
        self._reserved = []

    def swap_out_partitioned_params(self, dst_fp16_params, src_fp32_params) -> None:
        """Write fp32 master slices cast to the model dtype as the new partition content."""
        S = _status()
        if self.init_phase:  # DeepSpeed re-writes partitions from masters just made from them: identical bytes
            self.skipped_init_bytes += sum(p.ds_tensor.ds_numel for p in dst_fp16_params) * self.elsize
            for p in dst_fp16_params:
                p.ds_tensor.status = S.NOT_AVAILABLE
            return
        pending = {p.ds_id for p in self._inflight}
        for p in dst_fp16_params:  # cancel reads of the old bytes: they must never be published
            if p.ds_id in pending:
                self._inflight = [q for q in self._inflight if q is not p]
            if p.ds_id in self._published:
                self._published[p.ds_id].wait_ready()
                self._unpublish(p)
            p.ds_tensor.data = self._placeholder.data
        self._write(list(zip(dst_fp16_params, src_fp32_params)), keep=True)
        for p in dst_fp16_params:
            p.ds_tensor.status = S.NOT_AVAILABLE

    # ------------------------------------------------------------------ internals
    def _publish(self, p) -> None:
        s = self._slice_of[p.ds_id]
        if self._published.get(p.ds_id) is not s:
            self._unpublish(p)
            self.rt.tier.acquire(s)
            self._published[p.ds_id] = s
        p.ds_tensor.data = self._view(s, self._slice_base(s), p.ds_id)

    def _unpublish(self, p) -> None:
        s = self._published.pop(p.ds_id, None)
        if s is not None:
            self.rt.tier.release(s)

    def _runs(self, ids: list[int], gap: int) -> list[list[int]]:
        """Group ids into runs whose region ranges are at most ``gap`` bytes apart (sorted by offset)."""
        runs: list[list[int]] = []
        end = -1
        for i in sorted(set(ids), key=lambda i: self._loc[i][0]):
            start, numel = self._loc[i]
            if runs and start - end <= gap:
                runs[-1].append(i)
            else:
                runs.append([i])
            end = max(end, start + numel * self.elsize) if len(runs[-1]) > 1 else start + numel * self.elsize
        return runs

    def _span(self, run: list[int]) -> tuple[int, int]:
        """Region bytes ``[start, end)`` covered by the partitions of ``run``."""
        return (min(self._loc[i][0] for i in run),
                max(self._loc[i][0] + self._loc[i][1] * self.elsize for i in run))

    def _read_slices(self, ids: list[int], priority: int) -> list[Slice]:
        """Read coalesced slices for ``ids`` (none of which may be mapped already) into the tier."""
        out = []
        for run in self._runs(ids, GAP_BYTES):
            start, end = self._span(run)
            a, _ = self.region.aligned(start, end)
            fut, buf, _ = self.region.read(start, end, priority=priority)
            s = Slice(("p", a, next(self._seq)), buf, members=run, kind="param", ready=fut,
                      prefetched=priority == READ_PREFETCH, on_drop=self._on_drop)
            for i in run:
                self._slice_of[i] = s
            self.rt.tier.add(s)
            out.append(s)
        return out

    def prefetch(self, ds_ids: list[int], window: int) -> int:
        """Start reads of the partitions of ``ds_ids`` that are not in DRAM, in the given order, while
        the bytes read ahead and not yet used stay within ``window``. Returns bytes issued."""
        room = window - self.rt.tier.prefetched_bytes()
        take = []
        for i in ds_ids:
            if i in self._slice_of or i not in self._loc:
                continue
            need = self._loc[i][1] * self.elsize
            if need > room:
                break
            room -= need
            take.append(i)
        if take:
            self._read_slices(take, READ_PREFETCH)
        return sum(self._loc[i][1] for i in take) * self.elsize

    def _on_drop(self, s: Slice) -> None:
        for i in s.members:
            if self._slice_of.get(i) is s:
                del self._slice_of[i]

    def _write(self, items: list, keep: bool) -> list:
        """Stage and write ``[(param, source tensor), ...]``; exact neighbours share one write.

        Partitions held by the resident slice are updated in DRAM instead (no write). With ``keep``
        the staging buffer becomes the host slice of the written partitions; any older host copy
        of them stops being used.
        """
        src = {}
        for p, t in items:
            s = self._slice_of.get(p.ds_id)
            if s is not None and s.resident:
                self._view(s, self._slice_base(s), p.ds_id).copy_(t.reshape(-1))
                self.rt.tier.mark_dirty(s)
            else:
                src[p.ds_id] = t
        futs = []
        for run in self._runs(list(src), 0):
            start, end = self._span(run)

            def fill(view, run=run, start=start):
                for i in run:
                    off, numel = self._loc[i]
                    view[off - start:off - start + numel * self.elsize].view(self.dtype).copy_(src[i].reshape(-1))

            self.rt.tier.reserve_write(end - start)
            fut, staging, skip = self.region.write(start, end - start, fill, priority=WRITE_BACK)
            futs.append(fut)
            for i in run:
                old = self._slice_of.pop(i, None)
                if old is not None:
                    old.members = tuple(m for m in old.members if m != i)
            if keep:
                s = Slice(("p", start - skip, next(self._seq)), staging, members=run, kind="param",
                          on_drop=self._on_drop)
                for i in run:
                    self._slice_of[i] = s
                self.rt.tier.add_writing(s, fut)
            else:
                self.rt.tier.track_write(fut, end - start)
        return futs

    def make_resident(self) -> None:
        """Read every partition into one resident slice (the planner chose to keep parameters in DRAM)."""
        if self.resident or self.region.size == 0:
            self.resident = True
            return
        self.synchronize_writes()
        self.rt.tier.wait_writes()
        for s in {id(s): s for s in self._slice_of.values()}.values():
            if s.refs == 0:
                self.rt.tier.drop(s)
        fut, buf, _ = self.region.read(0, self.region.size, priority=READ_DEMAND)
        with self.rt.io_wait:
            fut.wait()
        ids = list(self._loc)
        s = Slice(("p", 0, next(self._seq)), buf, members=ids, kind="param", resident=True, on_drop=self._on_drop,
                  writeback=lambda sl: self.region.write(0, self.region.size, lambda v: v.copy_(sl.buf[:self.region.size]))[0])
        for i in ids:
            if i in self._published:  # keep DeepSpeed's view valid: copy its bytes, repoint it
                old = self._published[i]
                self._view(s, 0, i).copy_(self._view(old, self._slice_base(old), i))
        for i in ids:
            self._slice_of[i] = s
        self.rt.tier.add(s)
        for i, old in list(self._published.items()):
            self.rt.tier.release(old)
            self.rt.tier.acquire(s)
            self._published[i] = s
        self.resident = True

    def read_partition_tensors(self, ds_tensors) -> list[torch.Tensor]:
        """Current bytes of the partitions behind ``param.ds_tensor`` objects (copies, synchronous)."""
        return self.read_partitions([self._by_tensor[id(t)] for t in ds_tensors])

    def read_partitions(self, ds_ids: list[int]) -> list[torch.Tensor]:
        """Current bytes of the partitions ``ds_ids`` as tensors of the model dtype (copies; no publishing)."""
        missing = [i for i in ds_ids if i not in self._slice_of]
        if missing:
            self._read_slices(missing, READ_DEMAND)
        out = []
        for i in ds_ids:
            s = self._slice_of[i]
            with self.rt.io_wait:
                s.wait_ready()
            out.append(self._view(s, self._slice_base(s), i).clone())
        self.rt.tier.enforce_budget()
        return out

    def prefetch_window(self) -> int:
        """Bytes that may be read ahead and not used yet (see :meth:`Runtime.prefetch_bytes`)."""
        if getattr(self, "_window", None) is None:
            self._window = self.rt.prefetch_bytes(2 * self.largest_partition_bytes())
        return self._window

    def promote_ready(self, params) -> None:
        """Publish (INFLIGHT) the leading partitions of ``params`` (queue order) whose reads are done,
        stopping at the first one that is still on the drive or being read."""
        S = _status()
        take = []
        for p in params:
            st = p.ds_tensor.status
            if st != S.NOT_AVAILABLE:
                continue
            s = self._slice_of.get(p.ds_id)
            if s is None or (s.ready is not None and not s.ready.done()):
                break
            take.append(p)
        if take:
            self.swap_in(take, async_op=True)
