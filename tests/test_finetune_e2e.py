"""End-to-end runs of launch/finetune.py, each in a fresh interpreter (DeepSpeed keeps global state).

* the embedded demo with ds_configs/cpu_offload.json (the reference run of this file);
* stories260K (a real HF checkpoint) on 8 real Dolly records: eval lines, summary, and the saved HF
  directory reloads and reproduces the reported eval loss; the loaded weights reproduce eval_loss_before;
* bf16: the saved safetensors are bf16;
* ds_configs/native_nvme.json through aidaptiv_ds's pure-Python aio handle: same losses as DRAM offload;
* the ``deepspeed`` launcher (1 rank; 2 ranks is ``slow``);
* ds_configs/aidaptiv_zero3*.json once those files exist.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from _oracle import STORIES, STORIES_ABSENT

from aidaptiv_ds.ports import free_port

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.normpath(os.path.join(REPO, "..", "shared", "data"))
#: shipped with the repository (CC BY-SA 3.0: data/dolly/NOTICE)
DOLLY = os.path.join(REPO, "data", "dolly", "dolly_sample_151.jsonl")
CPU_OFFLOAD = os.path.join(REPO, "ds_configs", "cpu_offload.json")
STEP_KEYS = {"step", "epoch", "loss", "lr", "tokens", "tokens_per_s", "step_time_s", "bytes_read", "bytes_written",
             "proc_read_bytes", "proc_write_bytes", "dram_bytes", "dram_peak_bytes", "io_wait_s"}
SUMMARY_KEYS = {"bytes_written_per_param_per_step", "proc_bytes_written_per_param_per_step", "total_params", "steps",
                "mean_tokens_per_s", "final_eval_loss", "eval_loss_before", "saved_model", "timed_steps"}
DEMO_STEPS = 6


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def finetune(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return _run([sys.executable, os.path.join("launch", "finetune.py"), *args], timeout)


def child(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one ``RESULT <json>`` line."""
    p = _run([sys.executable, "-c", textwrap.dedent(code)])
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])


def metrics(out_dir) -> tuple[list[dict], list[dict], dict]:
    """(eval lines, step lines, summary line) of a run."""
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(ln) for ln in f]
    evals = [ln for ln in lines if "eval_loss" in ln and not ln.get("summary")]
    steps = [ln for ln in lines if "loss" in ln and "eval_loss" not in ln and not ln.get("summary")]
    summaries = [ln for ln in lines if ln.get("summary")]
    assert len(summaries) == 1 and lines[-1] is summaries[0]
    return evals, steps, summaries[0]


