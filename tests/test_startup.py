"""What a user sees at start (``aidaptiv_ds/integration/startup.py``): the job's need on the cache paths
named whole, one line on rank 0, and our errors printed once without a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from aidaptiv_ds.integration import startup
from aidaptiv_ds.io.errors import StorageFullError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def test_job_need_counts_every_parameters_state_less_what_the_budget_keeps():
    n = 1_000_000
    bf16 = startup.job_need(n, {"bf16": {"enabled": True}}, budget=0, world=1)
    # bf16 parameters 2 + bf16 gradients 2 + fp32 master 4 + Adam moments 8
    assert bf16["state"] == 16 * n and bf16["need"] == 16 * n and bf16["param_bytes"] == 2
    fp32 = startup.job_need(n, {}, budget=0, world=1)
    assert fp32["state"] == 16 * n  # fp32: 4 + 4 + 12, the parameters read from the master slots
    two = startup.job_need(n, {}, budget=0, world=2)
    assert two["state"] == 8 * n  # per rank
    kept = startup.job_need(n, {"bf16": {"enabled": True}}, budget=4 * n, world=1)
    assert kept["resident"] == 4 * n and kept["need"] == 12 * n  # gradients, then parameters, stay in DRAM
    assert startup.job_need(n, {}, budget=100 * n, world=1)["need"] == 0


def test_grad_accum_is_resolved_as_deepspeed_resolves_it():
    """The drive preflight's ``gradient_accumulation_steps`` (partial gradient sums need extents above 1): given,
    else DeepSpeed's ``train_batch_size // micro // world``, else 1 (HF's "auto" is filled in later)."""
    assert startup._grad_accum({"gradient_accumulation_steps": 4}, 2) == 4
    assert startup._grad_accum({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 4) == 4
    assert startup._grad_accum({"gradient_accumulation_steps": "auto", "train_batch_size": "auto"}, 1) == 1
    assert startup._grad_accum({}, 8) == 1


def _fake_runtime(capacity: int, budget: int = 0):
    return types.SimpleNamespace(budget=budget, store=types.SimpleNamespace(capacity=lambda: capacity),
                                 namespace=types.SimpleNamespace(cache_paths=["/mnt/small"]))


def test_a_drive_too_small_is_named_with_the_whole_jobs_bytes(monkeypatch):
    from aidaptiv_ds.integration import runtime

    monkeypatch.setattr(runtime, "get_runtime", lambda cfg: _fake_runtime(100 * MiB))
    startup.preflight_params(None, {}, 6 * MiB)  # 96 MiB: fits
    with pytest.raises(StorageFullError) as e:
        startup.preflight_params(None, {}, 135_000_000)
    msg = str(e.value)
    assert "cache path /mnt/small needs 2.01 GiB" in msg and "the training state of this job (135,000,000 parameters" \
        in msg and "16 B/param" in msg and "has 100.00 MiB" in msg, msg
    assert "raise aidaptiv.dram_budget" in msg


def _fake_engine(n: int, write: int):
    p = types.SimpleNamespace(ds_numel=n, numel=lambda: 0)
    return types.SimpleNamespace(module=types.SimpleNamespace(parameters=lambda: [p]),
                                 optimizer=types.SimpleNamespace(aidaptiv_plan=types.SimpleNamespace(
                                     write_bytes_per_step=write)))


def test_the_start_line_says_active_paths_budget_and_the_plans_pace(tmp_path):
    from aidaptiv_ds.integration.config import AidaptivConfig

    led = types.SimpleNamespace(capacity=2 * 10 ** 12, rating=types.SimpleNamespace(rated_dwpd=1.0))
    rt = types.SimpleNamespace(
        namespace=types.SimpleNamespace(cache_paths=[str(tmp_path)]), budget=0, world=1, local_world=1,
        cfg=AidaptivConfig(cache_paths=[str(tmp_path)], dram_budget=0),
        store=types.SimpleNamespace(ledgers=[led], planned_share=lambda: [1.0], allocated=lambda: 8 * MiB))
    line = startup.startup_line(_fake_engine(10 ** 9, 12 * 10 ** 9), rt)
    assert line.startswith("aidaptiv_ds ") and " active: cache path " + str(tmp_path) + " (" in line, line
    assert "DRAM budget 0 B/rank" in line and "12.0 B/param" in line
    # 12 GB per step against 1 x 2 TB a day: one step every 518.4 s; the rating was not set in the config
    assert "rated 1 DWPD allows one step every 518.4 s or longer (rating assumed" in line, line
    rt.cfg = AidaptivConfig(cache_paths=[str(tmp_path)], dram_budget=0, endurance={"rated_dwpd": 1.0})
    assert "rating assumed" not in startup.startup_line(_fake_engine(10 ** 9, 12 * 10 ** 9), rt)
    assert "chosen here" not in line
    # the DeepSpeed settings the config left out and this backend chose are named (they were logged at INFO only)
    eng = _fake_engine(10 ** 9, 12 * 10 ** 9)
    eng.optimizer._aidaptiv = types.SimpleNamespace(picked={"sub_group_size": 26_041_666, "reduce_bucket_size": 2e7})
    line = startup.startup_line(eng, rt)
    assert "left out of the config, chosen here: zero_optimization.sub_group_size 2.6e+07 (DeepSpeed's default " \
           "1e+09), zero_optimization.reduce_bucket_size 2e+07 (DeepSpeed's default 5e+08)" in line, line


BAD = """
import deepspeed, torch
cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
       "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": CACHE, "max_in_cpu": 0},
                             "offload_optimizer": {"device": "nvme", "nvme_path": CACHE}},
       "aidaptiv": {"enabled": True, "dram_budgt": "1GiB"}}
