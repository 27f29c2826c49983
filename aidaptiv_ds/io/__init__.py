"""Asynchronous tensor I/O at file offsets: engine, aligned buffers, futures, errors (no DeepSpeed, nothing above)."""
from .buffers import PAGE_BYTES, REGISTRY, alloc_aligned, round_up
from .engine import READ_DEMAND, READ_PREFETCH, WRITE_BACK, DirectIOFallbackWarning, IOEngine, default_engine
from .errors import ChecksumError, StorageError, StorageFullError, StorageIOError
from .futures import IOFuture, combine, completed, wait_all

__all__ = ["PAGE_BYTES", "REGISTRY", "alloc_aligned", "round_up", "READ_DEMAND", "READ_PREFETCH", "WRITE_BACK",
           "DirectIOFallbackWarning", "IOEngine", "default_engine", "ChecksumError", "StorageError",
           "StorageFullError", "StorageIOError", "IOFuture", "combine", "completed", "wait_all"]
