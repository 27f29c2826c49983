"""The DeepSpeed adapter: the only layer that touches DeepSpeed internals (``docs/deepspeed-seams.md``)."""
from .config import AidaptivConfig, AidaptivConfigError, parse_section, validate
from .hooks import SUPPORTED_DEEPSPEED, UnsupportedDeepSpeedError, install, is_installed, uninstall

__all__ = ["AidaptivConfig", "AidaptivConfigError", "parse_section", "validate", "SUPPORTED_DEEPSPEED",
           "UnsupportedDeepSpeedError", "install", "is_installed", "uninstall"]
