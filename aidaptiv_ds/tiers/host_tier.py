"""The host (DRAM) tier: slices of state in host memory under a byte budget.

The tier holds :class:`~aidaptiv_ds.tiers.unit.TieredUnit` s, the units the scheduler moves: the packed
partitions one module fetch needs, one optimizer sub-group's master weights and moments, a gradient slice, a
KV block (one extent, one sequential transfer); a unit's host bytes are its *slice*. The tier runs every
transition of a unit's life under its lock ([Note: a unit's transitions], ``tiers/unit.py``). Memory is
booked in three classes:

* **resident** slices, chosen by the planner to live in DRAM for good (never evicted; dirty ones
  are written only on :meth:`HostTier.flush`, i.e. at a checkpoint);
* **cached** slices: unreferenced copies kept for reuse; ``resident + cached <= budget``, and the
  excess is evicted by :class:`EvictionPolicy` (furthest next use, LRU before the order is known; the
  training tier ranks optimizer and gradient slices first, [Note: ranking the kinds in training]).
  Evicting a clean slice writes nothing; evicting a dirty one issues its write-back and lets it go
  once written (the training thread does not wait);
* **working** slices: referenced by compute, prefetched and not yet used, or being written back.
  These are bounded by their owners (DeepSpeed's live-parameter limit, the prefetch window, the
  write-back limit), not by the cache budget, so a budget of 0 still streams everything.

Write-back is issued at ``WRITE_BACK`` priority, behind reads, and the bytes in flight are bounded
by ``writeback_limit``: past it, issuing waits for the oldest write to finish.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import typing
from collections.abc import Hashable

from ..io.futures import DeferredFuture, IOFuture
from .eviction import AccessOrder, EvictionPolicy
from .unit import TieredUnit


class _Write(typing.NamedTuple):
    """A write-back in flight, in the tier's write queue (oldest first)."""
    nbytes: int
    future: IOFuture
    unit: TieredUnit | None  # None: a write no unit keeps (``track_write``)


