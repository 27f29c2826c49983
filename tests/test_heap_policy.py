"""glibc heap policy (``aidaptiv_ds.io.heap``): the policies are recorded, the temporaries scope acts only
under the *return* policy, restores the policy's thresholds as it ends, and really keeps a tile's
temporaries in the heap (fewer page faults), and the planner counts what it can hold.

``mallopt`` is process-wide, so everything that sets a policy runs in a child process.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from aidaptiv_ds.io.heap import kept_heap_bound
from aidaptiv_ds.planner.auto import (OPTIMIZER_KEPT_TILES, OPTIMIZER_TILE_NUMEL, buffer_pool_bytes,
                                      cpu_rank_working_set, optimizer_scratch_bytes)

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
child = pytest.mark.subprocess


def _child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
@child
def test_scope_acts_only_under_return_and_restores_thresholds():
    r = _child("""
        import json
        from aidaptiv_ds.io import heap
        res = {"none": None}
        with heap.temporaries_kept(8 << 20) as acts:
            res["glibc_default_acts"] = acts
        heap.reuse_freed_host_memory()
        with heap.temporaries_kept(8 << 20) as acts:
            res["reuse_acts"] = acts
        res["reuse"] = heap.current_thresholds()
        heap.return_freed_host_memory()
        res["default_return"] = heap.current_thresholds()
        with heap.temporaries_kept(8 << 20) as acts:
            res["default_return_acts"] = acts  # 8 MiB blocks are below its 32 MiB threshold: kept already
        heap.return_freed_host_memory(1 << 20, 128 << 10)
        res["return"] = heap.current_thresholds()
        with heap.temporaries_kept(8 << 20) as acts:
            res["return_acts"] = acts
            res["inside"] = heap.current_thresholds()
            with heap.temporaries_kept(16 << 20) as inner:
                res["nested_acts"] = inner
                res["nested"] = heap.current_thresholds()
            res["after_nested"] = heap.current_thresholds()
            with heap.temporaries_kept(256 << 10) as small:
                res["small_acts"] = small  # 2 x 256 KiB is below the 1 MiB mmap threshold: nothing to do
        res["after"] = heap.current_thresholds()
        try:
            with heap.temporaries_kept(8 << 20):
                raise KeyError("x")
        except KeyError:
            pass
        res["after_error"] = heap.current_thresholds()
        res["kind"] = heap.heap_policy().kind
        print(json.dumps(res))
    """)
    assert r["glibc_default_acts"] is False and r["reuse_acts"] is False
    assert r["reuse"] == [1 << 30, 4 << 30]
    assert r["default_return"] == [32 << 20, 64 << 20] and r["default_return_acts"] is False
    assert r["return"] == [1 << 20, 128 << 10]
    assert r["return_acts"] is True and r["inside"] == [16 << 20, 32 << 20]
    assert r["nested_acts"] is True and r["nested"] == [32 << 20, 64 << 20]
    assert r["after_nested"] == [16 << 20, 32 << 20]  # the outer scope's thresholds hold until it ends
    assert r["small_acts"] is False
    assert r["after"] == r["return"] and r["after_error"] == r["return"] and r["kind"] == "return"


@glibc
@child
def test_scope_keeps_tile_temporaries_in_the_heap():
    """The fault count of 30 tile-sized temporaries allocated and freed in turn: each is a fresh mapping under
    the return policy (faulted in again every time; about 2048 per iteration here), far fewer inside the scope (the heap's pages are reused)."""
    r = _child("""
        import json, resource, torch
        from aidaptiv_ds.io import heap
        heap.return_freed_host_memory(1 << 20, 128 << 10)  # a threshold below the blocks: the scope acts
        def faults(kept):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if kept:
                with heap.temporaries_kept(8 << 20) as acts:
                    assert acts
                    for _ in range(30):
                        torch.ones(2 << 20).sqrt()
            else:
                for _ in range(30):
                    torch.ones(2 << 20).sqrt()
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        faults(True); faults(False)  # torch's own first-use allocations out of the way
        print(json.dumps({"fresh": faults(False), "kept": faults(True)}))
    """)
    assert r["fresh"] >= 30 * 1024, r  # fresh mappings each iteration (at least half of one block's 2048 pages)
    assert r["kept"] < r["fresh"] / 5, r


@glibc
@child
def test_tiled_step_bit_identical_inside_the_scope():
    """The tiled AdamW step under the return policy (the scope active) gives torch's whole-partition bits."""
    r = _child("""
        import json, torch
        from aidaptiv_ds.io import heap
        from aidaptiv_ds.integration.host_step import tiled_adam_step
        heap.return_freed_host_memory(1 << 20, 128 << 10)  # the scope acts
        torch.manual_seed(0)
        n = 5_000_003
        a = torch.nn.Parameter(torch.randn(n)); b = torch.nn.Parameter(a.detach().clone())
        oa = torch.optim.AdamW([a], lr=1e-3, weight_decay=0.1); ob = torch.optim.AdamW([b], lr=1e-3, weight_decay=0.1)
        for _ in range(3):
            g = torch.randn(n); a.grad = g.clone(); b.grad = g.clone()
            oa.step()
            assert tiled_adam_step(ob, ob.param_groups[0], b)
        same = bool(torch.equal(a, b)) and all(torch.equal(oa.state[a][k], ob.state[b][k]) for k in oa.state[a])
        print(json.dumps({"same": same, "after": heap.current_thresholds()}))
    """)
    assert r["same"] and r["after"] == [1 << 20, 128 << 10]


def test_planner_counts_the_scratch():
    tile = OPTIMIZER_TILE_NUMEL * 4
    assert OPTIMIZER_KEPT_TILES * tile == kept_heap_bound(tile)  # the planner's tiles are the scope's bound
    assert optimizer_scratch_bytes() == 8 * tile == 64 << 20
    kw = dict(readahead_bytes=256 << 20, grad_window_bytes=80 << 20, deepspeed_bytes=1 << 30, activation_bytes=0,
              subgroup_numels=[10_000_000] * 4, moment_bytes_per_param=8)
    s = optimizer_scratch_bytes()
    base = cpu_rank_working_set(**kw)
    after = cpu_rank_working_set(**kw, step_scratch=s)  # steps after backward only
    inb = cpu_rank_working_set(**kw, step_scratch=s, in_backward_slice_bytes=120_000_000)
    assert after["optimizer"] == base["optimizer"] + s and after["backward"] == base["backward"]
    assert inb["backward"] == cpu_rank_working_set(**kw, in_backward_slice_bytes=120_000_000)["backward"] + s
    # the pool holds our swap buffers, not torch's temporaries
    assert buffer_pool_bytes(inb, 1 << 30) == buffer_pool_bytes(
        cpu_rank_working_set(**kw, in_backward_slice_bytes=120_000_000), 1 << 30)
    assert buffer_pool_bytes(after, 1 << 30) == buffer_pool_bytes(base, 1 << 30)
