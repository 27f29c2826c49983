"""Install the DeepSpeed hooks as soon as DeepSpeed is imported (or now, if it already is).

``import aidaptiv_ds`` stays cheap (DeepSpeed and torch are not imported by it): a meta-path finder
waits for the top-level ``deepspeed`` package to finish loading, then calls
:func:`aidaptiv_ds.integration.install`. Set ``AIDAPTIV_DS_NO_AUTOINSTALL=1`` to opt out and call
``aidaptiv_ds.integration.install()`` yourself.
"""
from __future__ import annotations

import importlib.abc
import os
import sys


class _DeepSpeedWatcher(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "deepspeed" or getattr(self, "_searching", False):
            # [Note: two watchers] the site hook's watcher and the package's each ask the other finders;
            # without this guard each asks the other again, without end (RecursionError at `import deepspeed`)
            return None
        spec = None
        self._searching = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module, _run=run, _self=self):
            _run(module)
            if _self in sys.meta_path:
                sys.meta_path.remove(_self)
            from .integration.hooks import install
            install()

        loader.exec_module = exec_module
        return spec


def activate() -> None:
    """Install now if DeepSpeed is loaded, else when it gets imported (no-op when opted out)."""
    if os.environ.get("AIDAPTIV_DS_NO_AUTOINSTALL") == "1":
        return
    if "deepspeed" in sys.modules and hasattr(sys.modules["deepspeed"], "initialize"):
        from .integration.hooks import install
        install()
    elif not any(isinstance(f, _DeepSpeedWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedWatcher())
