"""The DeepSpeed aio_handle adapter: the contract of docs/deepspeed-seams.md section 3, registration without
any compilation, and DeepSpeed 0.19.8's own ZeRO-3 NVMe swappers training through it."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from _storage_helpers import REPO, child_env, free_port, rand_tensor, same_bytes
from aidaptiv_ds.io import REGISTRY, IOEngine, StorageIOError
from aidaptiv_ds.integration.aio_handle import AioHandle, make_op_module
from aidaptiv_ds.io.buffers import PAGE_BYTES


@pytest.fixture
def engine():
    eng = IOEngine()
    yield eng
    eng.close()


def _handle(engine, **kw):
    args = dict(block_size=1 << 20, queue_depth=8, single_submit=False, overlap_events=True, intra_op_parallelism=1)
    args.update(kw)
    return AioHandle(engine=engine, **args)


def test_constructor_takes_deepspeed_keywords_and_getters_echo_them(engine):
    h = _handle(engine, block_size=2 << 20, queue_depth=16, single_submit=True, overlap_events=False,
                intra_op_parallelism=2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (2 << 20, 16, True, False, 2)
    assert h.get_alignment() == 1024
    assert make_op_module().aio_handle is AioHandle


def test_wait_counts_per_handle_across_interleaved_handles(tmp_path, engine):
    h1, h2 = _handle(engine), _handle(engine)
    ex = torch.empty(0, dtype=torch.float32)
    bufs = [h1.new_cpu_locked_tensor(1 << 16, ex) for _ in range(8)]
    for i, b in enumerate(bufs):
        b.copy_(rand_tensor(1 << 16, torch.float32, seed=i))
    paths = [str(tmp_path / f"t{i}.swp") for i in range(8)]
    # interleave: h1 gets writes 0,2,4 ; h2 gets 1,3,5,6,7
    for i in range(8):
        h = h1 if i in (0, 2, 4) else h2
        assert h.async_pwrite(bufs[i], paths[i]) == 0
    assert h2.wait() == 5
    assert h1.wait() == 3
    assert h1.wait() == 0 and h2.wait() == 0
    outs = [h2.new_cpu_locked_tensor(1 << 16, ex) for _ in range(8)]
    for i in range(8):
        assert (h1 if i % 2 else h2).async_pread(outs[i], paths[i]) == 0
    assert h2.async_pwrite(bufs[0], str(tmp_path / "extra.swp"), 0) == 0
    assert h1.wait() == 4 and h2.wait() == 5
    assert all(same_bytes(a, b) for a, b in zip(outs, bufs))


def test_write_creates_0600_without_truncating_and_honours_offsets(tmp_path, engine):
    h = _handle(engine)
    p = str(tmp_path / "param.swp")
    ex = torch.empty(0, dtype=torch.bfloat16)
    a = h.new_cpu_locked_tensor(4096, ex)
    a.copy_(rand_tensor(4096, torch.bfloat16, 1))
    b = h.new_cpu_locked_tensor(2048, ex)
    b.copy_(rand_tensor(2048, torch.bfloat16, 2))
    h.async_pwrite(a, p)
    h.wait()
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    h.async_pwrite(b, p, 4096)   # second half of the file (byte offset); the rest must survive (no O_TRUNC)
    h.async_pwrite(b[:512], p, 0)
    assert h.wait() == 2
    assert os.path.getsize(p) == 8192
    back = h.new_cpu_locked_tensor(4096, ex)
    h.async_pread(back, p)
    h.wait()
    assert same_bytes(back[:512], b[:512]) and same_bytes(back[512:2048], a[512:2048])
    assert same_bytes(back[2048:], b)


def test_views_and_slices_of_pool_buffers_read_and_write_at_unaligned_addresses(tmp_path, engine):
    """DeepSpeed's SwapBufferPool hands out slices at multiples of 1024 x intra_op_parallelism bytes."""
    h = _handle(engine)
    pool = h.new_cpu_locked_tensor(3 * 256 + 100, torch.empty(0, dtype=torch.float32))
    src = rand_tensor(pool.numel(), torch.float32, 5)
    pool.copy_(src)
    p = str(tmp_path / "opt.swp")
    h.async_pwrite(pool.narrow(0, 256, 512), p)        # starts 1 KiB into the pool: not page aligned
    h.wait()
    back = torch.zeros_like(pool)
    h.async_pread(back.narrow(0, 256, 512), p)
    h.wait()
    assert same_bytes(back[256:768], src[256:768]) and not back[:256].any()


