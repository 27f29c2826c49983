"""Completion handles for asynchronous requests."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from .. import spans

log = logging.getLogger(__name__)


class IOFuture:
    """Completion of one request that the engine may have split into several chunks.

    ``wait()`` blocks until every chunk finished and returns the bytes transferred, or raises the
    first chunk's error (a :class:`~aidaptiv_ds.io.errors.StorageIOError` naming path and offset).
    A request never reports success unless all of its bytes were transferred.
    """

    __slots__ = ("nbytes", "_pending", "_lock", "_event", "_error", "_error_tb", "_callbacks", "_keepalive",
                 "_expedite", "_complete", "_drained")

    def __init__(self, nbytes: int, chunks: int, keepalive=None) -> None:
        self.nbytes = nbytes
        self._pending = chunks
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error: BaseException | None = None
        # the error's traceback where it happened (re-raising would grow it)
        self._error_tb: TracebackType | None = None
        self._callbacks: list = []
        #: every chunk has completed (set under the lock before the callbacks run; the event after them)
        self._complete = False
        #: the finishing thread ran every callback queued so far: a callback added now runs at once
        self._drained = False
        self._keepalive = keepalive  # the buffer: must outlive the I/O
        #: how to serve it sooner (:meth:`expedite`): a callable taking a priority, or the futures it combines
        self._expedite: Callable[[int], None] | list[IOFuture] | None = None
        if chunks == 0:
            self._finish()

    def _finish(self) -> None:
        # [Note: callbacks before waiters] Mark the request complete, run its callbacks, and only then wake the
        # waiters. A waiter then sees what the callbacks did: the bytes counted (the store's counters, the
        # ledger's), the request retired from the in-flight set. (Waking first let a waiter read the counters
        # before the count: a test saw it.) The callbacks run in the order they were added, including those added
        # while the earlier ones run: until the finishing thread has drained the list, add_done_callback queues
        # behind it instead of running at once. (Running at once let a later callback overtake an earlier one:
        # the store's byte counter, waiting for the store's lock, was overtaken by the combining future's
        # callback that the submitting thread, holding that lock, added -- so the combined request completed, and
        # its waiters woke, before the count; the full test suite saw that one too.) So no callback may wait for
        # its own request, nor take a lock a waiter holds while it waits; and no thread may add a callback and
        # then, holding a lock an earlier callback of that request takes, wait for what the new one completes.
        # None does: the only lock callbacks take is the store's, and nobody waits while holding it.
        with self._lock:
            self._keepalive = None
            self._complete = True
        try:
            while True:
                with self._lock:
                    callbacks, self._callbacks = self._callbacks, []
                    if not callbacks:
                        self._drained = True
                        break
                for cb in callbacks:
                    try:
                        cb(self)
                    except Exception:  # a bug in a callback: logged; the others still run (a combined request
                        # waits on one of them), and the request's own outcome stands (re-raised, the finishing
                        # engine worker would book it as the transfer's error on a request already complete)
                        log.exception("aidaptiv_ds: a completion callback of an I/O request of %d bytes raised",
                                      self.nbytes)
        finally:  # an interrupt: the waiters still wake, and later callbacks run on their adders' threads
            with self._lock:
                self._drained = True
            self._event.set()

    def _chunk_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error, self._error_tb = error, error.__traceback__
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._finish()

    def done(self) -> bool:
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        return self._error if self._complete else None

    def add_done_callback(self, fn) -> None:
        """Call ``fn(self)`` on completion, after the callbacks added before it and before the request's waiters
        wake ([Note: callbacks before waiters]): on the finishing thread, or at once on this one when that thread
        has already run them all."""
        with self._lock:
            if not self._drained:
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> int:
        """Block until complete; return bytes transferred.

        Raises:
            TimeoutError: if ``timeout`` seconds pass first.
            StorageIOError: the first failed chunk's error.

        A wait that blocks while a timeline records is a span ``aidaptiv::io_blocked`` (category
        ``"wait"``) on the waiting thread's lane, with the request's bytes.
        """
        if not self._event.is_set():
            self.expedite(DEMAND)  # someone is blocked on it now: whatever it is queued behind must not be
        if spans.ACTIVE is not None and not self._event.is_set():
            with spans.span("aidaptiv::io_blocked", cat="wait", bytes=self.nbytes):
                ready = self._event.wait(timeout)
        else:
            ready = self._event.wait(timeout)
        if not ready:
            raise TimeoutError(f"I/O request of {self.nbytes} bytes not complete after {timeout} s")
        if self._error is not None:
            # each raise of one exception object appends the raising frames to its traceback: reset it,
            # so the traceback shows this wait and the failed transfer, not every earlier waiter too
            raise self._error.with_traceback(self._error_tb)
        return self.nbytes


    def expedite(self, priority: int) -> None:
        """Serve this request (and what it is ordered after) at ``priority`` if that is more urgent than
        the priority it was queued at (``io.engine.READ_DEMAND`` < ``READ_PREFETCH`` < ``WRITE_BACK``).
        :meth:`wait` does it with ``READ_DEMAND`` before it blocks: a prefetch read or a write-back that
        a caller waits for has become demand (the store's [Note: priority inheritance], io/engine.py).
        A no-op when done, or for requests not made through the store."""
        e = self._expedite
        if e is None or self._event.is_set():
            return
        if callable(e):
            e(priority)
        else:
            for f in e:
                f.expedite(priority)


class DeferredFuture(IOFuture):
    """A request decided now and issued later: :meth:`issue` runs ``submit() -> IOFuture | None`` once, and this
    future completes with the request it returned (its bytes, its error), at once when it returned None, or with
    the error ``submit`` raised.

    Whoever comes first issues it: the owner's :meth:`issue`, or a :meth:`wait` that comes before (so a wait can
    never block on a request nobody issued yet; a second caller waits for the first one's ``submit`` to return).
    The host tier decides its write-backs under its lock and issues them after it ([Note: callbacks after the
    lock], ``tiers/host_tier.py``).
    """

    __slots__ = ("_submit", "_claim", "_issued")

    def __init__(self, nbytes: int, submit: Callable[[], IOFuture | None]) -> None:
        super().__init__(nbytes, 1)
        self._submit: Callable[[], IOFuture | None] | None = submit
        self._claim = threading.Lock()
        self._issued = threading.Event()

    def issued(self) -> bool:
        return self._issued.is_set()

    def issue(self) -> BaseException | None:
        """Run ``submit`` unless another caller did (then wait until it returned); returns the error ``submit``
        raised (also this future's error), or None."""
        if not self._claim.acquire(blocking=False):
            self._issued.wait()
            return None
        submit, self._submit = self._submit, None
        assert submit is not None  # the claim is taken once
        try:
            inner = submit()
        except BaseException as e:  # noqa: BLE001 - the request failed: its future carries the error
            self._issued.set()
            self._chunk_done(e)
            return e
        self._issued.set()
        if inner is None:
            self._chunk_done()
        else:
            self._expedite = [inner]
            inner.add_done_callback(lambda f: self._chunk_done(f.exception()))
        return None

    def wait(self, timeout: float | None = None) -> int:
        self.issue()
        return super().wait(timeout)


#: ``io.engine.READ_DEMAND`` (not imported: the engine imports this module)
DEMAND = 0


def wait_all(futures) -> int:
    """Wait for every future (all of them, even after an error); return total bytes or raise the first error."""
    total, first = 0, None
    for f in futures:
        try:
            total += f.wait()
        except BaseException as e:  # noqa: BLE001 - re-raised below after all are drained
            first = first or e
    if first is not None:
        raise first
    return total


def completed(nbytes: int = 0) -> IOFuture:
    """A future that is already complete (for requests served from memory)."""
    return IOFuture(nbytes, 0)


def combine(futures: list[IOFuture], nbytes: int, finalizer=None, keepalive=None) -> IOFuture:
    """One future that completes when all ``futures`` have, then runs ``finalizer()`` (whose exception,
    e.g. a checksum mismatch, becomes the combined error). The first sub-request error wins and the
    finalizer is skipped then."""
    out = IOFuture(nbytes, 1, keepalive=keepalive)
    if not futures:
        _finish(out, None, finalizer)
        return out
    out._expedite = list(futures)
    lock = threading.Lock()
    remaining = [len(futures)]
    first_error: list[BaseException | None] = [None]

    def on_done(f: IOFuture) -> None:
        with lock:
            remaining[0] -= 1
            first_error[0] = first_error[0] or f.exception()
            last = remaining[0] == 0
        if last:
            _finish(out, first_error[0], finalizer)

    for f in futures:
        f.add_done_callback(on_done)
    return out


def _finish(out: IOFuture, err: BaseException | None, finalizer) -> None:
    if err is None and finalizer is not None:
        try:
            finalizer()
        except BaseException as e:  # noqa: BLE001
            err = e
    out._chunk_done(err)
