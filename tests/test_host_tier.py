"""The DRAM tier: budget, clean/dirty, Belady eviction from a known access order, LRU before it,
bounded write-back; clean evictions add nothing to the ledger."""
from __future__ import annotations

import random

import pytest
import torch

from aidaptiv_ds.io.buffers import alloc_aligned
from aidaptiv_ds.io.engine import IOEngine
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore
from aidaptiv_ds.io.futures import IOFuture
from aidaptiv_ds.tiers import AccessOrder, HostTier, TieredUnit, UnitState

UNIT = 4096


def belady_misses(trace: list[int], capacity: int) -> tuple[int, list[int]]:
    """Reference MIN (Belady 1966) on a cyclic reference string, deciding after each access (so the
    item just used competes too: MIN with bypass, never worse than MIN), ties to the least recently
    used. Returns misses and the eviction order."""
    cache: dict[int, int] = {}  # item -> last use
    misses, evicted, n = 0, [], len(trace)

    def next_use(y, i):
        for d in range(1, n + 1):
            if trace[(i + d) % n] == y:
                return d
        return float("inf")

    for i, x in enumerate(trace):
        if x not in cache:
            misses += 1
        cache[x] = i
        if len(cache) > capacity:
            victim = max(cache, key=lambda y: (next_use(y, i), -cache[y]))
            del cache[victim]
            evicted.append(victim)
    return misses, evicted


def run_tier(trace: list[int], capacity: int, order_known: bool) -> tuple[int, list[int]]:
    """Drive a HostTier with clean slices of UNIT bytes along ``trace``; return misses and evictions."""
    order = AccessOrder()
    tier = HostTier(budget=capacity * UNIT, order=order)
    evicted: list[int] = []
    if order_known:
        order.set_order(trace)
    misses = 0
    for i, x in enumerate(trace):
        order.advance_to(i + 1)  # the access at i is happening: distances count from the next one
        s = tier.get(x)
        if s is None:
            misses += 1
            s = TieredUnit(x, torch.empty(UNIT, dtype=torch.uint8), members=[x], prefetched=True,
                      on_drop=lambda sl: evicted.append(sl.key))
            tier.add(s)
        tier.acquire(s)
        tier.release(s)
    return misses, evicted


@pytest.mark.parametrize("seed", range(5))
def test_eviction_order_equals_belady_on_a_known_trace(seed):
    rng = random.Random(seed)
    trace = [rng.randrange(8) for _ in range(60)]  # one training step's order, repeated every step
    got_misses, got_evicted = run_tier(trace, capacity=4, order_known=True)
    want_misses, want_evicted = belady_misses(trace, 4)
    assert got_evicted == want_evicted
    assert got_misses == want_misses
    assert got_misses <= run_tier(trace, capacity=4, order_known=False)[0]  # never worse than LRU


def test_lru_before_the_order_is_known():
    _, evicted = run_tier([1, 2, 3, 1, 4, 5], capacity=3, order_known=False)
    assert evicted == [2, 3]  # least recently used first


def test_budget_and_classes():
    tier = HostTier(budget=2 * UNIT)
    res = tier.add(TieredUnit("r", torch.empty(UNIT, dtype=torch.uint8), resident=True))
    a = tier.add(TieredUnit("a", torch.empty(UNIT, dtype=torch.uint8), prefetched=True))
    b = tier.add(TieredUnit("b", torch.empty(UNIT, dtype=torch.uint8), prefetched=True))
    assert tier.held_bytes == 3 * UNIT  # prefetched slices are working memory, outside the budget
    tier.acquire(a)
    tier.acquire(b)
    tier.release(a)  # a becomes cached: resident + cached = 2 units = budget
    assert "a" in tier
    tier.release(b)  # now 3 units > budget: the LRU cached slice (a) goes, the resident one never
    assert "a" not in tier and "b" in tier and "r" in tier and res.resident
    with pytest.raises(RuntimeError, match="released more often"):
        tier.release(b)


@pytest.fixture
def store(tmp_path):
    st = SlabStore(Namespace([str(tmp_path)], "tier", 0), [PathSpec(str(tmp_path), capacity=64 << 20)],
                   engine=IOEngine())
    yield st
    st.close()


