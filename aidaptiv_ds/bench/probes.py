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


class RssTrace:
    """A thread sampling this process's RSS every ``every_s`` seconds, each sample tagged with the phase
    ``label()`` names then; :meth:`samples` keeps the first sample of each phase, every sample that moved
    ``min_step`` bytes from the last one kept, and each phase's largest sample (``[t_s, rss_bytes, phase]``,
    ``t_s`` from :meth:`start`). A sampled peak is a lower bound of ``VmHWM``'s (a spike shorter than
    ``every_s`` can fall between two samples); its use is *where* the memory rose, beside the exact peaks.
    """

    def __init__(self, label, every_s: float = 0.05, min_step: int = 32 << 20, detail=None) -> None:
        self._label, self._every, self._min = label, float(every_s), int(min_step)
        self._detail = detail  # optional ``fn() -> dict`` appended to each kept sample (where the bytes are)
        self._out: list[list] = []
        self._top: dict[str, list] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # samples() may be called while the thread samples
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> RssTrace:
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="aidaptiv-rss-trace", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        last_rss, last_phase = -1, None
        while not self._stop.wait(self._every):
            rss, phase = rss_bytes(), str(self._label())
            sample = [round(time.perf_counter() - self._t0, 3), rss, phase]
            if self._detail is not None:
                try:
                    sample.append(self._detail())
                except Exception as e:  # noqa: BLE001 - a diagnostic must not stop the run
                    sample.append({"error": repr(e)})
            with self._lock:
                if phase != last_phase or abs(rss - last_rss) >= self._min:
                    self._out.append(sample)
                    last_rss, last_phase = rss, phase
                top = self._top.get(phase)
                if top is None or rss > top[1]:
                    self._top[phase] = sample

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def samples(self) -> list[list]:
        """The kept samples and each phase's largest one, in time order."""
        with self._lock:
            kept = self._out + list(self._top.values())
        seen, out = set(), []
        for x in kept:
            if id(x) not in seen:
                seen.add(id(x))
                out.append(x)
        return sorted(out, key=lambda x: x[0])


def smaps_rss(ranges: dict[str, tuple[int, int]] | None = None) -> dict:
    """Resident bytes of this process by kind of mapping (``/proc/self/smaps``): ``files`` (libraries and
    other file mappings), ``heap`` (the ``brk`` heap), ``arenas`` (glibc's 64 MiB thread arenas), ``anon``
    (other anonymous mappings: blocks above the mmap threshold, torch's and numpy's own, thread stacks) and
    one entry per named address range of ``ranges`` (``{name: (start, end)}``: e.g. the buffer pool's region).
    The kernel merges neighbouring anonymous mappings, so a named range can share a mapping with others; its
    share is then the mapping's resident bytes up to the overlap (an upper bound). A diagnostic: reading smaps
    costs milliseconds."""
    out: dict[str, int] = {}
    ranges = ranges or {}
    kind, a, b, path = "", 0, 0, ""
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    parts = line.split()
                    a, b = (int(x, 16) for x in parts[0].split("-"))
                    path = parts[5] if len(parts) > 5 else ""
                    if path.startswith("/"):
                        kind = "files"
                    elif path == "[heap]":
                        kind = "heap"
                    elif path:
                        kind = "other"
                    else:
                        kind = "arenas" if b - a == 64 << 20 and a % (64 << 20) == 0 else "anon"
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                    if kind == "anon":
                        for name, (s0, e0) in ranges.items():
                            share = min(rss, max(min(b, e0) - max(a, s0), 0))
                            if share:
                                out[name] = out.get(name, 0) + share
                                rss -= share
                    out[kind] = out.get(kind, 0) + rss
    except OSError:
        return {}
    return out


def heap_bytes() -> dict:
    """glibc's ``mallinfo2`` over every arena (bytes): ``heap`` (obtained with ``brk``/arenas), ``heap_free``
    (free chunks in it), ``mmapped`` (blocks mapped on their own); ``{}`` where it is not glibc."""
    import ctypes

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        from ..io.heap import glibc

        fn = glibc().mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {"heap": int(m.arena), "heap_free": int(m.fordblks), "mmapped": int(m.hblkhd)}


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
