"""Process-wide I/O and memory counters, read once per optimizer step by the training loop.

The runtime that moves bytes (the aidaptiv_ds swappers) registers a *provider*, a function that
returns its cumulative counters; :func:`snapshot` merges all providers with the process's own I/O
counters from ``/proc/self/io`` (bytes that really reached the block layer, for any backend,
DeepSpeed's native NVMe offload included). All byte counts are cumulative since process start;
take differences between two snapshots for per-step figures.

A provider may also register a *settle* function: ``snapshot(settle=True)`` calls it first, so
that asynchronous work the interval started (write-back still in flight when a training step
returns) has completed, is counted, and is booked in the endurance ledger before the counters
are read. Then the interval's bytes, the ledger's and ``/proc/self/io``'s are the same bytes.

[Note: why settle instead of counting at issue.] ``/proc/self/io`` counts a write when the
kernel accepts it (an I/O thread's ``pwritev``), and the store counts it when it completes; a
write-back issued at the end of step *k* reaches either in step *k+1*. Counting at issue would
fix our figure but not the kernel's, and the ledger books completed bytes only. Waiting for the
step's own write-back at the step boundary makes all three agree per step; it costs the overlap
of that last write-back with the next step's first reads (measured in the README).

Snapshot keys (all ints unless noted):
    ``bytes_read`` / ``bytes_written``: dict tier -> bytes moved by aidaptiv_ds (tier ``"cache"``:
        the SSD slabs); empty when no provider is registered.
    ``per_path``: dict cache path -> {"bytes_read", "bytes_written"}.
    ``bytes_read_by_kind``: dict extent kind (``"opt"``, ``"grad"``, ``"params"``) -> bytes of the cache
        tier's reads for that kind of state (:func:`aidaptiv_ds.store.store.extent_kind`).
    ``dram_bytes``: bytes the DRAM tier holds now; ``dram_peak_bytes``: the most it held (both with its
        working memory: read-ahead not used yet, slices in use, write-back in flight, which the budget does
        not bound, so they are not 0 at a budget of 0).
    ``dram_budgeted_bytes`` / ``dram_budgeted_peak_bytes``: of those, what the DRAM budget books (resident
        and cached slices), now and at most; ``dram_budget_bytes``: the budget (:func:`dram_gauges`).
    ``io_wait_s`` (float): seconds the training thread waited on I/O.
    ``proc_read_bytes`` / ``proc_write_bytes``: ``/proc/self/io`` read_bytes / write_bytes.
    ``optimizer_steps``: dict path -> optimizer sub-group steps taken that way (``in_backward``,
        ``committed``, ``redone``, ``rolled_back``, ``after_backward``: see
        :class:`aidaptiv_ds.integration.backward_step.StepCounters`), and ``window_waits``: reads of a
        sub-group's state inside backward that first waited for write-backs (the in-backward window).
    ``grad_spilled_bytes``: gradient bytes written to the cache tier (part of ``bytes_written``).
    ``act_written_bytes`` / ``act_read_bytes``: a layer-major step's boundary activations written to and read
        back from the cache tier (part of ``bytes_written`` / ``bytes_read``); ``act_dram_bytes``: those taken
        from DRAM instead of read back (the budget kept them, or their write-back was still in flight). Each
        kept activation is taken once: ``act_read_bytes + act_dram_bytes`` is what the step kept, whatever the
        drive's speed.
    ``master_from_params_bytes``: fp32 master-weight bytes a step inside backward took from the parameter
        partitions backward had read instead of reading them again; ``master_demand_bytes``: those it
        still read (on demand) because no parameter slice held them any more (part of ``bytes_read``);
        ``master_held_bytes``: of ``master_from_params_bytes``, those copied from a parameter slice kept
        after backward left it, until the sub-group's slice was read.
    ``buffer_pool_bytes`` / ``buffer_pool_peak_bytes``: the host buffer pool's region and the most of it
        handed out at once (gauges; :mod:`aidaptiv_ds.io.pool`); ``buffer_pool_miss_bytes``: bytes of
        swap buffers the pool had no room for, served by fresh memory instead; ``buffer_pool_released_bytes``:
        bytes of the pool's pages given back to the OS (they are faulted in again when next used).
"""
from __future__ import annotations

import threading
from typing import Callable

#: Cumulative byte counters summed over providers (their per-interval delta is ``after - before``).
_SUMMED = ("grad_spilled_bytes", "master_from_params_bytes", "master_demand_bytes", "master_held_bytes",
           "buffer_pool_miss_bytes", "buffer_pool_released_bytes", "act_written_bytes", "act_read_bytes",
           "act_dram_bytes")
#: Gauges summed over providers and taken from the later snapshot in :func:`delta`.
_GAUGES = ("dram_bytes", "dram_peak_bytes", "dram_budgeted_bytes", "dram_budgeted_peak_bytes", "dram_budget_bytes",
           "buffer_pool_bytes", "buffer_pool_peak_bytes")


