"""DeepSpeed's public ZeRO-3 API on one backend: a scenario per call pattern, compared by tests/test_zero3_api.py.

    python tests/scripts/ds_api.py --scenario NAME --backend cpu|aidaptiv --cache DIR --out DIR [--dtype fp32|bf16]

``cpu`` is DeepSpeed's own offload to CPU (the reference); ``aidaptiv`` the same config with the offload on
``nvme`` and an ``"aidaptiv"`` section (DRAM budget ``--budget``). Scenarios follow DeepSpeed's own unit tests
(deepspeedai/DeepSpeed tests/unit/runtime/zero/test_zero_tensor_fragment.py, test_zero_context*.py,
tests/unit/checkpoint/) where they have one:

* ``fragment_set`` (``TestTensorFragmentSet``): after backward set random fp32 weights and gradients with
  ``safe_set_full_*`` / ``safe_set_local_*`` (``--api full|local``) and read them back; after the step the same
  for weights and both Adam moments; then train on;
* ``fragment_get`` (``TestTensorFragmentGet``, frozen first layer): every getter returns a tensor for a trainable
  parameter and None for a frozen one, after backward and after the step;
* ``gathered_edit``: ``weight *= 0.5`` under ``GatheredParameters(modifier_rank=0)`` after a step; the next gather
  shows it; train on;
* ``save16``: ``save_16bit_model`` (``stage3_gather_16bit_weights_on_model_save``) after two steps, writing
  nothing to the cache drive, then two more steps;
* ``reload``: ``save_checkpoint``, ``engine.destroy()``, a new engine (another cache path) in the same process,
  ``load_checkpoint`` with ``--load module_only|no_optimizer|full``, train on;
* ``warm_load``: an engine that trained two steps of its own loads another run's weights (``--load
  no_optimizer``: ``load_optimizer_states=False``, its Adam state kept; ``custom``: the same through a
  ``custom_load_fn`` that takes only the embedding; ``strict_frozen``: the first layer frozen and saved with
  ``exclude_frozen_parameters=True``: a strict load raises PyTorch's missing-keys error, a non-strict one loads),
  then trains on;
* ``eval_between``: an eval forward under ``torch.no_grad()`` between steps;
* ``resize``: an HF Llama built under ``zero.Init`` (``HfDeepSpeedConfig``) and ``resize_token_embeddings``.

Every rank writes ``OUT/rank<R>.pt``: the scenario's checks (name -> bool), losses, gradient norms, its masters
and moments, and on rank 0 the gathered parameters and what the scenario read back.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

for _k, _v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(_k, _v)
if "LOCAL_SIZE" not in os.environ:
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from aidaptiv_ds.integration.blas_threads import pin_blas_threads  # noqa: E402
from aidaptiv_ds.integration.state_readout import flat_optimizer_state  # noqa: E402

pin_blas_threads()
MIN_SWAPPABLE_BYTES = 1 << 20  # deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES


class SimpleModel(torch.nn.Module):
    """DeepSpeed's ``tests/unit/simple_model.py`` SimpleModel (one Linear, cross-entropy)."""

    def __init__(self, hidden):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.cross_entropy_loss(self.linears[0](x), y)


class MyModel(torch.nn.Module):
    """``test_zero_tensor_fragment.py``'s MyModel (three Linear layers, the first frozen)."""

    def __init__(self, hidden, frozen):
        super().__init__()
        self.act = torch.nn.ReLU()
        self.cel = torch.nn.CrossEntropyLoss()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden, 1), torch.nn.Linear(1, 1),
                                            torch.nn.Linear(1, hidden)])
        if frozen:
            for p in self.linears[0].parameters():
                p.requires_grad = False

    def forward(self, x, y):
        for lin in self.linears:
            x = self.act(lin(x))
        return self.cel(x, y)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--backend", choices=["cpu", "aidaptiv"], required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--budget", default="0")
    ap.add_argument("--api", choices=["full", "local"], default="full")
    ap.add_argument("--load", choices=["module_only", "no_optimizer", "full", "custom", "strict_frozen"],
                    default="module_only")
    ap.add_argument("--clip", type=float, default=None, help="gradient_clipping (default: left out, DeepSpeed's 1.0)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--scheduler", action="store_true", help="DeepSpeed's WarmupDecayLR: the lr changes every step")
    ap.add_argument("--ride", action="store_true", help="aidaptiv.step_rides_forward: true (off by default on CPU)")
    ap.add_argument("--min-swap", default=None, help="aidaptiv.min_swap_bytes (partitions below stay in DRAM)")
    ap.add_argument("--local_rank", type=int, default=None)
    return ap.parse_args()


