"""One greedy ``generate`` of one backend, in its own process: ZeRO-Inference on aidaptiv_ds, on
DeepSpeed's native NVMe offload, or plain (no DeepSpeed). Tests and ``launch/bench_zero_inference.py``
run it; by hand only for debugging::

    python -m aidaptiv_ds.bench.zero_inference SPEC.json RESULT.json

``SPEC.json`` keys:

* ``backend``: ``"plain"`` (the model as loaded, ``model.generate``), ``"aidaptiv"`` (ZeRO-3,
  ``offload_param`` on ``nvme``, the ``"aidaptiv"`` section), ``"native"`` (the same config without
  the section: DeepSpeed's own swapper, with the compiled ``async_io`` op when ``aio`` is
  ``"compiled"`` and it loads, else aidaptiv_ds's pure-Python handle);
* ``model``: an HF directory or a ``.gguf`` file; ``dtype``: ``"fp32"`` or ``"bf16"``;
* ``load``: ``"pretrained"`` (``from_pretrained`` under ``HfDeepSpeedConfig``, i.e. ``zero.Init``),
  ``"engine"`` (loaded whole, partitioned by ``deepspeed.initialize``) or ``"unpacked"``
  (``from_config`` under ``zero.Init``, weights from ``aidaptiv-ds unpack`` under ``run_name``);
* ``cache_dir``, ``dram_budget`` (aidaptiv), ``run_name`` and ``min_swap_bytes`` (aidaptiv, optional: the
  latter keeps smaller partitions in DRAM, as DeepSpeed's own swapper does below ``max(1 MiB, aio
  block_size)``), ``aio`` (native);
* ``prompt_ids`` (list of ints) or ``prompt_tokens`` + ``seed`` (random ids), ``max_new_tokens``,
  ``repeats`` (generate calls; the first is the warm-up of the prefetch trace), ``threads`` (torch
  compute threads, optional), ``scores_path``
  (optional: the logits of the last call as a torch file).

``RESULT.json``: ``ok``, ``error``, ``output_ids`` (the new tokens of the last call), per call
``calls[i]`` = ``{ttft_s, decode_tokens_per_s, total_s, new_tokens}``, ``per_token`` (of the last
call: cumulative ``cache_written``/``cache_read`` (aidaptiv_ds's store) and ``proc_write``/``proc_read``
(``/proc/self/io``, any backend) bytes at each generated token),
``written_during_generate`` (cache-tier bytes written during the ``generate`` calls, prefill
included), ``swapper``, ``plan`` (aidaptiv: :class:`~aidaptiv_ds.integration.inference.InferencePlan`),
``aio`` (native), ``setup_s``, ``peak_rss_bytes``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

for _k, _v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
               ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29641")):
    os.environ.setdefault(_k, _v)

BACKENDS = ("plain", "aidaptiv", "native")


def ds_config(backend: str, spec: dict, largest_numel: int) -> dict:
    """The ZeRO-Inference DeepSpeed config of ``backend`` (identical but for the ``"aidaptiv"`` section).

    Every parameter is offloaded (``stage3_param_persistence_threshold: 0``); DeepSpeed's buffer pool
    holds 5 partitions of the largest parameter (its swapper asserts otherwise).
    """
    from ..integration.inference import zero_inference_config

    extra = {k: spec[k] for k in ("run_name", "min_swap_bytes") if spec.get(k)}
    if spec.get("load") == "unpacked":
        extra["from_unpacked"] = True
    cfg = zero_inference_config(spec["cache_dir"], spec.get("dram_budget", 0), spec.get("dtype", "fp32"), **extra)
    if backend == "native":
        del cfg["aidaptiv"]
        cfg["zero_optimization"]["offload_param"].update(buffer_count=5,
                                                         buffer_size=-(-int(largest_numel) // (1 << 20)) * (1 << 20))
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                      "overlap_events": True}
    return cfg


class _Clock:
    """A ``generate`` streamer that records when each new token arrives (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _load(spec: dict, backend: str, torch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..checkpoint.hf_source import resolve_source

    src = resolve_source(spec["model"])
    dtype = torch.bfloat16 if spec.get("dtype") == "bf16" else torch.float32
    load = spec.get("load", "pretrained")
    if backend == "plain":
        return AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.kwargs()), None, None
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    from ..integration.bench_patches import dedup_native_swap_in, skip_shm_comm_build

    skip_shm_comm_build()
    if backend == "native":
        dedup_native_swap_in()
    conf = AutoConfig.from_pretrained(src.path, **src.kwargs())
    largest = max(conf.vocab_size * conf.hidden_size, conf.hidden_size * getattr(conf, "intermediate_size", 0))
    cfg = ds_config(backend, spec, largest)
    keep = None
    if load == "engine":
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.kwargs())
    else:
        keep = HfDeepSpeedConfig(cfg)  # transformers holds only a weak reference
        if load == "unpacked":
            model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.kwargs())
        if any(not hasattr(p, "ds_id") for p in model.parameters()):
            # transformers loads a GGUF checkpoint whole; partition it here, with the config's dtype: DeepSpeed's
            # own conversion in deepspeed.initialize passes dtype=, which 0.19.8 turns into bf16 on a CPU
            # accelerator (partition_parameters.py:409), so its native swapper would store fp32 weights as bf16
            with deepspeed.zero.Init(module=model, config_dict_or_path=cfg):
                pass
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    engine.module.eval()
    return engine.module, engine, keep