def test_clean_evictions_write_nothing_dirty_ones_write_once(store):
    tier = HostTier(budget=UNIT)
    store.allocate("x", UNIT)
    store.allocate("y", UNIT)

    def wb(key):
        return lambda sl: store.write(key, sl.buf, 0)

    clean = tier.add(TieredUnit("x", alloc_aligned(UNIT), prefetched=True, writeback=wb("x")))
    tier.acquire(clean)
    tier.release(clean)
    before = sum(store.bytes_written)
    tier.add(TieredUnit("y", alloc_aligned(UNIT), dirty=True, writeback=wb("y")))  # evicts clean x: no write
    assert "x" not in tier
    store.drain()
    assert sum(store.bytes_written) == before
    store.flush_ledger()
    ledger = store.ledgers[0]
    assert ledger.run_bytes == before  # the ledger books only what was written
    tier.add(TieredUnit("z", alloc_aligned(UNIT), prefetched=True))
    tier.enforce_budget()
    z = tier.get("z")
    tier.acquire(z)
    tier.release(z)  # y (dirty) is the victim now: written back exactly once
    store.drain()
    assert sum(store.bytes_written) == before + UNIT
    assert tier.dirty_evictions == 1


def test_write_back_is_bounded(store):
    tier = HostTier(budget=0, writeback_limit=2 * UNIT)
    for i in range(8):
        store.allocate(f"k{i}", UNIT)
    issued = []
    for i in range(8):
        s = tier.add(TieredUnit(f"k{i}", alloc_aligned(UNIT), dirty=True,
                           writeback=lambda sl: store.write(sl.key, sl.buf, 0)))
        tier.write_back(s)
        issued.append(tier._pending_write_bytes())
        assert tier._pending_write_bytes() <= 2 * UNIT
    tier.wait_writes()
    assert tier._pending_write_bytes() == 0


def test_working_bytes_by_kind_and_waiting_for_the_oldest_write(store):
    """``working_bytes(kind)`` counts referenced, prefetched and writing slices of that kind (not resident, not
    cached); ``wait_oldest_write`` waits for one write and lets the budget evict what it no longer holds."""
    tier = HostTier(budget=0)
    store.allocate("w", UNIT)
    ref = tier.add(TieredUnit("ref", torch.empty(UNIT, dtype=torch.uint8), kind="opt", prefetched=True))
    tier.acquire(ref)
    tier.add(TieredUnit("pre", torch.empty(2 * UNIT, dtype=torch.uint8), kind="opt", prefetched=True))
    tier.add(TieredUnit("res", torch.empty(4 * UNIT, dtype=torch.uint8), kind="opt", resident=True))
    tier.add(TieredUnit("param", torch.empty(8 * UNIT, dtype=torch.uint8), kind="param", prefetched=True))
    w = tier.add(TieredUnit("w", alloc_aligned(UNIT), kind="opt", dirty=True,
                       writeback=lambda sl: store.write(sl.key, sl.buf, 0)))
    tier.write_back(w)
    assert tier.working_bytes("opt") in (4 * UNIT, 3 * UNIT)  # the write may have finished (then it is cached)
    assert tier.working_bytes("param") == 8 * UNIT
    assert tier.wait_oldest_write() in (True, False)
    assert "w" not in tier  # written, unreferenced: cached, and a budget of 0 evicts it
    assert tier.working_bytes("opt") == 3 * UNIT
    assert tier.wait_oldest_write() is False  # nothing left in flight


def test_waiting_for_a_write_that_already_finished_still_evicts(store):
    """A write that completed before ``wait_oldest_write`` (reaped there, or by an earlier call) must
    still let the budget evict its now-clean slice; otherwise a caller looping ``while not fits and
    wait_oldest_write()`` stops with memory it could free (the clean-clone CI run hit this race)."""
    tier = HostTier(budget=0)
    store.allocate("w", UNIT)
    w = tier.add(TieredUnit("w", alloc_aligned(UNIT), kind="opt", dirty=True,
                       writeback=lambda sl: store.write(sl.key, sl.buf, 0)))
    tier.write_back(w)
    w.writing.wait()  # the write is done before anyone asks
    assert tier.wait_oldest_write() is True
    assert "w" not in tier
    assert tier.wait_oldest_write() is False


