"""The runtime pins MKL's thread count (``integration/blas_threads.py``): the CPU-offload oracle's GEMMs.

MKL's dynamic mode is process-wide state, so each case runs in a fresh interpreter. The divergence it
prevents is timing-dependent (about one 2-step 40M run in eight on a 2-core machine, ``docs/profiling.md``),
so it is not a unit test; the oracle tests and ``launch/compare.py`` cover the numbers.
"""
from __future__ import annotations

import pytest
import torch

from _storage_helpers import run_child

pytestmark = pytest.mark.subprocess

if not torch.backends.mkl.is_available():  # pragma: no cover - non-MKL builds (aarch64, macOS)
    pytest.skip("this torch build has no MKL", allow_module_level=True)

_CHILD = """
import ctypes, json, os, sys, torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
get = getattr(lib, "mkl_serv_get_dynamic", None)
if get is None:
    print("RESULT " + json.dumps({"skip": "libtorch_cpu exports no mkl_serv_get_dynamic"})); sys.exit(0)
threads = torch.get_num_threads()
before = get()
from aidaptiv_ds.integration.config import parse_section
from aidaptiv_ds.integration.runtime import get_runtime
rt = get_runtime(parse_section({"cache_paths": [%(cache)r],
                                "dram_budget": 0, "run_name": "blas"}))
print("RESULT " + json.dumps({"before": before, "after": get(), "threads": (threads, torch.get_num_threads())}))
rt.close()
"""


def _run(tmp_path, **env):
    res = run_child(_CHILD % {"cache": str(tmp_path)}, **env)
    if "skip" in res:
        pytest.skip(res["skip"])
    return res


def test_runtime_switches_mkl_dynamic_threads_off(tmp_path, monkeypatch):
    monkeypatch.delenv("MKL_DYNAMIC", raising=False)
    res = _run(tmp_path)
    assert res["before"] == 1, "torch's default should leave MKL dynamic; the premise of the fix changed"
    assert res["after"] == 0
    assert res["threads"][0] == res["threads"][1]  # the intra-op thread count is kept


def test_user_mkl_dynamic_choice_is_kept(tmp_path):
    res = _run(tmp_path, MKL_DYNAMIC="TRUE")
    assert res["before"] == 1 and res["after"] == 1
