"""Session-wide test environment, and the test tiers.

**Tiers.** Every test has one of ``unit``, ``engine``, ``subprocess``, ``multirank``, ``benchmark``
(``slow`` is orthogonal):

* ``engine``: builds a DeepSpeed engine or ``deepspeed.zero.Init`` in the test process;
* ``subprocess``: starts a child process (a training script, a CLI, ``dd``, a crash helper);
* ``multirank``: launches several ranks (gloo); implies ``subprocess``;
* ``benchmark``: pytest-benchmark suites (``tests/bench/``; timings, not checks of behaviour);
* ``unit``: everything else, assigned here to every test that carries none of these markers.

The default is checked, not trusted: while a ``unit`` test runs (its fixtures included), starting a
child process or building a DeepSpeed engine / ``zero.Init`` fails the test with the marker to add
(``pytestmark = pytest.mark.subprocess`` for a file, ``@pytest.mark.engine`` for one test). Short
system probes some libraries run (``ldconfig`` for ``ctypes.util.find_library``, ``uname``,
compilers probed by DeepSpeed's op builders) are allowed, see :data:`PROBES`. So
``python -m pytest -m unit`` is the fast tier (in-process, no DeepSpeed engine), whoever wrote the test.

**Tools of child processes.** Child processes (training runs, launchers) find the venv's tools
first: DeepSpeed JIT-builds a small comm op per process into the shared torch-extensions cache, and
two ``ninja`` versions (the venv's and the system's) treat each other's build log as stale and
rebuild it in turn (about a minute each), so every process must see the same one.
"""
from __future__ import annotations

import importlib.abc
import multiprocessing.util
import os
import subprocess
import sys

import pytest

_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

TIERS = ("engine", "subprocess", "multirank", "benchmark")
#: programs a library may run as a short probe inside a unit test (basename of argv[0])
PROBES = {"ldconfig", "uname", "gcc", "cc", "c++", "g++", "clang", "nvcc", "nvidia-smi", "lscpu", "which",
          "hipcc", "rocm-smi", "ld", "ar"}

_current: dict = {"item": None}


class TierViolation(Exception):
    """A test classified ``unit`` started a child process or built a DeepSpeed engine."""


def _violate(what: str, marker: str) -> None:
    item = _current["item"]
    if item is not None:
        raise TierViolation(f"{item.nodeid} is a unit test (no tier marker) but {what}. Mark it "
                            f"@pytest.mark.{marker} (or pytestmark = pytest.mark.{marker} for the file); "
                            f"see tests/conftest.py")


def _guard_processes() -> None:
    orig_execute = subprocess.Popen._execute_child

    def _execute_child(self, args, executable, *rest, **kw):
        argv0 = executable or (args if isinstance(args, (str, bytes)) else list(args)[0])
        name = os.path.basename(os.fsdecode(argv0)).split()[0]
        if name not in PROBES:
            _violate(f"starts a child process ({name})", "subprocess")
        return orig_execute(self, args, executable, *rest, **kw)

    subprocess.Popen._execute_child = _execute_child

    def guarded(mod, name, what):
        orig = getattr(mod, name, None)
        if orig is None:
            return

        def wrapper(*a, **kw):
            _violate(what, "subprocess")
            return orig(*a, **kw)
        setattr(mod, name, wrapper)

    guarded(os, "fork", "forks (os.fork / multiprocessing)")
    guarded(os, "system", "runs os.system")
    guarded(os, "posix_spawn", "spawns a process")
    guarded(os, "posix_spawnp", "spawns a process")
    guarded(multiprocessing.util, "spawnv_passfds", "starts a multiprocessing child")


def _wrap_init(cls, what: str) -> None:
    orig = cls.__init__
    if getattr(orig, "_tier_guard", False):
        return

    def __init__(self, *a, **kw):
        _violate(what, "engine")
        return orig(self, *a, **kw)
    __init__._tier_guard = True
    __init__.__wrapped__ = orig
    cls.__init__ = __init__


_ENGINE_CLASSES = {"deepspeed.runtime.engine": ("DeepSpeedEngine", "builds a DeepSpeed engine"),
                   "deepspeed.runtime.zero.partition_parameters": ("Init", "enters deepspeed.zero.Init")}


class _EngineGuard(importlib.abc.MetaPathFinder):
    """Wraps ``DeepSpeedEngine.__init__`` and ``zero.Init.__init__`` as soon as their modules load."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _ENGINE_CLASSES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module, _run=run):
            _run(module)
            cls_name, what = _ENGINE_CLASSES[module.__name__]
            _wrap_init(getattr(module, cls_name), what)

        spec.loader.exec_module = exec_module
        return spec


def pytest_configure(config):
    _guard_processes()
    for name, (cls_name, what) in _ENGINE_CLASSES.items():
        if name in sys.modules:
            _wrap_init(getattr(sys.modules[name], cls_name), what)
    sys.meta_path.insert(0, _EngineGuard())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tier ``unit`` for every test without another tier marker (before ``-m`` selects)."""
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.unit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    is_unit = not any(item.get_closest_marker(t) for t in TIERS)
    _current["item"] = item if is_unit else None
    try:
        yield
    finally:
        _current["item"] = None
