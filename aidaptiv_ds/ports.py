"""One free TCP port for a rendezvous (``MASTER_PORT``, ``--master_port``)."""
from __future__ import annotations

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
