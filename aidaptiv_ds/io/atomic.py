"""One way to write a file safely: a temporary file, every write checked, fsync, rename, directory fsync.

Every file aidaptiv_ds writes whole -- checkpoint files and manifests, the store index, the
endurance ledger, export shards, benchmark results -- goes through :class:`AtomicFile`, so that
after a crash (``kill -9``, a power cut) at any moment the final path holds either its complete
previous content (or nothing) or its complete new content, never a part:

1. the bytes go to ``<path>.tmp.<pid>`` in the same directory (same filesystem, so the rename is
   atomic); every ``pwrite`` is checked, a short one is continued from where it stopped, and a
   write that makes no progress or fails raises :class:`~aidaptiv_ds.io.errors.FileWriteError`
   naming the path and the bytes written of the bytes expected;
2. ``fsync`` of the file, and a check that its size is what was written (a file that came up short
   is never renamed);
3. ``rename`` over the final path (POSIX: atomic replacement);
4. ``fsync`` of the directory, so the rename itself survives a power cut (without it the directory
   entry may still name the old file, or no file, after a reboot; ``rename(2)``, ``fsync(2)``).

On any error the temporary file is removed and the final path is untouched. The steps are also
test crash points (:mod:`aidaptiv_ds.io.killpoint`: ``atomic.written``, ``atomic.synced``,
``atomic.renamed``, detail = the final path).

Only the standard library is used: the endurance ledger imports this in processes without torch.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import zlib

from ..errors import AidaptivError
from .errors import FileWriteError
from .killpoint import kill_point


def fsync_dir(path: str) -> None:
    """``fsync`` the directory ``path`` (makes renames and new entries in it durable).

    Raises:
        FileWriteError: naming the directory, when the filesystem reports an error.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise FileWriteError(path, 0, None, e.errno, step="opening the directory for fsync") from e
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # some filesystems cannot fsync a directory
            raise FileWriteError(path, 0, None, e.errno, step="fsync of the directory") from e
    finally:
        os.close(fd)


def pwrite_all(fd: int, data, offset: int, path: str, written_before: int = 0, expected: int | None = None) -> int:
    """Write all of ``data`` (bytes-like) at ``offset`` of ``fd``, continuing after short writes.

    Args:
        path: the file's final path (named in errors); written_before / expected: bytes of the whole
            file written so far and expected in total (for the error message).

    Returns:
        ``len(data)`` in bytes.

    Raises:
        FileWriteError: the system refused (``ENOSPC``, ``EIO``, ...) or accepted no byte (a short
            write that does not progress), with the path and the bytes written of those expected.
    """
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):
        try:
            n = os.pwrite(fd, mv[done:], offset + done)
        except InterruptedError:
            continue
        except OSError as e:
            raise FileWriteError(path, written_before + done, expected, e.errno) from e
        if n <= 0:
            raise FileWriteError(path, written_before + done, expected, None)
        done += n
    return done


class AtomicFile:
    """A file written under a temporary name and put in place only when complete.

    Use as a context manager; on a clean exit :meth:`commit` runs, on an exception :meth:`abort`::

        with AtomicFile(path, expected=len(header) + n) as f:
            f.pwrite(header, 0)
            f.pwrite(body, len(header))

    Args:
        path: the final path.
        expected: the file's size in bytes once complete (None: the highest byte written). At
            commit the file must have exactly this size, else nothing is renamed.
        mode: permission bits of the new file.
        crc: keep the CRC32 of the bytes written sequentially by :meth:`write` in :attr:`crc32`.

    Attributes:
        fd: the temporary file's descriptor (for ``ioctl``/``ftruncate`` by the caller).
        tmp: the temporary path; written: bytes written; crc32: see ``crc``.
    """

    def __init__(self, path: str, expected: int | None = None, mode: int = 0o644, crc: bool = False) -> None:
        self.path = path
        self.expected = expected
        self.tmp = f"{path}.tmp.{os.getpid()}"
        self.written = 0
        self.end = 0  # highest byte offset written + 1
        self._pos = 0  # offset of the next sequential write()
        self.crc32 = 0 if crc else None
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        except OSError as e:
            raise FileWriteError(path, 0, expected, e.errno, step="creating a temporary file for") from e
        self._open = True

    def pwrite(self, data, offset: int) -> int:
        """Write ``data`` at byte ``offset`` (checked, see :func:`pwrite_all`). Returns its length."""
        n = pwrite_all(self.fd, data, offset, self.path, self.written, self.expected)
        self.written += n
        self.end = max(self.end, offset + n)
        return n

    def write(self, data) -> int:
        """Write ``data`` after the previous :meth:`write` (and fold it into :attr:`crc32`)."""
        n = self.pwrite(data, self._pos)
        self._pos += n
        if self.crc32 is not None:
            self.crc32 = zlib.crc32(data, self.crc32)
        return n

    @property
    def pos(self) -> int:
        """Offset of the next sequential :meth:`write`."""
        return self._pos

    def seek(self, offset: int) -> None:
        """Continue sequential :meth:`write` at ``offset`` (the gap stays a hole of zeros)."""
        self._pos = offset

    def truncate(self, size: int) -> None:
        """Set the file's length to ``size`` bytes (``ftruncate``)."""
        try:
            os.ftruncate(self.fd, size)
        except OSError as e:
            raise FileWriteError(self.path, self.written, self.expected, e.errno, step="truncating") from e
        self.end = size

    def commit(self) -> None:
        """fsync, check the size, rename over the final path, fsync the directory.

        Raises:
            FileWriteError: fsync failed or the file does not have the expected size (nothing renamed).
        """
        try:
            try:
                kill_point("atomic.written", self.path)
                os.fsync(self.fd)
                size = os.fstat(self.fd).st_size
            except OSError as e:
                raise FileWriteError(self.path, self.written, self.expected, e.errno, step="fsync") from e
            want = self.expected if self.expected is not None else self.end
            if size != want:
                raise FileWriteError(self.path, size, want, None, step="completing")
            os.close(self.fd)
            self._open = False
            kill_point("atomic.synced", self.path)
            try:
                os.replace(self.tmp, self.path)
            except OSError as e:
                raise FileWriteError(self.path, size, want, e.errno, step="renaming into place") from e
        except BaseException:
            self.abort()
            raise
        kill_point("atomic.renamed", self.path)
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        """Close and remove the temporary file (the final path is untouched)."""
        if self._open:
            self._open = False
            try:
                os.close(self.fd)
            except OSError:
                pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # None: an exception in the block propagates
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def atomic_write(path: str, data: bytes, mode: int = 0o644) -> None:
    """Put ``data`` at ``path`` crash-safely (see module docstring).

    Raises:
        FileWriteError: naming the path and the bytes written; ``path`` keeps its previous content.
    """
    with AtomicFile(path, expected=len(data), mode=mode) as f:
        f.pwrite(data, 0)