def run(spec: dict, out: dict, write) -> None:
    t_start = time.time()
    backend = spec["backend"]
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if backend == "native":
        from .aio import install_native_aio
        from .probes import WaitClock

        out["aio"] = install_native_aio(spec.get("aio", "compiled"), WaitClock())
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))

    from ..integration.zero_params import swapper_of
    from ..telemetry import counters
    from .probes import process_peak_rss_bytes

    model, engine, _keep = _load(spec, backend, torch)
    out["threads"] = torch.get_num_threads()
    out["setup_s"] = time.time() - t_start
    swapper = swapper_of(next(model.parameters()))
    out["swapper"] = type(swapper).__name__ if swapper is not None else None
    plan = getattr(engine, "aidaptiv_inference", None) if engine is not None else None
    out["plan"] = plan.as_dict() if plan is not None else None
    if "prompt_ids" in spec:
        ids = torch.tensor([spec["prompt_ids"]], dtype=torch.long)
    else:
        g = torch.Generator().manual_seed(int(spec.get("seed", 0)))
        ids = torch.randint(0, model.config.vocab_size, (1, int(spec["prompt_tokens"])), generator=g)
    samples: list[dict] = []

    class Probe(LogitsProcessor):
        def __call__(self, input_ids, scores):
            s = counters.snapshot()
            samples.append({"cache_written": s["bytes_written"].get("cache", 0),
                            "cache_read": s["bytes_read"].get("cache", 0), "proc_write": s["proc_write_bytes"],
                            "proc_read": s["proc_read_bytes"]})
            return scores

    out["calls"], written = [], 0
    gen = None
    for _ in range(int(spec.get("repeats", 1))):
        samples.clear()
        clock = _Clock()
        before = counters.snapshot()["bytes_written"].get("cache", 0)
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(spec["max_new_tokens"]),
                                 min_new_tokens=int(spec["max_new_tokens"]), do_sample=False, streamer=clock,
                                 logits_processor=LogitsProcessorList([Probe()]), return_dict_in_generate=True,
                                 output_scores=True, pad_token_id=0)
        total = time.perf_counter() - t0
        n = len(clock.times)
        decode = (n - 1) / (clock.times[-1] - clock.times[0]) if n > 1 and clock.times[-1] > clock.times[0] else None
        out["calls"].append({"ttft_s": clock.times[0] - t0 if n else None, "decode_tokens_per_s": decode,
                             "total_s": total, "new_tokens": n})
        written += counters.snapshot()["bytes_written"].get("cache", 0) - before
        write()
    out["output_ids"] = gen.sequences[0, ids.shape[1]:].tolist()
    out["prompt_tokens"] = int(ids.shape[1])
    out["per_token"] = list(samples)
    out["written_during_generate"] = written
    if spec.get("scores_path"):
        torch.save([s.clone() for s in gen.scores], spec["scores_path"])
    out["peak_rss_bytes"] = process_peak_rss_bytes()
    out["ok"] = True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m aidaptiv_ds.bench.zero_inference SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    out: dict = {"ok": False, "error": None, "backend": spec.get("backend"), "pid": os.getpid()}

    def write() -> None:
        tmp = argv[1] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, argv[1])

    try:
        run(spec, out, write)
    except BaseException as e:  # noqa: BLE001 - recorded for the caller, then an exit code
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        print(traceback.format_exc(), file=sys.stderr)
        write()
        return 1
    write()
    return 0


if __name__ == "__main__":
    from ..process_group import run_worker

    run_worker(main)  # no abort in finalization after the result is written (process_group.py)
