"""Byte sizes: parse ``"8GiB"`` / ``"1.5TB"`` / ``8589934592`` and format them for people."""
from __future__ import annotations

import math
import re

from .errors import AidaptivConfigError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB, "pib": 1 << 50,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, field: str = "size") -> int:
    """Bytes from an int, a float (``1e9``) or a string with a unit.

    Decimal units (``KB MB GB TB``, also ``K M G T``) are powers of 1000 as drive vendors use them;
    binary units (``KiB MiB GiB TiB``) are powers of 1024. Case-insensitive.

    Raises:
        AidaptivConfigError: (a ``ValueError``) naming ``field``, the value and the accepted forms, for negative, infinite or
            NaN numbers, unknown units or anything else that is not a size.
    """
    if isinstance(value, bool):
        raise AidaptivConfigError(f"{field}: {value!r} is not a size; give bytes as an integer or a string such as '8GiB'")
    if isinstance(value, (int, float)):
        if value < 0 or value != value or value == math.inf:
            raise AidaptivConfigError(f"{field}: {value!r} is negative, infinite or NaN; give a size >= 0 such as 0, 4096 "
                             f"or '8GiB'")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if not math.isfinite(n):  # '1e400', or 400 digits: int() of the float would raise OverflowError
                raise AidaptivConfigError(f"{field}: {value[:40]!r}{'...' if len(value) > 40 else ''} is too large to be a "
                                 f"size; give one such as '8GiB' or '2TB'")
            return int(n)
    raise AidaptivConfigError(f"{field}: {value!r} is not a size; use an integer number of bytes or a string such as "
                     f"'512MiB', '8GiB', '2TB' (units: B, KB/MB/GB/TB = 1000^n, KiB/MiB/GiB/TiB = 1024^n)")


_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DECIMAL = ("B", "KB", "MB", "GB", "TB", "PB")


def format_bytes(n: float, decimal: bool = False) -> str:
    """Bytes for people, two decimals: ``1536 -> '1.50 KiB'``; with ``decimal=True`` in powers of 1000,
    as drive vendors state capacity: ``8e12 -> '8.00 TB'``. Whole bytes below the first unit
    (``'512 B'``). :func:`parse_size` reads both forms back (to the precision printed)."""
    n = float(n)
    step = 1000 if decimal else 1024
    units = _DECIMAL if decimal else _BINARY
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= step
    raise AssertionError("unreachable")  # pragma: no cover
