"""SlabStore: round trips of tensors (fp32/bf16/fp16/int8, 1 element .. 256 MiB, odd sizes, 64 in flight),
restart in a fresh process, extents, the owner lock, cleanup, and close() with I/O in flight."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from _storage_helpers import DTYPES, REPO, digest, make_dirs, rand_tensor, run_child, same_bytes
from aidaptiv_ds.io import IOEngine, StorageError, alloc_aligned, wait_all
from aidaptiv_ds.io.syscalls import SysIO
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore, StoreInUseError
from aidaptiv_ds.store.layout import list_namespaces

SIZES = [1, 7, 1023, 4097, 65537, (1 << 20) + 3, (5 << 20) + 1]
GiB = 1 << 30


@pytest.fixture
def engine():
    eng = IOEngine()
    yield eng
    eng.close()


def open_store(dirs, engine, run="t", weights=None, caps=None, **kw) -> SlabStore:
    weights = weights or [1.0] * len(dirs)
    caps = caps or [GiB] * len(dirs)
    ns = Namespace(dirs, run, 0)
    return SlabStore(ns, [PathSpec(d, weight=w, capacity=c) for d, w, c in zip(dirs, weights, caps)],
                     engine=engine, **kw)


@pytest.mark.parametrize("npaths", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_put_get_round_trip(tmp_path, engine, npaths, dtype):
    st = open_store(make_dirs(tmp_path, npaths), engine, weights=[3, 2, 1][:npaths], checksum=True)
    try:
        src = {n: rand_tensor(n, dtype, seed=n) for n in SIZES}
        for n, t in src.items():
            st.put(f"k{n}", t).wait()
        for n, t in src.items():
            out = torch.empty_like(t)
            assert st.get(f"k{n}", out).wait() == t.numel() * t.element_size()
            assert same_bytes(out, t), n
            assert st.extent(f"k{n}").nbytes == -(-(n * t.element_size()) // 4096) * 4096
    finally:
        st.close()


def test_shaped_tensor_and_requires_grad_round_trip(tmp_path, engine):
    st = open_store(make_dirs(tmp_path, 1), engine)
    w = torch.nn.Linear(33, 17).weight          # 2-D, requires_grad
    st.put("w", w).wait()
    out = torch.empty(17, 33)
    st.get("w", out).wait()
    assert torch.equal(out, w.detach())
    st.close()


def test_64_requests_in_flight(tmp_path, engine):
    st = open_store(make_dirs(tmp_path, 3), engine, weights=[1, 1, 2], checksum=True)
    try:
        src = [rand_tensor(((i * 104729) % (1 << 19)) + 1 + i, DTYPES[i % 4], seed=i) for i in range(64)]
        futs = [st.put(f"t{i}", t) for i, t in enumerate(src)]
        wait_all(futs)
        outs = [torch.empty_like(t) for t in src]
        futs = [st.get(f"t{i}", o) for i, o in enumerate(outs)]
        wait_all(futs)
        assert all(same_bytes(a, b) for a, b in zip(outs, src))
        # rewrite half of them while reading the other half, all in flight together
        src2 = {i: rand_tensor(src[i].numel(), src[i].dtype, seed=1000 + i) for i in range(0, 64, 2)}
        futs = [st.put(f"t{i}", t) for i, t in src2.items()]
        futs += [st.get(f"t{i}", outs[i]) for i in range(1, 64, 2)]
        wait_all(futs)
        for i in range(64):
            o = torch.empty_like(src[i])
            st.get(f"t{i}", o).wait()
            assert same_bytes(o, src2.get(i, src[i]))
    finally:
        st.close()


def test_hundreds_of_mib_round_trip(tmp_path, engine):
    """256 MiB + 1 element of int8, and tens of MiB + 1 element of fp32, bf16 and fp16 (about 400 MiB in
    all), striped 3:2:1 over 3 paths and checksummed."""
    st = open_store(make_dirs(tmp_path, 3), engine, weights=[3, 2, 1], checksum=True)
    try:
        for key, n, dt in (("big8", (256 << 20) + 1, torch.int8), ("big32", (16 << 20) + 1, torch.float32),
                           ("big16", (24 << 20) + 1, torch.bfloat16), ("half", (16 << 20) + 1, torch.float16)):
            t = rand_tensor(n, dt, seed=n)
            st.put(key, t).wait()
            out = torch.empty_like(t)
            st.get(key, out).wait()
            assert same_bytes(out, t)
            del t, out
        assert st.allocated() >= (256 + 64 + 48 + 32) << 20
    finally:
        st.close()


def test_aligned_write_and_read_inside_an_extent(tmp_path, engine):
    st = open_store(make_dirs(tmp_path, 2), engine, stripe_unit=64 << 10)
    try:
        ext = st.allocate("x", 1 << 20)
        assert st.allocate("x", 4096) == ext                     # stable placement
        a = alloc_aligned(1 << 20)
        a.copy_(rand_tensor(1 << 20, torch.uint8, 1))
        st.write("x", a).wait()
        b = alloc_aligned(8192)
        b.copy_(rand_tensor(8192, torch.uint8, 2))
        st.write("x", b, offset=12288).wait()
        out = alloc_aligned(1 << 20)
        st.read("x", out).wait()
        expect = a.clone()
        expect[12288:12288 + 8192] = b
        assert same_bytes(out, expect)
        part = alloc_aligned(4096)
        st.read("x", part, offset=(1 << 20) - 4096).wait()
        assert same_bytes(part, a[-4096:])
        with pytest.raises(ValueError):
            st.write("x", alloc_aligned(4096), offset=100)
        with pytest.raises(ValueError):
            st.read("x", alloc_aligned(8192), offset=(1 << 20) - 4096)
        with pytest.raises(KeyError):
            st.read("nope", part)
    finally:
        st.close()


def test_allocate_free_and_reuse(tmp_path, engine):
    st = open_store(make_dirs(tmp_path, 1), engine)
    try:
        a = st.allocate("a", 10_000)
        b = st.allocate("b", 4096)
        assert a.offset % 4096 == 0 and a.nbytes == 12288 and b.offset >= a.offset + a.nbytes
        bigger = st.allocate("a", 20_000)                       # grows: new extent, old one freed
        assert bigger.nbytes == 20480 and st.extent("a") == bigger
        st.free("b")
        assert st.extent("b") is None and "b" not in st.keys()
        c = st.allocate("c", 4096)
        assert c.offset in (a.offset, b.offset)                   # freed space is reused
        assert st.allocated() == 20480 + 4096
    finally:
        st.close()


_REOPEN_CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
from _storage_helpers import rand_tensor, same_bytes, digest
from aidaptiv_ds.io import IOEngine
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore
dirs = {dirs!r}
eng = IOEngine()
st = SlabStore(Namespace(dirs, "restart", 0), [PathSpec(d, weight=w, capacity=c) for d, w, c in
               zip(dirs, [3, 2, 1], [1 << 30] * 3)], engine=eng, checksum=True, keep=True)
ok = {{}}
for key, (numel, dt, seed) in {expect!r}.items():
    t = rand_tensor(numel, getattr(torch, dt), seed)
    out = torch.empty_like(t)
    st.get(key, out).wait()
    ok[key] = same_bytes(out, t)
new = rand_tensor(777_777, torch.float16, 99)
st.put("from_child", new).wait()
keys = sorted(st.keys())
st.close()
print("RESULT " + json.dumps({{"ok": ok, "keys": keys, "pid": os.getpid()}}))
"""


