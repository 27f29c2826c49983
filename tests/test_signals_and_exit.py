"""Signals, exits and the DRAM budget (issue 11.9).

* SIGTERM (what SLURM, Kubernetes and the launchers send) is handled like SIGINT: the process exits
  (status 143, one line on stderr) and the store's slab is deleted (``keep_files`` false) -- before,
  3 of 3 runs left the 256 MiB slab behind; a user's own SIGTERM handler is kept and called; a real
  training run stopped by SIGTERM, alone and under torchrun, cleans up;
* a cache directory that cannot be cleaned at exit (made immutable: EPERM even for root) is reported
  in one line, not an "Exception ignored in atexit callback" traceback;
* a ``dram_budget`` larger than the machine's memory is refused with the numbers; one larger than
  the memory available now is accepted with a warning.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _oracle import REPO, SCRIPT, free_port
from _storage_helpers import child_env

from aidaptiv_ds.integration import config as config_mod
from aidaptiv_ds.integration.config import AidaptivConfigError, check_dram_budget, host_memory_limit
from aidaptiv_ds.store.layout import list_namespaces

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

GiB = 1 << 30

# A process with a real runtime (store, slab, ledger) but no DeepSpeed engine: cheap, and what the
# signal and exit paths act on.
_RUNTIME_CHILD = """
import json, os, signal, sys, time
mode, cache, ready = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "user_handler":
    def mine(signum, frame):
        open(os.path.join(cache, "user_handler_ran"), "w").close()
        sys.exit(7)
    signal.signal(signal.SIGTERM, mine)
from aidaptiv_ds.integration.config import parse_section
from aidaptiv_ds.integration.runtime import get_runtime

rt = get_runtime(parse_section({"cache_paths": [cache], "dram_budget": 0, "run_name": "sig"}))
rt.store.preflight(64 << 20, "the test state")
with open(ready, "w") as f:
    json.dump({"rank_dir": rt.namespace.rank_dir(0), "slab": rt.store.slabs[0].path}, f)
if mode == "immutable":
    import subprocess
    subprocess.run(["chattr", "+i", rt.namespace.rank_dir(0)], check=True)
    sys.exit(0)
while True:
    time.sleep(0.05)
"""


def _start(tmp_path, mode: str):
    cache = tmp_path / "cache"
    cache.mkdir()
    ready = tmp_path / "ready.json"
    p = subprocess.Popen([sys.executable, "-c", _RUNTIME_CHILD, mode, str(cache), str(ready)], env=child_env(),
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not ready.exists():
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)
    time.sleep(0.1)
    return p, str(cache), json.loads(ready.read_text())


def test_sigterm_deletes_the_slab_and_exits_143(tmp_path):
    p, cache, info = _start(tmp_path, "plain")
    assert os.path.getsize(info["slab"]) >= 64 << 20
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"aidaptiv_ds: received SIGTERM (pid {p.pid}); closing the store and exiting with status 143"]
    assert not os.path.exists(info["rank_dir"]) and list_namespaces(cache) == []


def test_a_users_sigterm_handler_is_kept_and_the_store_still_closes(tmp_path):
    p, cache, info = _start(tmp_path, "user_handler")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 7, err                                  # the user's handler decided
    assert os.path.exists(os.path.join(cache, "user_handler_ran"))
    assert not os.path.exists(info["rank_dir"]), err               # and its sys.exit closed the store


def test_an_undeletable_store_at_exit_is_one_line(tmp_path):
    if subprocess.run(["chattr", "-V"], capture_output=True).returncode not in (0, 1):
        pytest.skip("chattr is not available")
    p, cache, info = _start(tmp_path, "immutable")
    try:
        out, err = p.communicate(timeout=120)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if p.returncode != 0 and "Operation not supported" in err:
            pytest.skip(f"this filesystem has no immutable flag: {err[-300:]}")
        assert p.returncode == 0, err
        assert "Traceback" not in err and "Exception ignored" not in err, err
        assert len(lines) == 1 and lines[0].startswith("aidaptiv_ds: could not delete the store's files: "), err
        assert info["slab"] in lines[0] and "aidaptiv-ds gc --cache" in lines[0] and "Fix:" in lines[0]
    finally:
        subprocess.run(["chattr", "-i", info["rank_dir"]], capture_output=True)
    assert os.path.exists(info["slab"])  # left, as the message says; gc removes it now
    from aidaptiv_ds.cli.main import main as cli
    assert cli(["gc", "--cache", cache, "--delete"]) == 0 and list_namespaces(cache) == []


@pytest.mark.parametrize("launcher", ["python", pytest.param("torchrun", marks=[pytest.mark.multirank,
                                                                               pytest.mark.slow])])
def test_sigterm_to_a_training_run_cleans_up(tmp_path, launcher):
    """A real run (the oracle harness) paused between steps gets SIGTERM -- directly, or through
    torchrun's agent, which forwards it to its ranks: every rank exits and deletes its slab."""
    cache = tmp_path / "cache"
    ws = 1 if launcher == "python" else 2
    args = [SCRIPT, "--backend", "aidaptiv", "--model", "llama", "--dtype", "bf16", "--steps", "4", "--budget", "0",
            "--cache", str(cache), "--out", str(tmp_path / "o.pt"), "--pause_at", "2", "--pause_dir", str(tmp_path)]
    cmd = [sys.executable, *args] if ws == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                  "2", "--master_port", str(free_port()), *args]
    env = dict(os.environ, PYTHONPATH=REPO, MASTER_PORT=str(free_port()), AIDAPTIV_DS_NO_AUTOINSTALL="")
    p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not all((tmp_path / f"paused_2.rank{r}").exists() for r in range(ws)):  # every rank at its pause
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert len([n for n in list_namespaces(str(cache)) if n["live"]]) == ws
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode != 0
    assert err.count("aidaptiv_ds: received SIGTERM") == ws, err[-3000:]
    assert list_namespaces(str(cache)) == [], (list_namespaces(str(cache)), err[-3000:])


