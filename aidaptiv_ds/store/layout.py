"""Where a store's files live under each cache path, and the lock that keeps two owners apart.

Layout under every cache path (so ranks, nodes sharing a network path, and runs never collide)::

    <cache_path>/aidaptiv_ds/<host>/ledger.json              endurance ledger of this node on this path
    <cache_path>/aidaptiv_ds/<host>/<run>/rank<R>/slab.bin    the preallocated slab of rank R
    <cache_path>/aidaptiv_ds/<host>/<run>/rank<R>/owner.lock  flock held by the owning process
    <cache_path>/aidaptiv_ds/<host>/<run>/rank<R>/index.json  extent index (first path only)

The owner lock is an ``fcntl.flock`` on ``owner.lock`` of every path, taken without blocking: a
second process asking for the same (host, run, rank) gets :class:`StoreInUseError` naming the
holder's pid, and the kernel drops the lock when a process dies, so a crash leaves no stale lock.
Nothing here deletes a directory it does not own.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import tempfile

from ..io.errors import StorageError

ROOT_NAME = "aidaptiv_ds"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class StoreInUseError(StorageError):
    """Another live process owns this (host, run, rank) namespace."""


class CachePathError(StorageError, ValueError):
    """A cache path is missing, not a directory, or not writable."""


def safe_name(name: str) -> str:
    """``name`` reduced to characters that are safe in a path component."""
    out = _SAFE.sub("_", str(name)).strip("._")
    return out or "_"


HOSTNAME_ENV = "AIDAPTIV_HOSTNAME"


def hostname() -> str:
    """This node's name in the layout: ``$AIDAPTIV_HOSTNAME`` when set (non-empty), else the machine's
    host name; reduced by :func:`safe_name`. The override is for nodes whose host names clash (containers
    that all call themselves ``localhost``) and for several simulated nodes on one machine."""
    return safe_name(os.environ.get(HOSTNAME_ENV) or socket.gethostname())


def check_cache_path(path: str, field: str = "aidaptiv.cache_paths") -> str:
    """Absolute path of an existing, writable directory.

    Raises:
        CachePathError: naming ``field``, the path, what is wrong and the fix.
    """
    ap = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(ap):
        raise CachePathError(f"{field}: {path!r} does not exist. Fix: create it (mkdir -p {ap}) or list an "
                             f"existing directory on the cache drive.")
    if not os.path.isdir(ap):
        raise CachePathError(f"{field}: {path!r} is not a directory. Fix: give the directory on the cache drive "
                             f"(a mount point or a folder below it).")
    if os.statvfs(ap).f_flag & os.ST_RDONLY:  # before access(): "not writable by this user" would mislead
        raise CachePathError(f"{field}: {path!r} is on a read-only filesystem. Fix: remount it read-write "
                             f"(mount -o remount,rw <its mount point>), or choose a directory on a writable drive.")
    if not os.access(ap, os.W_OK | os.X_OK):
        raise CachePathError(f"{field}: {path!r} is not writable by this user (uid {os.getuid()}). Fix: "
                             f"chown/chmod it, or choose a writable directory.")
    # access() trusts the mode bits, and root passes them everywhere: pseudo-filesystems (/sys, /proc), a
    # read-only bind or an LSM refuse the first mkdir instead. Make and remove one directory to know.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".aidaptiv_probe_", dir=ap))
    except OSError as e:
        fs = _fstype(ap)
        raise CachePathError(f"{field}: {path!r} does not accept new files ({e.strerror}"
                             f"{', filesystem ' + fs if fs else ''}) although its permissions allow it. Fix: choose a "
                             f"directory on the cache drive's filesystem (not /sys, /proc or a read-only "
                             f"mount).") from None
    return ap


def _fstype(path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (from ``/proc/mounts``), or None."""
    where = filesystem_of(path)
    return where.split(" mounted at ")[0] if " mounted at " in where else None


def filesystem_of(path: str) -> str:
    """``"<type> mounted at <mount point>"`` for the filesystem holding ``path`` (``/proc/mounts``), or
    ``"an unknown filesystem"``."""
    real = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best[1]):
                    best = (parts[2], parts[1])
    except OSError:
        pass
    return f"{best[0]} mounted at {best[1]}" if best[0] else "an unknown filesystem"


