"""Prefetch driven by DeepSpeed's recorded access order, replacing the coordinator's NVMe prefetch.

DeepSpeed's ``__prefetch_nvme_param_partitions`` (``partitioned_param_coordinator.py:667-690``)
reads at most ``2 x`` the numel of the all-gathers in flight (one parameter when none is), passes
duplicates, and is limited by the swapper's buffer count. Ours, called at the same point (after each
module fetch, once the trace is complete):

1. records the trace (``__param_order``, the full forward + backward order) as the DRAM tier's
   access order, so eviction is by furthest next use (Belady), and the position in it;
2. reads ahead, in queue order, every parameter partition not in DRAM, as coalesced slices, while
   the bytes read ahead and not used yet fit the prefetch window (from the DRAM budget);
3. marks leading partitions ``INFLIGHT`` (published), so DeepSpeed's own all-gather prefetch, which
   stops at the first partition that is on NVMe and not available, carries on over them. With one
   rank: those whose reads have completed (``synchronize_reads`` then never waits on a read that is
   not done). With several ranks: those within ``2 x`` the numel of the all-gathers in flight, as
   DeepSpeed's own NVMe prefetch does, whether read or not: every rank must publish the same
   partitions, because the all-gathers that follow are collective (a rule based on read completion
   let ranks on drives of different speed all-gather different parameters: gloo aborted with a
   size mismatch in ``tests/test_multirank.py::test_affinity_*``).
"""
from __future__ import annotations

import torch

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
    if not queue:  # the rest of this forward is fetched already: nothing to read ahead (either swapper)
        return
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

    def ids():  # lazily: the swapper stops at the window, long before the end of the queue
        seen = set()
        for t in queue:
            p = t.param
            if p.ds_id not in seen and getattr(p, "nvme_swapper", None) is swapper:
                seen.add(p.ds_id)
                yield p.ds_id

    window = swapper.prefetch_window()
    swapper.prefetch(ids(), window)
    mine = (t.param for t in queue if getattr(t.param, "nvme_swapper", None) is swapper)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        in_flight = sum(p.ds_numel for p in _attr(coord, "inflight_param_registry"))
        swapper.promote_ready(mine, numel_limit=2 * in_flight)
    else:
        swapper.promote_ready(mine)


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
