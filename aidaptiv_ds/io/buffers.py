"""Page-aligned host buffers for direct I/O, and the registry that answers ``is_pinned``.

``O_DIRECT`` needs the host address, the file offset and the length to be multiples of the
device's logical block size. torch's CPU allocator only aligns to 64 bytes, so every buffer the
engine does I/O on comes from :func:`alloc_aligned`, which over-allocates and slices at a page
boundary (pinned ``cudaHostAlloc`` memory when CUDA is available, which is page aligned already).

DeepSpeed asserts ``aio_handle.is_pinned(t)`` for *views or slices* of buffers the handle gave out
(``ops/csrc/pin_memory/deepspeed_pin_tensor.cpp:83-98`` does a range check); on a CPU-only torch
build ``Tensor.pin_memory()`` raises, so we keep our own range registry (:data:`REGISTRY`).
"""
from __future__ import annotations

import bisect
import ctypes
import threading

import torch

from .heap import glibc
from .pool import POOL_MIN_BYTES, HostBufferPool

PAGE_BYTES = 4096


_POOL: HostBufferPool | None = None


def use_pool(pool: HostBufferPool | None) -> HostBufferPool | None:
    """Make ``pool`` the buffer pool :func:`alloc_aligned` carves unpinned buffers from (None: none);
    returns the previous one. Buffers carved earlier stay valid either way."""
    global _POOL
    prev, _POOL = _POOL, pool
    return prev


def current_pool() -> HostBufferPool | None:
    """The buffer pool in use, if any (:func:`use_pool`)."""
    return _POOL