def dram_gauges(tier, budget: int) -> dict:
    """The budget's gauges of a DRAM tier (:class:`aidaptiv_ds.tiers.host_tier.HostTier`) for a provider."""
    return {"dram_budgeted_bytes": tier.budgeted_bytes(), "dram_budgeted_peak_bytes": tier.budgeted_peak_bytes,
            "dram_budget_bytes": int(budget)}

_providers: dict[str, Callable[[], dict]] = {}
_settlers: dict[str, Callable[[], None]] = {}
_lock = threading.Lock()


def register_provider(name: str, fn: Callable[[], dict], settle: Callable[[], None] | None = None) -> None:
    """Add (or replace) a counter source; ``fn()`` returns a dict with the snapshot keys it knows.

    ``settle()`` (optional) finishes the provider's asynchronous work and books it (see the module
    docstring); it may raise the error of a failed write, which then reaches the caller of
    :func:`snapshot`.
    """
    with _lock:
        _providers[name] = fn
        if settle is None:
            _settlers.pop(name, None)
        else:
            _settlers[name] = settle


def unregister_provider(name: str) -> None:
    with _lock:
        _providers.pop(name, None)
        _settlers.pop(name, None)


def settle() -> None:
    """Call every provider's settle function (write-back in flight completes and is booked)."""
    with _lock:
        settlers = list(_settlers.values())
    for fn in settlers:
        fn()


def proc_io() -> dict:
    """``read_bytes`` and ``write_bytes`` of this process from ``/proc/self/io`` (0 where unavailable)."""
    out = {"read_bytes": 0, "write_bytes": 0}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in out:
                    out[k] = int(v)
    except OSError:
        pass
    return out


def snapshot(settle_first: bool = False) -> dict:
    """Cumulative counters of every provider plus ``/proc/self/io`` (see module docstring).

    ``settle_first``: call :func:`settle` before reading, so the interval ending here holds all of
    its own asynchronous bytes.
    """
    if settle_first:
        settle()
    snap: dict = {"bytes_read": {}, "bytes_written": {}, "per_path": {}, "bytes_read_by_kind": {}, **{k: 0 for k in _GAUGES},
                  "io_wait_s": 0.0, "optimizer_steps": {}, **{k: 0 for k in _SUMMED}}
    with _lock:
        providers = list(_providers.values())
    for fn in providers:
        d = fn()
        for tier_key in ("bytes_read", "bytes_written"):
            for tier, v in d.get(tier_key, {}).items():
                snap[tier_key][tier] = snap[tier_key].get(tier, 0) + v
        for path, v in d.get("per_path", {}).items():
            cur = snap["per_path"].setdefault(path, {"bytes_read": 0, "bytes_written": 0})
            for k in cur:
                cur[k] += v.get(k, 0)
        for k in _GAUGES + ("io_wait_s",) + _SUMMED:
            snap[k] += d.get(k, 0)
        for kind, v in d.get("bytes_read_by_kind", {}).items():
            snap["bytes_read_by_kind"][kind] = snap["bytes_read_by_kind"].get(kind, 0) + v
        for k, v in d.get("optimizer_steps", {}).items():
            snap["optimizer_steps"][k] = snap["optimizer_steps"].get(k, 0) + v
    p = proc_io()
    snap["proc_read_bytes"], snap["proc_write_bytes"] = p["read_bytes"], p["write_bytes"]
    return snap


def delta(after: dict, before: dict) -> dict:
    """Per-interval figures from two snapshots (gauges ``dram_bytes``/``dram_peak_bytes`` taken from ``after``)."""
    out: dict = {}
    for k in ("bytes_read", "bytes_written"):
        out[k] = {t: after[k].get(t, 0) - before[k].get(t, 0) for t in after[k]}
    out["per_path"] = {p: {kk: v[kk] - before["per_path"].get(p, {}).get(kk, 0) for kk in v}
                       for p, v in after["per_path"].items()}
    out["io_wait_s"] = after["io_wait_s"] - before["io_wait_s"]
    out["bytes_read_by_kind"] = {k: v - before.get("bytes_read_by_kind", {}).get(k, 0)
                                 for k, v in after.get("bytes_read_by_kind", {}).items()}
    out["optimizer_steps"] = {k: v - before.get("optimizer_steps", {}).get(k, 0)
                              for k, v in after.get("optimizer_steps", {}).items()}
    for k in _SUMMED:
        out[k] = after.get(k, 0) - before.get(k, 0)
    out["proc_read_bytes"] = after["proc_read_bytes"] - before["proc_read_bytes"]
    out["proc_write_bytes"] = after["proc_write_bytes"] - before["proc_write_bytes"]
    for k in _GAUGES:
        out[k] = after.get(k, 0)
    return out
