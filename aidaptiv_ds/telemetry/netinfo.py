"""Network facts for multi-node launches: what this node's host name resolves to, its interfaces and
their IPv4 addresses, and how many nodes the current job has.

Why it matters (``launch/MULTINODE.md``): torchrun's c10d rendezvous publishes this node's address as
``socket.getfqdn()`` unless ``--local_addr`` is given, decides whether it hosts the rendezvous store
by comparing the endpoint with the addresses of ``socket.gethostname()`` (``torch/distributed/
elastic/rendezvous/utils.py`` ``_matches_machine_hostname``) unless ``--rdzv_conf is_host=...``
says so, and gloo binds to the address the host name resolves to unless ``GLOO_SOCKET_IFNAME``
names an interface. A host name resolving to ``127.0.0.1`` -- an ``/etc/hosts`` line many images
carry, and every container by default -- makes each node advertise an address no other node can
reach.

Every function returns plain data and never raises for a fact the OS does not expose.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct

SIOCGIFADDR = 0x8915  # linux/sockios.h: get an interface's IPv4 address


def resolve_host(name: str | None = None) -> dict:
    """``{"host", "addresses", "loopback", "error"}``: the addresses ``name`` (default: this machine's
    host name) resolves to, whether all of them are loopback (or none resolved), and the resolver's
    error if it failed."""
    host = name or socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        addrs = sorted({i[4][0] for i in infos})
        err = None
    except OSError as e:
        addrs, err = [], str(e)
    loop = not addrs or all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)
    return {"host": host, "addresses": addrs, "loopback": loop, "error": err}


def interfaces() -> list[dict]:
    """This node's network interfaces: ``[{"name", "ipv4", "loopback"}]`` (``ipv4`` None when the
    interface has none), from ``if_nameindex`` and ``ioctl(SIOCGIFADDR)`` (Linux)."""
    out = []
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return out
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for n in names:
            addr = None
            try:
                import fcntl
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", n.encode()[:15]))
                addr = socket.inet_ntoa(raw[20:24])
            except (OSError, ImportError):
                pass
            out.append({"name": n, "ipv4": addr,
                        "loopback": addr is not None and ipaddress.ip_address(addr).is_loopback or n == "lo"})
    finally:
        s.close()
    return out


def _env_int(env, key: str) -> int | None:
    try:
        return int(env[key]) if (env.get(key) or "").strip() else None
    except ValueError:
        return None


def processes_on_node(env=None) -> int | None:
    """Processes of this job on this node, from the launchers' variables: the larger of ``LOCAL_WORLD_SIZE``
    (torchrun) and ``LOCAL_SIZE`` (the ``deepspeed`` launcher sets only that one); None where neither is set.
    The larger, because a library may set one of them wrong: under the ``deepspeed`` launcher with two CPU ranks,
    HF Trainer's accelerate (``PartialState``, MULTI_CPU) sets ``LOCAL_WORLD_SIZE=1`` beside the launcher's
    ``LOCAL_SIZE=2`` (found by a new-user trial); counting too many ranks only makes each rank's share smaller."""
    env = os.environ if env is None else env
    return max(_env_int(env, "LOCAL_WORLD_SIZE") or 0, _env_int(env, "LOCAL_SIZE") or 0) or None


def nodes_in_job(env=None) -> int | None:
    """How many nodes the job this process belongs to has, from the launchers' variables: torchrun's
    ``GROUP_WORLD_SIZE`` (its agents), else ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` (or DeepSpeed's
    ``LOCAL_SIZE``), else SLURM's ``SLURM_JOB_NUM_NODES`` / ``SLURM_NNODES``; None outside a job."""
    env = os.environ if env is None else env
    if _env_int(env, "GROUP_WORLD_SIZE"):
        return _env_int(env, "GROUP_WORLD_SIZE")
    world, local = _env_int(env, "WORLD_SIZE"), processes_on_node(env)
    if world and local:
        return max(1, world // local)
    return _env_int(env, "SLURM_JOB_NUM_NODES") or _env_int(env, "SLURM_NNODES")
