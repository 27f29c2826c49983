"""Does a plan wear its cache drives out faster than their rating allows, and what would not.

A plan fits when the state fits the tiers; it can still write the drives faster than their rated
drive writes per day (DWPD) allow, and then the warranty's TBW is used up in days instead of years.
:func:`assess_wear` says so, and what brings the pace within the rating, each change re-planned
with :func:`~aidaptiv_ds.planner.plan.make_plan` (nothing is assumed to help that the plan does not
show helping):

* the pace itself: the longest step the rating allows (``w / (rated_dwpd x capacity / 86 400 s)``
  for the drive written most per step). At the plan's *lower-bound* pace (no ``--gpu-tflops``, no
  measured ``--step-time``) an I/O-bound step writes the drives flat out, so the DWPD is the write
  rate x 86 400 / capacity whatever the bytes per step; a measured step time is what tells;
* more DRAM (the ``auto`` budget grows with it; an explicit ``--dram-budget`` is raised instead):
  fewer bytes written per step;
* a larger gradient accumulation: the same writes per optimizer step over more micro-steps (helps
  once compute or the reads bound the step);
* more drives like the last: the writes spread over more drives (helps once the step is not
  bound by the writes).

Formulas of DWPD and TBW: :func:`aidaptiv_ds.store.ledger.projection` (JEDEC JESD218).
"""
from __future__ import annotations

import dataclasses
import math

from ..store.ledger import SECONDS_PER_DAY

#: the DRAM steps tried (per node), as the capacity check's "more DRAM" change
DRAM_STEP = 64 * 10 ** 9
#: at most this many DRAM steps, gradient-accumulation doublings and added drives are tried
MAX_DRAM_STEPS = 1024
MAX_GA = 1024
MAX_MORE_DRIVES = 8


def worst_drive(plan) -> dict:
    """The drive of ``plan`` (a :class:`~aidaptiv_ds.planner.plan.CapacityPlan`) with the highest DWPD
    against its rating: ``{"index", "dwpd", "rated_dwpd", "days_to_rated_tbw", "ratio"}`` (``ratio`` =
    DWPD / rated DWPD)."""
    best = None
    for i, d in enumerate(plan.drives):
        e = d.endurance
        ratio = e["dwpd"] / e["rated_dwpd"] if e["rated_dwpd"] else math.inf
        if best is None or ratio > best["ratio"]:
            best = {"index": i, "dwpd": e["dwpd"], "rated_dwpd": e["rated_dwpd"],
                    "days_to_rated_tbw": e["days_to_rated_tbw"], "ratio": ratio}
    return best or {"index": None, "dwpd": 0.0, "rated_dwpd": None, "days_to_rated_tbw": math.inf, "ratio": 0.0}


def rating_step_s(plan) -> float:
    """Seconds per optimizer step at which no drive of ``plan`` exceeds its rated DWPD (0 without writes)."""
    out = 0.0
    for d in plan.drives:
        allowed_per_day = d.endurance["rated_dwpd"] * d.capacity
        if d.write_bytes_per_step and allowed_per_day:
            out = max(out, d.write_bytes_per_step * SECONDS_PER_DAY / allowed_per_day)
    return out


def _within(plan) -> bool:
    return worst_drive(plan)["ratio"] <= 1.0


def _first_within(candidates, make):
    """The first ``(value, plan)`` of ``candidates`` whose plan is within the rating, else ``(None, last plan)``."""
    last = None
    for v in candidates:
        last = make(v)
        if _within(last):
            return v, last
    return None, last


