"""Errors raised by the I/O and storage layers. Each names the path, the offset and the fix."""
from __future__ import annotations

import errno as _errno
import os

from ..errors import AidaptivError


class StorageError(AidaptivError, RuntimeError):
    """Base class of every error aidaptiv_ds raises about cache drives (a :class:`~aidaptiv_ds.AidaptivError`)."""


def _as_os_error(e: StorageIOError | FileWriteError, msg: str, err: int | None, what: str, path: str) -> None:
    """Initialise ``e``, a :class:`StorageError` that is also an ``OSError``: ``msg`` is its one argument
    (its ``__str__`` returns it), and ``errno`` / ``strerror`` / ``filename`` are set for callers that
    catch ``OSError``."""
    StorageError.__init__(e, msg)
    e.errno = err
    e.strerror = what
    e.filename = path


class StorageIOError(StorageError, OSError):
    """A read or write failed after the bounded retries.

    Attributes:
        path: the file (slab or DeepSpeed swap file).
        offset: byte offset of the failed request in that file.
        nbytes: length of the failed request in bytes.
        errno: the OS error number (``EIO``, ``ENOSPC``, ...), or None for a short transfer.
    """

    def __init__(self, op: str, path: str, offset: int, nbytes: int, err: int | None, detail: str = "",
                 attempts: int = 1) -> None:
        self.op, self.path, self.offset, self.nbytes, self.attempts = op, path, offset, nbytes, attempts
        what = os.strerror(err) if err else "short transfer"
        fix = {
            _errno.ENOSPC: "free space on this drive or point aidaptiv.cache_paths at a larger one",
            _errno.EIO: "the drive reported a media error; check `dmesg` and the drive's SMART log, "
                        "then resume from the last checkpoint",
            _errno.EROFS: "the filesystem is read-only; remount it read-write or choose another cache path",
            _errno.EACCES: "make the cache path writable by this user",
        }.get(err or 0, "check the drive and the path, then resume from the last checkpoint")
        _as_os_error(self, f"aidaptiv_ds: {op} of {nbytes} bytes at offset {offset} in {path} failed after "
                           f"{attempts} attempt(s): {what}{(' (' + detail + ')') if detail else ''}. Fix: {fix}.",
                     err, what, path)

    def __str__(self) -> str:  # OSError.__str__ would print "[Errno n] ..." instead of our message
        return self.args[0]


class StorageFullError(StorageError):
    """A cache path lacks the space a plan or a write needs. Raised before any data is written."""

    def __init__(self, path: str, needed: int, free: int, what: str = "", hint: str = "") -> None:
        """``hint``: more about what holds the space (e.g. dead stores of earlier runs, and the command
        that removes them), put before the fix."""
        from ..units import format_bytes
        self.path, self.needed, self.free = path, needed, free
        super().__init__(
            f"aidaptiv_ds: cache path {path} needs {format_bytes(needed)} ({needed} bytes)"
            f"{' for ' + what if what else ''}"
            f" but has {format_bytes(free)} ({free} bytes) free.{hint} Fix: free space there, add another path to "
            f"aidaptiv.cache_paths, or raise aidaptiv.dram_budget so less state goes to the drive.")


class ChecksumError(StorageError):
    """An extent read back does not match the checksum recorded when it was written."""

    def __init__(self, key: str, path: str, offset: int, nbytes: int, expected: int, got: int) -> None:
        self.key, self.path, self.offset, self.nbytes = key, path, offset, nbytes
        super().__init__(
            f"aidaptiv_ds: checksum mismatch for extent {key!r} ({nbytes} bytes at offset {offset} in {path}): "
            f"stored crc32 {expected:#010x}, read {got:#010x}. The drive returned corrupted data. Fix: resume "
            f"from the last checkpoint; if it repeats, check the drive (SMART log) and stop using it.")


class FileWriteError(StorageError, OSError):
    """Writing a file (a checkpoint file, an index, a ledger, a report) failed or came up short.

    Raised by :mod:`aidaptiv_ds.io.atomic`, which never puts such a file in place: the path keeps
    its previous content (or stays absent) and the temporary file is removed.

    Attributes:
        path: the file's final path.
        written: bytes written before the failure.
        expected: bytes the file should have held (None when unknown).
        errno: the OS error number (``ENOSPC``, ``EDQUOT``, ``EIO``, ...), or None for a short write.
    """

    _FIX = {
        _errno.ENOSPC: "free space on that filesystem, or write to a larger one",
        _errno.EDQUOT: "raise this user's disk quota there, or write to another filesystem",
        _errno.EROFS: "the filesystem is read-only; remount it read-write or write elsewhere",
        _errno.EACCES: "make the directory writable by this user",
        _errno.EIO: "the drive reported a media error; check `dmesg` and the drive's SMART log",
    }

    def __init__(self, path: str, written: int, expected: int | None, err: int | None, step: str = "write") -> None:
        self.path, self.written, self.expected = path, int(written), expected
        what = os.strerror(err) if err else "short write (the system accepted fewer bytes and then none)"
        of = f" of {expected}" if expected is not None else ""
        fix = self._FIX.get(err or 0, "check the filesystem (free space, quota, `dmesg`)"
                            if err is None else "check the filesystem and the path")
        _as_os_error(self, f"aidaptiv_ds: {step} of {path} failed after {written}{of} bytes: {what}. The file was "
                           f"not put in place (any previous version of it is unchanged). Fix: {fix}.", err, what, path)

    def __str__(self) -> str:  # OSError.__str__ would print "[Errno n] ..." instead of our message
        return self.args[0]
