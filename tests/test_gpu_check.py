"""launch/gpu_check.sh: the one prepared GPU run, tested here without a GPU.

The end-to-end test runs ``launch/gpu_check.sh OUTDIR --smoke`` on CPU (every section at a tiny size:
the oracle on the CPU accelerator, the CUDA tests skipped with their reason, the comparison with all
five backends) and checks the files it leaves; the rest are fast tests of its pieces (the oracle
plan and verdicts, the junit parsing, the section verdicts, the model choice).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from _oracle import REPO, half_state_budget, llama_shape

SCRIPT = os.path.join(REPO, "launch", "gpu_check.sh")


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check_driver", os.path.join(REPO, "launch", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_half_state_budget_follows_the_oracle_llama():
    """The shape behind the "half the state" budget is train_oracle's Llama, parameter for parameter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = llama_shape()
    # train_oracle.llama_config (tests/scripts/train_oracle.py) with the default --hidden 256 --layers 2
    m = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256 * 2 + 24,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=128, tie_word_embeddings=True, rms_norm_eps=1e-5))
    n = sum(p.numel() for p in m.parameters())
    assert shape.n_params() == n
    assert half_state_budget("bf16") == n * (2 + 4 + 8 + 4) // 2
    assert half_state_budget("fp32") == n * (4 + 4 + 8 + 4) // 2


def test_oracle_plan_repeats_the_reference_only_on_cuda():
    g = _driver()
    cpu, cuda = g.oracle_plan(False), g.oracle_plan(True)
    assert [(d, n) for d, n, _, _ in cpu] == [(d, n) for d in ("bf16", "fp32")
                                              for n in ("reference", "aidaptiv_budget0", "aidaptiv_half")]
    assert sum(n == "reference_repeat" for _, n, _, _ in cuda) == 2 and len(cuda) == 8
    half = [x for d, n, _, x in cpu if d == "bf16" and n == "aidaptiv_half"][0]
    assert half == ["--budget", str(half_state_budget("bf16"))]


def _res(losses, norms=(2.0, 1.5), param=0.0):
    import torch

    return {"losses": losses, "norms": list(norms), "params": {"w": torch.full((3,), param)},
            "masters": [torch.full((3,), param)]}


def test_oracle_verdicts_name_what_differs():
    g = _driver()
    ref = _res([[1.0, 2.0]])
    results = {"bf16": {"reference": {"ok": True, "_res": ref},
                        "reference_repeat": {"ok": True, "_res": _res([[1.0, 2.0]])},
                        "aidaptiv_budget0": {"ok": True, "_res": _res([[1.0, 2.0]], param=1e-3)},
                        "aidaptiv_half": {"ok": False, "error": "exit code 1: boom"}},
               "fp32": {"reference": {"ok": False, "error": "x"}, "aidaptiv_budget0": {"ok": True, "_res": ref}}}
    v = g.verdicts(results, cuda=True)
    assert v["bf16"]["reference_repeat"] == "identical" and v["bf16"]["clipping_acted"] is True
    assert v["bf16"]["aidaptiv_budget0"].startswith("DIFFERENT: parameter w differs")
    assert v["bf16"]["aidaptiv_half"] == "failed: exit code 1: boom"
    assert v["fp32"]["aidaptiv_budget0"] == "not compared: the reference run failed"
    results["bf16"]["aidaptiv_budget0"]["_res"] = _res([[1.0, 2.0]], norms=(2.0, 1.25))
    assert "gradient norms differ" in g.verdicts(results, cuda=True)["bf16"]["aidaptiv_budget0"]
    s = g.summarize({"oracle": {"verdicts": v}})
    assert s["oracle"]["ok"] is False and s["oracle"]["verdicts"]["bf16 reference_repeat"] == "identical"
    good = {"bf16": {"reference_repeat": "identical", "aidaptiv_budget0": "identical", "clipping_acted": True}}
    assert g.summarize({"oracle": {"verdicts": good}})["oracle"]["ok"] is True


