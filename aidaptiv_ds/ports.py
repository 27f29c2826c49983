"""One free TCP port for a rendezvous (``MASTER_PORT``, ``--master_port``)."""
from __future__ import annotations

import os
import socket


#: ports this process handed out already (never twice)
_GIVEN: set[int] = set()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (``net.ipv4.ip_local_port_range``; Linux's default 32768-60999)."""
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no socket is bound to now, below the kernel's ephemeral range.

    [Note: ports outside the ephemeral range.] The port is released before it is returned, so another
    process may take it before the caller binds it. The kernel's choice for port 0 is an ephemeral port,
    the range every outgoing connection of the machine draws from: on a busy machine one of them took it
    in that window (``EADDRINUSE`` at the rendezvous: one test of a default run under load). A random port
    of the 12,000 below the range is never handed out by the kernel, only bound on purpose; one that binds
    now is returned (never twice in a process), else the kernel's choice as before.

    [Note: a slice per process tree] Two processes that draw at once (two test workers, each with its children)
    can draw the same free port, and the later bind fails or, worse, a rank of one job joins the other's
    rendezvous. ``AIDAPTIV_PORT_SLICE=i/n`` (inherited by children) confines this process to the ``i``-th of
    ``n`` equal slices of the range; ``tests/conftest.py`` gives each pytest-xdist worker its own.

    Raises:
        OSError: ``host`` is not a local address.
    """
    import random

    lo, _ = ephemeral_range()
    first, last = max(1024, lo - 12000), lo - 1
    first, last = _slice(first, last, os.environ.get("AIDAPTIV_PORT_SLICE", ""))
    rng = random.Random()
    if last > first:
        for _ in range(64):
            port = rng.randint(first, last)
            if port in _GIVEN:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _slice(first: int, last: int, spec: str) -> tuple[int, int]:
    """The ``i``-th of ``n`` equal parts of ports ``first..last`` for ``spec`` ``"i/n"``; the whole range for an
    empty or malformed ``spec``."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        return first, last
    if not 0 <= i < n:
        return first, last
    width = (last - first + 1) // n
    return first + i * width, first + (i + 1) * width - 1


def ensure_env() -> dict[str, str]:
    """Set the single-process defaults of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` (a free local port) for the variables that are absent (what ``deepspeed.init_distributed``
    reads; a launcher sets them all and they are left alone); returns what was set."""
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    if "MASTER_PORT" not in os.environ:
        defaults["MASTER_PORT"] = str(free_port())
    set_now = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now
