"""A pure-Python stand-in for DeepSpeed's compiled ``async_io`` op, backed by :class:`IOEngine`.

Contract (``docs/deepspeed-seams.md`` §3.2-3.4, DeepSpeed 0.19.8):

* ``aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)``
  is constructed with keyword arguments;
* ``async_pread``/``async_pwrite(buffer, filename, file_offset=0)`` return 0 (callers assert it);
  writes open with ``O_CREAT`` and never truncate;
* ``wait()`` returns the number of requests completed on *this handle* since the last ``wait()``
  (callers assert it equals their own count) and buffers stay untouched until it returns;
* ``new_cpu_locked_tensor``/``free_cpu_locked_tensor`` hand out page-aligned host buffers;
* ``is_pinned(t)`` is True for views and slices of those buffers (a range check across all
  handles, as in ``deepspeed_pin_tensor.cpp``) and for torch-pinned tensors.

:func:`register_with_deepspeed` puts this module where ``AsyncIOBuilder().load()`` looks first
(:mod:`aidaptiv_ds.integration.aio_ops`), so DeepSpeed never JIT-compiles ``async_io``.
"""
from __future__ import annotations

import os
import threading
import types

import torch

from ..io.buffers import REGISTRY, alloc_aligned
from ..io.engine import READ_DEMAND, WRITE_BACK, IOEngine, default_engine
from ..io.errors import StorageIOError
from ..io.futures import IOFuture
from .errors import DeepSpeedContractError


class AioHandle:
    """DeepSpeed ``aio_handle`` implemented on the aidaptiv_ds I/O engine (no libaio, no compile)."""

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1, engine: IOEngine | None = None) -> None:
        self._block_size = int(block_size)
        self._queue_depth = int(queue_depth)
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        self._intra_op_parallelism = int(intra_op_parallelism)
        self._engine = engine or default_engine()
        self._lock = threading.Lock()
        self._pending: list[IOFuture] = []

    # getters of the C++ handle
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_alignment(self) -> int:
        return 512 * self._intra_op_parallelism

    # ------------------------------------------------------------------ I/O
    def _submit(self, buffer: torch.Tensor, filename: str, file_offset: int, write: bool) -> IOFuture:
        buf = buffer.detach()
        if not buf.is_contiguous():
            raise DeepSpeedContractError(f"aidaptiv_ds aio_handle: the buffer for {filename} is not contiguous; "
                                         f"DeepSpeed's swappers pass contiguous (pinned) buffers. Fix: pass "
                                         f"buffer.contiguous()")
        nbytes = buf.numel() * buf.element_size()
        if not write:
            try:
                size = os.path.getsize(filename)
            except OSError as e:
                raise StorageIOError("read", filename, file_offset, nbytes, e.errno) from e
            if size < file_offset + nbytes:
                raise StorageIOError("read", filename, file_offset, nbytes, None,
                                     detail=f"file holds {size} bytes, the request ends at byte {file_offset + nbytes}")
        fh = self._engine.open(filename, drive=os.path.dirname(os.path.abspath(filename)), create=write)
        fut = (self._engine.write(fh, file_offset, buf, WRITE_BACK) if write
               else self._engine.read(fh, file_offset, buf, READ_DEMAND))
        fut.add_done_callback(lambda _f: fh.close())
        return fut

    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        fut = self._submit(buffer, filename, file_offset, write=False)
        with self._lock:
            self._pending.append(fut)
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        fut = self._submit(buffer, filename, file_offset, write=True)
        with self._lock:
            self._pending.append(fut)
        return 0

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        self._submit(buffer, filename, file_offset, write=False).wait()
        return 1

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        self._submit(buffer, filename, file_offset, write=True).wait()
        return 1

    def pread(self, buffer, filename, validate=False, async_op=False, file_offset=0) -> int:
        if async_op:
            return self.async_pread(buffer, filename, file_offset)
        return self.sync_pread(buffer, filename, file_offset)

    def pwrite(self, buffer, filename, validate=False, async_op=False, file_offset=0) -> int:
        if async_op:
            return self.async_pwrite(buffer, filename, file_offset)
        return self.sync_pwrite(buffer, filename, file_offset)

    def read(self, buffer, filename, validate=False) -> int:
        return self.sync_pread(buffer, filename)

    def write(self, buffer, filename, validate=False) -> int:
        return self.sync_pwrite(buffer, filename)

    def wait(self) -> int:
        """Complete every request submitted on this handle; return how many there were.

        Raises:
            StorageIOError: the first failed request's error, after all of them finished.
        """
        with self._lock:
            pending, self._pending = self._pending, []
        first = None
        for f in pending:
            try:
                f.wait()
            except BaseException as e:  # noqa: BLE001
                first = first or e
        if first is not None:
            raise first
        return len(pending)

    # ------------------------------------------------------------------ buffers
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-aligned 1-D CPU tensor of ``num_elem`` elements of ``example_tensor.dtype``."""
        itemsize = example_tensor.element_size()
        t = alloc_aligned(int(num_elem) * itemsize, dtype=example_tensor.dtype, register=True)
        return t[: int(num_elem)]

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return REGISTRY.remove(tensor)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if REGISTRY.contains(tensor):
            return True
        try:
            return bool(tensor.is_pinned())
        except Exception:  # CPU-only torch raises "Cannot access accelerator device"
            return False

    def pin_device_tensor(self, tensor: torch.Tensor) -> bool:  # GDS only; nothing to do without cuFile
        return True

    def unpin_device_tensor(self, tensor: torch.Tensor) -> bool:
        return True


def make_op_module() -> types.ModuleType:
    """A module object shaped like the compiled op: ``m.aio_handle`` is :class:`AioHandle`."""
    m = types.ModuleType("aidaptiv_ds_async_io")
    m.aio_handle = AioHandle
    return m


def register_with_deepspeed() -> types.ModuleType:
    """Make ``AsyncIOBuilder().load()`` return our module (process-wide, incl. the FAST checkpoint writer),
    and DeepSpeed's pin-memory loader too where nothing is loaded yet (:mod:`.aio_ops`)."""
    from .aio_ops import pin_memory_module, set_loaded_async_io, set_pin_memory_module

    m = make_op_module()
    set_loaded_async_io(m)
    if pin_memory_module() is None:
        set_pin_memory_module(m)
    return m
