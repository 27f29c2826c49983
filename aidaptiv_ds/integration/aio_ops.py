"""Which ``async_io`` op DeepSpeed loads: the registry seams and the probes of its compiled op.

DeepSpeed 0.19.8's ``AsyncIOBuilder().load()`` returns ``OpBuilder._loaded_ops['async_io']`` when it is
set (``ops/op_builder/builder.py:549-566``), and ``load_pin_memory_module`` returns
``sys._deepspeed_pin_memory_op_module`` when it is set (``ops/op_builder/pin_memory_load.py:10-21``);
only otherwise does either JIT-build its op. Every write of those two private names in aidaptiv_ds is
here (``docs/deepspeed-surface.md``): our pure-Python handle registers itself through them
(:func:`aidaptiv_ds.integration.aio_handle.register_with_deepspeed`), and the benchmarks install
DeepSpeed's compiled op, or a timed wrapper of either, through them.
"""
from __future__ import annotations

import sys
import types

_PIN_MEMORY = "_deepspeed_pin_memory_op_module"  # DeepSpeed's process-wide pin-memory op cache (on ``sys``)


def loaded_async_io() -> types.ModuleType | None:
    """The ``async_io`` op module DeepSpeed's next ``AsyncIOBuilder().load()`` returns without building, or None."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    return OpBuilder._loaded_ops.get("async_io")


def set_loaded_async_io(module: types.ModuleType | None) -> None:
    """Make ``AsyncIOBuilder().load()`` return ``module`` (anything with ``aio_handle``) in this process;
    None removes the entry (DeepSpeed's next load builds or loads its own op)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if module is None:
        OpBuilder._loaded_ops.pop("async_io", None)
    else:
        OpBuilder._loaded_ops["async_io"] = module


def pin_memory_module() -> types.ModuleType | None:
    """The module DeepSpeed's ``load_pin_memory_module`` returns without building, or None."""
    return getattr(sys, _PIN_MEMORY, None)


def set_pin_memory_module(module: types.ModuleType | None) -> None:
    """Make DeepSpeed's ``load_pin_memory_module`` return ``module`` (None: it loads its own op next time)."""
    setattr(sys, _PIN_MEMORY, module)


def is_ours(module) -> bool:
    """Whether ``module`` is aidaptiv_ds's op module (its ``aio_handle`` is defined in aidaptiv_ds)."""
    return getattr(getattr(module, "aio_handle", None), "__module__", "").startswith("aidaptiv_ds")


def async_io_installed() -> bool:
    """Whether this DeepSpeed install has the ``async_io`` op precompiled (``installed_ops['async_io']``).

    Raises:
        ImportError: DeepSpeed is not importable.
    """
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get("async_io", False))


def async_io_buildable() -> bool:
    """Whether DeepSpeed could JIT-build ``async_io`` here (``AsyncIOBuilder().is_compatible()``: libaio
    and its headers found). Raises what DeepSpeed's probe raises (ImportError without DeepSpeed)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def load_compiled_async_io(allow_build: bool) -> tuple[types.ModuleType | None, str]:
    """DeepSpeed's compiled ``async_io`` op: ``(module, "loaded" | "built")`` or ``(None, "not built: <reason>")``.

    An op already loaded in this process is returned as it is (unless it is ours). Otherwise the op is
    loaded only when it is precompiled or ``allow_build`` (a JIT build takes minutes and needs
    libaio-dev and a compiler). While DeepSpeed loads, our own registered handle and pin-memory module
    are stepped aside (else ``load()`` would return ours) and put back afterwards.
    """
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        loaded = loaded_async_io()
        installed = async_io_installed()
    except Exception as e:  # noqa: BLE001 - any import problem is a reason, not a crash
        return None, f"not built: deepspeed is not importable ({type(e).__name__}: {e})"
    if loaded is not None and not is_ours(loaded):
        return loaded, "loaded"
    if not allow_build and not installed:
        return None, ("not built: async_io is not precompiled in this DeepSpeed install (installed_ops['async_io'] "
                      "is False) and a JIT build takes minutes; pass --with-deepspeed-aio to build it")
    ours = loaded
    if ours is not None:
        set_loaded_async_io(None)
    pin = pin_memory_module()
    pin_is_ours = pin is not None and not getattr(pin, "__file__", None)
    if pin_is_ours:
        set_pin_memory_module(None)
    try:
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, ("not built: AsyncIOBuilder().is_compatible() is False (libaio and its headers not found; "
                          "install libaio-dev)")
        return builder.load(verbose=False), "built"
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()
        return None, f"not built: {type(e).__name__}: {msg[-1] if msg else ''}"
    finally:
        if ours is not None:
            set_loaded_async_io(ours)
        if pin_is_ours and pin_memory_module() is None:
            set_pin_memory_module(pin)