def _need_shared(*paths):
    for p in paths:
        if not os.path.exists(p):
            pytest.skip(STORIES_ABSENT if p == STORIES else f"shared data absent: {p}")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The embedded demo (no model/data flags) with DRAM offload: the reference losses of this file."""
    out = str(tmp_path_factory.mktemp("demo"))
    finetune("--deepspeed", CPU_OFFLOAD, "--output_dir", out, "--max_steps", str(DEMO_STEPS))
    return out


def test_demo_runs_by_default_learns_and_logs_every_step(demo_run):
    evals, steps, summary = metrics(demo_run)
    assert [s["step"] for s in steps] == list(range(1, DEMO_STEPS + 1))
    for s in steps:
        assert STEP_KEYS <= s.keys()
        assert isinstance(s["bytes_read"], dict) and isinstance(s["bytes_written"], dict)
        assert s["tokens"] > 0 and s["tokens_per_s"] > 0 and math.isfinite(s["loss"]) and s["lr"] == 1e-3
    assert [e["step"] for e in evals] == [0, DEMO_STEPS]
    # ~ln(259) = 5.56 before training: the random-init weights really carry transformers' init
    assert abs(evals[0]["eval_loss"] - math.log(259)) < 0.5
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["steps"] == DEMO_STEPS and summary["timed_steps"] == DEMO_STEPS - 1
    assert summary["final_eval_loss"] == evals[-1]["eval_loss"]
    assert summary["total_params"] == 427008
    assert summary["bytes_written_per_param_per_step"] is None      # DRAM offload: no cache-tier counters
    assert summary["proc_bytes_written_per_param_per_step"] is not None
    for name in ("config.json", "model.safetensors", "tokenizer.json", "eval_split.jsonl", "finetune_args.json"):
        assert os.path.isfile(os.path.join(demo_run, name)), name


def _dolly_subset(path, n=8) -> str:
    """The first ``n`` Dolly records without a context (short prompts fit stories260K's 512 positions)."""
    kept = []
    with open(DOLLY, encoding="utf-8") as f:
        for line in f:
            if not json.loads(line)["context"]:
                kept.append(line)
            if len(kept) == n:
                break
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(kept)
    return str(path)


def test_stories260k_on_dolly_saves_a_model_that_reproduces_the_eval_loss(tmp_path, monkeypatch):
    """The data as a Hugging Face dataset: ``--data_path`` a local directory laid out as the Hub repository
    ``databricks/databricks-dolly-15k`` (one JSONL file), loaded through ``datasets.load_dataset`` as a Hub
    id is (the ``datasets`` cache under the test's directory)."""
    _need_shared(DOLLY, STORIES)
    pytest.importorskip("datasets", reason="the datasets library (the test extra) is not installed")
    (tmp_path / "databricks-dolly-15k").mkdir()
    data = os.path.dirname(_dolly_subset(tmp_path / "databricks-dolly-15k" / "databricks-dolly-15k.jsonl"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    out = str(tmp_path / "out")
    # 6 train examples, micro-batch 2, accumulation 2: windows of 2 + 1 micro-batches, 2 steps per epoch
    finetune("--model_name_or_path", STORIES, "--data_path", data, "--deepspeed", CPU_OFFLOAD, "--output_dir", out,
             "--max_steps", "4", "--max_seq_length", "256", "--per_device_train_batch_size", "2",
             "--gradient_accumulation_steps", "2", "--eval_fraction", "0.25", "--learning_rate", "1e-3")
    evals, steps, summary = metrics(out)
    assert [(e["step"], e["epoch"]) for e in evals] == [(0, 0.0), (2, 1.0), (4, 2.0)]
    assert [s["epoch"] for s in steps] == [0.6667, 1.0, 1.6667, 2.0]   # share of the micro-batches done
    assert summary["n_train_examples"] == 6 and summary["n_eval_examples"] == 2 and summary["dropped_examples"] == 0
    assert summary["total_params"] == 260032 and summary["dtype"] == "float32"
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    got = child(f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        from aidaptiv_ds.finetune.evaluate import reload_eval_loss, evaluate, hf_forward
        from aidaptiv_ds.finetune.data import read_dolly
        from aidaptiv_ds.finetune.template import encode_records, pad_token_id
        from aidaptiv_ds.finetune.model_io import load_tokenizer, resolve_source
        reloaded = reload_eval_loss({out!r}, torch.float32)
        tok = load_tokenizer(resolve_source({STORIES!r}))
        ex = encode_records(tok, read_dolly({out!r} + "/eval_split.jsonl"), 256).examples
        orig = evaluate(hf_forward(AutoModelForCausalLM.from_pretrained({STORIES!r}, dtype=torch.float32).eval()), ex, 2,
                        pad_token_id(tok))
        print("RESULT " + json.dumps({{"reloaded": reloaded, "original": orig}}))
    """)
    # Same fp32 weights, same batches and kernels: equal up to float summation order (observed: exactly equal).
    assert got["reloaded"]["eval_loss"] == pytest.approx(summary["final_eval_loss"], rel=1e-6, abs=0)
    assert got["reloaded"]["eval_tokens"] == evals[-1]["eval_tokens"]
    # The weights ZeRO-3 loaded into the partitions are the checkpoint's: the untouched model scores eval_loss_before.
    assert got["original"]["eval_loss"] == pytest.approx(summary["eval_loss_before"], rel=1e-6, abs=0)


def test_bf16_run_saves_bf16_safetensors_that_reload(tmp_path):
    _need_shared(DOLLY, STORIES)
    data = _dolly_subset(tmp_path / "dolly8.jsonl")
    out = str(tmp_path / "out")
    finetune("--model_name_or_path", STORIES, "--data_path", data, "--deepspeed", CPU_OFFLOAD, "--output_dir", out,
             "--max_steps", "1", "--max_seq_length", "128", "--per_device_train_batch_size", "2",
             "--eval_fraction", "0.25", "--bf16", "true")
    _, _, summary = metrics(out)
    assert summary["dtype"] == "bfloat16"
    got = child(f"""
        import json
        from safetensors import safe_open
        from aidaptiv_ds.finetune.evaluate import reload_eval_loss
        with safe_open({out!r} + "/model.safetensors", "pt") as f:
            dtypes = sorted({{str(f.get_slice(k).get_dtype()) for k in f.keys()}})
        print("RESULT " + json.dumps({{"dtypes": dtypes, "config_dtype": json.load(open({out!r} + "/config.json"))["dtype"],
                                       "reloaded": reload_eval_loss({out!r})}}))
    """)
    assert got["dtypes"] == ["BF16"] and got["config_dtype"] == "bfloat16"
    # bf16 weights scored in bf16 by plain transformers: the engine's forward does the same arithmetic
    # (observed: exactly equal; the tolerance only allows another float summation order)
    assert got["reloaded"]["eval_loss"] == pytest.approx(summary["final_eval_loss"], rel=1e-6, abs=0)


def test_native_nvme_config_trains_through_the_python_aio_handle_like_dram_offload(demo_run, tmp_path):
    cache = tmp_path / "nvme"
    cache.mkdir()
    out = str(tmp_path / "out")
    finetune("--deepspeed", os.path.join(REPO, "ds_configs", "native_nvme.json"), "--cache_path", str(cache),
             "--aio_handle", "aidaptiv", "--output_dir", out, "--max_steps", str(DEMO_STEPS))
    _, steps, summary = metrics(out)
    _, ref_steps, _ = metrics(demo_run)
    # same arithmetic, only the storage differs: bit-identical losses (the design's oracle)
    assert [s["loss"] for s in steps] == [s["loss"] for s in ref_steps]
    assert os.path.isdir(os.path.join(cache, "zero_stage_3", "optimizer"))
    assert summary["proc_bytes_written_per_param_per_step"] is not None


def _deepspeed_cli() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.isfile(exe):
        exe = shutil.which("deepspeed")
    if not exe:
        pytest.skip("the deepspeed launcher script is not installed next to this python")
    return exe


def test_deepspeed_launcher_single_rank_matches_the_single_process_run(demo_run, tmp_path):
    out = str(tmp_path / "out")
    _run([_deepspeed_cli(), "--num_gpus", "1", "--master_port", str(free_port()), os.path.join("launch", "finetune.py"),
          "--deepspeed", CPU_OFFLOAD, "--output_dir", out, "--max_steps", "2"])
    _, steps, _ = metrics(out)
    _, ref_steps, _ = metrics(demo_run)
    assert [s["loss"] for s in steps] == [s["loss"] for s in ref_steps[:2]]


@pytest.mark.slow
@pytest.mark.multirank
def test_deepspeed_launcher_two_ranks_reload_matches(tmp_path):
    out = str(tmp_path / "out")
    _run([_deepspeed_cli(), "--num_gpus", "2", "--master_port", str(free_port()), os.path.join("launch", "finetune.py"),
          "--deepspeed", CPU_OFFLOAD, "--output_dir", out, "--max_steps", "3", "--gradient_accumulation_steps", "2"],
         timeout=400)
    evals, steps, summary = metrics(out)
    assert summary["world_size"] == 2 and len(steps) == 3 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    got = child(f"""
        import json
        from aidaptiv_ds.finetune.evaluate import reload_eval_loss
        print("RESULT " + json.dumps(reload_eval_loss({out!r})))
    """)
    # 2 ranks score rank-strided shards; the reload scores one sequence of batches: same sum, other order
    assert got["eval_loss"] == pytest.approx(summary["final_eval_loss"], rel=1e-6)


@pytest.mark.parametrize("name, n_paths", [("aidaptiv_zero3.json", 1), ("aidaptiv_zero3_multi.json", 2)])
def test_aidaptiv_configs_train_like_dram_offload(demo_run, tmp_path, name, n_paths):
    cfg = os.path.join(REPO, "ds_configs", name)
    if not os.path.isfile(cfg):
        pytest.skip(f"ds_configs/{name} is not in the tree yet (written with the aidaptiv_ds integration)")
    caches = []
    for i in range(n_paths):
        (tmp_path / f"cache{i}").mkdir()
        caches += ["--cache_path", str(tmp_path / f"cache{i}")]
    out = str(tmp_path / "out")
    finetune("--deepspeed", cfg, *caches, "--output_dir", out, "--max_steps", str(DEMO_STEPS))
    _, steps, summary = metrics(out)
    _, ref_steps, _ = metrics(demo_run)
    assert [s["loss"] for s in steps] == [s["loss"] for s in ref_steps]
    assert summary["bytes_written_per_param_per_step"] is not None    # the cache tier's counters are reported


def test_layer_major_trains_like_dram_offload_with_a_short_last_window(tmp_path):
    """``--layer_major``: each full window is one ``engine.train_batch`` (issue 38); one epoch of 45 micro-batches at
    GA 4 ends with a window of one, which runs micro-batch by micro-batch. Every step's loss and the eval losses
    equal DeepSpeed's own DRAM offload bit for bit."""
    common = ["--output_dir", None, "--num_train_epochs", "1", "--per_device_train_batch_size", "8",
              "--gradient_accumulation_steps", "4", "--save_strategy", "no"]
    ref, out = str(tmp_path / "ref"), str(tmp_path / "lm")
    finetune("--deepspeed", CPU_OFFLOAD, *[ref if a is None else a for a in common])
    (tmp_path / "cache").mkdir()
    finetune("--deepspeed", os.path.join(REPO, "ds_configs", "aidaptiv_zero3.json"), "--cache_path",
             str(tmp_path / "cache"), "--layer_major", *[out if a is None else a for a in common])
    ref_evals, ref_steps, _ = metrics(ref)
    evals, steps, _ = metrics(out)
    assert len(steps) == 12  # 11 windows of 4 and one of 1
    assert [s["loss"] for s in steps] == [s["loss"] for s in ref_steps]
    assert [e["eval_loss"] for e in evals] == [e["eval_loss"] for e in ref_evals]