def test_read_beyond_the_end_of_a_file_is_refused_with_path(tmp_path, engine):
    h = _handle(engine)
    p = str(tmp_path / "short.swp")
    with open(p, "wb") as f:
        f.write(b"\0" * 4096)
    buf = h.new_cpu_locked_tensor(2048, torch.empty(0, dtype=torch.float32))
    with pytest.raises(StorageIOError, match=str(p)):
        h.async_pread(buf, p)
    with pytest.raises(StorageIOError, match="missing"):
        h.async_pread(buf, str(tmp_path / "missing.swp"))
    assert h.wait() == 0


def test_is_pinned_ranges_views_slices_and_free(engine):
    h1, h2 = _handle(engine), _handle(engine)
    t = h1.new_cpu_locked_tensor(10_000, torch.empty(0, dtype=torch.float16))
    assert t.dtype == torch.float16 and t.dim() == 1 and t.numel() == 10_000
    assert t.data_ptr() % PAGE_BYTES == 0
    for v in (t, t[5:], t[100:200], t.narrow(0, 9_990, 10), t.view(torch.uint8), t[:1024].view(32, 32),
              t[1:].view(torch.int8)[3:7], t[::2]):
        assert h1.is_pinned(v) and h2.is_pinned(v)         # range check, across handles
    assert not h1.is_pinned(torch.empty(10_000, dtype=torch.float16))
    assert not h1.is_pinned(torch.empty(0))
    plain = torch.empty(2 << 20, dtype=torch.uint8)
    assert not h1.is_pinned(plain[4096:8192])
    n = len(REGISTRY)
    assert h1.free_cpu_locked_tensor(t) is True
    assert len(REGISTRY) == n - 1 and not h1.is_pinned(t[5:])
    assert h1.free_cpu_locked_tensor(t) is False


def test_write_error_surfaces_at_wait_never_success(tmp_path):
    from aidaptiv_ds.io.syscalls import FaultRule, FaultyIO
    eng = IOEngine(sysio=FaultyIO([FaultRule("write", path_contains="bad", offset_min=4096, count=-1)]),
                   max_retries=1, retry_delay_s=0.001, block_size=4096)
    try:
        h = _handle(eng)
        buf = h.new_cpu_locked_tensor(3 * 1024, torch.empty(0, dtype=torch.float32))
        h.async_pwrite(buf, str(tmp_path / "good.swp"))
        h.async_pwrite(buf, str(tmp_path / "bad.swp"))
        with pytest.raises(StorageIOError) as ei:
            h.wait()
        assert ei.value.path == str(tmp_path / "bad.swp") and ei.value.offset in (4096, 8192)
        assert h.wait() == 0      # the failed batch is not counted again
    finally:
        eng.close()