def assess_wear(inp, plan, make_plan) -> dict:
    """The wear verdict of ``plan`` (made from ``inp``, a :class:`~aidaptiv_ds.planner.plan.PlanInput`).

    ``make_plan(inp)`` re-plans a changed input (the caller passes the planner's own, without a wear
    assessment of its own).

    Returns:
        ``{"exceeds", "dwpd", "rated_dwpd", "days_to_rated_tbw", "ratio", "rating_assumed",
        "pace_source", "rating_step_s", "changes": [{"change", "dwpd", "rated_dwpd", "within"}]}``:
        ``exceeds`` when the worst drive's DWPD at the plan's pace is above its rating; ``changes`` (only
        then) one entry per kind of change tried, the smallest of its kind that brings the pace within
        the rating, or the largest tried and the DWPD it leaves (``within`` False).
    """
    w = worst_drive(plan)
    out = {**w, "exceeds": w["ratio"] > 1.0, "rating_assumed": any("rated DWPD" in a for a in inp.assumed),
           "pace_source": plan.step_time["pace_source"], "rating_step_s": rating_step_s(plan), "changes": []}
    out.pop("index")
    if not out["exceeds"]:
        return out
    r = dataclasses.replace
    changes = out["changes"]

    def entry(text: str, p, within: bool) -> None:
        ww = worst_drive(p)
        changes.append({"change": text, "dwpd": ww["dwpd"], "rated_dwpd": ww["rated_dwpd"], "within": within})

    # more DRAM: the auto budget grows with the host; an explicit budget is raised with it
    def with_dram(k: int):
        extra = k * DRAM_STEP
        budget = None if inp.dram_budget is None else inp.dram_budget + extra
        return make_plan(r(inp, dram=inp.dram + extra, dram_budget=budget))
    k, p = _bisect(with_dram, MAX_DRAM_STEPS)
    if k is not None:
        dram = _dec(inp.dram + k * DRAM_STEP)
        what = (f"a DRAM budget of {_dec(inp.dram_budget + k * DRAM_STEP)} per node (DRAM {dram})"
                if inp.dram_budget is not None else
                f"{dram} of DRAM per node (the auto budget grows to {_dec(p.dram['budget_bytes'])})")
        entry(what + f", {_dec(p.per_step['write_bytes'])} written per step", p, True)
    else:
        entry(f"{_dec(inp.dram + MAX_DRAM_STEPS * DRAM_STEP)} of DRAM per node", p, False)
    measured = inp.step_time_s is not None

    def bound(p) -> str:
        return "at the measured step time" if measured else \
            f"the step bound by {p.step_time['bound_by']}, {_secs(p.step_time['pace_s'])}"

    # gradient accumulation; a measured step time is taken to grow with the micro-steps (compute-bound)
    ga, p = _first_within([inp.grad_accum * 2 ** i for i in range(1, 11) if inp.grad_accum * 2 ** i <= MAX_GA],
                          lambda g: make_plan(r(inp, grad_accum=g, step_time_s=inp.step_time_s * g / inp.grad_accum
                                                if measured else None)))
    if p is not None:
        g = p.inputs["grad_accum"]
        grows = f" x {g // inp.grad_accum}, if it grows with the micro-steps)" if measured else ")"
        entry(f"gradient accumulation {g} ({bound(p)}{grows}", p, ga is not None)
    # more drives like the last one
    d0 = inp.drives[-1]
    n, p = _first_within(range(1, MAX_MORE_DRIVES + 1), lambda n: make_plan(
        r(inp, drives=inp.drives + [dataclasses.replace(d0, path=None, free=None)] * n)))
    k = n if n is not None else MAX_MORE_DRIVES
    entry(f"{k} more cache drive{'s' if k > 1 else ''} of {_dec(d0.capacity)} ({len(inp.drives) + k} in all; "
          f"{bound(p)}" + ("" if n is not None or measured else ": faster writes, the same bytes per drive per day")
          + ")", p, n is not None)
    return out


def _bisect(make, hi: int):
    """The smallest ``k`` in ``1..hi`` whose plan ``make(k)`` is within the rating (the DWPD falls as
    ``k`` grows), and its plan; ``(None, make(hi))`` when even ``hi`` is not."""
    top = make(hi)
    if not _within(top):
        return None, top
    lo, best = 0, (hi, top)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = make(mid)
        if _within(p):
            hi, best = mid, (mid, p)
        else:
            lo = mid
    return best


def _dec(n: float) -> str:
    from ..units import format_bytes

    return format_bytes(n, decimal=True)


def _secs(x: float) -> str:
    if x < 600:
        return f"{x:,.1f} s"
    return f"{x / 60:,.1f} min" if x < 7200 else f"{x / 3600:,.1f} h"


def describe(wear: dict) -> list[str]:
    """The verdict's wear lines for people (empty when the pace is within the rating)."""
    if not wear["exceeds"]:
        return []
    lines = [f"  the rated {wear['rated_dwpd']:g} DWPD allows one step every {_secs(wear['rating_step_s'])} or longer"
             + (" (the plan's pace is its lower bound: with the compute unknown an I/O-bound step writes the drives "
                "flat out; give --gpu-tflops or the measured --step-time)" if wear["pace_source"] == "lower bound"
                else "")]
    ok = [c for c in wear["changes"] if c["within"]]
    if ok:
        lines.append("  within the rating with any one of:")
        lines += [f"    - {c['change']} ({c['dwpd']:.2f} DWPD)" for c in ok]
    lines += [f"  not enough alone: {c['change']} ({c['dwpd']:.2f} DWPD)" for c in wear["changes"] if not c["within"]]
    return lines


__all__ = ["assess_wear", "describe", "rating_step_s", "worst_drive"]
