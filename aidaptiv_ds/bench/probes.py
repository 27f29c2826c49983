"""In-process measurements for the comparison worker: I/O wait of the training thread, memory peaks.

I/O wait is measured the same way for both storage backends: the seconds the *training thread*
spends blocked on an I/O completion.

* aidaptiv_ds: every blocking wait goes through :meth:`aidaptiv_ds.io.futures.IOFuture.wait`
  (slice reads, write-back throttling, synchronous writes), which :func:`time_future_waits` times.
  The runtime's own ``io_wait_s`` counter covers only the waits the swappers bracket, so it can be
  lower; the worker reports both.
* DeepSpeed native: every blocking wait of its swappers is ``aio_handle.wait()``;
  :func:`aidaptiv_ds.bench.aio.install_native_aio` wraps the handle DeepSpeed loads (its compiled
  ``async_io`` op, or aidaptiv_ds's pure-Python handle when the op cannot be loaded) so each
  ``wait()`` is timed into the same kind of :class:`WaitClock`.

Memory: ``VmHWM`` (peak resident set) can be reset through ``/proc/self/clear_refs`` (Linux >= 4.0),
so the worker reports the peak of the training steps apart from the peak of model construction;
``ru_maxrss`` is the peak of the whole process. On a CUDA device, :func:`gpu_memory` adds torch's
peak allocated/reserved device memory, the device's used memory from NVML and the pinned host
memory torch's host allocator holds. All sizes in bytes, times in seconds.
"""
from __future__ import annotations

import resource
import sys
import threading
import time


class WaitClock:
    """Seconds the main thread spent in timed waits (calls on other threads are not counted)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._main = threading.main_thread().ident

    def add(self, dt: float) -> None:
        if threading.get_ident() == self._main:
            self.seconds += dt
            self.calls += 1


def time_future_waits(clock: WaitClock):
    """Time every :meth:`IOFuture.wait` call on the main thread into ``clock``; returns an undo function."""
    from ..io.futures import IOFuture

    orig = IOFuture.wait

    def wait(self, timeout=None):
        t0 = time.perf_counter()
        try:
            return orig(self, timeout)
        finally:
            clock.add(time.perf_counter() - t0)

    IOFuture.wait = wait

    def undo() -> None:
        IOFuture.wait = orig
    return undo


# ---------------------------------------------------------------------------- memory
def _status_field(name: str) -> int:
    """A ``/proc/self/status`` field in bytes (0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """Current resident set size."""
    return _status_field("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or since :func:`reset_peak_rss` (``VmHWM``)."""
    return _status_field("VmHWM")


def process_peak_rss_bytes() -> int:
    """Peak resident set size of the process (``ru_maxrss``). On Linux :func:`reset_peak_rss` lowers it too
    (both read the memory map's high-water mark): a caller that resets keeps the earlier peak itself."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def cpu_times() -> tuple[float, float, int]:
    """This process's CPU seconds so far, user and system (every thread), and its minor page faults
    (``getrusage``; a fault is one page, 4 KiB or a 2 MiB huge page)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime, ru.ru_minflt


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------- accelerator memory
def reset_gpu_peaks(device) -> None:
    """Restart torch's peak counters of ``device`` (a CUDA ``torch.device``; nothing for another kind)."""
    import torch

    if getattr(device, "type", None) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gpu_memory(device) -> dict:
    """Memory of a CUDA ``device`` for one step record (``{}`` for another kind of device), bytes:

    * ``gpu_peak_allocated_bytes`` / ``gpu_peak_reserved_bytes``: torch's caching allocator, peak since
      :func:`reset_gpu_peaks` (tensors / what the allocator took from the driver);
    * ``gpu_used_bytes``: the whole device as NVML reports it now (every process, the CUDA context
      included), None when NVML is not available;
    * ``pinned_host_bytes``: page-locked host memory held by torch's pinned (host) allocator, in use
      or cached for reuse (``torch.cuda.host_memory_stats()["allocated_bytes.current"]``; None where
      this torch has no such counter). The pinned allocator rounds each block up to a power of two and
      keeps freed blocks, so this can exceed the bytes the buffers asked for.
    """
    import torch

    if getattr(device, "type", None) != "cuda":
        return {}
    from ..telemetry.nvml import vram_used_bytes

    used = vram_used_bytes()
    index = device.index if device.index is not None else torch.cuda.current_device()
    pinned = None
    try:
        stats = torch.cuda.host_memory_stats()
        pinned = stats.get("allocated_bytes.current", stats.get("reserved_bytes.current"))
    except (AttributeError, RuntimeError):
        pass
    return {"gpu_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "gpu_peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "gpu_used_bytes": used[index] if used and index < len(used) else None,
            "pinned_host_bytes": None if pinned is None else int(pinned)}
