"""aidaptiv_ds: a DeepSpeed ZeRO-3 backend that keeps the training state on cache SSDs.

Importing the package installs the DeepSpeed hooks (a no-op for configs without an enabled
``"aidaptiv"`` section); see :func:`aidaptiv_ds.integration.install`.
"""
__version__ = "0.1.0"