def round_up(nbytes: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` that is >= ``nbytes`` (both in bytes)."""
    return -(-int(nbytes) // alignment) * alignment


def round_down(nbytes: int, alignment: int) -> int:
    """Largest multiple of ``alignment`` that is <= ``nbytes`` (both in bytes)."""
    return (int(nbytes) // alignment) * alignment


def cuda_pinning_available() -> bool:
    """True when page-locked host memory can be allocated (a CUDA device is visible)."""
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - broken CUDA installs
        return False


class BufferRegistry:
    """Address ranges ``[start, end)`` of host buffers handed out as "pinned".

    ``contains(t)`` is True when all bytes of tensor ``t`` (any dtype, any view) lie inside one
    registered buffer. Like DeepSpeed's C++ pinned-tensor manager, the registry holds a strong
    reference to each buffer until :meth:`remove` is called, so an address range can never be
    recycled by the allocator while it is still registered.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._entries: dict[int, tuple[int, torch.Tensor]] = {}

    def add(self, t: torch.Tensor) -> None:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        with self._lock:
            if start not in self._entries:
                bisect.insort(self._starts, start)
            self._entries[start] = (end, t)

    def remove(self, t: torch.Tensor) -> bool:
        """Forget the buffer that starts at ``t``'s first byte; False when none was registered."""
        start = t.data_ptr()
        with self._lock:
            if self._entries.pop(start, None) is None:
                return False
            i = bisect.bisect_left(self._starts, start)
            self._starts.pop(i)
            return True

    def contains(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        p = t.data_ptr()
        e = p + t.numel() * t.element_size()
        with self._lock:
            i = bisect.bisect_right(self._starts, p) - 1
            return i >= 0 and e <= self._entries[self._starts[i]][0]

    def __len__(self) -> int:
        return len(self._starts)


REGISTRY = BufferRegistry()


def alloc_aligned(nbytes: int, dtype: torch.dtype = torch.uint8, alignment: int = PAGE_BYTES,
                  pin: bool | None = None, zero: bool = False, register: bool = False,
                  pipeline: bool = False) -> torch.Tensor:
    """Allocate a 1-D host tensor whose first byte is ``alignment``-aligned.

    Args:
        nbytes: capacity in bytes; rounded up to a multiple of ``alignment`` and of the dtype size.
        dtype: element type of the returned tensor (shape ``(rounded_nbytes // itemsize,)``).
        alignment: address alignment in bytes (a power of two, default 4096 = one page).
        pin: page-lock the memory (``cudaHostAlloc``); default: only when CUDA is available.
        zero: fill with zeros (otherwise the content is undefined).
        register: record the range in :data:`REGISTRY` (``is_pinned`` then holds for the buffer and
            its views until ``REGISTRY.remove`` is called).
        pipeline: a buffer of the step's pipeline that dies within its phase (an optimizer sub-group's slice
            that the budget does not keep): carved from the pool's top, apart from the buffers that live longer
            (:mod:`aidaptiv_ds.io.pool`, [Note: the pipeline's slices at the top]).

    An unpinned buffer of at least :data:`~aidaptiv_ds.io.pool.POOL_MIN_BYTES` is carved from the
    process's buffer pool when one is in use (:func:`use_pool`) and has room; it goes back to the pool
    when its last view dies (:mod:`aidaptiv_ds.io.pool`).

    Returns:
        A CPU tensor of ``ceil(nbytes / itemsize)`` elements (rounded as above).
    """
    itemsize = dtype.itemsize
    nbytes = round_up(max(int(nbytes), 1), max(alignment, itemsize))
    if pin is None:
        pin = cuda_pinning_available()
    if pin:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # cudaHostAlloc: page aligned
        if raw.data_ptr() % alignment:
            raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=True)
    else:
        pool = _POOL
        asked = pool is not None and nbytes >= POOL_MIN_BYTES and pool.granule % alignment == 0
        carved = pool.take(nbytes, high=pipeline) if asked and pool is not None else None
        if carved is not None:  # granule-aligned already
            return _hand_out(carved[:nbytes], dtype, zero, register)
        if asked and pool is not None:  # a miss: fresh memory the pool counts while it lives
            raw = pool.fresh(nbytes + alignment)  # (io/pool.py, [Note: lean while a miss is alive])
        else:
            raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
        if nbytes >= HUGE_PAGE_BYTES:
            advise_huge_pages(raw)
    skip = (-raw.data_ptr()) % alignment
    return _hand_out(raw[skip:skip + nbytes], dtype, zero, register)


def _hand_out(buf: torch.Tensor, dtype: torch.dtype, zero: bool, register: bool) -> torch.Tensor:
    """``buf`` (aligned uint8 bytes) as ``dtype``, zeroed and registered as asked (:func:`alloc_aligned`)."""
    if zero:
        buf.zero_()
    out = buf.view(dtype)
    if register:
        REGISTRY.add(out)
    return out


#: Transparent huge page size on x86-64 and most aarch64 kernels.
HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back the 2 MiB-aligned interior of CPU tensor ``t`` 's bytes with transparent
    huge pages (``madvise(MADV_HUGEPAGE)``) before they are first touched.

    [Note: why huge pages] A DRAM budget of 0 keeps no freed heap (:func:`return_freed_host_memory`), so
    every swap buffer of every step is fresh memory that page-faults in: 4 KiB at a time, at 2.4-2.9
    GiB/s alloc+fill on this project's VM against 27 GiB/s for memory already mapped; with huge pages
    3.6-6.7 GiB/s. Where the kernel's THP mode is ``madvise`` (the default of many distributions) only
    advised ranges get huge pages. Host memory is unchanged: the buffers are filled whole anyway.
    PyTorch can advise all its own allocations too (``THP_MEM_ALLOC_ENABLE=1``); measured, that helped
    at budget 0 but made the step 1.42x DeepSpeed's CPU offload at ``auto`` (bf16, where the heap is
    kept for reuse; why is not profiled yet) against 1.01x without, so it is left to the user.
    Returns False where ``madvise`` is unavailable or refused (never raises).
    """
    start = round_up(t.data_ptr(), HUGE_PAGE_BYTES)
    end = round_down(t.data_ptr() + t.numel() * t.element_size(), HUGE_PAGE_BYTES)
    if end <= start:
        return False
    try:
        return glibc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D ``uint8`` view (no copy).

    Raises:
        ValueError: when ``t`` is not contiguous (its bytes are not one range).
    """
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor; call .contiguous() first")
    return t.reshape(-1).view(torch.uint8)


