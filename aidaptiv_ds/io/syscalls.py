"""The system calls the engine makes, behind one small object so faults can be injected.

:class:`SysIO` is the real thing (``os.preadv``/``os.pwritev``, which release the GIL).
:class:`FaultyIO` wraps it and raises ``OSError`` for matching requests, to test that every
failure reaches the caller with its path and offset. A training process picks up fault rules from
the ``AIDAPTIV_FAULTS`` environment variable (see :func:`rules_from_env`), which is how the
end-to-end fault tests inject ``EIO`` into a child process; nothing reads it unless it is set.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import threading


class SysIO:
    """Thin wrapper over the file system calls used by :class:`aidaptiv_ds.io.engine.IOEngine`."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def preadv(self, fd: int, bufs: list[memoryview], offset: int, path: str) -> int:
        return os.preadv(fd, bufs, offset)

    def pwritev(self, fd: int, bufs: list[memoryview], offset: int, path: str) -> int:
        return os.pwritev(fd, bufs, offset)


@dataclasses.dataclass
class FaultRule:
    """Fail ``count`` matching requests after skipping the first ``skip`` of them.

    Attributes:
        op: ``"read"``, ``"write"`` or ``"open_direct"`` (refuse ``O_DIRECT`` at open, like tmpfs).
        err: errno to raise (``errno.EIO``, ``errno.ENOSPC``, ``errno.EINVAL``, ...).
        path_contains: only requests whose file path contains this string.
        offset_min / offset_max: only requests overlapping ``[offset_min, offset_max)`` (bytes).
        skip: matching requests to let through first.
        count: how many to fail (then the rule is spent); ``-1`` fails forever.
    """
    op: str
    err: int = errno.EIO
    path_contains: str = ""
    offset_min: int = 0
    offset_max: int = 1 << 62
    skip: int = 0
    count: int = -1
    hits: int = 0

    def matches(self, op: str, path: str, offset: int, nbytes: int) -> bool:
        return (op == self.op and self.path_contains in path and offset < self.offset_max
                and offset + max(nbytes, 1) > self.offset_min)


class FaultyIO(SysIO):
    """:class:`SysIO` that raises ``OSError(rule.err)`` for requests matching one of ``rules``."""

    def __init__(self, rules: list[FaultRule]) -> None:
        self.rules = list(rules)
        self._lock = threading.Lock()
        self.injected = 0

    def _check(self, op: str, path: str, offset: int, nbytes: int) -> None:
        with self._lock:
            for r in self.rules:
                if r.count == 0 or not r.matches(op, path, offset, nbytes):
                    continue
                r.hits += 1
                if r.hits <= r.skip:
                    continue
                if r.count > 0:
                    r.count -= 1
                self.injected += 1
                raise OSError(r.err, os.strerror(r.err), path)

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            self._check("open_direct", path, 0, 0)
        return super().open(path, flags, mode)

    def preadv(self, fd: int, bufs: list[memoryview], offset: int, path: str) -> int:
        self._check("read", path, offset, sum(len(b) for b in bufs))
        return super().preadv(fd, bufs, offset, path)

    def pwritev(self, fd: int, bufs: list[memoryview], offset: int, path: str) -> int:
        self._check("write", path, offset, sum(len(b) for b in bufs))
        return super().pwritev(fd, bufs, offset, path)


def rules_from_env(value: str | None = None) -> list[FaultRule]:
    """Parse ``AIDAPTIV_FAULTS``: rules separated by ``;``, fields by ``,`` as ``key=value``.

    Example: ``op=write,err=EIO,path_contains=slab,skip=3,count=-1``. ``err`` takes an errno name.

    Raises:
        ValueError: naming the rule and the field that does not parse.
    """
    value = os.environ.get("AIDAPTIV_FAULTS", "") if value is None else value
    rules = []
    for text in filter(None, (t.strip() for t in value.split(";"))):
        kw: dict = {}
        for field in filter(None, (f.strip() for f in text.split(","))):
            key, _, val = field.partition("=")
            if key == "err":
                kw[key] = getattr(errno, val) if not val.isdigit() else int(val)
            elif key in ("offset_min", "offset_max", "skip", "count"):
                kw[key] = int(val)
            elif key in ("op", "path_contains"):
                kw[key] = val
            else:
                raise ValueError(f"AIDAPTIV_FAULTS rule {text!r}: unknown field {key!r}")
        rules.append(FaultRule(**kw))
    return rules


def default_sysio() -> SysIO:
    """The real system calls, or a :class:`FaultyIO` when ``AIDAPTIV_FAULTS`` is set."""
    rules = rules_from_env()
    return FaultyIO(rules) if rules else SysIO()