def test_training_ranks_optimizer_and_gradient_slices_before_parameters():
    """[Note: ranking the kinds in training]: with the order known, optimizer and gradient slices go before every
    parameter slice, also one the order no longer holds (which plain Belady ties with them, then LRU); within a
    kind it is Belady; before the order is known it is LRU over all kinds."""
    from aidaptiv_ds.tiers.eviction import TRAINING_KIND_RANK, EvictionPolicy

    def fill(tier, order, known):
        if known:
            order.set_order([1, 2, 3])
        made = [TieredUnit("stale-param", torch.empty(UNIT, dtype=torch.uint8), members=["gone"], kind="param"),
                TieredUnit(("opt", 0), torch.empty(UNIT, dtype=torch.uint8), kind="opt"),
                TieredUnit(2, torch.empty(UNIT, dtype=torch.uint8), members=[2], kind="param"),
                TieredUnit(("grad", 0), torch.empty(UNIT, dtype=torch.uint8), kind="grad"),
                TieredUnit(3, torch.empty(UNIT, dtype=torch.uint8), members=[3], kind="param")]
        gone = []
        for s in made:
            s.on_drop = lambda sl: gone.append(sl.key)
            tier.add(s)
            tier.acquire(s)
            tier.release(s)
        tier.budget = 0
        tier.enforce_budget()
        return gone

    order = AccessOrder()
    ranked = fill(HostTier(budget=8 * UNIT, policy=EvictionPolicy(order, TRAINING_KIND_RANK)), order, known=True)
    assert ranked == [("opt", 0), ("grad", 0), "stale-param", 3, 2]
    order = AccessOrder()
    plain = fill(HostTier(budget=8 * UNIT, order=order), order, known=True)
    assert plain == ["stale-param", ("opt", 0), ("grad", 0), 3, 2]  # never used again: a tie, then LRU
    order = AccessOrder()
    lru = fill(HostTier(budget=8 * UNIT, policy=EvictionPolicy(order, TRAINING_KIND_RANK)), order, known=False)
    assert lru == ["stale-param", ("opt", 0), 2, ("grad", 0), 3]


def test_one_access_order_per_tier():
    from aidaptiv_ds.tiers.eviction import EvictionPolicy

    with pytest.raises(ValueError, match="not two orders"):
        HostTier(budget=0, order=AccessOrder(), policy=EvictionPolicy(AccessOrder()))
    order = AccessOrder()
    assert HostTier(budget=0, order=order, policy=EvictionPolicy(order)).order is order


def test_owners_are_told_of_a_drop_after_the_tiers_lock():
    """[Note: callbacks after the lock]: ``on_drop`` runs once the outermost operation released the lock (another
    thread can take it from inside the callback), in removal order, and before the operation returns."""
    import threading

    from aidaptiv_ds.tiers import HostTier, TieredUnit

    tier = HostTier(budget=0)
    seen = []

    def dropped(s):
        def other():  # another thread can take the tier's lock now: the callback does not hold it
            got = tier._lock.acquire(timeout=5)
            seen.append((s.key, got))
            if got:
                tier._lock.release()
        t = threading.Thread(target=other)
        t.start()
        t.join()

    for k in ("a", "b"):
        tier.add(TieredUnit(k, torch.zeros(64, dtype=torch.uint8), kind="param", on_drop=dropped, prefetched=True))
    assert seen == []
    for s in tier.slices():
        tier.mark_used(s)
    tier.enforce_budget()  # evicts both inside one operation
    assert seen == [("a", True), ("b", True)]


def test_write_backs_are_issued_after_the_tiers_lock(store):
    """[Note: callbacks after the lock]: the owner's ``writeback`` of a slice evicted inside an operation (a budget
    check in ``release``) and of a direct ``write_back`` runs once the outermost operation released the lock, in
    the order decided, before the operation returns; the slice's bytes reach the store."""
    tier = HostTier(budget=0)
    issued = []

    def wb(sl):
        issued.append((sl.key, tier._lock._is_owned()))
        return store.write(sl.key, sl.buf, 0)

    slices = []
    for k in ("a", "b", "c"):
        store.allocate(k, UNIT)
        buf = alloc_aligned(UNIT)
        buf.fill_(ord(k))
        sl = TieredUnit(k, buf, writeback=wb)
        tier.acquire(sl)  # referenced before it is added: a budget of 0 keeps it
        tier.add(sl)
        tier.mark_dirty(sl)
        slices.append(sl)
    fut = tier.write_back(slices[0])
    assert issued == [("a", False)] and fut.issued()
    tier.acquire(slices[0])  # the budget check in release evicts b and c, dirty: each write is decided in the loop
    for sl in slices:
        tier.release(sl)
    assert issued == [("a", False), ("b", False), ("c", False)]
    tier.wait_writes()
    for k in ("a", "b", "c"):
        out = alloc_aligned(UNIT)
        store.read(k, out, 0).wait()
        assert bool((out == ord(k)).all()), k


