"""PyTorch's huge pages: the environment, the kernel mode and the runtime's advice (aidaptiv_ds/torch_env.py)."""
from __future__ import annotations

from aidaptiv_ds.torch_env import (
    TORCH_HUGE_PAGES_ENV,
    huge_pages_advice,
    kernel_huge_page_mode,
    torch_huge_pages_env,
    torch_huge_pages_on,
)


def test_the_users_value_wins():
    assert torch_huge_pages_env({}) == TORCH_HUGE_PAGES_ENV
    assert torch_huge_pages_env({"THP_MEM_ALLOC_ENABLE": "0"}) == {}


def test_on_reads_the_environment():
    assert torch_huge_pages_on({"THP_MEM_ALLOC_ENABLE": "1"})
    assert not torch_huge_pages_on({"THP_MEM_ALLOC_ENABLE": "0"}) and not torch_huge_pages_on({})


def test_advice_only_where_it_pays():
    off = {}
    assert "THP_MEM_ALLOC_ENABLE=1" in huge_pages_advice(False, "madvise", off)
    assert huge_pages_advice(True, "madvise", off) is None  # the heap is kept: no gain (and measured costs)
    assert huge_pages_advice(False, "never", off) is None  # the kernel gives none
    assert huge_pages_advice(False, None, off) is None
    assert huge_pages_advice(False, "always", {"THP_MEM_ALLOC_ENABLE": "1"}) is None  # already on


def test_kernel_mode(tmp_path):
    mm = tmp_path / "kernel" / "mm" / "transparent_hugepage"
    mm.mkdir(parents=True)
    (mm / "enabled").write_text("always [madvise] never\n")
    assert kernel_huge_page_mode(str(tmp_path)) == "madvise"
    (mm / "enabled").write_text("garbled\n")
    assert kernel_huge_page_mode(str(tmp_path)) is None
    assert kernel_huge_page_mode(str(tmp_path / "absent")) is None


def test_the_runtime_advises_once_where_no_heap_is_kept(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    from aidaptiv_ds.integration import runtime as rt_mod

    monkeypatch.setattr(rt_mod, "kernel_huge_page_mode", lambda: "madvise")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    rt = SimpleNamespace(cfg=SimpleNamespace(io=SimpleNamespace(reuse_host_memory="auto")), reuse_host_memory=False,
                         rank=0, _huge_pages_advised=False)
    with caplog.at_level(logging.INFO, logger="aidaptiv_ds"):
        assert rt_mod.Runtime.settle_host_memory_reuse(rt, heap_bytes=2, budget_free_bytes=1) is False
        rt_mod.Runtime.settle_host_memory_reuse(rt, heap_bytes=2, budget_free_bytes=1)
    assert sum("THP_MEM_ALLOC_ENABLE=1" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    rt._huge_pages_advised = False
    with caplog.at_level(logging.INFO, logger="aidaptiv_ds"):
        rt_mod.Runtime.settle_host_memory_reuse(rt, heap_bytes=2, budget_free_bytes=1)
    assert not any("THP_MEM_ALLOC_ENABLE" in r.getMessage() for r in caplog.records)