@pytest.mark.subprocess
def test_reopen_in_a_fresh_process(tmp_path, engine):
    dirs = make_dirs(tmp_path, 3)
    st = open_store(dirs, engine, run="restart", weights=[3, 2, 1], checksum=True, keep=True)
    expect = {}
    for i, dt in enumerate(DTYPES):
        for n in (1, 4097, (2 << 20) + 5):
            key = f"{dt}-{n}"
            expect[key] = (n, str(dt).split(".")[1], i * 10 + n)
            st.put(key, rand_tensor(n, dt, i * 10 + n))
    st.free(f"{DTYPES[0]}-1")                        # a hole in the logical space survives the restart
    expect.pop(f"{DTYPES[0]}-1")
    st.close(keep=True)                               # must finish the puts (not waited above)
    assert not st.ns.locked
    res = run_child(_REOPEN_CHILD.format(tests=os.path.join(REPO, "tests"), dirs=dirs, expect=expect))
    assert res["pid"] != os.getpid()
    assert res["ok"] == {k: True for k in expect}
    assert sorted(res["keys"]) == sorted(list(expect) + ["from_child"])
    # and back in this process: the child's write and the originals, checksums verified
    st2 = open_store(dirs, engine, run="restart", weights=[3, 2, 1], checksum=True, keep=True)
    try:
        out = torch.empty(777_777, dtype=torch.float16)
        st2.get("from_child", out).wait()
        assert same_bytes(out, rand_tensor(777_777, torch.float16, 99))
        for key, (n, dt, seed) in expect.items():
            t = rand_tensor(n, getattr(torch, dt), seed)
            o = torch.empty_like(t)
            st2.get(key, o).wait()
            assert digest(o) == digest(t)
        # new extents go into free space, not over live ones
        st2.put("new", rand_tensor(4096, torch.uint8, 5)).wait()
        live = sorted((e.offset, e.offset + e.nbytes) for e in (st2.extent(k) for k in st2.keys()))
        assert all(a[1] <= b[0] for a, b in zip(live, live[1:]))
    finally:
        st2.close(keep=False)