# ---------------------------------------------------------------------------------------------- directories
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)  # glibc >= 2.28
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` (files or directories) in one atomic step: ``renameat2(2)``
    with ``RENAME_EXCHANGE`` (Linux >= 3.15; ext4, XFS, btrfs, tmpfs). Both must exist.

    Returns:
        True when swapped; False when this system or filesystem cannot (nothing changed).

    Raises:
        FileWriteError: any other error, naming both paths.
    """
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise FileWriteError(f"{a} <-> {b}", 0, None, err, step="exchanging the directories")


# ---------------------------------------------------------------------------------------------- checked JSON
SELF_CRC = "self_crc32"


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def dumps_checked(obj: dict, indent: int | None = 1) -> bytes:
    """``obj`` as JSON with a ``"self_crc32"`` key: the CRC32 of the canonical JSON of the other keys
    (sorted keys, no spaces), so a reader detects any change to a value (see :func:`loads_checked`)."""
    if SELF_CRC in obj:
        obj = {k: v for k, v in obj.items() if k != SELF_CRC}
    return json.dumps(dict(obj, **{SELF_CRC: zlib.crc32(_canonical(obj))}), indent=indent, sort_keys=True).encode()


class ChecksumMismatch(AidaptivError, ValueError):
    """A checked JSON file whose content does not match its ``self_crc32`` (or has none when required)."""


def loads_checked(data: bytes | str, path: str, required: bool = True) -> dict:
    """Parse a file written by :func:`dumps_checked` and verify its CRC.

    Args:
        path: named in errors. required: a file without ``self_crc32`` is an error (else accepted
            as written by an older version, unverified).

    Raises:
        ChecksumMismatch: the file is not valid JSON, or its content does not match its CRC.
    """
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise ChecksumMismatch(f"{path} is not valid JSON ({e}): it was damaged or cut short") from None
    if not isinstance(obj, dict):
        raise ChecksumMismatch(f"{path} does not hold a JSON object")
    want = obj.pop(SELF_CRC, None)
    if want is None:
        if required:
            raise ChecksumMismatch(f"{path} has no {SELF_CRC}: it was not written whole by aidaptiv_ds")
        return obj
    got = zlib.crc32(_canonical(obj))
    if got != want:
        raise ChecksumMismatch(f"{path}: its content does not match its CRC32 (stored {want:#010x}, computed "
                               f"{got:#010x}): a value in it was changed or damaged after it was written")
    return obj


def write_json(path: str, obj, checked: bool = False, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON at ``path`` crash-safely, with a self-CRC when ``checked``."""
    data = dumps_checked(obj, indent) if checked else json.dumps(obj, indent=indent, sort_keys=True).encode()
    atomic_write(path, data)


def read_json_checked(path: str, required: bool = True) -> dict:
    """Read and verify a file written by ``write_json(..., checked=True)`` (see :func:`loads_checked`).

    Raises:
        FileNotFoundError; ChecksumMismatch: damaged or changed content.
    """
    with open(path, "rb") as f:
        return loads_checked(f.read(), path, required)
