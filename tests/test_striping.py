"""Weighted RAID-0: the layout's map is a bijection with weighted shares, and a store striped over 3
paths puts bytes on each path in proportion to its weight and reads back the right bytes."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _storage_helpers import make_dirs, rand_tensor, same_bytes
from aidaptiv_ds.io import IOEngine, wait_all
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore, StripeLayout
from aidaptiv_ds.store.striping import apportion, smooth_pattern

MiB = 1 << 20


def test_apportion_and_smooth_pattern():
    assert apportion([1, 1, 1], 3) == [1, 1, 1]
    assert apportion([3, 2, 1], 6) == [3, 2, 1]
    assert sum(apportion([0.3, 7, 2.2], 32)) == 32
    assert apportion([100, 1], 8)[1] == 1                  # every path with weight > 0 gets a slot
    pat = smooth_pattern([3, 2, 1])
    assert sorted(pat) == [0, 0, 0, 1, 1, 2]
    assert all(pat[i] != pat[i + 1] or pat[i] == 0 for i in range(len(pat) - 1))
    with pytest.raises(ValueError):
        apportion([0, 0], 4)


@pytest.mark.parametrize("weights", [[3, 2, 1], [1, 1, 1], [5, 1], [2.9, 3.3, 6.8], [1, 1, 1, 1, 4], [7, 1, 1]])
def test_layout_shares_follow_weights_within_5_percent(weights):
    lay = StripeLayout(list(range(len(weights))), weights, MiB)
    for i, w in enumerate(weights):
        want = w / sum(weights)
        assert abs(lay.share(i) - want) <= 0.05 * want, (weights, i, lay.share(i), want)


def _check_map(lay: StripeLayout, logical: int, length: int) -> None:
    runs = lay.map(logical, length)
    seen = np.zeros(length, dtype=np.int8)
    for p, rs in runs.items():
        for r in rs:
            pos = 0
            for off, n in r.parts:
                seen[off:off + n] += 1
                # each part maps byte by byte to what mapping its unit alone gives
                for probe in (off, off + n - 1):
                    single = lay.map(logical + probe, 1)
                    assert list(single) == [p]
                    assert single[p][0].phys == r.phys + pos + (probe - off)
                pos += n
    assert seen.min() == 1 and seen.max() == 1


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(weights=st.lists(st.floats(0.2, 8.0), min_size=1, max_size=4),
       logical=st.integers(0, 200 * 4096), length=st.integers(1, 90 * 4096))
def test_layout_map_is_a_bijection(weights, logical, length):
    lay = StripeLayout(list(range(len(weights))), weights, 4096, phys_base={0: 8192})
    _check_map(lay, logical, length)
    # injective: distinct logical units land on distinct physical units
    units = {}
    for k in range(3 * len(lay.pattern) + 2):
        (p, rs), = lay.map(k * 4096, 4096).items()
        assert (p, rs[0].phys) not in units
        units[(p, rs[0].phys)] = k
    # phys_size is the end of the highest physical byte each path needs
    end = logical + length
    need = lay.phys_size(end)
    for p, rs in lay.map(0, end).items():
        assert max(r.phys + r.length for r in rs) - lay.phys_base[p] <= need[p]
        assert need[p] - (max(r.phys + r.length for r in rs) - lay.phys_base[p]) < 4096


@given(caps=st.lists(st.integers(0, 400), min_size=2, max_size=4), weights=st.data())
@settings(max_examples=60, deadline=None, database=None)
def test_logical_capacity_fits_the_physical_caps(caps, weights):
    w = weights.draw(st.lists(st.floats(0.2, 8.0), min_size=len(caps), max_size=len(caps)))
    unit = 4096
    lay = StripeLayout(list(range(len(caps))), w, unit)
    phys = {i: c * unit for i, c in enumerate(caps)}
    cap = lay.logical_capacity(phys)
    need = lay.phys_size(cap)
    assert all(need[p] <= phys[p] for p in phys)
    # and it is the largest whole number of units that fits
    more = lay.phys_size(cap + unit)
    assert any(more[p] > phys[p] for p in phys)


def test_a_path_with_weight_zero_gets_nothing():
    lay = StripeLayout([0, 1, 2], [1, 0, 1], MiB)
    assert lay.share(1) == 0 and 1 not in lay.pattern
    assert lay.logical_capacity({0: 8 * MiB, 1: 0, 2: 8 * MiB}) == 16 * MiB
    assert 1 not in lay.map(0, 16 * MiB) and lay.phys_size(16 * MiB)[1] == 0


@pytest.fixture
def engine():
    eng = IOEngine()
    yield eng
    eng.close()


def _store(dirs, engine, weights, caps, **kw):
    return SlabStore(Namespace(dirs, "stripe", 0), [PathSpec(d, weight=w, capacity=c)
                                                     for d, w, c in zip(dirs, weights, caps)], engine=engine, **kw)


def test_striped_over_3_paths_bytes_per_path_follow_weights(tmp_path, engine):
    dirs = make_dirs(tmp_path, 3)
    weights = [3, 2, 1]
    st_ = _store(dirs, engine, weights, [1 << 30] * 3, stripe_unit=MiB)
    try:
        rng = np.random.default_rng(0)
        sizes, total = [], 0
        while total < 200 * MiB:                         # mixed sizes: 1 element .. 9 MiB
            n = int(rng.choice([1, 4097, 300_000, 2 * MiB + 3, 9 * MiB - 5]))
            sizes.append(n)
            total += n
        src = [rand_tensor(n, torch.uint8, seed=i) for i, n in enumerate(sizes)]
        wait_all([st_.put(f"k{i}", t) for i, t in enumerate(src)])
        cnt = st_.io_counters()
        written = [cnt[d]["bytes_written"] for d in dirs]
        assert sum(written) == sum(st_.extent(f"k{i}").nbytes for i in range(len(src)))
        for d, w, b in zip(dirs, weights, written):
            want = w / sum(weights)
            assert abs(b / sum(written) - want) <= 0.05 * want, (d, b / sum(written), want)
        eng_stats = engine.stats()                      # the engine's own per-drive counters agree
        assert [eng_stats[d].bytes_written for d in dirs] == written
        outs = [torch.empty_like(t) for t in src]
        wait_all([st_.get(f"k{i}", o) for i, o in enumerate(outs)])
        assert all(same_bytes(a, b) for a, b in zip(outs, src))
        cnt = st_.io_counters()
        assert [cnt[d]["bytes_read"] for d in dirs] == written
    finally:
        st_.close()


def test_striped_units_are_really_on_disk_once_each(tmp_path, engine):
    """Write logical 4 KiB blocks tagged with their number; scan the raw slab files: every block is on
    exactly one path, blocks per path follow the weights, and each path holds its blocks in order."""
    dirs = make_dirs(tmp_path, 3)
    unit = 64 << 10
    st_ = _store(dirs, engine, [3, 2, 1], [1 << 30] * 3, stripe_unit=unit)
    try:
        nblk = 6 * 8 * (unit // 4096)                  # 48 units: several whole pattern rows
        tags = torch.arange(nblk, dtype=torch.int64).repeat_interleave(512) + 1   # 512 int64 = 4 KiB per tag
        st_.put("tagged", tags).wait()
        st_.drain()
        per_path = []
        for s in st_.slabs:
            with open(s.path, "rb") as f:                # the data sits in the first 3 MiB; slabs are preallocated
                raw = np.frombuffer(f.read(4 * MiB), dtype=np.int64)
            blocks = raw.reshape(-1, 512)[:, 0]
            got = [int(b) - 1 for b in blocks if b > 0]
            assert got == sorted(got)                  # physically in logical order on each path
            per_path.append(got)
        flat = sorted(b for p in per_path for b in p)
        assert flat == list(range(nblk))
        shares = [len(p) / nblk for p in per_path]
        assert shares == pytest.approx([3 / 6, 2 / 6, 1 / 6], rel=0.05)
    finally:
        st_.close()


def test_affinity_fills_the_primary_first_then_spills(tmp_path, engine):
    dirs = make_dirs(tmp_path, 3)
    st_ = _store(dirs, engine, [1, 1, 1], [64 * MiB, 16 * MiB, 64 * MiB], policy="affinity", primary=1,
                 stripe_unit=MiB)
    try:
        assert st_.capacity() == 16 * MiB + 128 * MiB
        src = []
        for i in range(7):                             # 7 x 3 MiB: the 6th crosses the 16 MiB primary
            t = rand_tensor(3 * MiB, torch.uint8, seed=i)
            src.append(t)
            st_.put(f"k{i}", t).wait()
            w = [st_.io_counters()[d]["bytes_written"] for d in dirs]
            if (i + 1) * 3 <= 16:
                assert w[0] == 0 and w[2] == 0 and w[1] == (i + 1) * 3 * MiB
            else:
                assert w[1] == 16 * MiB                # primary exactly full, the rest spilled
                assert w[0] + w[2] == (i + 1) * 3 * MiB - 16 * MiB and w[0] > 0 and w[2] > 0
        for i, t in enumerate(src):
            o = torch.empty_like(t)
            st_.get(f"k{i}", o).wait()
            assert same_bytes(o, t)
        assert os.path.getsize(st_.slabs[1].path) <= 16 * MiB
    finally:
        st_.close()
