"""A packed region reads back only blocks that hold written bytes ([Note: blocks never written] in
``store/packed.py``): items appended and written in order cost no boundary reads, an item written out of
order still merges with its neighbours' bytes, and a reopened region reads its partial blocks."""
from __future__ import annotations

import pytest
import torch
from _storage_helpers import make_dirs

from aidaptiv_ds.io import IOEngine
from aidaptiv_ds.store import Namespace, PathSpec, SlabStore
from aidaptiv_ds.store.packed import PackedRegion


@pytest.fixture
def store(tmp_path):
    eng = IOEngine()
    st = SlabStore(Namespace(make_dirs(tmp_path, 1), "pk", 0), [PathSpec(str(tmp_path / "p0"))], engine=eng)
    yield st
    st.close()
    eng.close()


def _item(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _read(region: PackedRegion, start: int, n: int) -> torch.Tensor:
    fut, buf, skip = region.read(start, start + n)
    fut.wait()
    return buf[skip:skip + n].clone()


def test_items_written_in_order_read_no_block_back(store):
    """The sizes are partitions that end mid-block (a norm weight of 3 KiB, matrices of 37 KiB + a few
    bytes); the edge cache holds a single block, so only the rule, not the cache, saves the reads."""
    region = PackedRegion(store, "params/float32", edge_cache_blocks=1)
    sizes = [3000, 37 * 1024 + 12, 100, 9000, 4096, 5]
    items = [(region.append(n), _item(n, i)) for i, n in enumerate(sizes)]
    for start, data in items:
        region.write(start, data.numel(), lambda v, d=data: v.copy_(d))
    region.flush()
    assert region.boundary_reads == 0
    assert sum(store.bytes_read) == 0  # nothing was read to write them
    for start, data in items:
        assert torch.equal(_read(region, start, data.numel()), data)


def test_an_item_written_before_its_neighbour_keeps_the_neighbours_bytes(store):
    """Out of order: the second item is written first, so the first one's tail block holds written bytes
    and is merged, from the edge cache or read back from the drive (a cache of one block, evicted here by
    a third item)."""
    region = PackedRegion(store, "params/float32", edge_cache_blocks=1)
    a, b, c = (region.append(n) for n in (5000, 3000, 20000))
    da, db, dc = _item(5000, 1), _item(3000, 2), _item(20000, 3)
    region.write(b, 3000, lambda v: v.copy_(db))
    region.write(c, 20000, lambda v: v.copy_(dc))  # evicts b's blocks from the one-block cache
    region.write(a, 5000, lambda v: v.copy_(da))   # its tail block holds b's first bytes: read back
    region.flush()
    assert region.boundary_reads == 1
    for start, data in ((a, da), (b, db), (c, dc)):
        assert torch.equal(_read(region, start, data.numel()), data)


def test_a_reopened_region_reads_its_partial_blocks(store):
    region = PackedRegion(store, "params/float32")
    first, second = region.append(1000), region.append(1000)
    d1, d2 = _item(1000, 4), _item(1000, 5)
    region.write(first, 1000, lambda v: v.copy_(d1))
    region.flush()
    again = PackedRegion(store, "params/float32", edge_cache_blocks=1)
    again.reopen(region.size)  # an earlier process's bytes: every block may hold data
    again.write(second, 1000, lambda v: v.copy_(d2))
    again.flush()
    assert again.boundary_reads == 1
    assert torch.equal(_read(again, first, 1000), d1) and torch.equal(_read(again, second, 1000), d2)