deepspeed.initialize(model=torch.nn.Linear(4, 4), config=cfg)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("traceback", [False, True])
def test_a_refused_config_prints_its_message_once_without_a_traceback(tmp_path, traceback):
    env = dict(os.environ, PYTHONPATH=REPO, AIDAPTIV_DS_TRACEBACK="1" if traceback else "")
    env.pop("RANK", None)
    code = "CACHE = " + json.dumps(str(tmp_path)) + "\nimport aidaptiv_ds\n" + textwrap.dedent(BAD)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert p.stderr.count("'dram_budget'") == 1, p.stderr  # the fix, named once
    if traceback:
        assert "Traceback (most recent call last)" in p.stderr
    else:
        assert "Traceback" not in p.stderr, p.stderr
        assert "aidaptiv_ds stopped the program (set AIDAPTIV_DS_TRACEBACK=1 for the traceback):\n" \
               "aidaptiv_ds.errors.AidaptivConfigError: invalid \"aidaptiv\" section:" in p.stderr, p.stderr
        assert "aidaptiv.dram_budgt: unknown key; did you mean 'dram_budget'?" in p.stderr


def test_the_ranks_on_this_node_are_the_larger_of_the_launchers_counts(monkeypatch):
    """Under the ``deepspeed`` launcher HF Trainer's accelerate sets ``LOCAL_WORLD_SIZE=1`` beside the launcher's
    ``LOCAL_SIZE=2``: the node's ``auto`` budget is split over 2, not taken whole by each rank."""
    from aidaptiv_ds.integration.runtime import local_world_size

    for k in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert local_world_size() == 1
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert local_world_size() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert local_world_size() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_world_size() == 4
    from aidaptiv_ds.telemetry.netinfo import nodes_in_job  # the doctor's node count follows the same rule
    assert nodes_in_job({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1", "LOCAL_SIZE": "2"}) == 2
    assert nodes_in_job({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": " ", "LOCAL_SIZE": "x"}) is None


ZINIT_WITHOUT_CONFIG = """
import os
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
import deepspeed, torch
nvme = {"device": "nvme", "nvme_path": CACHE}
cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
       "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme},
       "aidaptiv": {"enabled": True, "cache_paths": [CACHE]}}
deepspeed.init_distributed()
with deepspeed.zero.Init():
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
"""


@pytest.mark.subprocess
def test_a_model_partitioned_by_zero_init_without_the_config_is_refused_with_the_fix(tmp_path):
    """``with deepspeed.zero.Init():`` (no config), then ``deepspeed.initialize`` with parameters on nvme: DeepSpeed
    stopped in its constructor on ``None.reserve_partitioned_swap_space`` (its own NVMe offload too); now the error
    names the parameter and says to give zero.Init the config (found by a new-user trial)."""
    from aidaptiv_ds.ports import free_port

    code = (f"CACHE = {json.dumps(str(tmp_path))}\nPORT = {json.dumps(str(free_port()))}\nimport aidaptiv_ds\n"
            + textwrap.dedent(ZINIT_WITHOUT_CONFIG))
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1
    assert "parameter 0.weight was partitioned by a deepspeed.zero.Init() that was not given this config" in p.stderr
    assert "deepspeed.zero.Init(config_dict_or_path=ds_config)" in p.stderr and "reserve_partitioned" not in p.stderr
