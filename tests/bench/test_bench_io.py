"""pytest-benchmark suite of the storage core (not timed tests: nothing here asserts a speed).

Run for numbers:  python -m pytest tests/bench -m benchmark --benchmark-enable
Environment: AIDAPTIV_BENCH_DIR (default: pytest's tmp dir, i.e. under /tmp), AIDAPTIV_BENCH_SIZE
(bytes moved per round, default 256MiB). With the project's default --benchmark-disable each case
runs once, as a smoke test. GB/s of each case is in its ``extra_info``.
"""
from __future__ import annotations

import os

import pytest
import torch

from aidaptiv_ds.io import IOEngine, alloc_aligned
from aidaptiv_ds.io.engine import READ_DEMAND, WRITE_BACK
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore
from aidaptiv_ds.units import parse_size

pytestmark = pytest.mark.benchmark
MiB = 1 << 20
THREADS = 4
DEPTH = 8


@pytest.fixture(scope="module")
def SIZE(request):
    """Bytes per round: AIDAPTIV_BENCH_SIZE, default 256 MiB; 32 MiB when benchmarks are disabled (smoke run)."""
    if "AIDAPTIV_BENCH_SIZE" in os.environ:
        return parse_size(os.environ["AIDAPTIV_BENCH_SIZE"])
    cfg = request.config
    disabled = cfg.getoption("benchmark_disable", False) and not cfg.getoption("benchmark_enable", False)
    return 32 * MiB if disabled else 256 * MiB


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    base = os.environ.get("AIDAPTIV_BENCH_DIR")
    if base:
        d = os.path.join(base, f"aidaptiv-bench-{os.getpid()}")
        os.makedirs(d, exist_ok=True)
        return d
    return str(tmp_path_factory.mktemp("bench"))


@pytest.fixture(scope="module")
def engine_file(bench_dir, SIZE):
    eng = IOEngine(threads_per_drive=THREADS)
    fh = eng.open(os.path.join(bench_dir, "engine.bin"))
    bufs = [alloc_aligned(8 * MiB) for _ in range(DEPTH)]
    for b in bufs:
        b.random_(0, 256)
    _pass(eng, fh, True, 8 * MiB, bufs, SIZE)           # write every block once before reading
    yield eng, fh, bufs
    fh.close()
    eng.close()
    os.unlink(fh.path)


def _pass(eng, fh, write, block, bufs, size):
    futs = [None] * len(bufs)
    for i in range(size // block):
        k = i % len(bufs)
        if futs[k] is not None:
            futs[k].wait()
        buf = bufs[k][:block]
        futs[k] = eng.write(fh, i * block, buf, WRITE_BACK) if write else eng.read(fh, i * block, buf, READ_DEMAND)
    for f in futs:
        if f is not None:
            f.wait()


def _check_blocks(path, write, block, bufs, size):
    """The bytes the last pass moved, read back through the page cache on a separate descriptor: after a
    write every block of the file holds the buffer it was written from; after a read each buffer holds
    the file block it read last."""
    n = size // block
    fd = os.open(path, os.O_RDONLY)
    try:
        last = range(max(n - len(bufs), 0), n)
        for i in (list(range(min(n, len(bufs)))) if write else []) + list(last):
            disk = os.pread(fd, block, i * block)
            assert disk == bufs[i % len(bufs)][:block].numpy().tobytes(), f"block {i} of {n} ({block} bytes)"
    finally:
        os.close(fd)


@pytest.mark.parametrize("block", [MiB, 8 * MiB], ids=["1MiB", "8MiB"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_engine_sequential(benchmark, engine_file, SIZE, op, block):
    eng, fh, bufs = engine_file
    benchmark.group = f"engine {op}"
    benchmark.extra_info.update(bytes=SIZE, block=block, threads=THREADS, in_flight=DEPTH)
    benchmark.pedantic(_pass, args=(eng, fh, op == "write", block, bufs, SIZE), rounds=3, iterations=1, warmup_rounds=0)
    _check_blocks(fh.path, op == "write", block, bufs, SIZE)
    if benchmark.stats is not None:
        benchmark.extra_info["gbps"] = SIZE / benchmark.stats.stats.median / 1e9


@pytest.fixture(scope="module")
def striped_store(bench_dir, SIZE):
    dirs = []
    for i in range(3):
        d = os.path.join(bench_dir, f"path{i}")
        os.makedirs(d, exist_ok=True)
        dirs.append(d)
    eng = IOEngine(threads_per_drive=THREADS)
    st = SlabStore(Namespace(dirs, "bench", 0), [PathSpec(d, weight=w, capacity=4 * SIZE) for d, w in
                                                 zip(dirs, [2, 1, 1])], engine=eng)
    yield st
    st.close()
    eng.close()


@pytest.mark.parametrize("op", ["put", "get"])
def test_store_striped(benchmark, striped_store, SIZE, op):
    """SIZE bytes as 16 MiB bf16 tensors, all in flight, striped 2:1:1 over 3 paths."""
    n = max(SIZE // (16 * MiB), 1)
    src = [torch.randn(8 * MiB).to(torch.bfloat16) for _ in range(min(n, 4))]
    for i in range(n):
        striped_store.put(f"t{i}", src[i % len(src)]).wait()
    outs = [torch.empty(8 * MiB, dtype=torch.bfloat16) for _ in range(n)]

    def run():
        if op == "put":
            futs = [striped_store.put(f"t{i}", src[i % len(src)]) for i in range(n)]
        else:
            futs = [striped_store.get(f"t{i}", outs[i]) for i in range(n)]
        for f in futs:
            f.wait()

    benchmark.group = "store striped"
    benchmark.extra_info.update(bytes=n * 16 * MiB, tensors=n)
    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=0)
    if op == "get":
        assert torch.equal(outs[0], src[0])
    if benchmark.stats is not None:
        benchmark.extra_info["gbps"] = n * 16 * MiB / benchmark.stats.stats.median / 1e9
