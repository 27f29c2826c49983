"""aidaptiv_ds: a DeepSpeed ZeRO-3 backend that keeps the training state on cache SSDs.

``import aidaptiv_ds`` installs the DeepSpeed hooks (at once if DeepSpeed is imported, otherwise
when it is); they change nothing for configs without an enabled ``"aidaptiv"`` section. See
:func:`aidaptiv_ds.integration.install` and the README.
"""
__version__ = "0.1.0"

from ._autoload import activate as _activate

_activate()