_ZERO3 = r"""
import json, os, sys, torch
MODE = os.environ["MODE"]
import deepspeed
from deepspeed.ops.op_builder.builder import OpBuilder
_jit = OpBuilder.jit_load
def no_build(self, *a, **k):
    if self.name in ("async_io", "pin_memory", "gds"):
        raise AssertionError(f"DeepSpeed tried to compile {self.name}")
    return _jit(self, *a, **k)
OpBuilder.jit_load = no_build
calls = {"init": 0, "async_pwrite": 0, "async_pread": 0, "wait": 0}
registered = None
if MODE == "nvme":
    from aidaptiv_ds.integration.aio_handle import AioHandle, register_with_deepspeed
    register_with_deepspeed()
    from deepspeed.ops.op_builder import AsyncIOBuilder
    registered = AsyncIOBuilder().load().aio_handle is AioHandle
    for name in list(calls):
        orig = getattr(AioHandle, "__init__" if name == "init" else name)
        def wrap(self, *a, _o=orig, _n=name, **k):
            calls[_n] += 1
            return _o(self, *a, **k)
        setattr(AioHandle, "__init__" if name == "init" else name, wrap)
work = os.environ["WORK"]
off_p = {"device": "nvme", "nvme_path": work, "buffer_count": 6, "buffer_size": 1100000, "max_in_cpu": 0,
         "pin_memory": True} if MODE == "nvme" else {"device": "cpu"}
off_o = {"device": "nvme", "nvme_path": work, "buffer_count": 4, "pin_memory": True} if MODE == "nvme" \
    else {"device": "cpu"}
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
       "bf16": {"enabled": True},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
       "zero_optimization": {"stage": 3, "sub_group_size": 1100000, "stage3_param_persistence_threshold": 0,
                             "stage3_prefetch_bucket_size": 2000000, "stage3_max_live_parameters": 3000000,
                             "offload_param": off_p, "offload_optimizer": off_o},
       "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
               "overlap_events": True}}

class Net(torch.nn.Module):
    def __init__(self, n=4, d=1024):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(d, d, bias=False) for _ in range(n)])
    def forward(self, x):
        for l in self.layers:
            x = torch.relu(l(x))
        return x.pow(2).mean()

torch.manual_seed(0)
m = Net()
engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(123)).to(torch.bfloat16)
losses = []
for _ in range(3):
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    losses.append(float(loss))
with torch.no_grad():
    losses.append(float(engine(x)))
swp = sorted(os.path.relpath(os.path.join(r, f), work) for r, _, fs in os.walk(work) for f in fs)
print("RESULT " + json.dumps({"losses": losses, "calls": calls, "swap_files": swp, "registered": registered,
      "opt_swapper": type(engine.optimizer.optimizer_swapper).__name__,
      "param_swapper": type(next(engine.module.parameters()).nvme_swapper).__name__
      if hasattr(next(engine.module.parameters()), "nvme_swapper") else None}))
"""


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    """The same tiny ZeRO-3 model trained 3 steps twice, in two fresh processes run side by side:
    NVMe offload through our registered handle, and DeepSpeed's CPU offload (the oracle)."""
    tmp = tmp_path_factory.mktemp("zero3")
    script = tmp / "zero3.py"
    script.write_text(_ZERO3)
    procs = {}
    for mode in ("nvme", "cpu"):
        work = tmp / f"work_{mode}"
        work.mkdir()
        env = child_env(MODE=mode, WORK=str(work), RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=free_port())
        procs[mode] = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    res = {}
    for mode, p in procs.items():
        out, err = p.communicate(timeout=600)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"{mode} run failed (rc {p.returncode}):\n{out[-3000:]}\n{err[-6000:]}"
        res[mode] = json.loads(lines[-1][len("RESULT "):])
    return res


@pytest.mark.subprocess
def test_register_with_deepspeed_replaces_async_io_without_building(zero3_runs):
    """After register_with_deepspeed(), AsyncIOBuilder().load().aio_handle is AioHandle; the child
    patched OpBuilder.jit_load to fail for async_io/pin_memory, so nothing was (or could be) compiled."""
    assert zero3_runs["nvme"]["registered"] is True


@pytest.mark.subprocess
def test_deepspeed_zero3_nvme_swappers_train_through_our_handle(zero3_runs):
    """DeepSpeed's own AsyncPartitionedParameterSwapper + PartitionedOptimizerSwapper, bf16, 3 steps,
    nothing compiled; losses bit-identical to DeepSpeed's CPU offload of the same model."""
    nv, cpu = zero3_runs["nvme"], zero3_runs["cpu"]
    assert nv["opt_swapper"] == "PartitionedOptimizerSwapper"
    assert nv["param_swapper"] == "AsyncPartitionedParameterSwapper"
    c = nv["calls"]
    assert c["init"] >= 2 and c["async_pwrite"] > 0 and c["async_pread"] > 0 and c["wait"] > 0
    assert any(f.endswith(".swp") for f in nv["swap_files"]), nv["swap_files"]
    assert nv["losses"] == cpu["losses"], (nv["losses"], cpu["losses"])
    assert nv["losses"][-1] < nv["losses"][0]
