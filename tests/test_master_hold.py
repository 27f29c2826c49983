"""The parameter bytes a step inside backward keeps for a master slot (``AidaptivOptimizerSwapper``,
[Note: master weights from the parameter reads]): kept only for a sub-group still to be stepped and
without a slice, within ``master_hold_limit`` bytes of buffers, copied once its slice is created, and
let go at the end of backward."""
from __future__ import annotations

import types

import torch

from aidaptiv_ds.integration.master_links import Fill, MasterLinks
from aidaptiv_ds.integration.optimizer_swapper import AidaptivOptimizerSwapper, _Group
from aidaptiv_ds.tiers.unit import UnitLayout


def _swapper(limit: int, waiting: set[int]) -> AidaptivOptimizerSwapper:
    sw = object.__new__(AidaptivOptimizerSwapper)
    sw.groups = {}
    sw.master_links = MasterLinks(limit)
    sw.master_copied_bytes = sw.master_held_bytes = sw.master_demand_bytes = 0
    sw.holds_master = lambda index: index in waiting
    sw.rt = types.SimpleNamespace(param_swapper=types.SimpleNamespace(host_bytes=lambda ds_id: None))
    return sw


def _group(sw, index: int, parts: list[tuple[int, int]]) -> _Group:
    numel = sum(n for _, n in parts) // 4
    g = _Group(str(index), numel=numel, layout=UnitLayout.packed(numel, [(s, torch.float32) for s in ("m", "s1", "s2")]),
               index=index)
    sw.groups[g.key] = g
    off, entries = 0, []
    for ds_id, n in parts:
        entries.append((ds_id, off, n))
        off += n
    sw.set_alias(g, entries)
    return g


def _held(sw, g) -> set[int]:
    return {k.ds_id for k in sw.master_links.held(g)}


def _waiting(sw, g) -> dict[int, tuple[int, int]]:
    return {k.ds_id: (k.offset, k.waiting) for k in sw.master_links.waiting(g)}


def test_kept_bytes_fill_the_master_slot_bit_for_bit():
    sw = _swapper(limit=1 << 20, waiting={0})
    g = _group(sw, 0, [(1, 4096), (2, 8192)])
    a = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    b = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    sw.take_master_bytes(1, a)
    sw.take_master_bytes(2, b)
    assert _held(sw, g) == {1, 2} and sw.held_bytes() == 4096 + 8192
    buf = torch.zeros(3 * 12288, dtype=torch.uint8)
    sw._fill_from_params(g, buf, 12288)
    assert torch.equal(buf[:4096], a) and torch.equal(buf[4096:12288], b)
    assert not _waiting(sw, g) and not _held(sw, g) and sw.held_bytes() == 0
    assert sw.master_held_bytes == sw.master_copied_bytes == 12288


def test_nothing_kept_past_the_limit_or_for_a_sub_group_not_waiting():
    sw = _swapper(limit=6000, waiting={0})
    g0 = _group(sw, 0, [(1, 4096), (2, 4096)])
    g1 = _group(sw, 1, [(3, 4096)])
    sw.take_master_bytes(1, torch.ones(4096, dtype=torch.uint8))
    sw.take_master_bytes(2, torch.ones(4096, dtype=torch.uint8))  # a second buffer would pass 6000 bytes
    sw.take_master_bytes(3, torch.ones(4096, dtype=torch.uint8))  # sub-group 1 is not waiting
    assert _held(sw, g0) == {1} and not _held(sw, g1)
    buf = torch.zeros(3 * 8192, dtype=torch.uint8)
    sw._fill_from_params(g0, buf, 8192)
    assert _waiting(sw, g0) == {2: (4096, 4096)}  # read on demand (or filled when a slice holds it again)


def test_views_of_one_buffer_count_once_and_are_let_go_at_the_end_of_backward():
    sw = _swapper(limit=12288, waiting={0})
    g = _group(sw, 0, [(1, 4096), (2, 4096)])
    run = torch.arange(3072, dtype=torch.int32).view(torch.uint8)  # one parameter slice (12288 B), two partitions
    sw.take_master_bytes(1, run[:4096])
    sw.take_master_bytes(2, run[4096:])
    assert _held(sw, g) == {1, 2} and sw.held_bytes() == run.untyped_storage().nbytes()
    sw.release_held()
    assert not _held(sw, g) and sw.held_bytes() == 0


def test_a_slice_that_exists_takes_the_bytes_directly():
    sw = _swapper(limit=1 << 20, waiting={0})
    g = _group(sw, 0, [(1, 4096)])
    g.slice = types.SimpleNamespace(buf=torch.zeros(3 * 4096, dtype=torch.uint8))
    sw.master_links.wait(sw.master_links.get(1), 4096)
    src = torch.full((4096,), 7, dtype=torch.uint8)
    sw.take_master_bytes(1, src)
    assert torch.equal(g.slice.buf[:4096], src) and not _held(sw, g) and not _waiting(sw, g)
    assert sw.master_links.get(1).fill is Fill.NONE


def test_a_links_fill_walks_its_states():
    """[Note: a link's fill]: NONE -wait-> WAITING -filled-> NONE, NONE -hold-> HELD -unhold-> NONE; a wait or an
    unhold from another state is refused, a second hold is not taken."""
    import pytest

    links = MasterLinks(hold_limit=1 << 20)
    grp = object()
    (a, b) = links.set(grp, [(1, 0, 4096), (2, 4096, 4096)])
    assert links.of(grp) == (a, b) and links.get(2) is b and a.fill is Fill.NONE
    links.wait(a, 100)
    with pytest.raises(RuntimeError, match="wait from waiting"):
        links.wait(a, 100)
    assert not links.hold(a, torch.ones(8, dtype=torch.uint8))  # a waiting link takes the bytes, not a hold
    links.filled(a)
    assert a.fill is Fill.NONE and a.waiting == 0
    src = torch.ones(4096, dtype=torch.uint8)
    assert links.hold(b, src) and b.fill is Fill.HELD and links.held_bytes() == 4096
    assert not links.hold(b, src) and links.held_bytes() == 4096
    with pytest.raises(RuntimeError, match="unhold from none"):
        links.unhold(a)
    assert links.unhold(b) is src and b.fill is Fill.NONE and links.held_bytes() == 0


def test_replacing_a_groups_links_lets_go_of_what_the_old_ones_kept():
    """``set`` for a group that has links: the old links' kept buffers go (not leaked against the hold limit), a
    partition no longer listed is no longer found, and a slice still waiting for old links' bytes refuses it."""
    import pytest

    links = MasterLinks(hold_limit=1 << 20)
    grp = object()
    (a, b) = links.set(grp, [(1, 0, 4096), (2, 4096, 4096)])
    assert links.hold(a, torch.ones(4096, dtype=torch.uint8)) and links.held_bytes() == 4096
    (c,) = links.set(grp, [(1, 0, 8192)])
    assert links.held_bytes() == 0 and a.fill is Fill.NONE
    assert links.get(2) is None and links.get(1) is c and links.of(grp) == (c,)
    links.wait(c, 8192)
    with pytest.raises(RuntimeError, match=r"waits for partitions \[1\]"):
        links.set(grp, [(1, 0, 8192)])
