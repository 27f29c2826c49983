"""The one place that talks to NVML (through nvidia-ml-py's ``pynvml``): GPU count, names, VRAM.

Nothing here raises because NVML is missing: without the library, the driver or a GPU,
:func:`nvml_status` says ``"NVML not available: <reason>"`` and lists no GPUs. Tests swap the
backend by setting ``_backend`` (e.g. a :class:`FakeNvml` with two GPUs; None: the real
:class:`PynvmlBackend`).
Memory figures are bytes from ``nvmlDeviceGetMemoryInfo`` (total, used, free of the whole device,
all processes included).
"""
from __future__ import annotations

import dataclasses
import threading

from ..errors import AidaptivError


class NvmlUnavailable(AidaptivError):
    """NVML cannot be used; the message is the reason shown to the user."""


class PynvmlBackend:
    """The real NVML through ``pynvml``; initialised once on first use, kept for the process."""

    def __init__(self) -> None:
        self._nv = None
        self._lock = threading.Lock()

    def _lib(self):
        with self._lock:
            if self._nv is None:
                try:
                    import pynvml
                except ImportError as e:
                    raise NvmlUnavailable(f"nvidia-ml-py is not installed ({e}); pip install nvidia-ml-py") from e
                try:
                    pynvml.nvmlInit()
                except Exception as e:  # pynvml.NVMLError and OSError from a broken driver
                    raise NvmlUnavailable(f"{e} (no NVIDIA driver or GPU visible)") from e
                self._nv = pynvml
            return self._nv

    def driver_version(self) -> str:
        v = self._lib().nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)

    def device_count(self) -> int:
        return int(self._lib().nvmlDeviceGetCount())

    def name(self, index: int) -> str:
        nv = self._lib()
        v = nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(index))
        return v.decode() if isinstance(v, bytes) else str(v)

    def memory(self, index: int) -> tuple[int, int]:
        """``(total_bytes, used_bytes)`` of GPU ``index``."""
        nv = self._lib()
        m = nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index))
        return int(m.total), int(m.used)


@dataclasses.dataclass
class FakeGpu:
    """One fake GPU: name and memory in bytes."""
    name: str
    total_bytes: int
    used_bytes: int = 0


class FakeNvml:
    """A stand-in backend: the given GPUs, or ``NvmlUnavailable(error)`` from every call when ``error`` is set."""

    def __init__(self, gpus: list[FakeGpu] | None = None, error: str | None = None,
                 driver: str = "fake-550.00") -> None:
        self.gpus = list(gpus or [])
        self.error = error
        self.driver = driver

    def _check(self) -> None:
        if self.error:
            raise NvmlUnavailable(self.error)

    def driver_version(self) -> str:
        self._check()
        return self.driver

    def device_count(self) -> int:
        self._check()
        return len(self.gpus)

    def name(self, index: int) -> str:
        self._check()
        return self.gpus[index].name

    def memory(self, index: int) -> tuple[int, int]:
        self._check()
        g = self.gpus[index]
        return g.total_bytes, g.used_bytes


_backend = None
_backend_lock = threading.Lock()



def get_backend():
    """The backend in use (created on first call)."""
    global _backend
    with _backend_lock:
        if _backend is None:
            _backend = PynvmlBackend()
        return _backend


def nvml_status(backend=None) -> dict:
    """GPUs as NVML sees them, never raising.

    Returns:
        ``{"available": bool, "status": "ok" | "NVML not available: <reason>", "driver_version",
        "gpus": [{"index", "name", "total_bytes", "used_bytes", "free_bytes"}]}``. With NVML but no
        GPU: ``available`` True, ``gpus`` empty, status ``"ok: NVML found no GPU"``.
    """
    b = backend or get_backend()
    try:
        n = b.device_count()
        gpus = []
        for i in range(n):
            total, used = b.memory(i)
            gpus.append({"index": i, "name": b.name(i), "total_bytes": total, "used_bytes": used,
                         "free_bytes": total - used})
        driver = b.driver_version()
    except NvmlUnavailable as e:
        return {"available": False, "status": f"NVML not available: {e}", "driver_version": None, "gpus": []}
    except Exception as e:  # an NVML error on one query: report it, do not crash the caller
        return {"available": False, "status": f"NVML not available: {type(e).__name__}: {e}",
                "driver_version": None, "gpus": []}
    return {"available": True, "status": "ok" if gpus else "ok: NVML found no GPU", "driver_version": driver,
            "gpus": gpus}


def vram_used_bytes(backend=None) -> list[int] | None:
    """Used bytes per GPU, or None when NVML is not available."""
    st = nvml_status(backend)
    return [g["used_bytes"] for g in st["gpus"]] if st["available"] else None
