"""Huge pages for fresh host memory (io/buffers.py ``advise_huge_pages``).

The speed-up itself is a benchmark figure (README, the 148M budget-0 run); here: the advice lands on the
2 MiB-aligned interior of a buffer where the kernel allows it and never fails the allocation.
"""
from __future__ import annotations

import os

import torch

from aidaptiv_ds.io.buffers import HUGE_PAGE_BYTES, advise_huge_pages, alloc_aligned

THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    try:
        with open(THP_MODE) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _smaps_huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds ``t`` 's first byte (from /proc/self/smaps)."""
    addr = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_small_buffers_and_odd_tensors_are_left_alone():
    assert advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 2, dtype=torch.uint8)) is False  # no aligned 2 MiB inside
    assert alloc_aligned(1 << 20).numel() == 1 << 20


def test_a_large_buffer_gets_huge_pages_where_the_kernel_allows():
    mode = _thp_mode()
    buf = alloc_aligned(64 << 20)
    buf.fill_(1)
    if mode not in ("madvise", "always") or not os.path.exists("/proc/self/smaps"):
        return  # nothing to observe here: the call must still have succeeded (it did: no exception)
    huge = _smaps_huge_kib(buf)
    # the kernel may fall back to small pages (fragmented memory, khugepaged settings): then this is 0, but a
    # "madvise" kernel with free memory backs most of the advised range with 2 MiB pages
    assert huge == 0 or huge >= 2048, huge
    assert advise_huge_pages(buf) is True
