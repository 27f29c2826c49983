"""Test-only stand-in for ``pdsh`` and ``ssh`` between simulated nodes (network namespaces on one machine).

DeepSpeed's launcher in its default multi-node mode checks ``ssh HOST hostname`` and then starts one
launcher per host with ``pdsh -S -f N -w HOST1,HOST2 CMD...`` (``%n`` in CMD: the host's index). This
machine has neither pdsh nor an ssh server, so ``tests/test_two_nodes.py`` puts this script on the
launching node's ``PATH`` as ``pdsh`` and ``ssh``: it runs CMD the way pdsh's ssh transport would, in
a shell "on" each host -- ``ip netns exec <the host's namespace> sh -c CMD`` -- with that host's
login environment. Everything DeepSpeed does around the transport (the ssh check, the hostfile, the
exports and ``.deepspeed_env``, ``%n``, ``-S``'s exit status) is DeepSpeed's own.

``AIDAPTIV_TEST_HOSTS`` (JSON) describes the hosts: ``{"ADDR": {"netns": NAME, "env": {...},
"mount": [DISK, MOUNT_POINT] | null}}``: the environment a login on the host starts with, and the
host's own disk bind-mounted at the same path on every host (node-local storage).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def _host(addr: str) -> dict:
    hosts = json.loads(os.environ["AIDAPTIV_TEST_HOSTS"])
    if addr not in hosts:
        sys.exit(f"netns_remote: no route to host {addr} (known: {sorted(hosts)})")
    return hosts[addr]


def remote(addr: str, command: str) -> subprocess.Popen:
    """Start ``command`` (a shell command line) "on" host ``addr``."""
    h = _host(addr)
    mount = h.get("mount")
    script = 'mount --bind "$1" "$2" && shift 2 && exec sh -c "$0"' if mount else 'exec sh -c "$0"'
    argv = ["ip", "netns", "exec", h["netns"], "sh", "-c", script, command, *(mount or [])]
    return subprocess.Popen(argv, env=h["env"])


def pdsh(args: list[str]) -> int:
    """``pdsh -S -f FANOUT -w HOSTS CMD...``: CMD on every host at once (``%n`` = the host's index);
    with ``-S`` the largest exit status. A ``pkill`` (DeepSpeed's clean-up on a signal) is not run:
    the test ends its own process groups by id."""
    hosts, status_max, i = [], False, 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] == "-w":
            hosts = args[i + 1].split(",")
            i += 2
        elif args[i] == "-f":
            i += 2
        elif args[i] == "-S":
            status_max = True
            i += 1
        else:
            sys.exit(f"netns_remote: pdsh option {args[i]} is not emulated")
    command = " ".join(args[i:])
    if command.lstrip().startswith("pkill"):
        return 0
    procs = [remote(h, command.replace("%n", str(n))) for n, h in enumerate(hosts)]
    codes = [p.wait() for p in procs]
    return max(codes) if status_max else codes[0]


def ssh(args: list[str]) -> int:
    """``ssh [-o OPT] [-p PORT] HOST CMD...``."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 2 if args[i] in ("-o", "-p") else 1
    return remote(args[i], " ".join(args[i + 1:])).wait()


def install(bin_dir: str) -> None:
    """Write ``pdsh`` and ``ssh`` wrappers into ``bin_dir`` (to put first on the launching node's PATH)."""
    os.makedirs(bin_dir, exist_ok=True)
    for role in ("pdsh", "ssh"):
        path = os.path.join(bin_dir, role)
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.abspath(__file__)}" {role} "$@"\n')
        os.chmod(path, 0o755)


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    sys.exit(pdsh(rest) if role == "pdsh" else ssh(rest))
