"""Spans: named time ranges for the step timeline and for a user's own ``torch.profiler`` trace.

Every layer marks what it does with one context manager, from the I/O engine up to the Stage-3
adapter::

    from aidaptiv_ds.spans import span

    with span("aidaptiv::optimizer_step", subgroup=i):
        ...

A span goes to up to two places, each only while it is switched on:

* the **recorder** of :mod:`aidaptiv_ds.telemetry.timeline` (``ACTIVE``, set for the steps a
  timeline was asked for): start and end (``time.perf_counter`` seconds), a *lane* (the row of the
  picture, e.g. ``"compute"``, ``"optimizer"``), a category and the keyword arguments;
* a ``torch.profiler.record_function`` range of the same name (arguments as ``k=v`` text), when a
  ``torch.profiler`` session is running, so a user's trace shows aidaptiv_ds's ranges among torch's
  operators.

With both off, :func:`span` returns one shared no-op object: a module-global read and one attribute
check of torch's profiler flag (measured well under 1 µs; ``record_function`` alone costs tens of µs
even without a profiler, so it is never entered then).

Lanes: ``lane=None`` takes the lane of the innermost open span on this thread, else the thread's
default lane: ``"compute"`` for the main thread and for threads that ran a traced module
(:func:`set_thread_lane`: autograd's device threads on GPUs), ``"thread <name>"`` for any other; so a
wait inside an optimizer span lands on the optimizer's lane, and a wait on a helper thread never
lands on the compute lane. Spans on one lane must nest (the Chrome-trace rule for one thread).

[Note: threads and torch.profiler] ``torch.profiler`` records ``record_function`` ranges only on the
thread that started it (and autograd's threads); ranges entered on our I/O worker threads would be
dropped, so the I/O engine records its transfers into the recorder only (:func:`complete`).

This module imports nothing of aidaptiv_ds and needs no torch (rank 1 of ``docs/design.md``); it looks
torch's profiler up in ``sys.modules`` only when torch is already imported.
"""
from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Literal

#: the recorder spans go to while a timeline records; None otherwise (read it once per event)
ACTIVE: Recorder | None = None

DEFAULT_LANE = "compute"
_tls = threading.local()


class Recorder:
    """Collects finished spans, instants and counters of this process (thread-safe).

    Each event is a tuple ``(kind, name, cat, lane, t0, t1, args)``: ``kind`` ``"X"`` (a span from
    ``t0`` to ``t1``) or ``"i"`` (an instant at ``t0``, ``t1`` None); times are ``time.perf_counter()``
    seconds; ``args`` a dict or None. ``origin`` is the perf_counter value taken as time 0 and
    ``wall_origin`` the matching ``time.time()``.
    """

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.wall_origin = time.time()
        self.events: list[tuple] = []  # list.append is atomic: no lock on the hot path

    def add(self, name: str, cat: str, lane: str, t0: float, t1: float, args: dict | None = None) -> None:
        """Record a span of ``lane`` from ``t0`` to ``t1`` (perf_counter seconds)."""
        self.events.append(("X", name, cat, lane, t0, t1, args))

    def instant(self, name: str, cat: str, lane: str, t: float, args: dict | None = None) -> None:
        self.events.append(("i", name, cat, lane, t, None, args))


def _default_lane() -> str:
    lane = getattr(_tls, "default", None)
    if lane is None:
        t = threading.current_thread()
        lane = _tls.default = DEFAULT_LANE if t is threading.main_thread() else f"thread {t.name}"
    return lane


def set_thread_lane(lane: str = DEFAULT_LANE) -> None:
    """Make ``lane`` the default lane of spans opened on the calling thread (see the module docstring)."""
    _tls.default = lane


def _profiler_on() -> bool:
    m = sys.modules.get("torch.autograd.profiler")
    return m is not None and bool(getattr(m, "_is_profiler_enabled", False))


def _record_function(name: str, args: dict):
    from torch.autograd.profiler import record_function  # torch is imported: _profiler_on() saw it

    return record_function(name, ", ".join(f"{k}={v}" for k, v in args.items()) if args else None)


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> Literal[False]:
        return False