def test_a_wait_on_a_decided_write_issues_it(store):
    """A flush with room for one write in flight decides the second write while the first is not issued yet: the
    wait for room issues the first there (under the lock: the documented exception), and nothing deadlocks."""
    tier = HostTier(budget=1 << 30, writeback_limit=UNIT)
    under_lock = []

    def wb(sl):
        under_lock.append(tier._lock._is_owned())
        return store.write(sl.key, sl.buf, 0)

    for k in ("a", "b", "c"):
        store.allocate(k, UNIT)
        tier.add(TieredUnit(k, alloc_aligned(UNIT), dirty=True, writeback=wb))
    tier.flush()
    assert len(under_lock) == 3 and under_lock[:2] == [True, True]  # waited for room inside flush
    assert tier._pending_write_bytes() == 0 and not any(s.dirty for s in tier.slices())


def test_a_failed_write_back_is_raised_by_the_operation_and_its_future(store):
    tier = HostTier(budget=1 << 30)

    def wb(sl):
        raise OSError("no space left on the cache drive")

    sl = tier.add(TieredUnit("a", alloc_aligned(UNIT), dirty=True, writeback=wb))
    with pytest.raises(OSError, match="no space left"):
        tier.write_back(sl)
    with pytest.raises(OSError, match="no space left"):
        sl.writing.wait()
    with pytest.raises(OSError, match="no space left"):  # the write queue raises it on the training thread too
        tier.wait_writes()


def test_a_slice_is_updated_in_place_only_after_its_write_back():
    """``acquire_to_update`` waits for the slice's write in flight (the store reads ``buf`` until the write
    completes: the optimizer step must not change the bytes under it); ``acquire`` does not (readers)."""
    from aidaptiv_ds.io.futures import IOFuture

    class Write(IOFuture):  # a write still in flight, queued behind reads: a waiter expedites it, and it completes
        waited = 0

        def expedite(self, priority):
            if not self.done():
                Write.waited += 1
                self._chunk_done()

    tier = HostTier(budget=0)
    sl = tier.add(TieredUnit("g", alloc_aligned(UNIT), dirty=True, kind="opt", writeback=lambda s: Write(UNIT, 1)))
    tier.write_back(sl)
    assert not sl.writing.done()
    tier.acquire(sl)
    assert Write.waited == 0 and not sl.writing.done()
    tier.release(sl)
    tier.acquire_to_update(sl)
    assert Write.waited == 1 and sl.writing.done() and sl.refs == 1


def test_a_deferred_future_is_issued_once_by_whoever_comes_first():
    import threading

    from aidaptiv_ds.io.futures import DeferredFuture, completed

    calls = []
    started, release = threading.Event(), threading.Event()

    def submit():
        calls.append(threading.current_thread().name)
        started.set()
        release.wait(5)
        return completed(7)

    fut = DeferredFuture(7, submit)
    t = threading.Thread(target=fut.issue, name="issuer")
    t.start()
    started.wait(5)
    waiter = threading.Thread(target=fut.wait, name="waiter")  # comes second: waits for the issuer's submit
    waiter.start()
    release.set()
    t.join(5)
    waiter.join(5)
    assert calls == ["issuer"] and fut.done() and fut.wait() == 7
    early = DeferredFuture(3, lambda: None)  # a wait before any issue issues it; None completes at once
    assert early.wait() == 3 and early.issued()


def test_a_slices_life_is_its_state_and_the_tier_refuses_a_gone_slice():
    """[Note: a unit's transitions]: the state follows add, acquire, release, a dirty eviction's write and the budget;
    acquiring or dirtying a slice that left the tier is an owner's bug and raises, naming the state."""
    from aidaptiv_ds.io.futures import IOFuture
    from aidaptiv_ds.tiers import HostTier, TieredUnit, UnitState

    writes = []

    def writeback(s):
        fut = IOFuture(64, 1)
        writes.append(fut)
        return fut

    tier = HostTier(budget=0)
    s = TieredUnit("a", torch.zeros(64, dtype=torch.uint8), kind="opt", writeback=writeback, prefetched=True)
    assert s.state is UnitState.NEW
    tier.add(s)
    assert s.state is UnitState.PREFETCHED
    tier.acquire(s)
    assert s.state is UnitState.IN_USE
    tier.mark_dirty(s)
    tier.release(s)  # over the budget of 0: a dirty eviction writes it, and it stays until written
    assert s.state is UnitState.WRITING and len(writes) == 1
    writes[0]._chunk_done()  # the write completes
    tier.enforce_budget()
    assert s.state is UnitState.GONE
    for op in (tier.acquire, tier.mark_dirty):
        with pytest.raises(RuntimeError, match=r"of unit 'a', which is gone: no longer in the host tier"):
            op(s)