def test_reopen_with_other_layout_is_refused(tmp_path, engine):
    dirs = make_dirs(tmp_path, 2)
    st = open_store(dirs, engine, run="lay", weights=[1, 1], keep=True)
    st.put("a", torch.ones(10)).wait()
    st.close()
    with pytest.raises(StorageError, match="different layout"):
        open_store(dirs, engine, run="lay", weights=[2, 1], keep=True)
    st = open_store(dirs, engine, run="lay", weights=[1, 1], keep=True)   # lock released after the refusal
    st.close(keep=False)


class SlowWrites(SysIO):
    def pwritev(self, fd, bufs, offset, path):
        time.sleep(0.03)
        return super().pwritev(fd, bufs, offset, path)


@pytest.mark.parametrize("keep", [True, False])
def test_close_completes_writes_in_flight(tmp_path, keep):
    """close() must not close the slabs under queued writes (lost data, or writes into a reused fd)."""
    eng = IOEngine(sysio=SlowWrites(), threads_per_drive=2)
    dirs = make_dirs(tmp_path, 2)
    try:
        st = open_store(dirs, eng, run="inflight", keep=keep, checksum=True)
        src = [rand_tensor(50_000 + i, torch.float32, i) for i in range(16)]
        futs = [st.put(f"k{i}", t) for i, t in enumerate(src)]
        st.close()
        assert all(f.done() for f in futs)
        wait_all(futs)                                   # none failed
        if keep:
            st = open_store(dirs, eng, run="inflight", keep=True, checksum=True)
            for i, t in enumerate(src):
                o = torch.empty_like(t)
                st.get(f"k{i}", o).wait()
                assert same_bytes(o, t)
            st.close(keep=False)
    finally:
        eng.close()


