"""Where bytes live: slab files on cache paths, extents, striping, checksums, the endurance ledger."""
from .allocator import ExtentAllocator, OutOfSpace
from .layout import CachePathError, Namespace, StoreInUseError, list_namespaces
from .ledger import EnduranceLedger, EnduranceRating, LedgerWarning, projection
from .store import Extent, PathSpec, SlabStore
from .striping import StripeLayout

__all__ = ["ExtentAllocator", "OutOfSpace", "CachePathError", "Namespace", "StoreInUseError", "list_namespaces",
           "EnduranceLedger", "EnduranceRating", "LedgerWarning", "projection", "Extent", "PathSpec", "SlabStore",
           "StripeLayout"]
