"""Injected faults: short space (a quota and a real small filesystem), EIO on read and write, a corrupted
extent, O_DIRECT refusal. Each raises a clear error naming the path and offset (or the numbers), and
no call ever reports success for data that was not transferred."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import warnings

import pytest
import torch

from _storage_helpers import REPO, file_digest, make_dirs, rand_tensor, run_child, same_bytes
from aidaptiv_ds.io import (ChecksumError, DirectIOFallbackWarning, IOEngine, StorageFullError, StorageIOError,
                            alloc_aligned, wait_all)
from aidaptiv_ds.integration.aio_handle import AioHandle
from aidaptiv_ds.io.syscalls import FaultRule, FaultyIO, SysIO, default_sysio, rules_from_env
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore

MiB = 1 << 20


def _store(dirs, engine, caps=None, weights=None, run="faults", **kw) -> SlabStore:
    caps = caps or [None] * len(dirs)
    weights = weights or [1.0] * len(dirs)
    return SlabStore(Namespace(dirs, run, 0), [PathSpec(d, weight=w, capacity=c)
                                               for d, w, c in zip(dirs, weights, caps)], engine=engine, **kw)


@pytest.fixture
def engine():
    eng = IOEngine()
    yield eng
    eng.close()


def _slab_state(st: SlabStore) -> list[tuple[int, int, str]]:
    return [(os.stat(s.path).st_size, os.stat(s.path).st_blocks, file_digest(s.path)) for s in st.slabs]


# ---------------------------------------------------------------------------- short space: quota
def test_quota_full_is_refused_before_any_write(tmp_path, engine):
    dirs = make_dirs(tmp_path, 1)
    st = _store(dirs, engine, caps=[8 * MiB])
    try:
        keep = rand_tensor(6 * MiB, torch.uint8, 1)
        st.put("keep", keep).wait()
        assert os.path.getsize(st.slabs[0].path) <= 8 * MiB          # the slab respects the quota
        before, written = _slab_state(st), engine.totals().bytes_written
        with pytest.raises(StorageFullError) as ei:
            st.put("big", rand_tensor(3 * MiB, torch.uint8, 2))
        e = ei.value
        assert e.path == dirs[0] and e.needed > e.free and e.free <= 8 * MiB
        assert dirs[0] in str(e) and str(e.needed) in str(e) and str(e.free) in str(e)
        assert _slab_state(st) == before and engine.totals().bytes_written == written
        assert st.extent("big") is None
        out = torch.empty_like(keep)
        st.get("keep", out).wait()
        assert same_bytes(out, keep)
        st.put("fits", rand_tensor(2 * MiB, torch.uint8, 3)).wait()  # what fits still goes in
    finally:
        st.close()


def test_striped_quota_names_the_path_that_is_short(tmp_path, engine):
    dirs = make_dirs(tmp_path, 3)
    st = _store(dirs, engine, caps=[64 * MiB, 8 * MiB, 64 * MiB], stripe_unit=MiB)
    try:
        assert st.capacity() < 27 * MiB
        before = _slab_state(st)
        with pytest.raises(StorageFullError) as ei:
            st.preflight(30 * MiB, "the optimizer state")
        e = ei.value
        assert e.path == dirs[1] and e.needed > 8 * MiB and e.free == 8 * MiB
        assert "the optimizer state" in str(e)
        assert _slab_state(st) == before
        with pytest.raises(StorageFullError, match=dirs[1]):
            st.put("x", torch.empty(30 * MiB, dtype=torch.uint8))
        assert _slab_state(st) == before
    finally:
        st.close()


# ---------------------------------------------------------------------------- short space: a real small filesystem
@pytest.fixture(params=["tmpfs", "ext4-loop"])
def small_fs(request, tmp_path):
    """A 64 MiB filesystem mounted for the test; skipped (with the reason) where mounting is not permitted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if request.param == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)]
    else:
        if not shutil.which("mkfs.ext4"):
            pytest.skip("mkfs.ext4 is not installed")
        img = tmp_path / "fs.img"
        with open(img, "wb") as f:
            f.truncate(64 * MiB)
        r = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
        cmd = ["mount", "-o", "loop", str(img), str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a {request.param} here ({' '.join(cmd)}): {r.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.subprocess
def test_small_filesystem_too_small_for_the_plan(small_fs, engine):
    st = _store([small_fs], engine)
    try:
        assert 40 * MiB < st.capacity() < 64 * MiB
        before, written = _slab_state(st), engine.totals().bytes_written
        with pytest.raises(StorageFullError) as ei:
            st.put("big", torch.empty(80 * MiB, dtype=torch.uint8))
        e = ei.value
        assert e.path == small_fs and e.needed > e.free and e.free < 64 * MiB and small_fs in str(e)
        with pytest.raises(StorageFullError, match=small_fs):
            st.preflight(100 * MiB)
        assert _slab_state(st) == before and engine.totals().bytes_written == written
    finally:
        st.close()


@pytest.mark.subprocess
def test_small_filesystem_filled_by_someone_else(small_fs, engine):
    """The space the store saw at open is taken by another writer: the slab growth (fallocate)
    fails with ENOSPC and the store raises StorageFullError before writing; the slab is untouched."""
    st = _store([small_fs], engine)
    filler = os.path.join(small_fs, "filler.bin")
    try:
        fs_free = shutil.disk_usage(small_fs).free
        with open(filler, "wb") as f:                # leave about 8 MiB free
            f.write(b"\xff" * (fs_free - 8 * MiB))
            f.flush()
            os.fsync(f.fileno())
        before, written = _slab_state(st), engine.totals().bytes_written
        with pytest.raises(StorageFullError) as ei:
            st.put("x", rand_tensor(16 * MiB, torch.uint8, 1))
        e = ei.value
        assert e.path == small_fs and e.needed >= 16 * MiB and e.free < 16 * MiB
        assert _slab_state(st) == before and engine.totals().bytes_written == written
        assert st.extent("x") is None
        os.unlink(filler)                            # space comes back: the store carries on
        t = rand_tensor(16 * MiB, torch.uint8, 2)
        st.put("x", t).wait()
        out = torch.empty_like(t)
        st.get("x", out).wait()
        assert same_bytes(out, t)
    finally:
        if os.path.exists(filler):
            os.unlink(filler)
        st.close()


def test_enospc_during_a_write_fails_at_once(tmp_path):
    eng = IOEngine(sysio=FaultyIO([FaultRule("write", err=errno.ENOSPC)]), max_retries=3)
    try:
        st = _store(make_dirs(tmp_path, 1), eng, caps=[64 * MiB])
        fut = st.put("x", torch.ones(1000))
        with pytest.raises(StorageIOError) as ei:
            fut.wait()
        assert ei.value.errno == errno.ENOSPC and ei.value.attempts == 1
        assert eng.totals().retries == 0 and "free space" in str(ei.value)
        st.close()
    finally:
        eng.close()


# ---------------------------------------------------------------------------- EIO
def _expected_runs(st: SlabStore, key: str, path_index: int) -> list[tuple[int, int]]:
    """Physical byte ranges [start, end) of ``key`` in the slab of path ``path_index``."""
    ext = st.extent(key)
    return [(phys, phys + sum(n for _, n in parts)) for p, phys, parts in st._map(ext.offset, ext.nbytes)
            if p == path_index]


def _inside(offset: int, runs: list[tuple[int, int]]) -> bool:
    return any(a <= offset < b for a, b in runs)


def test_eio_on_write_is_retried_then_names_path_and_offset(tmp_path):
    rule = FaultRule("write", err=errno.EIO, path_contains="cache1")
    eng = IOEngine(sysio=FaultyIO([rule]), max_retries=2, retry_delay_s=0.001, block_size=MiB)
    try:
        dirs = make_dirs(tmp_path, 3)
        st = _store(dirs, eng, caps=[256 * MiB] * 3, stripe_unit=MiB)
        fut = st.put("x", rand_tensor(6 * MiB, torch.uint8, 1))
        with pytest.raises(StorageIOError) as ei:
            fut.wait()
        e = ei.value
        slab1 = st.slabs[1].path
        assert e.path == slab1 and e.op == "write" and e.errno == errno.EIO and e.attempts == 3
        assert _inside(e.offset, _expected_runs(st, "x", 1)) and e.offset % MiB == 0 and e.nbytes > 0
        assert slab1 in str(e) and f"offset {e.offset}" in str(e) and "dmesg" in str(e)
        with pytest.raises(StorageIOError):          # asking again never turns it into success
            fut.wait()
        assert eng.totals().retries >= 2
        assert {p for p, _, _ in st._map(st.allocate("y", 4096).offset, 4096)} == {0}
        st.put("y", torch.ones(3)).wait()            # a failing path does not wedge the others
        rule.count = 0                                # the fault clears
        st.put("x", rand_tensor(6 * MiB, torch.uint8, 1)).wait()
        st.close()
    finally:
        eng.close()


def test_eio_on_read_names_path_and_offset_and_leaves_the_output_alone(tmp_path):
    rules = []
    eng = IOEngine(sysio=FaultyIO(rules), max_retries=1, retry_delay_s=0.001)
    try:
        dirs = make_dirs(tmp_path, 2)
        st = _store(dirs, eng, caps=[256 * MiB] * 2, checksum=True)
        t = rand_tensor(3 * MiB, torch.float16, 3)
        st.put("x", t).wait()
        eng.sysio.rules.append(FaultRule("read", err=errno.EIO, path_contains="cache0"))
        out = torch.zeros_like(t)
        with pytest.raises(StorageIOError) as ei:
            st.get("x", out).wait()
        e = ei.value
        assert e.path == st.slabs[0].path and e.op == "read" and e.attempts == 2
        assert _inside(e.offset, _expected_runs(st, "x", 0)) and st.slabs[0].path in str(e)
        assert not out.any()                          # the failed read did not hand out partial data
        raw = alloc_aligned(st.extent("x").nbytes)
        with pytest.raises(StorageIOError):
            st.read("x", raw).wait()
        st.close()
    finally:
        eng.close()


@pytest.mark.parametrize("op", ["write", "read"])
def test_transient_eio_within_the_retry_budget_succeeds(tmp_path, op):
    rules = [FaultRule(op, err=errno.EIO, count=2)] if op == "write" else []
    eng = IOEngine(sysio=FaultyIO(rules), max_retries=3, retry_delay_s=0.001)
    try:
        st = _store(make_dirs(tmp_path, 1), eng, caps=[64 * MiB], checksum=True)
        t = rand_tensor(2 * MiB + 17, torch.bfloat16, 4)
        st.put("x", t).wait()
        if op == "read":
            eng.sysio.rules.append(FaultRule("read", err=errno.EIO, count=3))
        out = torch.empty_like(t)
        st.get("x", out).wait()
        assert same_bytes(out, t)
        assert eng.totals().retries == (2 if op == "write" else 3)
        st.close()
    finally:
        eng.close()


def test_one_failing_chunk_fails_the_whole_request(tmp_path):
    """A 16 MiB write in 1 MiB chunks where only the chunk at 9 MiB fails: 15 chunks land, the request fails."""
    eng = IOEngine(sysio=FaultyIO([FaultRule("write", offset_min=9 * MiB, offset_max=9 * MiB + 1)]),
                   max_retries=1, retry_delay_s=0.001, block_size=MiB)
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        fut = eng.write(fh, 0, alloc_aligned(16 * MiB))
        with pytest.raises(StorageIOError) as ei:
            fut.wait()
        assert ei.value.offset == 9 * MiB and ei.value.path == fh.path
        assert eng.totals().bytes_written == 15 * MiB
        fh.close()
    finally:
        eng.close()


class ZeroWrites(SysIO):
    def pwritev(self, fd, bufs, offset, path):
        return 0


def test_a_write_that_accepts_no_bytes_is_an_error(tmp_path):
    eng = IOEngine(sysio=ZeroWrites())
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        with pytest.raises(StorageIOError, match="no bytes accepted") as ei:
            eng.write(fh, 8192, alloc_aligned(4096)).wait()
        assert ei.value.offset == 8192 and ei.value.errno is None
        fh.close()
    finally:
        eng.close()


def test_aio_handle_wait_raises_for_an_unwritten_request(tmp_path):
    eng = IOEngine(sysio=FaultyIO([FaultRule("write", path_contains="opt", count=-1)]), max_retries=0)
    try:
        h = AioHandle(engine=eng)
        buf = h.new_cpu_locked_tensor(1 << 18, torch.empty(0))
        for i in range(4):
            assert h.async_pwrite(buf, str(tmp_path / f"{'opt' if i == 2 else 'param'}{i}.swp")) == 0
        with pytest.raises(StorageIOError, match="opt2.swp"):
            h.wait()
    finally:
        eng.close()


# ---------------------------------------------------------------------------- corruption
@pytest.mark.parametrize("unit", [MiB, 64 << 10], ids=["unit=1MiB", "unit=64KiB"])
def test_corrupted_extent_raises_checksum_error_naming_path_and_offset(tmp_path, engine, unit):
    """With a stripe unit smaller than the checksum block, the error must still name the right drive."""
    dirs = make_dirs(tmp_path, 3)
    st = _store(dirs, engine, caps=[256 * MiB] * 3, weights=[3, 2, 1], checksum=True, stripe_unit=unit)
    try:
        t = rand_tensor(12 * MiB, torch.float32, 5)
        st.put("w", t).wait()
        other = rand_tensor(MiB, torch.uint8, 6)
        st.put("other", other).wait()
        runs = sorted(_expected_runs(st, "w", 2))
        bad = runs[-1][0] + 12345                       # a byte of "w" on the third path
        slab = st.slabs[2].path
        with open(slab, "r+b") as f:
            f.seek(bad)
            old = f.read(1)
            f.seek(bad)
            f.write(bytes([old[0] ^ 0x5A]))
        out = torch.empty_like(t)
        with pytest.raises(ChecksumError) as ei:
            st.get("w", out).wait()
        e = ei.value
        assert e.path == slab and e.offset <= bad < e.offset + e.nbytes and e.key == "w"
        assert slab in str(e) and f"offset {e.offset}" in str(e)
        o2 = torch.empty_like(other)                    # other extents are fine
        st.get("other", o2).wait()
        assert same_bytes(o2, other)
        part = alloc_aligned(MiB)                       # a partial read covering the bad block
        ext = st.extent("w")
        blk = next(o for o in range(0, ext.nbytes, MiB)
                   if any(p == 2 and ph <= bad < ph + sum(n for _, n in parts)
                          for p, ph, parts in st._map(ext.offset + o, MiB)))
        with pytest.raises(ChecksumError):
            st.read("w", part, offset=blk).wait()
        st.write("w", part, offset=blk).wait()          # rewriting the block heals it
        st.read("w", part, offset=blk).wait()
    finally:
        st.close()


@pytest.mark.subprocess
def test_corruption_is_detected_after_a_restart(tmp_path, engine):
    dirs = make_dirs(tmp_path, 2)
    st = _store(dirs, engine, caps=[256 * MiB] * 2, run="crc", checksum=True, keep=True)
    st.put("w", rand_tensor(4 * MiB, torch.bfloat16, 7)).wait()
    slab = st.slabs[1].path
    st.close(keep=True)
    with open(slab, "r+b") as f:
        f.seek(MiB + 999)
        b = f.read(1)
        f.seek(MiB + 999)
        f.write(bytes([b[0] ^ 1]))
    res = run_child(f"""
        import json, torch
        from aidaptiv_ds.io import ChecksumError
        from aidaptiv_ds.store import Namespace, PathSpec, SlabStore
        dirs = {dirs!r}
        st = SlabStore(Namespace(dirs, "crc", 0), [PathSpec(d, capacity={256 * MiB}) for d in dirs],
                       checksum=True, keep=True)
        try:
            st.get("w", torch.empty(4 << 20, dtype=torch.bfloat16)).wait()
            r = {{"raised": False}}
        except ChecksumError as e:
            r = {{"raised": True, "path": e.path, "offset": e.offset, "nbytes": e.nbytes}}
        st.close(keep=False)
        print("RESULT " + json.dumps(r))
    """)
    assert res["raised"] and res["path"] == slab and res["offset"] <= MiB + 999 < res["offset"] + res["nbytes"]


# ---------------------------------------------------------------------------- O_DIRECT refusal
def test_o_direct_refused_at_open_warns_once_per_path_and_io_still_works(tmp_path):
    eng = IOEngine(sysio=FaultyIO([FaultRule("open_direct", err=errno.EINVAL)]))
    dirs = make_dirs(tmp_path, 2)
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            st = _store(dirs, eng, caps=[64 * MiB] * 2, keep=True)
            t = rand_tensor(3 * MiB + 1, torch.float16, 8)
            st.put("x", t).wait()
            out = torch.empty_like(t)
            st.get("x", out).wait()
            assert same_bytes(out, t)
            assert all(not s.fh.direct for s in st.slabs)
            st.close()
            st = _store(dirs, eng, caps=[64 * MiB] * 2)          # same paths again: no new warning
            st.get("x", out).wait()
            assert same_bytes(out, t)
            st.close(keep=False)
            h = AioHandle(engine=eng)                          # DeepSpeed swap file: one warning for it
            p = str(tmp_path / "p.swp")
            buf = h.new_cpu_locked_tensor(4096, torch.empty(0))
            for _ in range(5):
                h.async_pwrite(buf, p)
                h.wait()
        fallback = [w for w in got if issubclass(w.category, DirectIOFallbackWarning)]
        named = sorted(str(w.message).split(":")[1].strip() for w in fallback)
        assert named == sorted([Namespace(dirs, "faults", 0).slab_path(i) for i in range(2)] + [p])
        assert all("O_DIRECT" in str(w.message) and "buffered" in str(w.message) for w in fallback)
        assert set(eng.fallback_paths) == set(named)
    finally:
        eng.close()


def test_o_direct_refused_at_io_time_falls_back_once(tmp_path):
    eng = IOEngine(sysio=FaultyIO([FaultRule("write", err=errno.EINVAL, count=1)]), block_size=MiB)
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        assert fh.direct
        src = alloc_aligned(4 * MiB)
        src.copy_(rand_tensor(4 * MiB, torch.uint8, 9))
        with pytest.warns(DirectIOFallbackWarning, match=fh.path):
            eng.write(fh, 0, src).wait()
        assert not fh.direct
        out = alloc_aligned(4 * MiB)
        eng.read(fh, 0, out).wait()
        assert same_bytes(out, src)
        fh.close()
    finally:
        eng.close()


# ---------------------------------------------------------------------------- AIDAPTIV_FAULTS
def test_fault_rules_from_the_environment():
    rules = rules_from_env("op=write,err=EIO,path_contains=slab,skip=3,count=-1; op=open_direct,err=22")
    assert rules[0] == FaultRule("write", errno.EIO, "slab", skip=3, count=-1)
    assert rules[1].op == "open_direct" and rules[1].err == errno.EINVAL
    assert rules_from_env("") == []
    with pytest.raises(ValueError, match="bogus"):
        rules_from_env("op=read,bogus=1")
    assert type(default_sysio()) is SysIO or os.environ.get("AIDAPTIV_FAULTS")


@pytest.mark.subprocess
def test_faults_injected_into_a_child_process(tmp_path):
    dirs = make_dirs(tmp_path, 1)
    res = run_child(f"""
        import json, torch
        from aidaptiv_ds.io import IOEngine, StorageIOError
        from aidaptiv_ds.io.syscalls import FaultyIO
        from aidaptiv_ds.store import Namespace, PathSpec, SlabStore
        eng = IOEngine(retry_delay_s=0.001)
        st = SlabStore(Namespace({dirs!r}, "env", 0), [PathSpec({dirs[0]!r}, capacity=1 << 26)], engine=eng)
        try:
            st.put("x", torch.ones(4096)).wait()
            r = {{"raised": False}}
        except StorageIOError as e:
            r = {{"raised": True, "path": e.path, "offset": e.offset, "faulty": isinstance(eng.sysio, FaultyIO)}}
        st.close()
        print("RESULT " + json.dumps(r))
    """, AIDAPTIV_FAULTS="op=write,err=EIO,path_contains=slab.bin,skip=0,count=-1")
    assert res == {"raised": True, "path": Namespace(dirs, "env", 0).slab_path(0), "offset": 0, "faulty": True}


# ---------------------------------------------------------------------------- every byte verified (issue 11.6)
def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("where", ["first block", "last block", "middle"])
def test_flips_in_an_extents_partly_covered_blocks_are_detected(tmp_path, engine, where):
    """With ``checksum`` on, every block a read touches is verified: also an extent's first and last
    block, which a 1 MiB checksum block covered only in part (issue 11.6: 2 of 2 flips there went
    undetected and changed the result)."""
    dirs = make_dirs(tmp_path, 1)
    st = _store(dirs, engine, caps=[64 * MiB], checksum=True)
    try:
        st.put("pad", rand_tensor(5000, torch.uint8, 1)).wait()        # "w" then starts 8 KiB into a MiB
        w = rand_tensor(3 * MiB + 12 * 1024, torch.uint8, 2)
        st.put("w", w).wait()
        ext = st.extent("w")
        assert ext.offset % MiB and (ext.offset + ext.nbytes) % MiB  # both ends inside 1 MiB blocks
        rel = {"first block": 100, "last block": ext.nbytes - 200, "middle": MiB + 7}[where]
        (path, phys, _), = st._map(ext.offset + rel, 1)
        _flip(st.slabs[path].path, phys)
        with pytest.raises(ChecksumError) as ei:
            st.get("w", torch.empty_like(w)).wait()
        e = ei.value
        assert e.key == "w" and e.offset <= phys < e.offset + e.nbytes and e.nbytes == 4096
        part = alloc_aligned(8192)                                     # a partial read of that spot too
        with pytest.raises(ChecksumError):
            st.read("w", part, offset=rel // 4096 * 4096 if rel + 8192 <= ext.nbytes else ext.nbytes - 8192).wait()
        out = torch.empty(5000, dtype=torch.uint8)                     # the neighbour is intact
        st.get("pad", out).wait()
    finally:
        st.close()


def test_sub_range_writes_and_reads_are_verified(tmp_path, engine):
    """Partitions packed in an extent are written and read a few KiB at a time: each such request
    records and checks its own blocks (a packed region's partial blocks)."""
    dirs = make_dirs(tmp_path, 1)
    st = _store(dirs, engine, caps=[64 * MiB], checksum=True)
    try:
        st.allocate("packed", 2 * MiB)
        piece = alloc_aligned(12 * 1024)
        piece.copy_(rand_tensor(12 * 1024, torch.uint8, 3))
        st.write("packed", piece, offset=MiB - 4096).wait()            # straddles a MiB boundary
        (path, phys, _), = st._map(st.extent("packed").offset + MiB + 10, 1)
        _flip(st.slabs[path].path, phys)
        with pytest.raises(ChecksumError):
            st.read("packed", alloc_aligned(4096), offset=MiB).wait()
        st.read("packed", alloc_aligned(4096), offset=MiB - 4096).wait()  # the untouched block passes
    finally:
        st.close()


class _SlowReads(SysIO):
    def preadv(self, fd, bufs, offset, path):
        import time
        time.sleep(0.3)
        return super().preadv(fd, bufs, offset, path)


def test_a_write_issued_after_a_read_does_not_fail_that_read(tmp_path):
    """The read returns the older bytes (the write waits for it); it must be checked against the
    CRCs of those bytes, not against the CRCs the later write already recorded."""
    eng = IOEngine(sysio=_SlowReads())
    st = _store(make_dirs(tmp_path, 1), eng, caps=[64 * MiB], checksum=True)
    try:
        old, new = rand_tensor(MiB, torch.uint8, 4), rand_tensor(MiB, torch.uint8, 5)
        st.put("x", old).wait()
        buf = alloc_aligned(MiB)
        r = st.read("x", buf)
        w = st.put("x", new)
        r.wait()
        w.wait()
        assert same_bytes(buf, old)
        out = torch.empty_like(new)
        st.get("x", out).wait()
        assert same_bytes(out, new)
    finally:
        st.close()
        eng.close()


def test_a_changed_store_index_is_refused_on_reopen(tmp_path, engine):
    """``index.json`` (extents, layout) and ``index.crc`` (block CRCs) carry CRCs checked on reopen."""
    import json

    dirs = make_dirs(tmp_path, 1)
    st = _store(dirs, engine, caps=[64 * MiB], run="idx", checksum=True, keep=True)
    st.put("w", rand_tensor(MiB, torch.uint8, 6)).wait()
    index = st.ns.index_path()
    st.close(keep=True)
    with open(index) as f:
        data = json.load(f)
    assert data["crc"]["file"] == "index.crc" and "self_crc32" in data
    data["extents"]["w"][1] += 4096                                   # a plausible, wrong value
    with open(index, "w") as f:
        json.dump(data, f)
    with pytest.raises(Exception, match="index.json is damaged") as ei:
        _store(dirs, engine, caps=[64 * MiB], run="idx", checksum=True, keep=True)
    assert "aidaptiv-ds gc" in str(ei.value)
