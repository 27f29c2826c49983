"""Fixtures shared by the pytest-benchmark suites of this directory."""
from __future__ import annotations

import os

import pytest


@pytest.fixture
def timing(request) -> bool:
    """True when the benchmarks time (``--benchmark-enable``); under the project's default
    ``--benchmark-disable`` each case runs once, at a smaller size, as a test."""
    c = request.config
    return not (c.getoption("benchmark_disable", False) and not c.getoption("benchmark_enable", False))


@pytest.fixture
def runtime(tmp_path, request):
    """A budget-0 runtime on its own cache directory (closed and deleted afterwards); the directory is
    under ``AIDAPTIV_BENCH_DIR`` when set (a real cache drive), else pytest's tmp dir."""
    from aidaptiv_ds.integration.config import AidaptivConfig
    from aidaptiv_ds.integration.runtime import Runtime

    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    base = os.environ.get("AIDAPTIV_BENCH_DIR") or str(tmp_path)
    d = os.path.join(base, f"aidaptiv-{name}-{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    rt = Runtime(AidaptivConfig(cache_paths=[d], dram_budget=0, run_name=name))
    yield rt
    rt.close()