def test_junit_outcomes_and_the_hazard_verdict(tmp_path):
    g = _driver()
    xml = tmp_path / "j.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite>
      <testcase classname="tests.gpu.test_copy_hazard" name="test_a" time="0.5"/>
      <testcase classname="tests.gpu.test_copy_hazard" name="test_b" time="0.1">
        <failure message="AssertionError: the gather copy saw bytes">trace</failure></testcase>
      <testcase classname="tests.gpu.test_pinned_memory" name="test_c" time="0">
        <skipped type="pytest.skip" message="no CUDA device: ..."/></testcase>
      <testcase classname="tests.gpu.test_copy_hazard" name="test_d" time="0.2">
        <skipped type="pytest.xfail" message="resident parameters ..."/></testcase>
    </testsuite></testsuites>""")
    tests = g.parse_junit(str(xml))
    assert [(t["test"], t["outcome"]) for t in tests] == [
        ("test_copy_hazard::test_a", "passed"), ("test_copy_hazard::test_b", "failure"),
        ("test_pinned_memory::test_c", "skipped"), ("test_copy_hazard::test_d", "xfailed")]
    assert tests[1]["message"].startswith("AssertionError")
    counts = {"passed": 1, "failure": 1, "error": 0, "skipped": 1, "xfailed": 1}
    assert g.summarize({"hazard": {"tests": tests, "counts": counts}})["hazard"]["ok"] is False
    counts.update(failure=0)
    assert g.summarize({"hazard": {"tests": tests, "counts": counts}})["hazard"]["ok"] is True
    skipped_only = {"passed": 0, "failure": 0, "error": 0, "skipped": 4, "xfailed": 0}
    assert g.summarize({"hazard": {"tests": tests, "counts": skipped_only}})["hazard"]["ok"] is False


def test_the_comparison_model_falls_back_to_what_the_disk_holds(tmp_path, monkeypatch):
    g = _driver()
    a = type("A", (), {"work": str(tmp_path), "bench_params": "1.1B"})()

    class St:
        f_frsize = 1
        f_bavail = 5 * 2 ** 30  # 5 GiB: not the 1.1B model's ~22 GB of state, the 150M's ~3 GB
    monkeypatch.setattr(os, "statvfs", lambda _p: St)
    preset, why = g.bench_shape(a, ["gpu", "cpu", "aidaptiv0"])
    assert preset == "150M" and "1.1B needs" in why and "5.0 GiB free" in why
    assert g.bench_shape(a, ["gpu", "cpu"]) == ("1.1B", "as asked")  # nothing goes to the drive


@pytest.mark.subprocess
@pytest.mark.slow
def test_gpu_check_smoke_on_cpu(tmp_path):
    """The whole script at a tiny size on CPU: every section runs and leaves its JSON."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PYTHONPATH=REPO, PYTHON=sys.executable)
    p = subprocess.run(["bash", SCRIPT, str(out), "--smoke", "--work", str(work)], env=env, capture_output=True,
                       text=True, timeout=2700)
    tail = (p.stdout + p.stderr)[-6000:]
    assert p.returncode == 0, tail
    files = sorted(os.listdir(out))
    assert files == ["aio.json", "bench.json", "env.json", "gpu_check.log", "hazard.json", "oracle.json",
                     "summary.json"], files
    load = lambda name: json.loads((out / name).read_text())  # noqa: E731
    env_j = load("env.json")
    assert env_j["smoke"] and not env_j["cuda_available"] and env_j["deepspeed"]["accelerator"] == "cpu"
    oracle = load("oracle.json")
    for dtype in ("bf16", "fp32"):
        v = oracle["verdicts"][dtype]
        assert v["aidaptiv_budget0"] == v["aidaptiv_half"] == "identical", v
        assert v["clipping_acted"] is True
        runs = oracle["runs"][dtype]
        assert runs["aidaptiv_half"]["budget_bytes"] == half_state_budget(dtype)
        assert runs["reference"]["device"] == "cpu" and "reference_repeat" not in runs
    hazard = load("hazard.json")
    assert hazard["tests"] and all(t["outcome"] == "skipped" and "no CUDA device" in t["message"]
                                   for t in hazard["tests"])
    assert load("aio.json")["status"].startswith("not built: --smoke")
    comp = load("bench.json")["comparisons"][-1]
    figs = comp["summary"]
    assert set(figs) == {"gpu", "cpu", "aidaptiv_auto", "aidaptiv0", "native"}
    assert all(f["ok"] for f in figs.values()), {b: f.get("errors") for b, f in figs.items()}
    assert figs["aidaptiv0"]["loss_max_abs_diff"] == 0.0 and figs["aidaptiv0"]["tokens_per_s"] > 0
    assert figs["aidaptiv0"].get("overlap_efficiency") is not None  # the drive was measured first
    summary = load("summary.json")
    assert summary["summary"]["oracle"]["ok"] and summary["summary"]["bench"]["ok"]
    assert not summary["summary"]["hazard"]["ok"]  # nothing ran without CUDA: never reported as passed
    assert summary["bench_run"]["drive"]["ok"] and summary["elapsed_s"] < summary["budget_s"]
    assert "==== gpu_check summary ====" in (out / "gpu_check.log").read_text()
