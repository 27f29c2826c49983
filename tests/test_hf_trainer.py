"""An unmodified HF ``Trainer --deepspeed`` script runs on aidaptiv_ds through ``python -m aidaptiv_ds.run``
(no import of aidaptiv_ds in the script) and trains exactly like DeepSpeed's CPU offload."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _oracle import REPO, STORIES, STORIES_ABSENT, free_port

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

SCRIPT = os.path.join(REPO, "tests", "scripts", "hf_trainer.py")


def trainer_run(cfg: dict, tmp_path, name: str, launcher: str = "python", extra: tuple = ()) -> dict:
    """The script's result; ``launcher`` ``python`` (``python -m aidaptiv_ds.run``) or ``accelerate``
    (``accelerate launch --use_deepspeed``, the package's site hook activating aidaptiv_ds)."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    # MKL on a fixed thread count (as the runtime sets it, integration/blas_threads.py) and alignment-independent
    # (aidaptiv_ds/bench/runner.py REPRODUCIBLE_MKL) in both runs
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=REPO, MASTER_PORT=port, MKL_DYNAMIC="FALSE", MKL_CBWR="AUTO,STRICT")
    head = [sys.executable, "-m", "aidaptiv_ds.run"] if launcher == "python" else [
        os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--use_deepspeed",
        "--deepspeed_config_file", str(path), "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", port]
    p = subprocess.run([*head, SCRIPT, STORIES, str(path), str(tmp_path / name), *extra],
                       env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-5000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    res["started"] = [ln for ln in p.stderr.splitlines() if ln.startswith("aidaptiv_ds ") and " active: " in ln]
    return res


def _configs(tmp_path) -> tuple[dict, dict, str]:
    """(ds_configs/aidaptiv_zero3.json on a cache directory under ``tmp_path`` at budget 0,
    ds_configs/cpu_offload.json, the cache directory)."""
    with open(os.path.join(REPO, "ds_configs", "aidaptiv_zero3.json")) as f:
        ours = json.load(f)
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    for sec in ("offload_param", "offload_optimizer"):
        ours["zero_optimization"][sec]["nvme_path"] = cache
    ours["aidaptiv"].update(cache_paths=[cache], dram_budget=0)
    with open(os.path.join(REPO, "ds_configs", "cpu_offload.json")) as f:
        ref = json.load(f)
    return ours, ref, cache


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
def test_unmodified_hf_trainer_script(tmp_path):
    ours, ref, cache = _configs(tmp_path)
    got, want = trainer_run(ours, tmp_path, "aidaptiv"), trainer_run(ref, tmp_path, "cpu")
    assert got["param_swapper"] == "AidaptivParamSwapper"
    assert got["optimizer_swapper"] == "AidaptivOptimizerSwapper"
    assert len(got["losses"]) == 3 and got["losses"] == want["losses"]
    # the unchanged script says once that aidaptiv_ds runs it, with the cache path and the budget
    (line,) = got["started"]
    assert f"cache path {cache} (" in line and "DRAM budget 0 B/rank" in line and "written per step" in line, line
    assert want["started"] == []
    # accelerate launch --use_deepspeed (HF's other launcher): the same run, the same losses
    acc = trainer_run(ours, tmp_path, "accelerate", launcher="accelerate")
    assert acc["param_swapper"] == "AidaptivParamSwapper" and acc["losses"] == want["losses"] and len(acc["started"]) == 1


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)
def test_layer_major_trainer_equals_the_cpu_offload_trainer(tmp_path):
    """``LayerMajorTrainer`` (issue 38) at GA 3 with HF's defaults (clipping 1.0, the loss normalised by the window's
    tokens): the logged losses equal ``Trainer`` on DeepSpeed's CPU offload bit for bit. 14 examples at 2 per
    micro-batch: windows of 3, 3 and 1 micro-batches; the last, short, runs micro-batch by micro-batch."""
    ours, ref, cache = _configs(tmp_path)
    want = trainer_run(ref, tmp_path, "cpu", extra=("3", "14"))
    got = trainer_run(ours, tmp_path, "layer_major", extra=("3", "14", "layer_major"))
    assert got["layer_major_steps"] == 1 and want["layer_major_steps"] == 0
    assert len(got["losses"]) == 3 and got["losses"] == want["losses"]


def test_a_lone_process_is_a_world_of_one_and_a_launchers_ranks_are_kept():
    """``python -m aidaptiv_ds.run`` with no launcher's rank variables sets those of a world of one (DeepSpeed
    would look for MPI and fail on a missing mpi4py, found by a new-user trial); under any launcher's variables
    it sets nothing."""
    from aidaptiv_ds.run import single_process_env

    env: dict = {"MASTER_PORT": "29999"}
    single_process_env(env)
    assert env["RANK"] == env["LOCAL_RANK"] == "0" and env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29999"  # a port given is kept
    fresh: dict = {}
    single_process_env(fresh)
    assert 0 < int(fresh["MASTER_PORT"]) < 65536
    for launcher in ({"RANK": "3", "WORLD_SIZE": "8"}, {"OMPI_COMM_WORLD_SIZE": "4"}, {"SLURM_NTASKS": "2"}):
        env = dict(launcher)
        assert single_process_env(env) == {} and env == launcher
    srun = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "LOCAL_RANK": "0"}  # srun -n1: one process, set up here
    single_process_env(srun)
    assert srun["RANK"] == "0" and srun["WORLD_SIZE"] == "1" and srun["LOCAL_RANK"] == "0"
