"""DeepSpeed's compiled ``async_io`` op for the native baseline: where it is, whether it loads, timed waits.

DeepSpeed JIT-builds the op with torch's cpp_extension into ``$TORCH_EXTENSIONS_DIR/async_io``
(default ``~/.cache/torch_extensions/py<version>_<cpu or cu<CUDA version>>/async_io``); a later load with the same
sources, flags and *the same ninja binary* finds nothing to rebuild and takes seconds. Two ninja
versions on ``PATH`` (a venv's and the system's) rebuild each other's output, so the processes the
comparison starts always get the interpreter's own ``bin`` directory first on ``PATH``
(:func:`aio_env`). libaio need not be installed: ``--libaio-root`` points at an unpacked
``libaio1``/``libaio-dev`` tree (``usr/include``, ``usr/lib/x86_64-linux-gnu``), added to ``CPATH``,
``LIBRARY_PATH`` and ``LD_LIBRARY_PATH``.

:func:`preflight` runs once per comparison in a separate process: it loads the op from the cache
(building it only when allowed) so no measured run ever pays for a build, and it returns the reason
when the op is unavailable; the native runs then use aidaptiv_ds's pure-Python handle and the table
says ``compiled aio unavailable: <reason>``.

Run as ``python -m aidaptiv_ds.bench.aio [--build]`` it prints the preflight JSON.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
import types

from .probes import WaitClock


def libaio_dirs(root: str) -> tuple[list[str], list[str]]:
    """``(include dirs, library dirs)`` of an unpacked libaio tree under ``root``."""
    inc = [d for d in glob.glob(os.path.join(root, "usr", "include")) if os.path.isfile(os.path.join(d, "libaio.h"))]
    lib = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(root, "usr", "lib*", "**", "libaio.so*"),
                                                        recursive=True)})
    return inc, lib


def _prepend(env: dict, key: str, dirs: list[str]) -> None:
    if dirs:
        env[key] = os.pathsep.join(dirs + ([env[key]] if env.get(key) else []))


def aio_env(base: dict | None = None, extensions_dir: str | None = None, libaio_root: str | None = None) -> dict:
    """The environment for processes that may load the compiled op (see the module docstring).

    Raises:
        ValueError: ``libaio_root`` holds no ``libaio.h`` or ``libaio.so*``.
    """
    env = dict(os.environ if base is None else base)
    bindir = os.path.dirname(sys.executable)
    path = env.get("PATH", "").split(os.pathsep)
    if not path or path[0] != bindir:
        env["PATH"] = os.pathsep.join([bindir] + [p for p in path if p and p != bindir])
    if extensions_dir:
        env["TORCH_EXTENSIONS_DIR"] = os.path.abspath(extensions_dir)
    if libaio_root:
        inc, lib = libaio_dirs(libaio_root)
        if not inc or not lib:
            raise ValueError(f"--libaio-root {libaio_root}: no usr/include/libaio.h and usr/lib*/**/libaio.so* under "
                             f"it; unpack libaio1 and libaio-dev there (dpkg-deb -x <deb> {libaio_root})")
        _prepend(env, "CPATH", inc)
        _prepend(env, "LIBRARY_PATH", lib)
        _prepend(env, "LD_LIBRARY_PATH", lib)
    return env


def _check(build: bool) -> dict:
    """In this process: find the cached build and load it (or build it when ``build``)."""
    import shutil

    from torch.utils.cpp_extension import _get_build_directory

    from .bench_io import load_deepspeed_aio

    d = _get_build_directory("async_io", verbose=False)
    so = os.path.join(d, "async_io.so")
    info = {"build_dir": d, "cached": os.path.isfile(so), "ninja": shutil.which("ninja"),
            "path_head": os.environ.get("PATH", "").split(os.pathsep)[0]}
    if not info["cached"] and not build:
        return {**info, "aio": "python",
                "status": f"compiled aio unavailable: no async_io build in {d} (pass --build-aio to JIT-build it once, "
                          f"about 10 minutes; needs libaio and a compiler)"}
    t0 = time.perf_counter()
    module, why = load_deepspeed_aio("build")
    info["load_s"] = time.perf_counter() - t0
    if module is None:
        return {**info, "aio": "python", "status": f"compiled aio unavailable: {why}"}
    return {**info, "aio": "compiled", "status": f"DeepSpeed async_io op ({module.__file__})"}


def preflight(env: dict, build: bool = False, timeout_s: float = 1800) -> dict:
    """Load (or with ``build`` JIT-build) the op once in a child process with ``env``.

    Returns:
        ``{"aio": "compiled" | "python", "status", "build_dir", "cached", "ninja", "load_s", "wall_s"}``;
        ``wall_s`` over a minute means the op was (re)built now.
    """
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "aidaptiv_ds.bench.aio"] + (["--build"] if build else [])
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"aio": "python", "status": f"compiled aio unavailable: loading it took over {timeout_s:.0f} s",
                "wall_s": time.perf_counter() - t0}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        return {"aio": "python", "status": f"compiled aio unavailable: the check failed (rc {p.returncode}: {tail})",
                "wall_s": time.perf_counter() - t0}
    out = json.loads(lines[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------- timed handles (in the worker)
class TimedHandle:
    """Delegates everything to a DeepSpeed-style ``aio_handle``; times ``wait()`` into a clock."""

    def __init__(self, inner, clock: WaitClock) -> None:
        self._inner = inner
        self._clock = clock

    def wait(self):
        t0 = time.perf_counter()
        try:
            return self._inner.wait()
        finally:
            self._clock.add(time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def timed_op_module(module, clock: WaitClock) -> types.ModuleType:
    """A module like ``module`` (an ``async_io`` op) whose ``aio_handle(...)`` returns :class:`TimedHandle`."""
    out = types.ModuleType(getattr(module, "__name__", "async_io") + "_timed")
    for name in dir(module):
        if not name.startswith("__"):
            setattr(out, name, getattr(module, name))

    def aio_handle(*args, **kwargs):
        return TimedHandle(module.aio_handle(*args, **kwargs), clock)

    out.aio_handle = aio_handle
    out.wrapped = module
    return out


def install_native_aio(want: str, clock: WaitClock) -> dict:
    """Give DeepSpeed's NVMe swappers an aio op whose waits are timed into ``clock``.

    Args:
        want: ``"compiled"`` (DeepSpeed's op, from the extensions cache; the preflight made sure it
            is there) or ``"python"`` (aidaptiv_ds's pure-Python handle).

    Returns:
        ``{"aio": "compiled" | "python", "status", "load_s"}``; when ``"compiled"`` was wanted and
        does not load, ``status`` is ``"compiled aio unavailable: <reason>"`` and the Python handle is used.
    """
    from ..integration.aio_handle import register_with_deepspeed
    from ..integration.aio_ops import loaded_async_io, set_loaded_async_io
    from .bench_io import load_deepspeed_aio

    t0 = time.perf_counter()
    kind, status = "python", "aidaptiv_ds pure-Python handle (requested)"
    if want == "compiled":
        module, why = load_deepspeed_aio("build")
        if module is not None:
            set_loaded_async_io(module)
            kind, status = "compiled", f"DeepSpeed async_io op ({getattr(module, '__file__', '?')})"
        else:
            status = f"compiled aio unavailable: {why}"
    if kind == "python":
        register_with_deepspeed()
    set_loaded_async_io(timed_op_module(loaded_async_io(), clock))
    return {"aio": kind, "status": status, "load_s": time.perf_counter() - t0}


if __name__ == "__main__":
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        result = _check("--build" in sys.argv[1:])
    print(json.dumps(result))
