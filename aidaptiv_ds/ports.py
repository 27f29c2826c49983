"""One free TCP port for a rendezvous (``MASTER_PORT``, ``--master_port``)."""
from __future__ import annotations

import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no socket is bound to now (the kernel's choice for port 0).

    The port is released before it is returned, so another process may take it before the caller
    binds it; the window is short (the launcher binds it next), and the kernel hands out ephemeral
    ports round-robin, so a second call does not return the same one at once.

    Raises:
        OSError: ``host`` is not a local address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