class HostTier:
    """TieredUnits in DRAM under ``budget`` bytes (see module docstring).

    Args:
        budget: bytes for resident + cached slices.
        writeback_limit: most bytes of write-back in flight.
        order: the access order used for Belady eviction (shared with the prefetcher).
        policy: which cached slice goes first (default: :class:`EvictionPolicy` over ``order``, no kind ranking).
    """

    def __init__(self, budget: int, writeback_limit: int = 512 << 20, order: AccessOrder | None = None,
                 policy: EvictionPolicy | None = None) -> None:
        if policy is not None and order is not None and order is not policy.order:
            raise ValueError("HostTier: give the access order or a policy built on it, not two orders")
        self.budget = int(budget)
        self.writeback_limit = int(writeback_limit)
        self.order = policy.order if policy is not None else (order or AccessOrder())
        self.policy = policy if policy is not None else EvictionPolicy(self.order)
        self._slices: dict[Hashable, TieredUnit] = {}
        self._writes: collections.deque[_Write] = collections.deque()
        self._clock = itertools.count(1)
        self._lock = threading.RLock()
        self._depth = 0  # nesting of the operation holding the lock ([Note: callbacks after the lock])
        self._gone: list[TieredUnit] = []  # slices removed during it, whose owners are told when it ends
        self._decided: list[DeferredFuture] = []  # write-backs decided during it, issued when it ends
        self.held_bytes = 0
        self.peak_bytes = 0
        self.budgeted_peak_bytes = 0  # the most resident + cached bytes held after a budget check
        self.evictions = 0
        self.dirty_evictions = 0
        self.hits = 0
        self.misses = 0

    # [Note: callbacks after the lock]
    # A slice's ``on_drop`` and its ``writeback`` are its owner's code (a swapper unmapping the slice, handing its
    # bytes to another owner; a swapper naming the extent and span to write). Run under the tier's lock they could
    # call back into the tier halfway through an eviction loop, or block every other user of the tier (the
    # prefetch thread, the step pipeline) on the owner's work and on the store's submission. So the tier only
    # decides under its lock: a write-back marks the slice clean and books a :class:`DeferredFuture` as the
    # slice's ``writing`` (in the write queue, its bytes counted against ``writeback_limit``); a removal records
    # the slice. When the outermost tier operation has released the lock, the decided writes are issued in the
    # order they were decided, then the owners of removed slices are told, in removal order; every operation
    # returns after that, so its caller sees the writes issued and the owners' maps updated. Nothing of the
    # owner's runs between a decision and its issue on the deciding thread, so the write carries the extent and
    # span the owner had when the tier decided. Two exceptions keep progress: a wait on a decided write before
    # its issue (the budget loop waiting for the oldest write, ``drop`` of a slice whose write was just decided)
    # issues it there and then, under the lock; and a thread that waits for a write another thread decided, but
    # has not issued yet, waits for that issue (the owner's ``writeback`` never takes the tier's lock). An error
    # is raised after every other write and callback ran (the first one; a write's error is also its future's).
    @contextlib.contextmanager
    def _op(self):
        """The tier's lock for one operation; afterwards, the write-backs decided and the ``on_drop`` of each
        slice removed during it."""
        gone: list[TieredUnit] = []
        decided: list[DeferredFuture] = []
        try:
            with self._lock:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                    if self._depth == 0:
                        gone, self._gone = self._gone, []
                        decided, self._decided = self._decided, []
        finally:  # also when the operation raised: the decisions stand either way
            err = None
            for fut in decided:
                err = err or fut.issue()
            for s in gone:
                try:
                    s.on_drop(s)
                except BaseException as e:  # noqa: BLE001 - every owner is told; the first error is raised
                    err = err or e
            if err is not None:
                raise err

    # ------------------------------------------------------------------ lookup
    def get(self, key: Hashable) -> TieredUnit | None:
        """The slice under ``key`` (counts a hit or a miss)."""
        with self._op():
            s = self._slices.get(key)
            if s is None:
                self.misses += 1
            else:
                self.hits += 1
                s.touch(next(self._clock))
            return s

    def peek(self, key: Hashable) -> TieredUnit | None:
        with self._op():
            return self._slices.get(key)

    def __contains__(self, key: Hashable) -> bool:
        with self._op():
            return key in self._slices

    def slices(self) -> list[TieredUnit]:
        with self._op():
            return list(self._slices.values())

    # ------------------------------------------------------------------ booking
    def resident_bytes(self) -> int:
        return sum(s.nbytes for s in self._slices.values() if s.resident)

    def cached_bytes(self) -> int:
        return sum(s.nbytes for s in self._slices.values() if s.cached)

    def _refuse_taken(self, s: TieredUnit) -> None:
        if s.key in self._slices:
            raise KeyError(f"slice {s.key!r} already in the host tier")

    def add(self, s: TieredUnit) -> TieredUnit:
        """Insert ``s`` (replacing nothing: the key must be free) and evict to stay in budget.

        A clean, unreferenced slice counts as cached and may be evicted at once (budget 0); create
        it ``dirty``, ``prefetched``, resident or writing (:meth:`add_writing`) to keep it.

        Raises:
            KeyError: a slice with that key is already in the tier.
        """
        with self._op():
            self._refuse_taken(s)
            s.enter(next(self._clock))
            self._slices[s.key] = s
            self.held_bytes += s.nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self.enforce_budget()
            return s

    def acquire(self, s: TieredUnit) -> None:
        """Take a compute reference (the slice cannot be evicted until :meth:`release`).

        Raises:
            RuntimeError: ``s`` left the tier (evicted or dropped).
        """
        with self._op():
            s.pin(next(self._clock))

    def acquire_to_update(self, s: TieredUnit) -> None:
        """Take a compute reference to change ``s`` 's bytes in place: as :meth:`acquire`, then wait for the
        write-back of ``s`` in flight, if any (a write reads ``buf`` until it completes, ``SlabStore.write``;
        changed under it, the extent below would hold a mix of the old and the new bytes -- the state a
        discarded speculative step goes back to). The wait runs outside the tier's lock; the reference keeps
        ``s`` in the tier meanwhile.

        Raises:
            RuntimeError: ``s`` left the tier.
            StorageIOError: the write in flight failed.
        """
        with self._op():
            self.acquire(s)
            writing = s.writing
        if writing is not None:
            writing.wait()

    def release(self, s: TieredUnit) -> None:
        """Drop a compute reference; an unreferenced slice becomes cached and may be evicted."""
        with self._op():
            if s.unpin() == 0:
                self.enforce_budget()

    def mark_dirty(self, s: TieredUnit) -> None:
        """The slice's bytes differ (or are about to) from the copy below: it is written before it may go.

        Raises:
            RuntimeError: ``s`` left the tier (its bytes would never be written).
        """
        with self._op():
            s.mark_dirty()

    def mark_used(self, s: TieredUnit) -> None:
        """A read-ahead slice was used without a reference (its bytes copied out): it is cached from now on, and
        the next budget check may evict it."""
        with self._op():
            s.mark_used()

    def set_members(self, s: TieredUnit, members) -> None:
        """The ids whose next use ranks ``s`` for eviction (an owner stopped using part of it)."""
        with self._op():
            s.set_members(members)

    # ------------------------------------------------------------------ write-back
    def write_back(self, s: TieredUnit) -> IOFuture | None:
        """Write ``s`` below if dirty (at most ``writeback_limit`` bytes in flight); return the future (None when
        the slice is clean and no write of it is in flight). The owner's ``writeback`` is issued when the
        outermost tier operation has released the lock ([Note: callbacks after the lock]).

        Raises:
            RuntimeError: ``s`` left the tier.
            Exception: what the owner's ``writeback`` raised, when this call was the outermost operation.
        """
        with self._op():
            if not s.dirty:
                return s.writing
            s.expect("write_back")  # a unit that left the tier: its bytes would never be read
            if s.writing is not None:  # an older write of this slice is still running
                s.writing.wait()
                s.written()
            self.reserve_write(s.nbytes)
            fut = DeferredFuture(s.nbytes, lambda s=s: s.writeback(s))
            s.write_back(fut)
            self._decided.append(fut)
            self._writes.append(_Write(s.nbytes, fut, s))
            return fut

    def working_bytes(self, kind: str) -> int:
        """Bytes of ``kind`` slices in working memory: referenced, prefetched and unused, or being
        written back (not resident, not cached)."""
        with self._op():
            return sum(s.nbytes for s in self._slices.values()
                       if s.kind == kind and not s.resident and not s.cached)

    def wait_oldest_write(self) -> bool:
        """Wait for the oldest write-back in flight, then evict what the budget no longer holds
        (a written slice nobody references becomes cached). Returns True when a write completed since
        the last check (waited for here, or found finished), False when none was in flight or done: a
        caller looping ``while not fits and wait_oldest_write()`` then re-checks after each eviction."""
        with self._op():
            reaped = self._reap_writes()
            if not self._writes:  # nothing to wait for; a write reaped earlier may have left a cached slice
                held = self.resident_bytes() + self.cached_bytes()
                self.enforce_budget()
                return reaped > 0 or self.resident_bytes() + self.cached_bytes() < held
            self._writes[0].future.wait()
            self.enforce_budget()
            return True

    def reserve_write(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more of write-back fit under ``writeback_limit`` (oldest writes first)."""
        with self._op():
            self._reap_writes()
            while self._writes and self._pending_write_bytes() + nbytes > self.writeback_limit:
                self._writes[0].future.wait()
                self._reap_writes()

    def add_writing(self, s: TieredUnit, fut: IOFuture) -> TieredUnit:
        """Insert a clean slice whose bytes are being written below by ``fut`` (booked as working
        memory until the write completes; the caller reserved the bytes with :meth:`reserve_write`)."""
        with self._op():
            self._refuse_taken(s)
            s.writing_from(fut)
            self._writes.append(_Write(s.nbytes, fut, s))
            return self.add(s)

    def track_write(self, fut: IOFuture, nbytes: int) -> None:
        """Count a write that no slice keeps (its staging buffer is the future's keep-alive)."""
        with self._op():
            self._writes.append(_Write(int(nbytes), fut, None))

    def _pending_write_bytes(self) -> int:
        return sum(w.nbytes for w in self._writes if not w.future.done())

    def _reap_writes(self) -> int:
        """Drop the finished writes at the head of the queue; returns how many."""
        reaped = 0
        while self._writes and self._writes[0].future.done():
            reaped += 1
            _, fut, sl = self._writes.popleft()
            if sl is not None:
                sl.written(fut)
            fut.wait()  # raises the write's error here, on the training thread
        return reaped

    def wait_writes(self, kind: str | None = None) -> None:
        """Wait for every write-back in flight, or only for those of ``kind`` units, then evict what the budget no
        longer holds. Raises the first error of a write waited for (each write's error is raised once)."""
        with self._op():
            if kind is not None:
                mine = [w for w in self._writes if w.unit is not None and w.unit.kind == kind]
                # out of the queue: their errors are raised here, not again by a later reap
                self._writes = collections.deque(w for w in self._writes if w.unit is None or w.unit.kind != kind)
                err = None
                for w in mine:
                    try:
                        w.future.wait()
                    except BaseException as e:  # noqa: BLE001 - every write is waited for; the first error is raised
                        err = err or e
                    w.unit.written(w.future)  # type: ignore[union-attr]
                if err is not None:
                    raise err
                self.enforce_budget()
                return
            while self._writes:
                self._writes[0].future.wait()
                self._reap_writes()
            self.enforce_budget()

    def flush(self) -> None:
        """Write back every dirty slice (resident ones included) and wait for all writes."""
        with self._op():
            for s in list(self._slices.values()):
                if s.dirty:
                    self.write_back(s)
            self.wait_writes()

    # ------------------------------------------------------------------ eviction
    def enforce_budget(self) -> None:
        """Evict cached slices while resident + cached bytes exceed the budget."""
        with self._op():
            self._reap_writes()
            over = self.resident_bytes() + self.cached_bytes() - self.budget
            while over > 0:
                candidates = [s for s in self._slices.values() if s.cached]
                if not candidates:
                    break
                victim = self.policy.victim(candidates)
                over -= victim.nbytes
                self.evict(victim)
            self.budgeted_peak_bytes = max(self.budgeted_peak_bytes, over + self.budget)

    def budgeted_bytes(self) -> int:
        """Bytes the budget books now: resident and cached slices (``held_bytes`` less working memory)."""
        with self._op():
            return sum(s.nbytes for s in self._slices.values() if s.resident or s.cached)

    def evict(self, s: TieredUnit) -> None:
        """Remove an unreferenced slice. A dirty one is written back first, without waiting: it stays
        (as working memory, bounded by ``writeback_limit``) until its write completes, then goes as a
        clean slice at the next budget check."""
        with self._op():
            if s.refs:
                raise RuntimeError(f"slice {s.key!r} is in use and cannot be evicted")
            if s.dirty:
                self.dirty_evictions += 1
                self.write_back(s)
                return
            if s.writing is not None:
                s.writing.wait()
                s.written()
            self.evictions += 1
            self._remove(s, evicted=True)

    def drop(self, s: TieredUnit) -> None:
        """Remove ``s`` without writing (its bytes are stale or no longer needed): a dirty slice is marked clean,
        so a reference still held to it can never write it later."""
        with self._op():
            s.discard()
            if s.writing is not None:
                s.writing.wait()
                s.written()
            self._remove(s)

    def _remove(self, s: TieredUnit, evicted: bool = False) -> None:
        if self._slices.get(s.key) is s:
            del self._slices[s.key]
            s.leave(evicted)
            self.held_bytes -= s.nbytes
            if s.on_drop is not None:
                self._gone.append(s)  # told after the lock ([Note: callbacks after the lock])

    def clear(self) -> None:
        """Drop everything without writing (after :meth:`flush` when the data matters)."""
        with self._op():
            for s in list(self._slices.values()):
                self.drop(s)
