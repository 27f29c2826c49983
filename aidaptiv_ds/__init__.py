"""aidaptiv_ds: a DeepSpeed ZeRO-3 backend that keeps the training state on cache SSDs.

``import aidaptiv_ds`` installs the DeepSpeed hooks (at once if DeepSpeed is imported, otherwise
when it is); they change nothing for configs without an enabled ``"aidaptiv"`` section. Without the
import, the site hook installed with the package (:mod:`_aidaptiv_ds_autoload`) imports it the
first time a config with an ``"aidaptiv"`` section reaches DeepSpeed. See
:func:`aidaptiv_ds.integration.install` and the README.

Every error aidaptiv_ds raises for something a user can fix derives from :class:`AidaptivError`
(``except aidaptiv_ds.AidaptivError``); its kinds (``aidaptiv_ds.StorageFullError``,
``aidaptiv_ds.AidaptivConfigError``, ...) are listed in :mod:`aidaptiv_ds.errors`. The import stays
cheap: neither torch nor DeepSpeed is imported here, the kinds load on first access.
"""
__version__ = "0.1.0"

from ._autoload import activate as _activate
from .errors import LOCATIONS as _ERROR_LOCATIONS
from .errors import AidaptivConfigError, AidaptivError, AidaptivWarning

__all__ = ["__version__", *_ERROR_LOCATIONS]


def __getattr__(name: str):
    """``aidaptiv_ds.<ErrorName>``: the error kinds of the lower layers, imported on first access."""
    where = _ERROR_LOCATIONS.get(name)
    if where is None:
        raise AttributeError(f"module 'aidaptiv_ds' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


_activate()