def config(a, cache: str, offload_param: bool = True, extra_zero: dict | None = None) -> dict:
    ours = a.backend == "aidaptiv"
    dev = "nvme" if ours else "cpu"
    zero = {"stage": 3, "offload_optimizer": {"device": dev, **({"nvme_path": cache} if ours else {})}}
    if offload_param:
        zero["offload_param"] = {"device": dev, **({"nvme_path": cache} if ours else {})}
    zero.update(extra_zero or {})
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "zero_optimization": zero}
    if a.clip is not None:
        cfg["gradient_clipping"] = a.clip
    if a.scheduler:  # a learning rate that changes every step
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                                "warmup_num_steps": 3, "total_num_steps": 12}}
    if a.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if ours:
        os.makedirs(cache, exist_ok=True)
        cfg["aidaptiv"] = {"cache_paths": [cache], "dram_budget": a.budget}
        if a.ride:
            cfg["aidaptiv"]["step_rides_forward"] = True
        if a.min_swap is not None:
            cfg["aidaptiv"]["min_swap_bytes"] = a.min_swap
    return cfg


def dtype_of(a):
    return torch.bfloat16 if a.dtype == "bf16" else torch.float32


def data(hidden, n, dtype, rank):
    g = torch.Generator().manual_seed(1234 + rank)
    return [(torch.randn(1, hidden, generator=g).to(dtype), torch.randint(0, hidden, (1,), generator=g))
            for _ in range(n)]


