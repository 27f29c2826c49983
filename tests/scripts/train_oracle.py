"""Train a small model a few ZeRO-3 steps with one offload backend and dump what the oracle compares.

Run in a fresh process per backend (DeepSpeed keeps global state)::

    python tests/scripts/train_oracle.py --backend aidaptiv --model llama --dtype fp32 --steps 5 \
        --cache /tmp/x --out /tmp/x/result.pt

Backends: ``cpu`` (DeepSpeed's offload to DRAM: the oracle), ``aidaptiv`` (our swappers through the
cache path), ``native`` (DeepSpeed's own NVMe swappers, with our pure-Python aio handle so nothing
is compiled). The output file holds the per-step losses, the final fp32 parameters (gathered) and
the per-step I/O counters.

On a GPU (DeepSpeed's CUDA accelerator, chosen by DeepSpeed when CUDA is visible) the engine, the
model and the batches are on ``cuda:<local rank>``; the result says where (``device``,
``accelerator``). ``--deterministic --attn eager`` make a CUDA run repeat bit for bit, so two
backends can be compared there as on CPU (``tests/gpu/test_cuda_oracle.py``, ``launch/gpu_check.sh``).

Test-only options for the multi-rank tests (``tests/test_multirank.py``): ``--rank_out DIR`` makes
every rank write ``DIR/rank<R>.pt`` (its own losses, fp32 master partitions, namespace, per-path
cache bytes after the store closed); ``--shadow`` adds, per extent, the SHA-256 of every byte range
the store was last asked to write (recorded at submit time by wrapping ``SlabStore.write``), so a
fresh process can check that a kept store reads back exactly that; ``--hold_until FILE`` keeps the
store open after training until ``FILE`` exists (``FILE.ready<R>`` says the rank is waiting).
``--local_rank`` is accepted (and ignored) because the ``deepspeed`` launcher passes it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
if "LOCAL_SIZE" not in os.environ:  # the deepspeed launcher sets LOCAL_SIZE (not LOCAL_WORLD_SIZE): leave it alone
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29611")

# MKL's GEMMs independent of memory alignment in every backend (aidaptiv_ds/bench/runner.py REPRODUCIBLE_MKL),
# and on a fixed thread count in every backend (MKL picks fewer threads when the cores are busy: the reference
# run's bits would depend on the machine's load; the aidaptiv_ds runtime pins it in its own runs); read when MKL
# starts, so before torch is imported
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from aidaptiv_ds.integration.blas_threads import pin_blas_threads  # noqa: E402

pin_blas_threads()  # the reference backends' GEMMs on a fixed thread count too (integration/blas_threads.py)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["cpu", "aidaptiv", "native"], required=True)
    ap.add_argument("--model", choices=["mlp", "llama", "stories", "stories_config", "unused"], default="llama",
                    help="stories_config: the stories260K architecture from its config.json only, no weights")
    ap.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default="fp32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ga", type=int, default=1)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--budget", default="0")
    ap.add_argument("--sub_group_size", type=float, default=1e9)
    ap.add_argument("--reduce_bucket_size", type=float, default=0,
                    help="zero_optimization.reduce_bucket_size (0: left out of the config)")
    ap.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: off)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--cache", default="/tmp/aidaptiv_oracle")
    ap.add_argument("--cache_paths", default="", help="comma-separated aidaptiv cache paths (default: --cache)")
    ap.add_argument("--zinit", action="store_true", help="build the model under deepspeed.zero.Init")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--extra", default="{}", help="JSON merged into the aidaptiv section")
    ap.add_argument("--zero", default="{}", help="JSON merged into zero_optimization (a null value removes the key, "
                    "leaving DeepSpeed's default)")
    ap.add_argument("--ds_extra", default="{}", help="JSON merged into the DeepSpeed config (top level), e.g. "
                    '\'{"checkpoint": {"use_node_local_storage": true}}\'')
    ap.add_argument("--ckpt_dir", default="", help="checkpoint directory; {rank} is replaced by the global rank")
    ap.add_argument("--save_after", type=int, default=0, help="save a checkpoint after this many steps and stop")
    ap.add_argument("--save_at", default="", help="comma-separated steps after which to save and go on")
    ap.add_argument("--save_dir", default="", help="where to save (default: --ckpt_dir); several, comma-separated: "
                    "every save goes to each; {rank} is replaced by the global rank")
    ap.add_argument("--tag", default="", help="checkpoint tag for every save (default: DeepSpeed's global_stepN)")
    ap.add_argument("--save16", default="", help="after training, engine.save_16bit_model(DIR)")
    ap.add_argument("--resume", action="store_true", help="load the latest checkpoint of --ckpt_dir first")
    ap.add_argument("--no_optimizer_state", action="store_true", help="resume with load_optimizer_states=False")
    ap.add_argument("--cpu_adam", action="store_true", help="DeepSpeedCPUAdam (compiled cpu_adam op) instead of torch AdamW")
    ap.add_argument("--round_moments", default="", choices=["", "bf16", "int8"],
                    help="test-only reference for aidaptiv.optimizer_state.moments: after every optimizer step, round "
                         "the stepped sub-group's moments to this format in place (a torch step post-hook; int8: "
                         "quantized and dequantized block-wise, exp_avg signed, exp_avg_sq unsigned)")
    ap.add_argument("--untie", action="store_true", help="llama: separate input and output embeddings")
    ap.add_argument("--layer_major", action="store_true",
                    help="aidaptiv only: each optimizer step is engine.train_batch(iter(micro-batches)), layer-major")
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=None, help="passed by the deepspeed launcher (unused)")
    ap.add_argument("--rank_out", default="", help="test-only: every rank writes DIR/rank<R>.pt")
    ap.add_argument("--shadow", action="store_true", help="test-only: record digests of what the store wrote")
    ap.add_argument("--hold_until", default="", help="test-only: keep the store open until this file exists")
    # test-only options (tests/test_training_faults.py): observe and disturb a run between steps
    ap.add_argument("--progress", action="store_true", help="print 'aidaptiv-test: step N done' after each step")
    ap.add_argument("--pause_at", default="", help="comma-separated steps before which to pause (needs --pause_dir)")
    ap.add_argument("--pause_dir", default="", help="pausing before step N writes paused_N.json here (the store's "
                    "slabs and extents) and waits up to 300 s for a file resume_N")
    ap.add_argument("--faults_after", type=int, default=-1, help="before this step, arm the fault rules of --faults")
    ap.add_argument("--faults", default="", help="AIDAPTIV_FAULTS-style rules armed at --faults_after")
    ap.add_argument("--no_mkdir", action="store_true", help="do not create the cache paths (startup-error tests)")
    # GPU runs (tests/gpu, launch/gpu_check.sh): the model, batches and engine live on DeepSpeed's accelerator
    ap.add_argument("--attn", default="", help="HF attn_implementation of the Llama models (eager, sdpa; default: "
                    "transformers' choice); eager attention has no nondeterministic CUDA kernels")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True, warn_only=True) and CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                    "(CUDA: the same run gives the same bits; ops without a deterministic kernel are listed in the "
                    "result's nondeterministic_ops)")
    return ap.parse_args()


def ds_config(a) -> dict:
    cache = a.cache
    if not a.no_mkdir:
        os.makedirs(cache, exist_ok=True)
    dev = "cpu" if a.backend == "cpu" else "nvme"
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": a.ga,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.01, "torch_adam": not a.cpu_adam}},
        "gradient_clipping": a.clip,
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": int(a.sub_group_size),
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
            **({"reduce_bucket_size": int(a.reduce_bucket_size)} if a.reduce_bucket_size else {}),
            # max_in_cpu: DeepSpeed's default (1e9) for ours, where it caps the parameters the DRAM budget keeps
            # ([Note: max_in_cpu]); 0 for DeepSpeed's own NVMe offload, which would otherwise keep the first 1e9
            # parameter elements in CPU buffers of its own and offload nothing of a model this size
            "offload_param": {"device": dev, "nvme_path": cache, "pin_memory": False,
                              **({"max_in_cpu": 0} if a.backend == "native" else {}),
                              "buffer_count": 16, "buffer_size": 2e7},
            "offload_optimizer": {"device": dev, "nvme_path": cache, "pin_memory": False},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
        "wall_clock_breakdown": False,
    }
    for k, v in json.loads(a.zero).items():
        if v is None:
            cfg["zero_optimization"].pop(k, None)
        else:
            cfg["zero_optimization"][k] = v
    if a.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif a.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    cfg.update(json.loads(a.ds_extra))
    if a.backend == "aidaptiv":
        paths = a.cache_paths.split(",") if a.cache_paths else [cache]
        for p in paths:
            if not a.no_mkdir:
                os.makedirs(p, exist_ok=True)
        sec = {"enabled": True, "cache_paths": paths, "dram_budget": a.budget}
        sec.update(json.loads(a.extra))
        cfg["aidaptiv"] = sec
    return cfg


def dtype_of(a):
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[a.dtype]


class MLP(torch.nn.Module):
    def __init__(self, h, n, unused=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(h, h, bias=False) for _ in range(n))
        self.unused = torch.nn.Linear(h, h) if unused else None

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) * 2
        return x.float().pow(2).mean()


def llama_config(a):
    from transformers import LlamaConfig
    attn = {"attn_implementation": a.attn} if a.attn else {}
    return LlamaConfig(vocab_size=512, hidden_size=a.hidden, intermediate_size=a.hidden * 2 + 24,
                       num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, tie_word_embeddings=not a.untie, rms_norm_eps=1e-5, **attn)


def build(a, cfg):
    import deepspeed
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    torch.manual_seed(0)
    dt = dtype_of(a)
    keep = None
    if a.model in ("stories", "stories_config"):
        path = os.path.join(REPO, "..", "shared", "data", "models", "stories260K", "hf")
        if a.zinit:
            keep = HfDeepSpeedConfig(cfg)  # noqa: F841 - from_pretrained loads into zero.Init partitions
        if a.model == "stories":
            model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dt,
                                                         **({"attn_implementation": a.attn} if a.attn else {}))
        else:
            from transformers import AutoConfig
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), torch_dtype=dt,
                                                     **({"attn_implementation": a.attn} if a.attn else {}))
    elif a.model == "llama":
        model = LlamaForCausalLM(llama_config(a)).to(dt)  # HF init runs (not under zero.Init)
        if a.zinit:  # convert an initialised model through zero.Init(module=...)
            with deepspeed.zero.Init(module=model, config_dict_or_path=cfg, dtype=dt):
                pass
    else:
        unused = a.model == "unused"
        if a.zinit:
            with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=dt):
                model = MLP(a.hidden, a.layers, unused)
        else:
            model = MLP(a.hidden, a.layers, unused).to(dt)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=cfg)
    eng._oracle_keep = keep
    if a.round_moments:
        torch_opt = eng.optimizer.optimizer

        def _round(opt, args, kwargs):  # DeepSpeed steps one sub-group at a time: the params of the groups now
            from aidaptiv_ds.tiers import blockwise
            for p in [p for g in opt.param_groups for p in g["params"]]:
                state = opt.state.get(p, {})
                for k, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                    v = state.get(k)
                    if v is None:
                        continue
                    if a.round_moments == "bf16":
                        v.copy_(v.to(torch.bfloat16))
                    else:
                        flat = v.reshape(-1)
                        codes = torch.empty(flat.numel(), dtype=torch.uint8)
                        scales = torch.empty(blockwise.n_blocks(flat.numel()))
                        blockwise.quantize(flat, codes, scales, signed)
                        blockwise.dequantize(codes, scales, signed, out=flat)
        torch_opt.register_step_post_hook(_round)
    return eng


def batch(a, i, rank, vocab=512):
    g = torch.Generator().manual_seed(1000 + 10 * i + rank)
    if a.model in ("llama", "stories", "stories_config"):
        return torch.randint(0, vocab, (a.micro, 24), generator=g)
    return torch.randn(a.micro, a.hidden, generator=g).to(dtype_of(a))


def _between_steps(a, step: int) -> None:
    """Test-only hooks run before ``step`` (after a save at ``step``): arm injected faults, pause for an
    outside disturbance (the store's writes are complete then: the loop flushes after each step)."""
    import time

    from aidaptiv_ds.integration.runtime import current_runtime
    rt = current_runtime()
    if step == a.faults_after and rt is not None:
        from aidaptiv_ds.io.syscalls import FaultyIO, rules_from_env
        rt.engine.sysio = FaultyIO(rules_from_env(a.faults))  # the engine looks the object up per call
    if a.pause_dir and str(step) in a.pause_at.split(","):
        info = {"step": step, "pid": os.getpid()}
        if rt is not None:
            info.update(cache_paths=rt.namespace.cache_paths, rank_dir=rt.namespace.rank_dir(0),
                        slabs=[s.path for s in rt.store.slabs],
                        extents={k: [e.offset, e.nbytes] for k, e in rt.store._extents.items()})
        tmp = os.path.join(a.pause_dir, f"paused_{step}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(a.pause_dir, f"paused_{step}.json"))
        open(os.path.join(a.pause_dir, f"paused_{step}.rank{os.environ.get('RANK', '0')}"), "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(a.pause_dir, f"resume_{step}")):
            if time.monotonic() > deadline:
                raise SystemExit(f"train_oracle: nobody resumed the pause before step {step}")
            time.sleep(0.05)


class StoreShadow:
    """Test-only: a copy of every byte range the process's store was asked to write, per extent key.

    Wraps ``SlabStore.write`` (which ``put``, the packed regions and the swappers all go through),
    ``allocate`` (a re-allocated key starts empty) and ``free``. Writes are aligned to the store's
    alignment, so written ranges are tracked per alignment block. Also counts the bytes asked to be
    written into each placement segment (striped: one; affinity: primary, then spill), from which a
    test derives the planned bytes per path without the store's own mapping.
    """

    def __init__(self) -> None:
        import threading
        from aidaptiv_ds.store.store import SlabStore
        self.data: dict[str, tuple[int, bytearray, bytearray]] = {}  # key -> (extent offset, bytes, written mask)
        self.align = 4096
        self.segment_bytes: dict[int, int] = {}  # store segment index -> bytes the process asked to write there
        self.lock = threading.Lock()
        orig_write, orig_alloc, orig_free = SlabStore.write, SlabStore.allocate, SlabStore.free
        shadow = self

        def write(store, key, buf, offset=0, *args, **kwargs):
            from aidaptiv_ds.io.buffers import byte_view
            raw = bytes(byte_view(buf).numpy().tobytes())
            fut = orig_write(store, key, buf, offset, *args, **kwargs)  # validates key, range and alignment
            shadow.align = store.alignment
            ext = store.extent(key)
            with shadow.lock:
                lo, hi = ext.offset + offset, ext.offset + offset + len(raw)  # logical bytes of this write
                for k, seg in enumerate(store.segments):
                    inside = max(0, min(hi, seg.end) - max(lo, seg.start))
                    shadow.segment_bytes[k] = shadow.segment_bytes.get(k, 0) + inside
                cur = shadow.data.get(key)
                if cur is None or cur[0] != ext.offset or len(cur[1]) != ext.nbytes:
                    cur = shadow.data[key] = (ext.offset, bytearray(ext.nbytes),
                                              bytearray(ext.nbytes // store.alignment))
                cur[1][offset:offset + len(raw)] = raw
                a = store.alignment
                cur[2][offset // a:(offset + len(raw)) // a] = b"\x01" * (len(raw) // a)
            return fut

        def allocate(store, key, nbytes):
            ext = orig_alloc(store, key, nbytes)
            with shadow.lock:
                cur = shadow.data.get(key)
                if cur is not None and (cur[0] != ext.offset or len(cur[1]) != ext.nbytes):
                    del shadow.data[key]
            return ext

        def free(store, key):
            with shadow.lock:
                shadow.data.pop(key, None)
            return orig_free(store, key)

        orig_swap = SlabStore.swap_extents

        def swap_extents(store, a, b):  # a committed speculative step: the bytes change keys, not places
            orig_swap(store, a, b)
            with shadow.lock:
                da, db = shadow.data.pop(a, None), shadow.data.pop(b, None)
                if db is not None:
                    shadow.data[a] = db
                if da is not None:
                    shadow.data[b] = da

        SlabStore.write, SlabStore.allocate, SlabStore.free = write, allocate, free
        SlabStore.swap_extents = swap_extents

    def digests(self) -> dict[str, list[tuple[int, int, str]]]:
        """Per key: ``[(offset, length, sha256 hex), ...]`` of each maximal written range."""
        import hashlib
        out = {}
        with self.lock:
            for key, (_, data, mask) in self.data.items():
                runs, i, a = [], 0, self.align
                while i < len(mask):
                    if not mask[i]:
                        i += 1
                        continue
                    j = i
                    while j < len(mask) and mask[j]:
                        j += 1
                    runs.append((i * a, (j - i) * a, hashlib.sha256(data[i * a:j * a]).hexdigest()))
                    i = j
                out[key] = runs
        return out


def _hold(path: str, rank: int) -> None:
    """Test-only: say this rank is waiting (``path.ready<R>``), then wait until ``path`` exists (10 min at most)."""
    import time
    with open(f"{path}.ready{rank}", "w") as f:
        f.write(str(os.getpid()))
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > 600:
            raise TimeoutError(f"--hold_until {path}: nobody created it within 600 s")
        time.sleep(0.05)


def _deterministic() -> list[str]:
    """Deterministic kernels from here on (before CUDA initialises); returns the list that collects the
    names torch warns about (ops with no deterministic implementation)."""
    import warnings

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS creates its handle
    torch.use_deterministic_algorithms(True, warn_only=True)
    seen: list[str] = []
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        first = (str(message).splitlines() or [""])[0][:300]
        if "deterministic" in first and first not in seen:
            seen.append(first)
        return show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    return seen


def main():
    a = parse()
    nondeterministic = _deterministic() if a.deterministic else []
    shadow = StoreShadow() if a.shadow and a.backend == "aidaptiv" else None
    cfg = ds_config(a)
    if a.backend == "native" or not cfg.get("aidaptiv", {}).get("enabled", True):
        from aidaptiv_ds.integration.aio_handle import register_with_deepspeed
        register_with_deepspeed()  # DeepSpeed's own swappers, on our pure-Python aio handle (no compile)
    import aidaptiv_ds  # noqa: F401 - installs the hooks
    import deepspeed
    from aidaptiv_ds.telemetry import counters

    eng = build(a, cfg)
    rank = eng.global_rank
    vocab = getattr(getattr(eng.module, "config", None), "vocab_size", 512)
    losses, io, norms = [], [], []
    micro, first = 0, 0
    ckpt_dir = a.ckpt_dir.replace("{rank}", str(rank))
    save_dirs = [d.replace("{rank}", str(rank)) for d in (a.save_dir or a.ckpt_dir).split(",")]
    if a.resume:
        path, client = eng.load_checkpoint(ckpt_dir, load_optimizer_states=not a.no_optimizer_state)
        first = client["step"]
        micro = client["micro"]
    save_at = {int(x) for x in a.save_at.split(",") if x}
    for step in range(first, a.steps + (1 if a.save_after == a.steps else 0)):
        if step in save_at or (a.save_after and step == a.save_after):
            if a.progress:
                print(f"aidaptiv-test: saving at step {step}", flush=True)
            for d in save_dirs:
                eng.save_checkpoint(d, tag=a.tag or None, client_state={"step": step, "micro": micro})
            if a.progress:
                print(f"aidaptiv-test: saved at step {step}", flush=True)
            if a.save_after and step == a.save_after:  # (--save_at 0 saved and then stopped)
                break
        _between_steps(a, step)
        before = counters.snapshot()
        step_losses = []
        if a.layer_major:
            xs = [batch(a, micro + i, rank, vocab).to(eng.device) for i in range(a.ga)]
            micro += a.ga
            llama = a.model in ("llama", "stories", "stories_config")
            eng.train_batch(iter([{"input_ids": x, "labels": x} if llama else x for x in xs]))
            step_losses = [float(x.float()) for x in eng.aidaptiv_losses]
        for _ in range(0 if a.layer_major else a.ga):
            x = batch(a, micro, rank, vocab).to(eng.device)  # the accelerator's device (cuda:N on GPUs)
            micro += 1
            out = eng(x, labels=x) if a.model in ("llama", "stories", "stories_config") else eng(x)
            loss = out.loss if hasattr(out, "loss") else out
            eng.backward(loss)
            eng.step()
            step_losses.append(float(loss.detach().float()))
        from aidaptiv_ds.integration.runtime import current_runtime
        if current_runtime() is not None:  # count every write of this step in this step
            current_runtime().flush()
        losses.append(step_losses)
        norms.append(float(eng.get_global_grad_norm() or 0.0))
        io.append(counters.delta(counters.snapshot(), before))
        if a.progress:
            print(f"aidaptiv-test: step {step} done", flush=True)
    if a.save16:
        eng.save_16bit_model(a.save16)
    params = {}
    for name, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[name] = p.detach().float().cpu().clone()
    masters = []
    opt = eng.optimizer
    getattr(opt, "_aidaptiv_drain", lambda: None)()  # updates still riding the forward (step_pipeline.py)
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        if opt._swappable_optimizer_subgroup(i):
            opt._optimizer_states_and_gradient_swap_in(i)
            masters.append(fp32.detach().cpu().clone())
            opt._release_swap_buffers(i)
        else:
            masters.append(fp32.detach().cpu().clone())
    nparams = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in eng.module.parameters())
    extra = {}
    if a.backend == "aidaptiv" and cfg["aidaptiv"].get("enabled", True):
        from aidaptiv_ds.integration.runtime import current_runtime
        rt = current_runtime()
        extra = {"plan": getattr(opt, "aidaptiv_plan", None).as_dict(), "budget": rt.budget,
                 "tier_evictions": rt.tier.evictions, "dirty_evictions": rt.tier.dirty_evictions,
                 "optimizer_steps": dict(rt.counters()["optimizer_steps"]),
                 "swapper": type(next(eng.module.parameters()).nvme_swapper).__name__,
                 "optimizer_swapper": type(opt.optimizer_swapper).__name__,
                 "io_retries": rt.engine.totals().retries, "direct_fallback": dict(rt.engine.fallback_paths),
                 "store_extents": {k: e.nbytes for k, e in rt.store._extents.items()},
                 "store_high_water": rt.store.allocator.high_water, "slab_sizes": [s.size for s in rt.store.slabs]}
    else:
        extra = {"swapper": type(next(eng.module.parameters()).nvme_swapper).__name__,
                 "optimizer_swapper": type(opt.optimizer_swapper).__name__}
    if a.rank_out:
        os.makedirs(a.rank_out, exist_ok=True)
        mine = {"rank": rank, "world": eng.world_size, "pid": os.getpid(), "losses": losses, "masters": masters,
                "local_rank": int(os.environ.get("LOCAL_RANK", 0))}
        from aidaptiv_ds.integration import runtime as rt_mod
        rt = rt_mod.current_runtime()
        if rt is not None:
            if a.hold_until:
                _hold(a.hold_until, rank)
            st = rt.store
            rt_mod.shutdown()  # close the store as at exit, so the counters include the last writes and the index
            ns = st.ns
            mine.update({"host": ns.host, "run": ns.run, "ns_rank": ns.rank, "cache_paths": ns.cache_paths,
                         "rank_dirs": [ns.rank_dir(i) for i in range(len(ns.cache_paths))],
                         "per_path": st.io_counters(), "planned_share": st.planned_share(), "policy": st.policy,
                         "primary": st.primary, "phys_caps": st.phys_caps, "slab_sizes": [s.size for s in st.slabs],
                         "weights": [p.weight for p in st.paths], "stripe_unit": st.stripe_unit,
                         "alignment": st.alignment, "local_world": getattr(rt, "local_world", None),
                         "index_bytes": os.path.getsize(ns.index_path()) if os.path.exists(ns.index_path()) else 0,
                         "segments": [(sg.start, sg.end, sg.layout.paths) for sg in st.segments],
                         "extents": {k: (e.offset, e.nbytes) for k, e in st._extents.items()},
                         "shadow": shadow.digests() if shadow is not None else None,
                         "segment_bytes": dict(shadow.segment_bytes) if shadow is not None else None})
        torch.save(mine, os.path.join(a.rank_out, f"rank{rank}.pt"))
    if rank == 0:
        from deepspeed.accelerator import get_accelerator
        extra.update(device=str(eng.device), accelerator=get_accelerator().device_name(),
                     nondeterministic_ops=nondeterministic)
        torch.save({"losses": losses, "norms": norms, "params": params, "masters": masters, "io": io, "nparams": nparams,
                    "world": eng.world_size, **extra}, a.out)
    print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    from aidaptiv_ds.process_group import run_worker

    run_worker(main)  # no abort at exit with gloo (aidaptiv_ds/process_group.py)