class Namespace:
    """The directories of one store (``host``, ``run``, ``rank``) under each cache path.

    Args:
        cache_paths: user directories on the cache drives (must exist and be writable).
        run: run name (a path component; two concurrent runs need different names).
        rank: global rank of the owning process.
        host: node name (default: :func:`hostname`, i.e. ``$AIDAPTIV_HOSTNAME`` or the machine's host name).
    """

    def __init__(self, cache_paths: list[str], run: str, rank: int, host: str | None = None) -> None:
        self.cache_paths = [check_cache_path(p) for p in cache_paths]
        self.run = safe_name(run)
        self.rank = int(rank)
        self.host = safe_name(host) if host else hostname()
        self._lock_fds: list[int] = []

    def node_dir(self, i: int) -> str:
        """``<cache_path_i>/aidaptiv_ds/<host>``."""
        return os.path.join(self.cache_paths[i], ROOT_NAME, self.host)

    def run_dir(self, i: int) -> str:
        return os.path.join(self.node_dir(i), self.run)

    def rank_dir(self, i: int) -> str:
        return os.path.join(self.run_dir(i), f"rank{self.rank}")

    def slab_path(self, i: int) -> str:
        return os.path.join(self.rank_dir(i), "slab.bin")

    def index_path(self) -> str:
        return os.path.join(self.rank_dir(0), "index.json")

    def acquire(self) -> None:
        """Create the rank directories and take the owner lock on every path.

        Raises:
            StoreInUseError: another live process holds the lock on one of the paths.
        """
        for i in range(len(self.cache_paths)):
            d = self.rank_dir(i)
            os.makedirs(d, exist_ok=True)
            lock = os.path.join(d, "owner.lock")
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                self.release()
                raise StoreInUseError(
                    f"aidaptiv_ds: {d} is in use by another process (pid {holder}): run {self.run!r}, rank "
                    f"{self.rank} on host {self.host}. Two runs must not share a namespace. Fix: set a "
                    f"different aidaptiv.run_name, or leave it at \"auto\" so each run gets its own.") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self._lock_fds.append(fd)

    def release(self) -> None:
        for fd in self._lock_fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self._lock_fds = []

    @property
    def locked(self) -> bool:
        return bool(self._lock_fds)

    def still_owned(self, i: int) -> bool:
        """True while ``rank_dir(i)/owner.lock`` is still the file this process locked: False once
        someone removed the directory (or removed and re-created it), i.e. it is no longer ours."""
        if i >= len(self._lock_fds):
            return False
        try:
            st = os.stat(os.path.join(self.rank_dir(i), "owner.lock"))
        except OSError:
            return False
        mine = os.fstat(self._lock_fds[i])
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def remove_files(self) -> None:
        """Delete this namespace's rank directories (only while we hold their locks), then the run
        directory when it is empty. Other ranks' and runs' directories are never touched.

        Raises:
            StorageError: some files could not be deleted (a directory made read-only or immutable,
                a filesystem turned read-only): naming what is left, its size, the error and the
                command that removes it later. Everything deletable was deleted and the locks are
                released either way.
        """
        if not self.locked:
            raise StorageError("aidaptiv_ds: refusing to delete a namespace this process does not own")
        ours = [self.still_owned(i) for i in range(len(self.cache_paths))]
        failed: list[tuple[str, int, OSError]] = []
        for i in range(len(self.cache_paths)):
            if not ours[i]:  # removed under us, maybe re-created by another process: not ours to delete
                continue
            d = self.rank_dir(i)
            for name in os.listdir(d):
                if name != "owner.lock":
                    p = os.path.join(d, name)
                    try:
                        shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
                    except OSError as e:
                        size = os.stat(p).st_blocks * 512 if os.path.exists(p) else 0
                        failed.append((p, size, e))
        self.release()
        for i in range(len(self.cache_paths)):
            if not ours[i]:
                continue
            d = self.rank_dir(i)
            try:
                os.unlink(os.path.join(d, "owner.lock"))
                os.rmdir(d)
                os.rmdir(self.run_dir(i))
            except OSError:
                pass  # another rank of the run is still there (or the directory is read-only: reported above)
        if failed:
            from ..units import format_bytes
            left = ", ".join(f"{p} ({format_bytes(n)})" for p, n, _ in failed[:3]) + (" ..." if len(failed) > 3 else "")
            first = failed[0][2]
            raise StorageError(
                f"aidaptiv_ds: could not delete the store's files: {left}: {first.strerror or first}. They stay on the "
                f"drive. "
                f"Fix: make the directory writable again (chmod u+w, chattr -i, or remount read-write), then run "
                f"`aidaptiv-ds gc --cache {self.cache_paths[0]} --delete`.")


