"""ZeRO-Inference through aidaptiv_ds: HF ``generate`` on a ZeRO-3 engine without an optimizer, the weights
on the cache path. Greedy output and logits identical to the model without offload (stories260K, fp32),
nothing written while generating, weights streamed per token at budget 0 and read once when they fit.
Every run is a fresh process (DeepSpeed and the aidaptiv_ds runtime keep process-global state)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from _oracle import REPO, STORIES, STORIES_ABSENT, free_port

pytestmark = [pytest.mark.subprocess,  # every test here starts a child process (tests/conftest.py)
              pytest.mark.skipif(not os.path.isdir(STORIES), reason=STORIES_ABSENT)]
PROMPT = {"prompt_tokens": 40, "seed": 1, "max_new_tokens": 12}


def worker(tmp_path, name: str, **spec) -> tuple[dict, list]:
    spec = {"model": STORIES, "dtype": "fp32", "cache_dir": str(tmp_path / f"cache_{name}"), "repeats": 1,
            "scores_path": str(tmp_path / f"{name}.pt"), **PROMPT, **spec}
    os.makedirs(spec["cache_dir"], exist_ok=True)
    sp, out = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.json"
    sp.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=REPO, MASTER_PORT=str(free_port()), AIDAPTIV_DS_NO_AUTOINSTALL="")
    p = subprocess.run([sys.executable, "-m", "aidaptiv_ds.bench.zero_inference", str(sp), str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{name} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(out.read_text()), torch.load(spec["scores_path"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return worker(tmp_path_factory.mktemp("plain"), "plain", backend="plain")


def assert_same(ref, got):
    (r, rs), (g, gs) = ref, got
    assert g["output_ids"] == r["output_ids"]
    assert len(gs) == len(rs) and all(torch.equal(a, b) for a, b in zip(rs, gs)), "logits differ"


def test_budget0_streams_the_weights_and_matches_the_plain_model(reference, tmp_path):
    """``from_pretrained`` under ``HfDeepSpeedConfig`` (zero.Init), DRAM budget 0, two generate calls (the
    first records DeepSpeed's trace, the second prefetches along it)."""
    got = worker(tmp_path, "b0", backend="aidaptiv", load="pretrained", dram_budget=0, repeats=2)
    res = got[0]
    assert res["swapper"] == "AidaptivParamSwapper" and res["plan"]["params_resident"] is False
    assert_same(reference, got)
    assert res["written_during_generate"] == 0  # nothing is written per token, nor during the prefill
    tok = res["per_token"]
    assert len({t["cache_written"] for t in tok}) == 1 and len({t["proc_write"] for t in tok}) == 1
    reads = [b["cache_read"] - a["cache_read"] for a, b in zip(tok, tok[1:])]
    # every token reads the weights again (budget 0); the tied embedding (512 x 64 fp32), used first and last
    # in a forward, stays gathered from one token's lm_head to the next token's embedding
    assert min(reads) >= res["plan"]["param_bytes"] - 512 * 64 * 4


def test_weights_that_fit_the_budget_are_read_once(reference, tmp_path):
    got = worker(tmp_path, "res", backend="aidaptiv", load="pretrained", dram_budget="64MiB")
    res = got[0]
    assert res["plan"]["params_resident"] is True and res["written_during_generate"] == 0
    assert_same(reference, got)
    assert len({t["cache_read"] for t in res["per_token"]}) == 1  # no reads per token


def test_model_partitioned_by_deepspeed_initialize(reference, tmp_path):
    """The model loaded whole and converted by ``deepspeed.initialize`` (no zero.Init at load time)."""
    got = worker(tmp_path, "eng", backend="aidaptiv", load="engine", dram_budget=0)
    assert got[0]["swapper"] == "AidaptivParamSwapper"
    assert_same(reference, got)


def test_weights_from_an_unpacked_store_are_never_written(reference, tmp_path):
    cache = tmp_path / "cache_unp"
    cache.mkdir()
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "aidaptiv": {"cache_paths": [str(cache)],
                                                                                "run_name": "stories-zi"}}))
    p = subprocess.run([sys.executable, "-m", "aidaptiv_ds.cli.main", "unpack", STORIES, "--deepspeed", str(cfg),
                        "--json"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = worker(tmp_path, "unp", backend="aidaptiv", load="unpacked", dram_budget=0, run_name="stories-zi",
                 cache_dir=str(cache))
    res = got[0]
    assert res["plan"]["adopted_bytes"] > 0
    assert_same(reference, got)
    assert all(t["cache_written"] == 0 for t in res["per_token"])  # the run wrote nothing at all


def test_zero_inference_config_needs_no_optimizer_offload(tmp_path):
    """Without an optimizer DeepSpeed builds no Stage-3 optimizer, so offload_optimizer and max_in_cpu are
    not required; with one (a config section or a client optimizer) they still are."""
    import deepspeed

    import aidaptiv_ds  # noqa: F401
    from aidaptiv_ds.integration.config import AidaptivConfigError, validate
    from aidaptiv_ds.integration.inference import zero_inference_config

    cfg = zero_inference_config(str(tmp_path), dram_budget=0)
    assert validate(cfg).dram_budget == 0
    trained = dict(cfg, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
    with pytest.raises(AidaptivConfigError, match="offload_optimizer.device"):
        validate(trained)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(AidaptivConfigError, match="offload_optimizer.device"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