_NOOP = _NoSpan()


class _Span:
    __slots__ = ("rec", "name", "cat", "lane", "args", "rf", "t0")

    def __init__(self, rec: Recorder | None, name: str, cat: str, lane: str | None, args: dict, profiled: bool):
        self.rec, self.name, self.cat, self.lane, self.args = rec, name, cat, lane, args
        self.rf = _record_function(name, args) if profiled else None

    def __enter__(self):
        if self.rec is not None:
            stack = _tls.__dict__.setdefault("lanes", [])
            if self.lane is None:
                self.lane = stack[-1] if stack else _default_lane()
            stack.append(self.lane)
        if self.rf is not None:
            self.rf.__enter__()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> Literal[False]:
        t1 = time.perf_counter()
        if self.rf is not None:
            self.rf.__exit__(*exc)
        if self.rec is not None:
            _tls.lanes.pop()
            self.rec.add(self.name, self.cat, self.lane or DEFAULT_LANE, self.t0, t1, self.args or None)
        return False


def span(name: str, lane: str | None = None, cat: str = "aidaptiv", **args):
    """A context manager timing its block as ``name`` (see the module docstring).

    Args:
        name: what runs, ``"aidaptiv::<what>"`` by convention (``aidaptiv::swap_in``,
            ``aidaptiv::io_wait``, ``aidaptiv::optimizer_step``, ``aidaptiv::write_back``).
        lane: the timeline row; None: the enclosing span's lane on this thread, else ``"compute"``.
            The picture draws ``"compute"`` and ``"optimizer"``; any other name gets its own row.
        cat: category (Chrome-trace ``cat``; the picture colours by it: ``"wait"`` marks a wait).
        **args: small JSON-serialisable facts (``subgroup=3``, ``bytes=...``), kept with the span.

    Returns:
        An object for ``with``; a shared no-op when neither a timeline nor ``torch.profiler`` records.
    """
    rec = ACTIVE
    profiled = _profiler_on()
    if rec is None and not profiled:
        return _NOOP
    return _Span(rec, name, cat, lane, args, profiled)


def spanned(name: str, lane: str | None = None, cat: str = "aidaptiv"):
    """A decorator: every call of the function runs inside :func:`span` ``(name, lane, cat)``.

    For methods whose whole body is the range (a swap-in, a write-back); costs what :func:`span` costs
    when nothing records, plus one Python call."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with span(name, lane, cat):
                return fn(*args, **kwargs)
        return wrapper
    return decorate


def complete(name: str, t0: float, t1: float, lane: str, cat: str = "aidaptiv", **args) -> None:
    """Record a span measured elsewhere (``t0``/``t1`` from ``time.perf_counter``), if a timeline records.

    For code that already times itself (the I/O engine's system calls) or whose start and end are
    seen in different callbacks (module hooks); never goes to ``torch.profiler``.
    """
    rec = ACTIVE
    if rec is not None:
        rec.add(name, cat, lane, t0, t1, args or None)


def instant(name: str, lane: str = DEFAULT_LANE, cat: str = "aidaptiv", **args) -> None:
    """Record a point in time (a decision, a counter), if a timeline records."""
    rec = ACTIVE
    if rec is not None:
        rec.instant(name, cat, lane, time.perf_counter(), args or None)


def start(recorder: Recorder | None = None) -> Recorder:
    """Make ``recorder`` (a new one by default) the one spans go to; returns it.

    Raises:
        RuntimeError: another recorder is active (one timeline per process at a time).
    """
    global ACTIVE
    if ACTIVE is not None and ACTIVE is not recorder:
        raise RuntimeError("aidaptiv_ds: a timeline is already recording in this process")
    ACTIVE = recorder or Recorder()
    return ACTIVE


def stop() -> Recorder | None:
    """Stop recording; return the recorder that was active (None if none was)."""
    global ACTIVE
    rec, ACTIVE = ACTIVE, None
    return rec