def list_namespaces(cache_path: str) -> list[dict]:
    """Every (host, run, rank) store under ``cache_path``, with its slab size and whether it is live.

    A store is live when its owner lock is held; a dead one (e.g. after ``kill -9``) can be removed
    with ``aidaptiv-ds gc``.
    """
    root = os.path.join(os.path.abspath(cache_path), ROOT_NAME)
    out: list[dict] = []
    if not os.path.isdir(root):
        return out
    for host in sorted(os.listdir(root)):
        hdir = os.path.join(root, host)
        if not os.path.isdir(hdir):
            continue
        for run in sorted(os.listdir(hdir)):
            rdir = os.path.join(hdir, run)
            if not os.path.isdir(rdir):
                continue
            for rank in sorted(os.listdir(rdir)):
                d = os.path.join(rdir, rank)
                if not (os.path.isdir(d) and rank.startswith("rank")):
                    continue
                live = False
                lock = os.path.join(d, "owner.lock")
                if os.path.exists(lock):
                    fd = os.open(lock, os.O_RDWR)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    except OSError:
                        live = True
                    finally:
                        os.close(fd)
                size = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for f in os.listdir(d))
                out.append({"host": host, "run": run, "rank": rank, "dir": d, "live": live, "bytes_on_disk": size})
    return out


def dead_stores(cache_path: str, host: str | None = None) -> list[dict]:
    """The stores under ``cache_path`` of this node (``host``, default :func:`hostname`) whose owner is
    gone: left by a run killed with ``kill -9``, or kept (``keep_files``, ``aidaptiv-ds unpack``).
    Each row as :func:`list_namespaces`, plus ``kept``: True when the store was closed and kept (it has
    an index), which a later run may still want (``from_unpacked``, a restart)."""
    me = safe_name(host) if host else hostname()
    out = []
    for ns in list_namespaces(cache_path):
        if ns["host"] != me or ns["live"]:
            continue
        out.append(dict(ns, kept=os.path.exists(os.path.join(ns["dir"], "index.json"))))
    return out


def dead_store_hint(cache_path: str, needed: int | None = None, free: int | None = None) -> str:
    """One or two sentences for a "drive full" error: the dead stores on ``cache_path`` and the
    command that removes them, or "" when there are none. With ``needed``/``free`` (bytes) it says
    whether removing them would make the space."""
    from ..units import format_bytes

    try:
        dead = dead_stores(cache_path)
    except OSError:
        return ""
    held = sum(d["bytes_on_disk"] for d in dead)
    if not held:
        return ""
    runs = sorted({d["run"] for d in dead})
    kept = sorted({d["run"] for d in dead if d["kept"]})
    enough = needed is not None and free is not None and free + held >= needed
    msg = (f" {len(dead)} dead store(s) of earlier runs ({', '.join(runs[:4])}{', ...' if len(runs) > 4 else ''}) "
           f"hold {format_bytes(held)} on {cache_path}{' -- removing them makes the space' if enough else ''}: "
           f"`aidaptiv-ds gc --cache {cache_path} --delete` removes them (never a live store)")
    if kept:
        msg += (f"; {', '.join(kept[:4])} {'was' if len(kept) == 1 else 'were'} kept on purpose (keep_files or "
                f"unpack): add --run NAME to delete only the others")
    return msg + "."
