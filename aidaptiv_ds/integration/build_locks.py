"""Left-over torch extension build locks, found before DeepSpeed waits on one forever.

DeepSpeed JIT-builds its ops with ``torch.utils.cpp_extension.load`` the first time a process needs
them; on the CPU accelerator every ``deepspeed.initialize`` needs ``deepspeed_shm_comm`` (in
``init_distributed``, about a minute to build on 2 cores), and ``cpu_adam`` / ``async_io`` are built
the same way. The build holds torch's ``FileBaton``: the file ``<build dir>/lock``, created with
``O_EXCL``, removed when the build ends. A second process polls for it to disappear **without a
time limit** (``torch/utils/file_baton.py``, ``FileBaton.wait``). A build that was killed half-way
(Ctrl-C during the first minute of the first run, a job time limit, an out-of-memory kill) leaves
the file behind, and from then on every DeepSpeed process of that user hangs in
``deepspeed.initialize`` with nothing in its log.

:func:`check_build_locks` runs before ``deepspeed.initialize`` and ``zero.Init`` of a config with the
``"aidaptiv"`` section enabled (:mod:`aidaptiv_ds.integration.hooks`). A lock is **stale** when it is
older than :data:`STALE_AFTER_S` and no process has its working directory in that build directory
(torch runs ``ninja`` there for the whole compile): then it raises :class:`StaleBuildLockError`
naming the file and the fix, before any state is touched. When another user's processes cannot be
inspected, an old lock is only warned about (:class:`BuildLockWarning`).

The build directory is torch's (``cpp_extension._get_build_directory``):
``$TORCH_EXTENSIONS_DIR/<op>`` when that variable is set, else
``<user cache>/torch_extensions/py<major><minor>_<cpu|cu<ver>|rocm<ver>>/<op>``.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings

from ..errors import AidaptivError, AidaptivWarning

#: a lock this old (seconds) with no build running in its directory is left over from a killed build
STALE_AFTER_S = 120.0
#: seconds to wait before looking at a stale-looking lock again
RECHECK_S = 0.5


class StaleBuildLockError(AidaptivError, RuntimeError):
    """A torch extension build lock left by a killed build: DeepSpeed would wait on it forever."""


class BuildLockWarning(AidaptivWarning):
    """An old torch extension build lock whose owner could not be checked."""


@dataclasses.dataclass(frozen=True)
class BuildLock:
    """One ``<build dir>/lock`` file.

    Attributes:
        path: the lock file; op: its build directory's name (the op, e.g. ``deepspeed_shm_comm``).
        age_s: seconds since it was created (from its mtime).
        building: True when a live process works in its build directory, None when some processes
            could not be inspected and none of the others does.
    """
    path: str
    op: str
    age_s: float
    building: bool | None


def extensions_root() -> str:
    """The directory holding one build directory per op, as torch computes it (module docstring)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        acc = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        acc = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        acc = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{py}_{acc}")


#: programs of a build (torch runs ``ninja`` in the build directory; it runs the compilers there)
BUILD_TOOLS = {"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "clang", "clang++", "nvcc", "hipcc", "ld", "as",
               "cicc", "ptxas", "collect2"}


def _working_dirs(proc: str = "/proc") -> tuple[set[str], bool]:
    """Working directories of the live processes, and whether every process that might be a build
    could be inspected (one whose ``cwd`` is unreadable counts only if its command line is a build
    tool of :data:`BUILD_TOOLS` or unreadable too: a sandbox's init often hides its ``cwd``)."""
    dirs, complete = set(), True
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return dirs, False
    for pid in pids:
        try:
            dirs.add(os.path.realpath(os.readlink(os.path.join(proc, pid, "cwd"))))
            continue
        except FileNotFoundError:
            continue  # the process ended meanwhile
        except OSError:
            pass
        try:
            with open(os.path.join(proc, pid, "cmdline"), "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except FileNotFoundError:
            continue
        except OSError:
            argv0 = b""
        name = os.path.basename(os.fsdecode(argv0)).split(maxsplit=1)[:1]
        if not name or name[0] in BUILD_TOOLS:
            complete = False
    return dirs, complete


def find_build_locks(root: str | None = None, now: float | None = None, proc: str = "/proc") -> list[BuildLock]:
    """Every ``<root>/<op>/lock`` (``root``: :func:`extensions_root`), oldest first."""
    root = root or extensions_root()
    try:
        ops = sorted(os.listdir(root))
    except OSError:
        return []
    now = time.time() if now is None else now
    found = []
    cwd_set, complete = None, True
    for op in ops:
        path = os.path.join(root, op, "lock")
        try:
            age = now - os.stat(path).st_mtime
        except OSError:
            continue
        if cwd_set is None:
            cwd_set, complete = _working_dirs(proc)
        d = os.path.realpath(os.path.join(root, op))
        busy = any(c == d or c.startswith(d + os.sep) for c in cwd_set)
        found.append(BuildLock(path, op, age, True if busy else (False if complete else None)))
    return sorted(found, key=lambda b: -b.age_s)


def check_build_locks(root: str | None = None, older_than_s: float = STALE_AFTER_S, proc: str = "/proc") -> None:
    """Refuse to start DeepSpeed on a stale build lock (see the module docstring).

    Raises:
        StaleBuildLockError: a lock older than ``older_than_s`` with no build running in its directory.

    Warns:
        BuildLockWarning: such a lock where other users' processes could not be inspected.
    """
    for lock in find_build_locks(root, proc=proc):
        if lock.age_s < older_than_s or lock.building:
            continue
        # a build that just ended releases its lock milliseconds after ninja exits: look once more
        time.sleep(RECHECK_S)
        if not os.path.exists(lock.path):
            continue
        what = (f"torch extension build lock {lock.path} is {lock.age_s / 60:.0f} minutes old and no build of "
                f"{lock.op} is running")
        fix = (f"fix: delete it (rm {lock.path}); it is left over from a build that was killed, and DeepSpeed "
               f"(torch's FileBaton) would wait for it to disappear forever")
        if lock.building is None:
            warnings.warn(f"{what} that this process can see; if none is, {fix}", BuildLockWarning, stacklevel=3)
            continue
        raise StaleBuildLockError(f"{what}; {fix}")