def test_a_units_transitions_are_refused_outside_their_states():
    """[Note: a unit's transitions]: every transition runs only from the states ``TRANSITIONS`` lists; the tier's
    operations go through them, so a misuse raises :class:`UnitStateError` naming the unit, the transition and the
    state, before any field changes."""
    from aidaptiv_ds.tiers import UnitStateError
    from aidaptiv_ds.tiers.unit import TRANSITIONS

    assert set(TRANSITIONS) == {"enter", "pin", "unpin", "mark_dirty", "mark_used", "write_back", "written",
                                "discard", "evict", "leave"}
    one, two = HostTier(budget=4 * UNIT), HostTier(budget=4 * UNIT)
    u = one.add(TieredUnit("u", torch.empty(UNIT, dtype=torch.uint8)))
    assert u.state is UnitState.CACHED
    with pytest.raises(UnitStateError, match=r"enter of unit 'u', which is cached"):
        two.add(u)  # in one tier at a time
    assert "u" not in two and u.state is UnitState.CACHED
    one.acquire(u)
    with pytest.raises(UnitStateError, match=r"evict of unit 'u', which is in_use"):
        u.leave(evicted=True)
    with pytest.raises(RuntimeError, match="in use and cannot be evicted"):
        one.evict(u)
    with pytest.raises(UnitStateError, match="clean or a write still in flight"):
        u.write_back(IOFuture(UNIT, 1))  # a clean unit has nothing to write
    one.release(u)
    with pytest.raises(UnitStateError, match="released more often"):
        one.release(u)
    one.drop(u)
    assert u.state is UnitState.GONE and u.refs == 0 and not u.dirty
    with pytest.raises(UnitStateError, match=r"leave of unit 'u', which is gone"):
        u.leave()
    two.add(u)  # a gone unit may enter again (a re-read of the same bytes)
    assert u.state is UnitState.CACHED and "u" in two
    new = TieredUnit("n", torch.empty(UNIT, dtype=torch.uint8))
    with pytest.raises(UnitStateError, match=r"evict of unit 'n', which is new"):
        new.leave(evicted=True)


def test_waiting_for_one_kinds_writes_settles_them_and_raises_a_failure_once():
    """``wait_writes(kind=)`` (the parameter swapper's ``synchronize_writes``): the units of that kind whose writes
    it waited for are no longer WRITING (at a budget of 0 they go), another kind's write is left in flight, and a
    failed write's error is raised by this call only, not again by the next operation."""
    from aidaptiv_ds.io.errors import StorageIOError

    class Write(IOFuture):  # in flight until waited for
        fail = False

        def expedite(self, priority):
            if not self.done():
                self._chunk_done(StorageIOError("write", "slab", 0, UNIT, 5, "param write failed") if self.fail else None)

    def unit(key, kind, fail=False):
        def writeback(u):
            w = Write(UNIT, 1)
            w.fail = fail
            return w
        return TieredUnit(key, torch.zeros(UNIT, dtype=torch.uint8), kind=kind, dirty=True, writeback=writeback)

    tier = HostTier(budget=0)
    p, o = unit("p", "param"), unit("o", "opt")
    for u in (o, p):
        tier.add(u)
        tier.acquire(u)
        tier.release(u)  # over the budget: a dirty eviction writes it
    assert p.state is UnitState.WRITING and o.state is UnitState.WRITING
    tier.wait_writes(kind="param")
    assert p.state is UnitState.GONE and "p" not in tier  # written, then evicted at a budget of 0
    assert o.state is UnitState.WRITING and not o.writing.done()
    bad = tier.add(unit("bad", "param", fail=True))
    tier.acquire(bad)
    tier.release(bad)
    with pytest.raises(StorageIOError, match="param write failed"):
        tier.wait_writes(kind="param")
    assert bad.state is not UnitState.WRITING
    tier.enforce_budget()  # the failure was raised once
    tier.wait_writes()
    assert o.state is UnitState.GONE