@pytest.mark.subprocess
def test_second_owner_is_refused_and_a_dead_owner_leaves_no_lock(tmp_path, engine):
    dirs = make_dirs(tmp_path, 2)
    st = open_store(dirs, engine, run="own")
    code = f"""
        import json
        from aidaptiv_ds.store import Namespace, StoreInUseError
        ns = Namespace({dirs!r}, "own", 0)
        try:
            ns.acquire()
            print("RESULT " + json.dumps({{"refused": False}}))
        except StoreInUseError as e:
            print("RESULT " + json.dumps({{"refused": True, "msg": str(e)}}))
    """
    res = run_child(code)
    assert res["refused"] and str(os.getpid()) in res["msg"]
    other_rank = SlabStore(Namespace(dirs, "own", 1), [PathSpec(d, capacity=GiB) for d in dirs], engine=engine)
    other_rank.close()
    with pytest.raises(StoreInUseError):
        open_store(dirs, engine, run="own")
    st.close()
    # a process that dies holding the lock (kill -9 style) leaves a reusable namespace
    run_child(f"""
        import os
        from aidaptiv_ds.store import Namespace
        Namespace({dirs!r}, "own", 0).acquire()
        print("RESULT {{}}", flush=True)
        os._exit(0)
    """)
    st = open_store(dirs, engine, run="own")
    st.close()


def test_close_without_keep_removes_only_its_own_files(tmp_path, engine):
    dirs = make_dirs(tmp_path, 2)
    other = open_store(dirs, engine, run="other", keep=True)
    other.put("x", torch.ones(5)).wait()
    other.close()
    mine = open_store(dirs, engine, run="mine")
    mine.put("y", torch.ones(5)).wait()
    slab = mine.ns.slab_path(1)
    assert os.path.exists(slab)
    mine.close()
    assert not os.path.exists(slab) and not os.path.exists(mine.ns.run_dir(0))
    assert os.path.exists(other.ns.slab_path(0)) and os.path.exists(other.ns.index_path())
    listed = {(n["run"], n["rank"]) for n in list_namespaces(dirs[0])}
    assert listed == {("other", "rank0")}
    with pytest.raises(StorageError, match="closed"):
        mine.put("z", torch.ones(1))


def test_preflight_reserves_space_in_the_slabs(tmp_path, engine):
    dirs = make_dirs(tmp_path, 3)
    st = open_store(dirs, engine, weights=[2, 1, 1], stripe_unit=1 << 20)
    try:
        st.preflight(64 << 20)
        sizes = [os.path.getsize(s.path) for s in st.slabs]
        assert sizes[0] >= 32 << 20 and sizes[1] >= 16 << 20 and sizes[2] >= 16 << 20
        share = st.planned_share()
        assert share == pytest.approx([0.5, 0.25, 0.25])
    finally:
        st.close()


def test_index_is_json_with_the_extents(tmp_path, engine):
    dirs = make_dirs(tmp_path, 1)
    st = open_store(dirs, engine, run="idx", keep=True)
    st.put("a", torch.ones(3)).wait()
    st.close()
    with open(st.ns.index_path()) as f:
        idx = json.load(f)
    assert idx["extents"] == {"a": [0, 4096]} and idx["alignment"] == 4096
    st = open_store(dirs, engine, run="idx")
    st.close(keep=False)


def test_reads_are_counted_per_kind_of_extent(tmp_path, engine):
    """``read_bytes_by_kind``: the bytes of completed reads per extent kind (the key's first part without
    its engine number), the same bytes the per-path counters hold; writes are not counted there."""
    from aidaptiv_ds.store.store import extent_kind

    assert (extent_kind("opt0/3"), extent_kind("grad12/0"), extent_kind("params/bfloat16/c2"), extent_kind("w")) \
        == ("opt", "grad", "params", "w")
    st = open_store(make_dirs(tmp_path, 2), engine)
    try:
        for key in ("opt0/0", "opt1/0", "grad0/0"):
            st.put(key, torch.ones(3000)).wait()
        assert st.read_bytes_by_kind() == {}
        for key in ("opt0/0", "opt1/0", "grad0/0", "opt0/0"):
            buf = alloc_aligned(12288)
            st.read(key, buf).wait()
        assert st.read_bytes_by_kind() == {"opt": 3 * 12288, "grad": 12288}
        assert sum(v["bytes_read"] for v in st.io_counters().values()) == 4 * 12288
    finally:
        st.close()
