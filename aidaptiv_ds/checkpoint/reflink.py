"""Copy-on-write range clones (``ioctl(FICLONERANGE)``): a checkpoint shares blocks with the slab
instead of writing the bytes again, on filesystems that support it (XFS with ``reflink=1``, btrfs).

Later in-place writes to the slab then allocate new blocks for the slab only (copy on write); the
checkpoint keeps the old ones. Where the filesystem refuses (ext4, tmpfs, different filesystems),
:func:`clone_range` returns False and the caller writes the bytes as usual.
"""
from __future__ import annotations

import errno
import fcntl
import struct

FICLONERANGE = 0x4020940D  # _IOW(0x94, 13, struct file_clone_range), linux/fs.h

_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF, errno.EPERM}


def clone_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int) -> bool:
    """Share ``length`` bytes at ``src_offset`` of ``src_fd`` into ``dst_fd`` at ``dst_offset``.

    Offsets and length must be multiples of the filesystem block size (the tail may end at EOF).

    Returns:
        True when the range was cloned; False when the filesystem cannot (nothing was changed).

    Raises:
        OSError: for other errors (e.g. ``ENOSPC``).
    """
    if length <= 0:
        return True
    try:
        fcntl.ioctl(dst_fd, FICLONERANGE, struct.pack("qQQQ", src_fd, src_offset, length, dst_offset))
        return True
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return False
        raise