# ----------------------------------------------------------------------------------------- the budget
def test_a_budget_over_the_machines_memory_is_refused_with_the_numbers(monkeypatch):
    monkeypatch.setattr(config_mod, "host_memory_limit", lambda: (23 * GiB, "MemTotal in /proc/meminfo"))
    with pytest.raises(AidaptivConfigError) as e:
        check_dram_budget("1TB", 10 ** 12, local_ranks=1)
    msg = str(e.value)
    assert msg.startswith("aidaptiv.dram_budget: '1TB' (931.32 GiB per rank) is more than this machine's memory, "
                          "23.00 GiB (MemTotal in /proc/meminfo)") and "Fix:" in msg and '"auto"' in msg
    with pytest.raises(AidaptivConfigError, match=r"8.00 GiB per rank x 4 ranks on this node = 32.00 GiB"):
        check_dram_budget("8GiB", 8 * GiB, local_ranks=4)
    check_dram_budget("auto", "auto", local_ranks=4)
    check_dram_budget(0, 0, local_ranks=4)


def test_a_budget_over_the_available_memory_warns_once(monkeypatch):
    monkeypatch.setattr(config_mod, "host_memory_limit", lambda: (64 * GiB, "MemTotal in /proc/meminfo"))
    import aidaptiv_ds.telemetry.sysinfo as si
    monkeypatch.setattr(si, "host_memory", lambda *a: {"total_bytes": 64 * GiB, "available_bytes": 10 * GiB})
    monkeypatch.setattr(config_mod, "_BUDGET_WARNED", set())
    with pytest.warns(config_mod.BudgetWarning, match=r"more than the memory available now, 10.00 GiB"):
        check_dram_budget("12GiB", 12 * GiB, local_ranks=1)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_dram_budget("12GiB", 12 * GiB, local_ranks=1)  # once per process
        check_dram_budget("8GiB", 8 * GiB, local_ranks=1)   # fits: silent


def test_validate_refuses_it_on_this_machine(tmp_path):
    """End to end through ``validate`` (what ``deepspeed.initialize`` and ``zero.Init`` run)."""
    from aidaptiv_ds.integration.config import validate
    limit, _ = host_memory_limit()
    assert limit and limit < 1 << 50
    cache = tmp_path / "c"
    cache.mkdir()
    ds = {"train_micro_batch_size_per_gpu": 1,
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(cache), "max_in_cpu": 0},
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(cache)}},
          "aidaptiv": {"enabled": True, "dram_budget": "1PiB"}}
    with pytest.raises(AidaptivConfigError, match=r"aidaptiv.dram_budget: '1PiB' .* more than this machine's memory"):
        validate(ds)


def test_the_cgroup_limit_counts_when_smaller(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal:       65536000 kB\nMemAvailable:   60000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert host_memory_limit(str(proc), str(cg)) == (65536000 * 1024, "MemTotal in /proc/meminfo")
    (cg / "memory.max").write_text("max\n")
    assert host_memory_limit(str(proc), str(cg))[0] == 65536000 * 1024
    (cg / "memory.max").write_text(f"{8 * GiB}\n")
    assert host_memory_limit(str(proc), str(cg)) == (8 * GiB, f"the cgroup limit {cg / 'memory.max'}")
