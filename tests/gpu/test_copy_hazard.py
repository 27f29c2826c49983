"""The host-to-device copy hazard: a host buffer is never reused while a non-blocking copy out of it is
pending (``docs/deepspeed-seams.md`` §1.5, "World size 1 and async copies").

With one rank DeepSpeed gathers a partition as ``ds_tensor.data.to(device, non_blocking=True)`` on its
all-gather stream (``partition_parameters.py:105-106``) and synchronizes only in ``wait()``; the
coordinator may release the swap buffers right after launching it (``partitioned_param_coordinator.py:
615-620``). aidaptiv_ds never recycles a host buffer by hand: a released slice's buffer goes back to
torch's pinned allocator, which hands a block out again only once the copies recorded on it are done.

Each test holds the copy back behind a GPU busy-wait on the copy's stream, so the host acts (release,
evict, write new content, allocate and fill new buffers) while the copy is certainly still pending,
then checks that the device holds the bytes the buffer had when the copy was issued. The first test
is the control: reusing a buffer by hand *does* show up in the device copy, so the check can fail.
Run with ``CUDA_LAUNCH_BLOCKING=0`` (the default); skipped without CUDA.
"""
from __future__ import annotations

import gc

import pytest
import torch
from _cuda import ASYNC_COPIES, GPU, delay, fill_pattern

from aidaptiv_ds.io.buffers import alloc_aligned

pytestmark = [*GPU, ASYNC_COPIES]

DELAY_MS = 300.0


def _pending_copy(buf: torch.Tensor, stream: torch.cuda.Stream) -> tuple[torch.Tensor, torch.cuda.Event]:
    """``buf.to(cuda, non_blocking=True)`` queued on ``stream`` behind a busy-wait; the copy and its event."""
    delay(stream, DELAY_MS)
    with torch.cuda.stream(stream):
        dev = buf.to("cuda", non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    assert not done.query(), "the copy finished before the host went on: the check would prove nothing"
    return dev, done


def test_control_a_buffer_reused_by_hand_corrupts_the_pending_copy():
    buf = alloc_aligned(32 << 20, pin=True)
    fill_pattern(buf, 1)
    dev, done = _pending_copy(buf, torch.cuda.Stream())
    second = fill_pattern(buf, 2)  # what recycling a buffer by hand does
    done.synchronize()
    assert torch.equal(dev.cpu().view(torch.uint8), second), \
        "the device copy kept the first bytes although the buffer was overwritten before the copy ran: " \
        "this check cannot see the hazard on this machine"


@pytest.mark.parametrize("nbytes", [4096, (1 << 20) + 123, 64 << 20])
def test_a_freed_pinned_buffer_is_not_handed_out_while_a_copy_from_it_is_pending(nbytes):
    buf = alloc_aligned(nbytes, pin=True)
    first = fill_pattern(buf, 3)
    old_ptr = buf.data_ptr()
    dev, done = _pending_copy(buf, torch.cuda.Stream())
    del buf
    gc.collect()
    fresh = [alloc_aligned(nbytes, pin=True) for _ in range(4)]  # the same size class, filled at once
    for i, t in enumerate(fresh):
        fill_pattern(t, 10 + i)
    done.synchronize()
    assert torch.equal(dev.cpu().view(torch.uint8)[:first.numel()], first), \
        "the pending copy saw bytes written into a buffer allocated after the source was freed"
    assert all(t.data_ptr() != old_ptr for t in fresh), "the source block was handed out while still in use"


# ---------------------------------------------------------------------------- through the parameter swapper
def _swapper(tmp_path, budget):
    from aidaptiv_ds.integration.config import parse_section
    from aidaptiv_ds.integration.param_swapper import AidaptivParamSwapper
    from aidaptiv_ds.integration.runtime import Runtime

    cfg = parse_section({"enabled": True, "cache_paths": [str(tmp_path)], "dram_budget": budget,
                         "run_name": "hazard", "io": {"direct": False}})
    rt = Runtime(cfg)
    rt.param_swapper = AidaptivParamSwapper(rt)
    return rt


def _param(sw, ds_id: int, values: torch.Tensor):
    """A first partition as ``partition_parameters.py:1820-1893`` makes it (see test_param_swapper_unit.py)."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus as S

    p = torch.nn.Parameter(torch.empty(0, dtype=values.dtype), requires_grad=False)
    p.ds_id, p.ds_numel = ds_id, values.numel()
    buf = sw.get_buffer(p, values.numel())
    buf.copy_(values)
    p.ds_tensor = buf
    p.ds_tensor.ds_numel = values.numel()
    p.ds_tensor.status = S.AVAILABLE
    sw.swap_out_and_release([p])
    return p


@pytest.mark.parametrize("placement", [
    "budget0",
    "cached",
    pytest.param("resident", marks=pytest.mark.xfail(strict=True, reason=(
        "resident parameters take the step's new content in place (param_swapper._write copies into the "
        "resident slice): safe in DeepSpeed's flow only because no gather copy is in flight at the optimizer "
        "step; a strict xfail, so a change of that behaviour shows"))),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_released_partition_keeps_its_bytes_until_the_gather_copy_ran(tmp_path, placement, dtype):
    """DeepSpeed's world-size-1 gather, then at once: release, the step's new content for the same
    partition, swap-ins of others and of the new content, host writes into the new buffers. The device
    copy holds the old bytes. budget0: the released slice leaves the tier at once; cached: the tier
    keeps it (a budget larger than the partitions); resident: the plan keeps the parameters in DRAM."""
    rt = _swapper(tmp_path, 0 if placement == "budget0" else "256MiB")
    sw = rt.param_swapper
    try:
        n = 4 << 20
        g = torch.Generator().manual_seed(5)
        old = torch.randn(n, generator=g).to(dtype)
        a = _param(sw, 0, old)
        others = [_param(sw, 1 + i, torch.randn(n, generator=g).to(dtype)) for i in range(3)]
        if placement == "resident":
            sw.make_resident()
        sw.swap_in([a], async_op=False)
        src = a.ds_tensor.data
        assert src.is_pinned(), "a swapped-in partition is in pageable memory: its gather copy is not asynchronous"
        dev, done = _pending_copy(src, torch.cuda.Stream())  # partition_parameters.py:105-106
        del src
        sw.remove_partition_and_release_buffers([a])  # the coordinator's release (:615-620)
        new = torch.randn(n, generator=g)  # fp32 master weights after a step
        sw.swap_out_partitioned_params([a], [new])  # stage3.py:1289, the per-step parameter write
        sw.synchronize_writes()
        sw.swap_in(others, async_op=False)  # fresh slices, filled from the store while the copy waits
        for p in others:
            p.ds_tensor.data.add_(1)  # host writes into the new buffers
        sw.swap_in([a], async_op=False)
        assert torch.equal(a.ds_tensor.data, new.to(dtype))
        done.synchronize()
        assert torch.equal(dev.cpu(), old), "the gather copy saw bytes written after the partition was released"
    finally:
        rt.close()