class Run:
    """What a scenario records (checks, losses, norms, read-backs)."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.checks: dict[str, bool] = {}
        self.losses: list[float] = []
        self.norms: list = []
        self.reads: dict[str, torch.Tensor] = {}

    def step(self, *inputs, after_backward=None, **kw):
        out = self.eng(*inputs, **kw)
        loss = out.loss if hasattr(out, "loss") else out
        self.eng.backward(loss)
        if after_backward is not None:
            after_backward()
        self.eng.step()
        self.losses.append(float(loss.detach().float()))
        n = self.eng.get_global_grad_norm()
        self.norms.append(None if n is None else float(n))


def _random_full(eng, shape_of, keys, dtype, group):
    import deepspeed.comm as dist
    out = {}
    for n, p in eng.module.named_parameters():
        out[n] = {}
        for k in keys:
            t = torch.rand(shape_of(p), dtype=dtype if k == "gradient" else torch.float32)
            dist.broadcast(t, src=0, group=group)
            out[n][k] = t
    return out


def scenario_fragment_set(a, rank):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_grad,
        safe_set_local_optimizer_state,
    )
    hidden = int(math.sqrt(MIN_SWAPPABLE_BYTES))
    cfg = config(a, a.cache, offload_param=False, extra_zero={"param_persistence_threshold": hidden})
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = SimpleModel(hidden)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run = Run(eng)
    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    dtype = dtype_of(a)
    full = a.api == "full"
    get = {"weight": safe_get_full_fp32_param if full else safe_get_local_fp32_param,
           "gradient": safe_get_full_grad if full else safe_get_local_grad}
    setter = {"weight": safe_set_full_fp32_param if full else safe_set_local_fp32_param,
              "gradient": safe_set_full_grad if full else safe_set_local_grad}

    def values(keys):
        if full:
            return _random_full(eng, lambda p: p.ds_shape, keys, dtype, group)
        return {n: {k: torch.rand(p.ds_tensor.shape, dtype=dtype if k == "gradient" else torch.float32)
                    for k in keys} for n, p in eng.module.named_parameters()}

    def set_and_check(tag, keys):
        vals = values(keys)
        for n, p in eng.module.named_parameters():
            for k, v in vals[n].items():
                if k in setter:
                    setter[k](p, v)
                else:
                    (safe_set_full_optimizer_state if full else safe_set_local_optimizer_state)(p, v, k)
        for n, p in eng.module.named_parameters():
            for k, v in vals[n].items():
                got = get[k](p) if k in get else (safe_get_full_optimizer_state if full else
                                                   safe_get_local_optimizer_state)(p, k)
                run.checks[f"{tag}:{n}:{k}"] = got is not None and torch.equal(v, got)

    batches = data(hidden, a.steps, dtype, rank)
    for i, (x, y) in enumerate(batches):
        run.step(x, y, after_backward=lambda i=i: set_and_check(f"after_backward{i}", ["weight", "gradient"]))
        set_and_check(f"after_step{i}", ["weight", "exp_avg", "exp_avg_sq"])
    return run


def scenario_fragment_get(a, rank):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
    hidden = MIN_SWAPPABLE_BYTES // 64  # smaller than DeepSpeed's MIN_SWAPPABLE_BYTES: CI-sized
    cfg = config(a, a.cache, offload_param=False)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = MyModel(hidden, frozen=True)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run = Run(eng)

    def check(tag, opt_states):
        for n, p in eng.module.named_parameters():
            vals = ([safe_get_full_optimizer_state(p, "exp_avg"), safe_get_full_optimizer_state(p, "exp_avg_sq")]
                    if opt_states else [safe_get_full_fp32_param(p), safe_get_full_grad(p)])
            ok = all(v is not None for v in vals) if p.requires_grad else all(v is None for v in vals)
            run.checks[f"{tag}:{n}"] = ok
            if rank == 0 and p.requires_grad:
                for j, v in enumerate(vals):
                    run.reads[f"{tag}:{n}:{j}"] = v.detach().float().clone()

    for i, (x, y) in enumerate(data(hidden, a.steps, dtype_of(a), rank)):
        run.step(x, y, after_backward=lambda i=i: check(f"after_backward{i}", False))
        check(f"after_step{i}", True)
    return run


def _llama(a, cache, zinit=True, vocab=128):
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    cfg = config(a, cache)
    hf = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=136, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     tie_word_embeddings=False, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    if zinit:
        keep = HfDeepSpeedConfig(cfg)
        model = LlamaForCausalLM(hf).to(dtype_of(a))
    else:
        keep, model = None, LlamaForCausalLM(hf).to(dtype_of(a))
    return model, cfg, keep, deepspeed


def _tokens(step, rank, vocab=128):
    g = torch.Generator().manual_seed(99 + 7 * step + 1000 * rank)
    return torch.randint(0, vocab, (1, 16), generator=g)


def _lm_step(run, step, rank, vocab=128):
    ids = _tokens(step, rank, vocab)
    run.step(input_ids=ids, labels=ids)


def _gather(eng, name):
    import deepspeed
    p = dict(eng.module.named_parameters())[name]
    with deepspeed.zero.GatheredParameters([p]):
        return p.detach().float().clone()


def scenario_gathered_edit(a, rank):
    model, cfg, keep, deepspeed = _llama(a, a.cache)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run = Run(eng)
    _lm_step(run, 0, rank)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    params = dict(eng.module.named_parameters())
    before = {n: _gather(eng, n) for n in names}
    with deepspeed.zero.GatheredParameters([params[n] for n in names], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                for n in names:
                    params[n].mul_(0.5)
    for n in names:
        after = _gather(eng, n)
        run.checks[f"edit_kept:{n}"] = torch.equal(after, (before[n].to(params[n].dtype) * 0.5).float())
        run.reads[f"after_edit:{n}"] = after
    for s in range(1, a.steps):
        _lm_step(run, s, rank)
    return run


def scenario_grad_after_consumed(a, rank):
    """``gradient_clipping: 0``: the first optimizer step keeps gradients; in the second, a step inside backward
    consumes them, and ``safe_get_full_grad`` after that backward raises GradientConsumedError (ours only; the
    call changes nothing); from the third step on gradients are kept and the call returns them."""
    from deepspeed.utils import safe_get_full_grad
    model, cfg, keep, deepspeed = _llama(a, a.cache)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run = Run(eng)
    name = "model.layers.1.mlp.down_proj.weight"
    p = dict(eng.module.named_parameters())[name]

    def read(tag):
        run.reads[tag] = safe_get_full_grad(p).detach().float().clone()

    def second():
        if a.backend != "aidaptiv":
            return
        from aidaptiv_ds.integration.errors import GradientConsumedError
        try:
            safe_get_full_grad(p)
            run.checks["consumed_gradient_refused"] = False
        except GradientConsumedError as e:
            run.checks["consumed_gradient_refused"] = "step_in_backward" in str(e)

    ids = [_tokens(s, rank) for s in range(4)]
    run.step(input_ids=ids[0], labels=ids[0])
    run.step(input_ids=ids[1], labels=ids[1], after_backward=second)
    run.step(input_ids=ids[2], labels=ids[2], after_backward=lambda: read("grad_step3"))
    run.step(input_ids=ids[3], labels=ids[3], after_backward=lambda: read("grad_step4"))
    return run


def scenario_ride_failure(a, rank):
    """Gradient clipping that always clips, so updates ride the next forward; then every read of the cache
    drive fails: the forward that runs a deferred update raises PipelineError naming the sub-group, and so does
    every later wait (a checkpoint save, the next step). Ours only (the CPU offload has nothing to fail)."""
    model, cfg, keep, deepspeed = _llama(a, a.cache)
    # several sub-groups: the first two are read at the end of backward, the later ones by the forward
    cfg["zero_optimization"]["sub_group_size"] = 20000
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run = Run(eng)
    for s in range(2):
        _lm_step(run, s, rank)
    if a.backend != "aidaptiv":
        return run
    from aidaptiv_ds.integration.runtime import current_runtime
    from aidaptiv_ds.integration.step_pipeline import PipelineError
    from aidaptiv_ds.io.syscalls import FaultyIO, rules_from_env
    pl = eng.optimizer._aidaptiv.pipeline
    run.checks["updates_deferred"] = pl.pending
    # every read of the optimizer state fails (only it: a parameter read failing first would be a plain
    # StorageIOError, and which read comes first depends on the I/O threads)
    store = current_runtime().store
    rules = []
    for key in (k for k in store.keys() if k.startswith("opt")):
        for _fd, phys, n, _rel in store.physical_runs(key, 0, store.extent(key).nbytes):
            rules += rules_from_env(f"op=read,err=EIO,path_contains=slab,offset_min={phys},"
                                    f"offset_max={phys + n},count=-1")
    run.checks["several_sub_groups"] = sum(k.startswith("opt") and not k.endswith("~") for k in store.keys()) > 2
    current_runtime().engine.sysio = FaultyIO(rules)
    for what, call in (("forward", lambda: _lm_step(run, 2, rank)),
                       ("save_checkpoint", lambda: eng.save_checkpoint(os.path.join(a.out, "ck"), tag="t")),
                       ("step", lambda: eng.step())):
        try:
            call()
            run.checks[f"{what}_raises"] = False
        except PipelineError as e:
            run.checks[f"{what}_raises"] = "sub-group" in str(e) and "riding the forward" in str(e)
    run.checks["nothing_saved"] = not os.path.exists(os.path.join(a.out, "ck", "t"))
    current_runtime().engine.sysio = FaultyIO([])
    run.losses = run.losses[:2]
    run.eng = None
    return run


def scenario_save16(a, rank):
    model, cfg, keep, deepspeed = _llama(a, a.cache)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run = Run(eng)
    for s in range(a.steps):
        _lm_step(run, s, rank)
    out = os.path.join(a.out, "save16")
    rt = getattr(getattr(eng.optimizer, "_aidaptiv", None), "rt", None)  # ours: the cache drive's byte counts

    def written():
        if rt is None:
            return 0
        rt.flush()
        return sum(rt.store.bytes_written)

    before = written()
    eng.save_16bit_model(out)
    # a save reads the weights: nothing rewritten to the drive ([Note: the 16-bit save reads only])
    run.checks["save16_wrote_nothing"] = written() == before
    for s in range(a.steps, a.steps + 2):  # and training goes on as on DeepSpeed's
        _lm_step(run, s, rank)
    if rank == 0:
        from safetensors.torch import load_file
        files = sorted(f for f in os.listdir(out) if f.endswith((".bin", ".safetensors")))
        for f in files:
            sd = load_file(os.path.join(out, f)) if f.endswith(".safetensors") else torch.load(os.path.join(out, f))
            for k, v in sd.items():
                run.reads[f"save16:{k}"] = v.float().clone()
        run.checks["save16_written"] = bool(files)
    return run


def scenario_reload(a, rank):
    model, cfg, keep, deepspeed = _llama(a, a.cache)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run = Run(eng)
    for s in range(2):
        _lm_step(run, s, rank)
    ckpt = os.path.join(a.out, "ckpt")
    saved = {n: _gather(eng, n) for n, _ in eng.module.named_parameters()}
    eng.save_checkpoint(ckpt, tag="t2")
    eng.destroy()
    del eng, model
    run.eng = None
    cache2 = a.cache + "-second"
    model2, cfg2, keep2, _ = _llama(a, cache2)
    torch.manual_seed(1)  # a different initialisation, replaced by the load
    eng2, *_ = deepspeed.initialize(model=model2, model_parameters=model2.parameters(), config=cfg2)
    run.eng = eng2
    kw = {"module_only": dict(load_module_only=True), "no_optimizer": dict(load_optimizer_states=False),
          "full": {}}[a.load]
    given = os.path.relpath(ckpt)  # a relative load_dir, as scripts pass one
    path, client = eng2.load_checkpoint(given, tag="t2", **kw)
    run.checks["loaded"] = path is not None
    # what load_checkpoint returns, as DeepSpeed returns it: the model-states file read (under the load_dir as
    # given: DeepSpeed's _get_ckpt_name joins it), the keys left to the client
    run.checks["load_path_under_the_dir_given"] = path == os.path.join(given, "t2", os.path.basename(path))
    run.reads["load_path"] = os.path.relpath(path, ckpt)
    if a.load == "full":  # (module_only is compared with DeepSpeed's load_optimizer_states=False: other keys left)
        run.reads["client_keys"] = sorted(client)
    if a.load == "module_only":  # DeepSpeed's rule (engine.py _load_checkpoint): the module, and the scheduler's and
        # the optimizer's states where their flags (True by default) say so, are not the client's
        ms = torch.load(path, map_location="cpu", weights_only=False)
        run.checks["module_only_client_keys"] = sorted(client) == sorted(
            k for k in ms if k not in ("module", "lr_scheduler", "optimizer"))
    for n in saved:  # the weights the first engine saved are the second one's now
        run.checks[f"loaded:{n}"] = torch.equal(saved[n], _gather(eng2, n))
    for s in range(2, 2 + a.steps):
        _lm_step(run, s, rank)
    return run


def scenario_warm_load(a, rank):
    from deepspeed.utils import safe_get_full_optimizer_state
    frozen = a.load == "strict_frozen"

    def engine(cache):
        model, cfg, keep, deepspeed = _llama(a, cache)
        if frozen:
            for p in model.model.layers[0].parameters():
                p.requires_grad_(False)
        eng, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                      if p.requires_grad], config=cfg)
        return eng, keep

    eng, keep = engine(a.cache)
    run = Run(eng)
    for s in range(2):
        _lm_step(run, s, rank)
    ckpt = os.path.join(a.out, "ckpt")
    saved = {n: _gather(eng, n) for n, _ in eng.module.named_parameters()}
    eng.save_checkpoint(ckpt, tag="t2", exclude_frozen_parameters=frozen)
    if frozen:
        eng.save_checkpoint(ckpt, tag="t2all")  # the frozen parameters included
    eng.destroy()
    del eng
    eng2, keep2 = engine(a.cache + "-second")
    run.eng = eng2
    for s in range(10, 12):  # its own two steps: its own weights and Adam moments
        _lm_step(run, s, rank)
    own = {n: _gather(eng2, n) for n, _ in eng2.module.named_parameters()}
    if a.load == "strict_frozen":
        try:
            eng2.load_checkpoint(ckpt, tag="t2")
            run.checks["strict_load_raised"] = False
        except RuntimeError as e:
            run.checks["strict_load_raised"] = "Missing key(s) in state_dict" in str(e) and \
                "model.layers.0.self_attn.q_proj.weight" in str(e)
        eng2.load_checkpoint(ckpt, tag="t2", load_module_strict=False)
        _, client = eng2.load_checkpoint(ckpt, tag="t2all")  # strict: every key saved
        for n, t in sorted(client["frozen_param_fragments"].items()):  # handed to the caller as DeepSpeed does
            run.reads[f"frozen_param_fragments:{n}"] = t.detach().clone()
        run.checks["frozen_param_fragments"] = len(client["frozen_param_fragments"]) == 9
        loaded = [n for n, p in eng2.module.named_parameters() if p.requires_grad]
    elif a.load == "custom":
        def embedding_only(src, dst):  # on rank 0 only, as HF's ZeRO-3 loaders do: DeepSpeed broadcasts its result
            if rank == 0:
                dst.model.embed_tokens.weight.data.copy_(src["model.embed_tokens.weight"])

        eng2.load_checkpoint(ckpt, tag="t2", load_optimizer_states=False, custom_load_fn=embedding_only)
        loaded = ["model.embed_tokens.weight"]
    else:
        eng2.load_checkpoint(ckpt, tag="t2", load_optimizer_states=False)
        loaded = list(saved)
    for n, p in eng2.module.named_parameters():
        run.checks[f"{'loaded' if n in loaded else 'kept'}:{n}"] = torch.equal(saved[n] if n in loaded else own[n],
                                                                                  _gather(eng2, n))
        if p.requires_grad and a.load != "strict_frozen":  # the engine's own Adam state is kept
            run.checks[f"moments_kept:{n}"] = safe_get_full_optimizer_state(p, "exp_avg") is not None
    for s in range(2, 2 + a.steps):
        _lm_step(run, s, rank)
    return run


def scenario_eval_between(a, rank):
    model, cfg, keep, deepspeed = _llama(a, a.cache)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run = Run(eng)
    for s in range(a.steps):
        _lm_step(run, s, rank)
        eng.eval()
        with torch.no_grad():
            ids = _tokens(100 + s, rank)
            run.reads[f"eval{s}"] = eng(input_ids=ids, labels=ids).loss.detach().float().reshape(1).clone()
        eng.train()
    return run


def scenario_resize(a, rank):
    model, cfg, keep, deepspeed = _llama(a, a.cache, vocab=120)
    model.resize_token_embeddings(136)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    run = Run(eng)
    for s in range(a.steps):
        _lm_step(run, s, rank, vocab=136)
    return run


def main():
    a = parse()
    os.makedirs(a.out, exist_ok=True)
    if a.backend == "aidaptiv":
        import aidaptiv_ds  # noqa: F401
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(0)  # the same initial weights in both backends
    run = globals()[f"scenario_{a.scenario}"](a, rank)
    eng = run.eng
    import deepspeed
    if eng is None:  # a scenario whose engine cannot go on (a failure it provoked): its checks only
        torch.save({"rank": rank, "checks": run.checks, "losses": run.losses}, os.path.join(a.out, f"rank{rank}.pt"))
        print(json.dumps({"rank": rank, "failed_checks": [k for k, v in run.checks.items() if not v]}))
        os._exit(0)  # the store holds a failed state: no clean close
    out = {"rank": rank, "checks": run.checks, "losses": run.losses, "norms": run.norms,
           **flat_optimizer_state(eng.optimizer)}
    params = {}
    for name, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            if rank == 0:
                params[name] = p.detach().float().clone()
    if rank == 0:
        out["params"] = params
        out["reads"] = run.reads
    if a.backend == "aidaptiv":
        from aidaptiv_ds.integration.runtime import current_runtime
        out["optimizer_steps"] = current_runtime().counters()["optimizer_steps"]  # which path each step took
    torch.save(out, os.path.join(a.out, f"rank{rank}.pt"))
    failed = [k for k, v in run.checks.items() if not v]
    print(json.dumps({"rank": rank, "losses": run.losses, "failed_checks": failed}))


if __name__ == "__main__":
    from aidaptiv_ds.process_group import run_worker

    run_worker(main)  # no abort at exit with gloo (aidaptiv_ds/process_group.py)
