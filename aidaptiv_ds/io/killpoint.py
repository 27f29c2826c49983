"""Test-only crash points: ``AIDAPTIV_TEST_KILL_AT`` makes this process ``SIGKILL`` itself at a named step.

The crash-safety tests (checkpoint saves, the safe-file writer) run a real process and ask it to die
at one exact moment, the way ``kill -9`` or a power cut would stop it. Nothing happens unless the
variable is set, and reading it costs one dictionary lookup per point.

Syntax: a comma-separated list of ``NAME[:DETAIL][@RANK][#N]``:

* ``NAME`` -- the point, e.g. ``before_manifest`` or ``atomic.synced``;
* ``:DETAIL`` -- only where the point's detail (for the safe-file writer: the final path) contains
  this text;
* ``@RANK`` -- only in the process whose ``RANK`` environment variable is this (default: every rank);
* ``#N`` -- only at the ``N``-th time (1-based) this process reaches a matching point (default: the first).
"""
from __future__ import annotations

import os
import signal

ENV = "AIDAPTIV_TEST_KILL_AT"
_SEEN: dict[str, int] = {}


def _matches(spec: str, name: str, detail: str) -> tuple[bool, int]:
    nth = 1
    if "#" in spec:
        spec, n = spec.rsplit("#", 1)
        nth = int(n)
    if "@" in spec:
        spec, rank = spec.rsplit("@", 1)
        if os.environ.get("RANK", "0") != rank:
            return False, nth
    want, _, sub = spec.partition(":")
    return want == name and (not sub or sub in detail), nth


def kill_point(name: str, detail: str = "") -> None:
    """``SIGKILL`` this process here when ``AIDAPTIV_TEST_KILL_AT`` names this point (see module docstring)."""
    specs = os.environ.get(ENV)
    if not specs:
        return
    for spec in specs.split(","):
        hit, nth = _matches(spec.strip(), name, detail)
        if hit:
            _SEEN[spec] = _SEEN.get(spec, 0) + 1
            if _SEEN[spec] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
