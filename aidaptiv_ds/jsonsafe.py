"""Strict JSON for reports: non-finite floats (a NaN loss, an infinite days-to-TBW) become ``null``."""
from __future__ import annotations

import math


def finite(x):
    """``x`` with every non-finite float replaced by None, recursively through dicts, lists and tuples."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x
