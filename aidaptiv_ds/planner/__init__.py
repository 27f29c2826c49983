"""Capacity planning: model sizes, the capacity plan, residency and the runtime defaults derived from them."""
