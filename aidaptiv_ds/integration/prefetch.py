"""Prefetch driven by DeepSpeed's recorded access order, replacing the coordinator's NVMe prefetch.

DeepSpeed's ``__prefetch_nvme_param_partitions`` (``partitioned_param_coordinator.py:667-690``)
reads at most ``2 x`` the numel of the all-gathers in flight (one parameter when none is), passes
duplicates, and is limited by the swapper's buffer count. Ours, called at the same point (after each
module fetch, once the trace is complete):

1. records the trace (``__param_order``, the full forward + backward order) as the DRAM tier's
   access order, so eviction is by furthest next use (Belady), and the position in it;
2. reads ahead, in queue order, every parameter partition not in DRAM, as coalesced slices, while
   the bytes read ahead and not used yet fit the prefetch window (from the DRAM budget);
3. marks the leading partitions whose reads have completed ``INFLIGHT`` (published), so DeepSpeed's
   own all-gather prefetch, which stops at the first partition that is on NVMe and not available,
   carries on over them; ``synchronize_reads`` then never waits on a read that is not done.
"""
from __future__ import annotations

from .param_swapper import AidaptivParamSwapper

_ORIGINAL = None
_PREFIX = "_PartitionedParameterCoordinator__"


def _attr(coord, name):
    return getattr(coord, _PREFIX + name)


def prefetch_nvme_param_partitions(coord) -> None:
    """Replacement of ``PartitionedParameterCoordinator.__prefetch_nvme_param_partitions``."""
    if not coord.is_complete_trace():
        return
    queue = _attr(coord, "param_queue")
    swapper = None
    for t in queue:
        sw = getattr(t.param, "nvme_swapper", None)
        if sw is not None:
            swapper = sw
            break
    if not isinstance(swapper, AidaptivParamSwapper):
        return _ORIGINAL(coord)
    order = _attr(coord, "param_order")
    rt = swapper.rt
    if getattr(coord, "_aidaptiv_order_id", None) != id(order):
        rt.order.set_order([t.param.ds_id for t in order])
        coord._aidaptiv_order_id = id(order)
    rt.order.advance_to(len(order) - len(queue))
    ids = []
    seen = set()
    for t in queue:
        p = t.param
        if p.ds_id in seen or getattr(p, "nvme_swapper", None) is not swapper:
            continue
        seen.add(p.ds_id)
        ids.append(p.ds_id)
    if not ids:
        return
    window = swapper.prefetch_window()
    swapper.prefetch(ids, window)
    swapper.promote_ready([t.param for t in queue if getattr(t.param, "nvme_swapper", None) is swapper])


def install(coordinator_cls) -> None:
    """Put :func:`prefetch_nvme_param_partitions` on the coordinator class (idempotent)."""
    global _ORIGINAL
    name = _PREFIX + "prefetch_nvme_param_partitions"
    current = getattr(coordinator_cls, name)
    if current is prefetch_nvme_param_partitions:
        return
    _ORIGINAL = current
    setattr(coordinator_cls, name, prefetch_nvme_param_partitions)


def uninstall(coordinator_cls) -> None:
    if _ORIGINAL is not None:
        setattr(coordinator_cls, _PREFIX + "prefetch_nvme_param_partitions", _ORIGINAL)
