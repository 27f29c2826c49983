"""What lives where and when: the DRAM tier, its budget and its eviction policy."""
from .eviction import AccessOrder, EvictionPolicy
from .host_tier import HostTier, Slice

__all__ = ["AccessOrder", "EvictionPolicy", "HostTier", "Slice"]
