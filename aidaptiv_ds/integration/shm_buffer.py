"""DeepSpeed's shared-memory all-reduce buffer on CPU ranks, given back when the process exits.

[Note: the buffer DeepSpeed never unlinks]
On the CPU accelerator, DeepSpeed 0.19.8's ``TorchBackend`` initialises its ``shm_comm`` op (``comm/torch.py:219``)
when every rank is on one node (``LOCAL_SIZE`` equal to the world size: the ``deepspeed`` launcher sets it, also for
a single rank). The op creates one POSIX shared-memory segment per rank,
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (``ops/csrc/cpu/comm/shm.cpp``,
``shm_initialize``; sized for two 32 MiB and two 1 MiB buffers), and never unlinks it: ``shared_close``, which
would, is called nowhere. A segment is host memory (tmpfs) that outlives its process, so every run leaks one per
rank until the machine reboots. On this project's VM a day of test and benchmark runs had left 131 of them, 4.0 GiB.
That is 4.0 GiB of the machine's 23.5 held by no process; a benchmark of a 481M-parameter model was stopped for low
memory beside it.

Each rank that runs our backend unlinks its own segment when its process exits (``atexit``). This is safe: every
peer opened and mapped it while the backends initialised (``shm_initialize`` loops until it has opened every
rank's segment), long before any rank exits. The mappings stay valid, and the memory goes when the last of them
is unmapped. A process killed with SIGKILL still leaks its segment; nothing in the process can prevent that.
"""
from __future__ import annotations

import atexit
import os
from collections.abc import Mapping

#: where glibc's ``shm_open`` keeps a segment named ``name`` (Linux)
SHM_DIR = "/dev/shm"
#: DeepSpeed's segment name prefix (``SHM_BUFFER_NAME`` in ``ops/csrc/cpu/comm/shm.cpp``)
SHM_BUFFER_NAME = "deepspeed_allreduce_buffer"

_registered = False


def allreduce_buffer_path(rank: int, environ: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """The path of rank ``rank``'s DeepSpeed all-reduce segment, as ``shm_initialize`` names it from the
    environment's ``MASTER_ADDR`` and ``MASTER_PORT`` (empty where unset) and the user id."""
    env = os.environ if environ is None else environ
    uid = os.getuid() if uid is None else int(uid)
    name = f"{SHM_BUFFER_NAME}_{uid}_{env.get('MASTER_ADDR', '')}_{env.get('MASTER_PORT', '')}_{int(rank)}"
    return os.path.join(SHM_DIR, name)


def _unlink(path: str) -> bool:
    """Unlink ``path``; True when it was there. Never raises: at exit there is nobody left to handle an error."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def release_allreduce_buffer(rank: int) -> bool:
    """Unlink rank ``rank``'s DeepSpeed all-reduce segment, as the environment names it now (see the module's
    note); True when one was there. Never raises."""
    return _unlink(allreduce_buffer_path(rank))


def release_allreduce_buffer_at_exit(rank: int) -> None:
    """Unlink rank ``rank``'s segment when this process exits (registered once per process), at the path named
    now, from the rendezvous this process joined (the environment may name another port by the time it exits)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_unlink, allreduce_buffer_path(rank))


def release_allreduce_buffers_of_port(port: int | str) -> int:
    """Unlink every DeepSpeed all-reduce segment of this user for rendezvous port ``port`` (any address, any rank);
    returns how many. For a harness whose child processes have all exited: it reaps what they left (DeepSpeed's
    own backends, which have no exit hook, and processes killed with SIGKILL). Never raises."""
    import glob

    pattern = os.path.join(SHM_DIR, f"{SHM_BUFFER_NAME}_{os.getuid()}_*_{port}_*")
    return sum(_unlink(path) for path in glob.glob(pattern))
