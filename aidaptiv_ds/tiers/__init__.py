"""What lives where and when: the units the tiers move, the DRAM tier, its budget and its eviction policy."""
from .eviction import AccessOrder, EvictionPolicy
from .host_tier import HostTier
from .unit import TieredUnit, UnitLayout, UnitState, UnitStateError

__all__ = ["AccessOrder", "EvictionPolicy", "HostTier", "TieredUnit", "UnitLayout", "UnitState", "UnitStateError"]
