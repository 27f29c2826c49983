"""One preallocated slab file per cache path.

The slab grows to what the store's extents need plus a small margin (:meth:`Slab.margin`: 1/32,
1 MiB to 64 MiB) with ``fallocate(2)`` (unwritten extents: space is reserved on the
drive without writing a byte, so preallocation costs no endurance). Where ``fallocate`` is not
supported the file is extended sparsely with ``ftruncate`` after checking ``statvfs`` free space.
Either way a growth that does not fit raises :class:`StorageFullError` naming the path, the bytes
needed and the bytes free, before any data is written to the new range.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from ..io.engine import FileHandle, IOEngine
from ..io.errors import StorageFullError

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


def free_bytes(path: str) -> int:
    """Bytes available to this user on the filesystem holding ``path`` (``f_bavail x f_frsize``)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fallocate(fd: int, offset: int, length: int) -> bool:
    """Reserve ``[offset, offset + length)`` of a file without writing. False if unsupported.

    Raises:
        OSError: ``ENOSPC`` and other errors from the call.
    """
    if _fallocate is None or length <= 0:
        return False
    if _fallocate(fd, 0, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, os.strerror(err))


class Slab:
    """The slab file of one cache path for one store.

    Args:
        path: slab file path (``.../rank<R>/slab.bin``).
        cache_path: the user's cache path (named in errors).
        engine: the I/O engine; the slab's requests go to the worker pool named ``drive``.
        drive: worker-pool (and statistics) name, the cache path.
        grow_step: largest growth margin in bytes (see :meth:`Slab.margin`).
        alignment: direct-I/O alignment of the file in bytes.
    """

    def __init__(self, path: str, cache_path: str, engine: IOEngine, drive: str, grow_step: int = 64 << 20,
                 alignment: int = 4096) -> None:
        self.path, self.cache_path, self.drive = path, cache_path, drive
        self.grow_step = grow_step
        self.fh: FileHandle = engine.open(path, drive=drive, create=True, alignment=alignment)
        self.size = os.fstat(self.fh.fileno()).st_size

    def ensure(self, nbytes: int, what: str = "", limit: int | None = None) -> None:
        """Make the slab at least ``nbytes`` long: ``nbytes`` plus the growth margin (:meth:`margin`),
        never past ``limit`` bytes (the path's capacity) unless ``nbytes`` itself is larger.

        Raises:
            StorageFullError: the filesystem lacks the space; nothing was written.
        """
        if nbytes <= self.size:
            return
        target = nbytes + self.margin(nbytes)
        if limit is not None:
            target = max(nbytes, min(target, int(limit)))
        self._grow(target, nbytes, what)

    def margin(self, nbytes: int) -> int:
        """Bytes reserved beyond ``nbytes`` when the slab grows: 1/32 of it, at least 1 MiB, at most
        ``grow_step`` -- so that a run of small allocations does not call ``fallocate`` for each, while
        the slab stays within ~3 % of what the state needs (and the space beside it, e.g. for
        checkpoints on the same filesystem, stays free). [Note: issue 11.8] Growing by a fixed 256 MiB
        reserved 184 MB for 32 MB of state on a 200 MB filesystem."""
        return int(min(max(nbytes // 32, 1 << 20), self.grow_step))

    def _grow(self, target: int, needed_size: int, what: str) -> None:
        fd = self.fh.fileno()
        for size in (target, needed_size):  # fall back to the exact need before giving up
            grow = size - self.size
            if grow <= 0:
                return
            try:
                if fallocate(fd, self.size, grow):
                    self.size = size
                    return
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                # ext4 keeps what a failed fallocate managed to allocate (and the longer file size):
                # give it back, or the slab would hold the drive's last free bytes without using them
                os.ftruncate(fd, self.size)
                continue
            if free_bytes(self.cache_path) >= grow:  # no fallocate here: sparse extension
                os.ftruncate(fd, size)
                self.size = size
                return
        from .layout import dead_store_hint

        need, free = needed_size - self.size, free_bytes(self.cache_path)
        raise StorageFullError(self.cache_path, need, free, what or "slab growth",
                               dead_store_hint(self.cache_path, need, free))

    def allocated_bytes(self) -> int:
        """Bytes the slab occupies on the drive (``st_blocks x 512``)."""
        return os.fstat(self.fh.fileno()).st_blocks * 512

    def sync(self) -> None:
        self.fh.sync()

    def close(self) -> None:
        self.fh.close()
