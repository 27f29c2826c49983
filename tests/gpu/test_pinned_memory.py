"""Host buffers on a CUDA machine: what ``alloc_aligned`` and the aio handle hand out is page-locked and
page-aligned, copies out of it are really asynchronous, and direct I/O works on it.

Page-locked (pinned) memory is what makes DeepSpeed's ``ds_tensor.to(device, non_blocking=True)``
(``partition_parameters.py:105-106``) an asynchronous DMA; ``O_DIRECT`` needs the page alignment.
Skipped without CUDA (tests/gpu/_cuda.py says why).
"""
from __future__ import annotations

import pytest
import torch
from _cuda import ASYNC_COPIES, GPU, delay, fill_pattern

from aidaptiv_ds.io.buffers import PAGE_BYTES, REGISTRY, alloc_aligned, cuda_pinning_available

pytestmark = GPU

SIZES = [1, 4095, 4097, (1 << 20) + 123, 64 << 20]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_alloc_aligned_pin_gives_pinned_page_aligned_memory(nbytes, dtype):
    t = alloc_aligned(nbytes, dtype=dtype, pin=True)
    assert t.device.type == "cpu" and t.dtype == dtype
    assert t.is_pinned(), "alloc_aligned(pin=True) returned pageable memory"
    assert t.data_ptr() % PAGE_BYTES == 0
    assert t.numel() * t.element_size() >= nbytes
    view = t[1:]
    assert view.is_pinned()  # views and slices of a pinned buffer are pinned (same allocation)


def test_buffers_are_pinned_by_default_when_cuda_is_visible():
    assert cuda_pinning_available()
    t = alloc_aligned(3 << 20, dtype=torch.float32)
    assert t.is_pinned() and t.data_ptr() % PAGE_BYTES == 0
    plain = alloc_aligned(3 << 20, dtype=torch.float32, pin=False)
    assert not plain.is_pinned() and plain.data_ptr() % PAGE_BYTES == 0


def test_aio_handle_buffers_are_pinned_and_recognised(tmp_path):
    from aidaptiv_ds.integration.aio_handle import AioHandle
    from aidaptiv_ds.io.engine import IOEngine

    eng = IOEngine()
    try:
        h = AioHandle(engine=eng)
        t = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.bfloat16))
        assert t.is_pinned() and t.data_ptr() % PAGE_BYTES == 0
        assert h.is_pinned(t) and h.is_pinned(t[4096:8192])
        assert not h.is_pinned(torch.empty(10, device="cuda"))  # device memory is never "pinned host"
        assert not REGISTRY.contains(torch.empty(10, device="cuda"))
        h.free_cpu_locked_tensor(t)
        assert not h.is_pinned(t)
    finally:
        eng.close()


@ASYNC_COPIES
def test_a_copy_out_of_pinned_memory_is_asynchronous():
    """The host gets control back while the copy is still queued (this is what makes reuse a hazard)."""
    buf = alloc_aligned(16 << 20, pin=True)
    fill_pattern(buf, 1)
    side = torch.cuda.Stream()
    delay(side, 200)
    with torch.cuda.stream(side):
        dev = buf.to("cuda", non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    assert not done.query(), "the copy completed before the host went on: not asynchronous"
    done.synchronize()
    assert torch.equal(dev.cpu(), buf)


def test_direct_io_into_pinned_buffers(tmp_path):
    """The engine's O_DIRECT reads and writes work on page-locked memory (where the filesystem allows it)."""
    from aidaptiv_ds.io.engine import IOEngine

    path = str(tmp_path / "f.bin")
    eng = IOEngine()
    try:
        out = alloc_aligned(8 << 20, pin=True)
        expect = fill_pattern(out, 2)
        fh = eng.open(path)
        eng.write(fh, 0, out).wait()
        back = alloc_aligned(8 << 20, pin=True)
        back.zero_()
        eng.read(fh, 0, back).wait()
        fh.close()
        assert back.is_pinned() and torch.equal(back, expect)
    finally:
        eng.close()
