"""Capacity planning: model sizes, the capacity plan, residency, and the budgets and prefetch derived from them."""
