"""aidaptiv_ds's site hook: the ``"aidaptiv"`` section of a DeepSpeed config is enough, no import needed.

``pip install aidaptiv_ds`` puts ``aidaptiv_ds_autoload.pth`` into ``site-packages`` (wheel and
editable installs alike, see ``setup.py``); Python runs its one line, ``import _aidaptiv_ds_autoload``,
at every interpreter start. From then on it costs nothing until ``deepspeed`` is imported: this
module uses only ``sys`` and ``os`` (loaded at startup anyway) and puts one finder on
``sys.meta_path`` that answers for one module name. When ``deepspeed`` has finished loading, two
thin wrappers go around ``deepspeed.initialize`` and ``deepspeed.zero.Init``; the first config that
has an ``"aidaptiv"`` section (a dict, or a JSON file) imports :mod:`aidaptiv_ds` there -- which
installs its hooks and validates the section -- before anything is built. Processes whose configs
have no such section never import aidaptiv_ds and run DeepSpeed's own classes.

``AIDAPTIV_DS_NO_AUTOINSTALL=1`` turns it off for a process (as it turns off ``import aidaptiv_ds``'s
automatic install). A failure to import aidaptiv_ds never breaks DeepSpeed: it is reported in one
line naming the fix, and DeepSpeed runs as if aidaptiv_ds were not installed.
"""
import os
import sys

SECTION = "aidaptiv"
_state = {"activated": False}


class _DeepSpeedWatcher:
    """A ``sys.meta_path`` finder for the name ``deepspeed`` only: the real finders find it, and
    :func:`_wrap_deepspeed` runs once the module has executed."""

    def find_spec(self, fullname, path=None, target=None):
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
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module, _run=run):
            _run(module)
            _wrap_deepspeed(module)

        spec.loader.exec_module = exec_module
        return spec


def has_section(config) -> bool:
    """Whether a DeepSpeed config (a dict, or the path of a JSON file) has an ``"aidaptiv"`` key.
    Whether it is enabled is for aidaptiv_ds to decide (a disabled section runs DeepSpeed's classes)."""
    if isinstance(config, dict):
        return SECTION in config
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        import json
        try:
            with open(config) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return False  # DeepSpeed reports its own config errors
        return isinstance(data, dict) and SECTION in data
    return False


def _activate_aidaptiv() -> bool:
    """Import aidaptiv_ds once (it installs its hooks, DeepSpeed being loaded). True the first time."""
    if _state["activated"]:
        return False
    _state["activated"] = True
    hooks = sys.modules.get("aidaptiv_ds.integration.hooks")
    if hooks is not None and hooks.is_installed():  # the script imported aidaptiv_ds itself: nothing to do
        return False
    try:
        import aidaptiv_ds  # noqa: F401 - installs the hooks
        from aidaptiv_ds.integration.hooks import install
        install()  # when aidaptiv_ds had been imported with AIDAPTIV_DS_NO_AUTOINSTALL unset later, or earlier
    except Exception as e:  # noqa: BLE001 - never break DeepSpeed; say what is missing instead
        print(f"aidaptiv_ds: the DeepSpeed config has an \"aidaptiv\" section but aidaptiv_ds could not be activated "
              f"({type(e).__name__}: {e}). Fix: reinstall it (pip install aidaptiv_ds) or add `import aidaptiv_ds` "
              f"to the script to see the full error.", file=sys.stderr)
        return False
    return True


def _wrap_deepspeed(deepspeed) -> None:
    """Wrap ``deepspeed.initialize`` and ``zero.Init.__init__``: a config with the section activates
    aidaptiv_ds, and the call goes through its (just installed) hooks."""
    for f in [f for f in sys.meta_path if isinstance(f, _DeepSpeedWatcher)]:
        sys.meta_path.remove(f)
    if getattr(deepspeed.initialize, "_aidaptiv_site", False):
        return
    orig_initialize = deepspeed.initialize

    def initialize(*args, **kwargs):
        config = kwargs.get("config") or kwargs.get("config_params")
        if config is None:
            a = kwargs.get("args", args[0] if args else None)
            config = getattr(a, "deepspeed_config", None) if a is not None else None
        if has_section(config) and _activate_aidaptiv():
            return deepspeed.initialize(*args, **kwargs)  # now aidaptiv_ds's wrapper, around this one
        return orig_initialize(*args, **kwargs)

    initialize.__doc__, initialize.__wrapped__, initialize._aidaptiv_site = orig_initialize.__doc__, orig_initialize, True
    deepspeed.initialize = initialize
    try:
        import deepspeed.runtime.zero.partition_parameters as pp
    except Exception:  # noqa: BLE001 - a DeepSpeed without it: aidaptiv_ds reports the version on activation
        return
    orig_init = pp.Init.__init__

    def __init__(self, *args, **kwargs):
        config = kwargs.get("config_dict_or_path", kwargs.get("config"))
        if has_section(config) and _activate_aidaptiv():
            return pp.Init.__init__(self, *args, **kwargs)
        return orig_init(self, *args, **kwargs)

    __init__.__doc__, __init__.__wrapped__, __init__._aidaptiv_site = orig_init.__doc__, orig_init, True
    pp.Init.__init__ = __init__


def activate() -> None:
    """Register the watcher (or wrap now when DeepSpeed is already loaded); no-op when opted out."""
    if os.environ.get("AIDAPTIV_DS_NO_AUTOINSTALL") == "1":
        return
    ds = sys.modules.get("deepspeed")
    if ds is not None and hasattr(ds, "initialize"):
        _wrap_deepspeed(ds)
    elif not any(isinstance(f, _DeepSpeedWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedWatcher())


activate()
