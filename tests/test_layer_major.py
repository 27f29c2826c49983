"""Layer-major gradient accumulation (issue 38): ``engine.train_batch`` runs the accumulation window block by
block and keeps DeepSpeed's micro-batch-major arithmetic bit for bit.

* unit: the schedule on plain PyTorch (``integration/layer_major.py`` with a :class:`Pieces` that
  accumulates as the gradient store does): the order of the blocks, one gather per block and phase, the
  gradients against micro-batch-major autograd bit for bit; the trunk found or refused (``trunk.py``);
* subprocess: ``engine.train_batch`` against DeepSpeed's CPU offload trained micro-batch by micro-batch
  (``tests/scripts/train_oracle.py --layer_major``), and the bytes it writes;
* multirank: the fuzzer's cases (``python -m aidaptiv_ds.bench.fuzz --layer-major`` draws more).
"""
from __future__ import annotations

import math
import threading

import greenlet
import pytest
import torch

from aidaptiv_ds.bench.fuzz_models import batch, build
from aidaptiv_ds.errors import AidaptivConfigError
from aidaptiv_ds.integration.layer_major import LayerMajorBackward, layer_major_forward, micro_batches
from aidaptiv_ds.integration.trunk import find_trunk, tied_outside


class Accumulate:
    """:class:`layer_major.Pieces` on plain PyTorch: after each piece every parameter's ``.grad`` is taken as
    DeepSpeed's gradient store takes it (the first copied, later ones added, in the order they arrive)."""

    def __init__(self, model: torch.nn.Module, gas: int) -> None:
        self.model, self.gas = model, gas
        self.acc: dict[str, torch.Tensor] = {}
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.withheld: set[int] = set()
        self.events: list[tuple[str, int]] = []
        self.blocks: dict[int, int] = {}

    def hold(self, block):
        self.events.append(("hold", self.blocks.get(id(block), -1)))

    def unhold(self, block):
        self.events.append(("unhold", self.blocks.get(id(block), -1)))

    def begin(self, j, boundary):
        pass

    def end(self):
        for p in self.model.parameters():
            if p.grad is not None and id(p) not in self.withheld:
                self.take_grad(p)

    def take_grad(self, p):
        n = self.names[id(p)]
        g, p.grad = p.grad, None
        if n in self.acc:
            self.acc[n].add_(g)
        else:
            self.acc[n] = g.clone()

    def scale(self, loss):
        return loss / self.gas

    def withhold(self, params):
        self.withheld = {id(p) for p in params}

    def release(self, p):
        self.take_grad(p)

    def keep(self, key, x):
        return x

    def take(self, token):
        return token

    def prefetch(self, tokens):
        pass


def _model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return build(kind, 64, 3)


def _batches(kind: str, k: int):
    return [batch(kind, 64, 2, i, 0, torch.float32) for i in range(k)]


def micro_batch_major(model, xs) -> tuple[list[float], dict]:
    """The reference: forward and backward per micro-batch, gradients taken after each."""
    acc = Accumulate(model, len(xs))
    losses = []
    for x in xs:
        loss = model(x)
        acc.scale(loss).backward()
        acc.end()
        losses.append(float(loss.detach()))
    return losses, acc.acc


def layer_major(model, xs) -> tuple[list[float], Accumulate, list]:
    trunk = find_trunk(model)
    pieces = Accumulate(model, len(xs))
    pieces.blocks = {id(b): i for i, b in enumerate(trunk.blocks)}
    seen: list[tuple[int, object]] = []  # (block, the forward running it: a greenlet per micro-batch)
    handles = [b.register_forward_pre_hook(lambda m, a, i=i: seen.append((i, greenlet.getcurrent())))
               for i, b in enumerate(trunk.blocks)]
    backward = LayerMajorBackward(trunk, len(xs), tied_outside(model, trunk), pieces)
    try:
        recs = layer_major_forward(model, trunk, xs, pieces, on_loss=backward.tail)
    finally:
        for h in handles:
            h.remove()
    assert all(r.tail_in is None for r in recs)  # each tail ran at its loss
    backward.finish(recs)
    first = list(dict.fromkeys(g for _, g in seen))  # micro-batch j's forward is the j-th to start
    assert len(first) == len(xs) and greenlet.getcurrent() not in first
    order = [(i, first.index(g)) for i, g in seen]
    return [float(r.loss) for r in recs], pieces, order


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "llama_ckpt"])
@pytest.mark.parametrize("k", [1, 3])
def test_gradients_equal_micro_batch_major_bit_for_bit(kind, k):
    """Untied (llama) and tied (qwen2, gpt2) embeddings, HF gradient checkpointing (llama_ckpt): every gradient
    and loss equal to autograd run micro-batch by micro-batch, accumulated in the same order."""
    xs = _batches(kind, k)
    ref_losses, ref = micro_batch_major(_model(kind), xs)
    losses, got, _ = layer_major(_model(kind), xs)
    assert losses == ref_losses
    assert sorted(got.acc) == sorted(ref)
    for n, g in ref.items():
        assert torch.equal(got.acc[n], g), f"{kind} k={k}: gradient of {n} differs"


def test_blocks_run_in_layer_major_order_and_are_gathered_once_per_phase():
    k, layers = 3, 3
    _, pieces, order = layer_major(_model("llama"), _batches("llama", k))
    assert order == [(b, j) for b in range(layers) for j in range(k)]  # block 0 for every micro-batch first
    fwd = [e for b in range(layers) for e in (("hold", b), ("unhold", b))]
    bwd = [e for b in reversed(range(layers)) for e in (("hold", b), ("unhold", b))]
    assert pieces.events == fwd + bwd  # one block gathered at a time, once for its k micro-batches


def test_trunk_of_hf_models_and_ties():
    assert find_trunk(_model("llama")).name == "model.model.layers"  # inside the user's wrapper (HFLoss)
    assert find_trunk(_model("gpt2")).name == "model.transformer.h"
    qwen = _model("qwen2")
    (tied,) = tied_outside(qwen, find_trunk(qwen))
    assert tied is qwen.model.model.embed_tokens.weight
    llama = _model("llama")
    assert tied_outside(llama, find_trunk(llama)) == []


class _Block(torch.nn.Module):
    def __init__(self, lin=None):
        super().__init__()
        self.lin = lin or torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class _Net(torch.nn.Module):
    _no_split_modules = ["_Block"]

    def __init__(self, blocks, head=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = head

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def test_models_without_a_clean_trunk_are_refused():
    with pytest.raises(AidaptivConfigError, match="_no_split_modules"):
        find_trunk(_model("mlp"))
    shared = _Block()
    with pytest.raises(AidaptivConfigError, match="shared by blocks 0 and 1"):
        find_trunk(_Net([shared, _Block(shared.lin)]))
    first = _Block()
    with pytest.raises(AidaptivConfigError, match="head.weight is also used inside blocks"):
        find_trunk(_Net([first, _Block()], head=first.lin))


def test_a_failing_micro_batch_is_raised_and_unwinds_every_forward():
    model = _Net([_Block(), _Block()])
    before = threading.active_count()
    unwound = []

    class Ctx:  # a context every forward is inside while it waits at block 0
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            unwound.append(exc[0])

    def forward(x):
        with Ctx():
            return _Net.forward(model, x)
    model.forward = forward
    xs = [torch.ones(2, 4), torch.ones(2, 5), torch.ones(2, 4)]  # micro-batch 1 cannot run the first block
    with pytest.raises(RuntimeError):
        layer_major_forward(model, find_trunk(model), xs, Accumulate(model, 3))
    assert threading.active_count() == before  # no thread of its own
    assert len(unwound) == 3 and unwound.count(RuntimeError) == 1  # every forward's frames are unwound now
    assert torch.is_grad_enabled()


def test_each_forward_keeps_its_own_gradient_mode_across_switches():
    """PyTorch's gradient mode is per thread, and the forwards share one ([Note: one OS thread]): a forward that
    turns gradients off around the trunk must not turn them off for the others, nor for the caller."""
    model = _Net([_Block(), _Block()])
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append((a[0].shape[0], torch.is_grad_enabled())))
    model.blocks[1].register_forward_pre_hook(lambda m, a: seen.append((a[0].shape[0], torch.is_grad_enabled())))

    def forward(x):
        with torch.set_grad_enabled(x.shape[0] != 3):  # the micro-batch of 3 rows runs without gradients
            for b in model.blocks:
                x = b(x)
        return x.pow(2).mean()
    model.forward = forward
    xs = [torch.ones(2, 4), torch.ones(3, 4), torch.ones(4, 4)]
    recs = layer_major_forward(model, find_trunk(model), xs, Accumulate(model, 3))
    assert seen == [(n, n != 3) for _ in range(2) for n in (2, 3, 4)]
    assert [r.loss.requires_grad for r in recs] == [True, False, True] and torch.is_grad_enabled()


def test_micro_batches_names_the_shortfall():
    assert micro_batches(iter(range(5)), 3) == [0, 1, 2]
    with pytest.raises(AidaptivConfigError, match="gradient_accumulation_steps=4 micro-batches per call; data_iter "
                                                  "ended after 2"):
        micro_batches([1, 2], 4)


# ------------------------------------------------------------------------------ engine.train_batch vs DeepSpeed
# (id, train_oracle.py arguments): the oracle is DeepSpeed's CPU offload trained micro-batch by micro-batch
ORACLE_CASES = [
    ("llama-tied-fp32-ga2", ["--model", "llama", "--dtype", "fp32", "--steps", "3", "--ga", "2"]),
    ("llama-untied-bf16-ga4-clip", ["--model", "llama", "--untie", "--dtype", "bf16", "--steps", "3", "--ga", "4",
                                    "--clip", "1.0", "--sub_group_size", "2e5"]),
    ("llama-tied-fp32-ga8-clip-budget", ["--model", "llama", "--dtype", "fp32", "--steps", "2", "--ga", "8",
                                         "--clip", "1.0", "--budget", "13MiB", "--zinit"]),
    # the updates of a step that clipped ride the next layer-major forward (on by default on GPUs)
    ("llama-untied-fp32-ga4-clip-riding", ["--model", "llama", "--untie", "--dtype", "fp32", "--steps", "3", "--ga",
                                           "4", "--clip", "1.0", "--extra", '{"step_rides_forward": true}']),
]


@pytest.mark.subprocess
@pytest.mark.parametrize("case", ORACLE_CASES, ids=[c[0] for c in ORACLE_CASES])
def test_train_batch_is_bit_identical_with_cpu_offload(case, tmp_path_factory):
    from _oracle import assert_identical, oracle, run
    name, args = case
    ref = oracle(args, str(tmp_path_factory.mktemp(name + "-cpu")))
    got = run("aidaptiv", args + ["--layer_major"], str(tmp_path_factory.mktemp(name)))
    assert_identical(ref, got)


@pytest.mark.subprocess
def test_train_batch_on_the_real_model(tmp_path_factory):
    import os
    from _oracle import STORIES, STORIES_ABSENT, assert_identical, oracle, run
    if not os.path.isdir(STORIES):
        pytest.skip(STORIES_ABSENT)
    args = ["--model", "stories", "--steps", "2", "--ga", "3", "--clip", "1.0"]
    ref = oracle(args, str(tmp_path_factory.mktemp("stories-cpu")))
    assert_identical(ref, run("aidaptiv", args + ["--layer_major"], str(tmp_path_factory.mktemp("stories"))))


@pytest.mark.subprocess
def test_gradients_are_never_written_between_micro_batches(tmp_path):
    """Budget 0, GA 4, clipping off, fp32: micro-batch by micro-batch each sub-group's partial gradient goes to
    the drive and back between micro-batches (12 B/param/step more); layer-major each block's gradient is final
    after its fourth piece, so only the master weights and moments are written (12 B/param/step)."""
    from _oracle import run, written_per_param_per_step
    args = ["--model", "llama", "--untie", "--layers", "4", "--dtype", "fp32", "--steps", "3", "--ga", "4"]
    mbm = run("aidaptiv", args, str(tmp_path / "mbm"))
    lm = run("aidaptiv", args + ["--layer_major"], str(tmp_path / "lm"))
    assert all(s["grad_spilled_bytes"] > 0 for s in mbm["io"][1:])
    assert all(s["grad_spilled_bytes"] == 0 for s in lm["io"][1:])
    # the boundary activations (4 micro-batches x 4 blocks x 2 x 24 x 256 fp32) go to the drive once and come back
    # once: read, or taken from DRAM where the write-back was still in flight when backward needed them (a busy drive)
    act = 4 * 4 * 2 * 24 * 256 * 4
    assert [(s["act_written_bytes"], s["act_read_bytes"] + s["act_dram_bytes"]) for s in lm["io"]] == \
        [(act, act)] * len(lm["io"])
    assert all(s["act_written_bytes"] == 0 for s in mbm["io"])
    state = [(s["bytes_written"]["cache"] - s["act_written_bytes"]) / lm["nparams"] for s in lm["io"][1:]]
    assert state == pytest.approx([12.0] * len(state), abs=0.05)
    assert written_per_param_per_step(mbm) == pytest.approx(24.0, abs=0.05)


# (id, fuzzer case): two ranks, DeepSpeed's defaults left unset, HF models the fuzzer builds
FUZZ_CASES = [
    ("qwen2-tied-bf16-ga4-clip-defaults", {"model": "qwen2", "hidden": 64, "layers": 2, "dtype": "bf16", "world": 2,
                                           "ga": 4, "micro": 1, "steps": 3, "budget": "0", "clip": 1.0, "zero": {}}),
    ("llama-ckpt-fp32-ga2-auto", {"model": "llama_ckpt", "hidden": 64, "layers": 2, "dtype": "fp32", "world": 2,
                                  "ga": 2, "micro": 2, "steps": 3, "budget": "auto", "zero": {}}),
]


@pytest.mark.multirank
@pytest.mark.parametrize("case", FUZZ_CASES, ids=[c[0] for c in FUZZ_CASES])
def test_train_batch_two_ranks(case, tmp_path):
    from aidaptiv_ds.bench.fuzz import reproducer, run_case
    c = dict(case[1], layer_major=True)
    o = run_case(c, str(tmp_path))
    assert not o.oracle_failed, o.error
    assert o.ok, "\n".join(o.diffs or [o.error or ""]) + f"\nreproduce: {reproducer(c)}"


# ------------------------------------------------------------------------------ boundary activations in the tiers
def test_boundary_activations_go_to_the_drive_at_budget_0_and_come_back_exact(runtime):
    """Budget 0: each kept block input is written once (its bytes booked) and read back once, bit for bit, then
    dropped unwritten; shapes and dtypes (fp32, bf16, a length that is not a page multiple) survive."""
    from aidaptiv_ds.integration.activations import BoundaryStore
    store = BoundaryStore(runtime, 0)
    g = torch.Generator().manual_seed(0)
    xs = {(b, j): torch.randn(2, 7, 33, generator=g).to(dt) for b in range(3) for j, dt in
          enumerate((torch.float32, torch.bfloat16))}
    tokens = {key: store.keep(key, x) for key, x in xs.items()}
    runtime.tier.flush()
    written = store.written_bytes
    assert written >= sum(x.numel() * x.element_size() for x in xs.values()) and runtime.tier.held_bytes == 0
    store.prefetch([tokens[(2, 0)], tokens[(2, 1)]])
    for key in sorted(xs, reverse=True):  # the backward's order: the last block first
        got = store.take(tokens[key])
        assert got.dtype == xs[key].dtype and torch.equal(got, xs[key])
    runtime.tier.flush()
    assert store.written_bytes == written and store.read_bytes == written  # each written once, read once
    assert store.dram_bytes == 0  # none was taken from DRAM: the flush had written them all
    with pytest.raises(KeyError):
        store.take(tokens[(0, 0)])


def test_boundary_activations_within_the_budget_are_never_written(tmp_path):
    from aidaptiv_ds.integration.activations import BoundaryStore
    from aidaptiv_ds.integration.config import AidaptivConfig
    from aidaptiv_ds.integration.runtime import Runtime
    rt = Runtime(AidaptivConfig(cache_paths=[str(tmp_path)], dram_budget="64MiB", run_name="act"))
    try:
        store = BoundaryStore(rt, 0)
        x = torch.arange(10_000, dtype=torch.float32)
        t = store.keep((0, 0), x)
        assert rt.tier.held_bytes >= x.numel() * 4
        assert torch.equal(store.take(t), x)
        rt.tier.flush()
        assert store.written_bytes == 0 and store.read_bytes == 0 and rt.tier.held_bytes == 0
        assert store.dram_bytes >= x.numel() * 4  # taken from DRAM, where the budget kept it
    finally:
        rt.close()


@pytest.mark.engine
def test_train_batch_between_micro_batch_major_windows(tmp_path, monkeypatch):
    """``train_batch`` refuses to start while a micro-batch-major window is half done (a gradient waits), works
    after it, pulls from ``training_data`` without an iterator, and names a short iterator's shortfall."""
    import deepspeed

    import aidaptiv_ds  # noqa: F401  (installs the hooks)
    from _engine import nvme_config, one_rank_env
    one_rank_env(monkeypatch)
    cfg = nvme_config(tmp_path / "cache", dram_budget=0)
    cfg["gradient_accumulation_steps"] = 2
    model = _model("llama")
    data = [batch("llama", 64, 1, i, 0, torch.float32)[0] for i in range(4)]
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, training_data=data)
    x = batch("llama", 64, 1, 0, 0, torch.float32)
    eng.backward(eng(x))
    eng.step()  # the first micro-batch of a window of 2
    with pytest.raises(AidaptivConfigError, match="gradients of the current one are waiting"):
        eng.train_batch(iter([x, x]))
    eng.backward(eng(x))
    eng.step()  # the window's boundary
    before = eng.global_steps
    loss = eng.train_batch(iter([x, x]))
    assert eng.global_steps == before + 1 and loss.dim() == 0 and len(eng.aidaptiv_losses) == 2
    eng.train_batch()  # two micro-batches of deepspeed.initialize(training_data=...)
    assert eng.global_steps == before + 2
    with pytest.raises(AidaptivConfigError, match="data_iter ended after 1"):
        eng.train_batch(iter([x]))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(AidaptivConfigError, match="autocast"):
        eng.train_batch(iter([x, x]))  # its recompute would not be cast as its forward was
    def boom(module, args):
        raise RuntimeError("boom")
    h = find_trunk(model).blocks[1].register_forward_pre_hook(boom)  # fails while block 1 is held
    with pytest.raises(RuntimeError, match="boom"):
        eng.train_batch(iter([x, x]))
    h.remove()
    assert not any(-1 in p.ds_active_sub_modules for p in model.parameters())  # no block left held
    eng.train_batch(iter([x, x]))  # and the engine trains on
    assert eng.global_steps == before + 3
    eng.destroy()
    from aidaptiv_ds.integration import runtime
    runtime.shutdown()


def test_dropout_masks_are_replayed_in_the_recompute():
    """With dropout active (GPT-2's default 0.1, everywhere: embeddings, attention, residuals) each block's
    recompute draws the masks its forward drew ([Note: dropout in the recompute]): every gradient equals
    autograd's micro-batch by micro-batch over the same masks, bit for bit; and the run's random stream ends
    where the forward's draws left it (the recompute draws nothing from it)."""
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.bench.fuzz_models import HFLoss, hf_config

    def model():
        torch.manual_seed(0)
        cfg = hf_config("gpt2", 64, 3)
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.1
        return HFLoss(AutoModelForCausalLM.from_config(cfg)).train()

    k = 3
    xs = _batches("gpt2", k)
    m = model()
    states: dict = {}  # (block or "model", forward) -> the random state it started from

    replayed: list = []  # (block, state) of each recompute (on the calling thread's own greenlet)
    caller = greenlet.getcurrent()

    def record(key):
        def hook(mod, args):
            if greenlet.getcurrent() is caller:
                replayed.append((key, torch.get_rng_state()))
            else:
                states.setdefault((key, greenlet.getcurrent()), torch.get_rng_state())
        return hook
    hs = [m.register_forward_pre_hook(record("model"))]
    hs += [b.register_forward_pre_hook(record(i)) for i, b in enumerate(find_trunk(m).blocks)]
    torch.manual_seed(1)
    losses, got, _ = layer_major(m, xs)
    end_state = torch.get_rng_state()
    for h in hs:
        h.remove()
    forwards = list(dict.fromkeys(g for _, g in states))
    assert len(forwards) == k
    # the recompute (blocks 2, 1, 0, each for micro-batches 0..k-1) starts from the forward's states
    assert [b for b, _ in replayed] == [b for b in (2, 1, 0) for _ in range(k)]
    assert all(torch.equal(st, states[(b, forwards[i % k])]) for i, (b, st) in enumerate(replayed))

    # the reference: autograd micro-batch by micro-batch, each block (and the code before the trunk) started
    # from the random state the layer-major forward started it from
    ref_model = model()
    acc = Accumulate(ref_model, k)
    ref_losses = []
    for j, x in enumerate(xs):
        g = forwards[j]
        hs = [ref_model.register_forward_pre_hook(lambda mod, a, g=g: torch.set_rng_state(states[("model", g)]))]
        hs += [b.register_forward_pre_hook(lambda mod, a, i=i, g=g: torch.set_rng_state(states[(i, g)]))
               for i, b in enumerate(find_trunk(ref_model).blocks)]
        loss = ref_model(x)
        acc.scale(loss).backward()
        acc.end()
        ref_losses.append(float(loss.detach()))
        for h in hs:
            h.remove()
    assert losses == ref_losses
    for n, g in acc.acc.items():
        assert torch.equal(got.acc[n], g), f"gradient of {n} differs"
    # dropout drew: without the replay the masks (and so the gradients) differ
    assert not torch.equal(states[(0, forwards[0])], states[(0, forwards[1])])
    assert not torch.equal(end_state, states[(2, forwards[-1])])


def test_active_dropout_names_what_draws_masks():
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.bench.fuzz_models import hf_config
    from aidaptiv_ds.integration.trunk import active_dropout
    cfg = hf_config("gpt2", 64, 2)
    cfg.attn_pdrop = 0.1
    gpt2 = AutoModelForCausalLM.from_config(cfg).train()
    assert active_dropout(gpt2) == ["transformer.h.0.attn.attn_dropout", "transformer.h.1.attn.attn_dropout"]
    assert active_dropout(gpt2.eval()) == []
    llama = _model("llama").train()
    assert active_dropout(llama) == []  # attention_dropout 0.0, HF's default
    llama.model.model.layers[1].self_attn.attention_dropout = 0.1
    assert active_dropout(llama) == ["model.model.layers.1.self_attn"]


@pytest.mark.engine
def test_train_batch_with_dropout_on_the_engine(tmp_path, monkeypatch, caplog):
    """GPT-2 with its default dropout through ``engine.train_batch``: it trains, says once that its masks are drawn
    in another order than DeepSpeed's, and its recompute replays them (the engine's path through
    ``LayerMajorBackward``: each block's forward state is used by its recompute and then let go)."""
    import logging

    import deepspeed
    from transformers import AutoModelForCausalLM

    import aidaptiv_ds  # noqa: F401  (installs the hooks)
    from _engine import nvme_config, one_rank_env
    from aidaptiv_ds.bench.fuzz_models import HFLoss, hf_config
    from aidaptiv_ds.integration import layer_major as lm
    one_rank_env(monkeypatch)
    cfg = nvme_config(tmp_path / "cache", dram_budget=0)
    cfg["gradient_accumulation_steps"] = 2
    torch.manual_seed(0)
    hf = hf_config("gpt2", 64, 2)
    hf.resid_pdrop = hf.embd_pdrop = hf.attn_pdrop = 0.1  # GPT-2's defaults
    model = HFLoss(AutoModelForCausalLM.from_config(hf))
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    replays = []
    real = lm._RngState.replay

    def counted(self):
        replays.append(self)
        return real(self)
    monkeypatch.setattr(lm._RngState, "replay", counted)
    xs = [batch("gpt2", 64, 1, i, 0, torch.float32) for i in range(4)]
    with caplog.at_level(logging.INFO, logger="aidaptiv_ds.integration.train_batch"):
        losses = [float(eng.train_batch(iter(xs[2 * s:2 * s + 2]))) for s in range(2)]
    assert all(math.isfinite(v) for v in losses)
    assert len(replays) == 2 * 2 * 2  # steps x blocks x micro-batches
    said = [r.getMessage() for r in caplog.records if "dropout active" in r.getMessage()]
    assert len(said) == 1 and "not bit-identical" in said[0]
    eng.destroy()
    from aidaptiv_ds.integration import runtime
    runtime.shutdown()  # the process-wide runtime goes with its cache path (the next tests make their own)


class _AuxNet(_Net):
    """``_Net`` with a layer before the trunk whose loss also takes block 0's internals (an auxiliary loss, as an
    MoE router's) or, ``around``, the trunk's input (a connection around it)."""

    def __init__(self, around=False):
        super().__init__([_Block(), _Block()])
        self.pre = torch.nn.Linear(4, 4)
        self.around = around

    def forward(self, x):
        x = h = self.pre(x)
        aux = 0.0
        for i, b in enumerate(self.blocks):
            if i == 0 and not self.around:
                aux = b.lin(x).pow(2).mean()  # what block 0 computes inside
            x = b(x)
        return x.pow(2).mean() + 0.01 * (h.sum() if self.around else aux)


@pytest.mark.parametrize("around, what", [(False, "a parameter of the trunk's blocks"),
                                          (True, "the trunk's input")])
def test_a_loss_that_reaches_the_trunk_other_than_through_its_output_is_refused(around, what):
    """[Note: one way into the trunk]: such a loss's gradient would be lost in part; refused before any of it
    runs, naming the fix."""
    model = _AuxNet(around)
    x = torch.ones(2, 4)
    trunk = find_trunk(model)
    pieces = Accumulate(model, 2)
    backward = LayerMajorBackward(trunk, 2, [], pieces)
    with pytest.raises(AidaptivConfigError, match=f"the loss reaches {what} other than through the last block"):
        layer_major_forward(model, trunk, [x, x], pieces, on_loss=backward.tail)
    assert pieces.acc == {}  # nothing ran backward


def _mixtral(aux: bool):
    from transformers import AutoModelForCausalLM, MixtralConfig

    from aidaptiv_ds.bench.fuzz_models import HFLoss
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                        max_position_embeddings=64, use_cache=False, attn_implementation="eager",
                        output_router_logits=aux, router_aux_loss_coef=0.01)
    return HFLoss(AutoModelForCausalLM.from_config(cfg))


def test_mixtral_is_exact_and_its_router_aux_loss_is_refused():
    """An HF MoE (Mixtral): bit for bit micro-batch-major without the router's auxiliary loss (HF's default);
    with it (``output_router_logits=True``) the loss reaches each block's router from outside the trunk's output
    and is refused ([Note: one way into the trunk]: without the check 10 of its 21 gradients came out wrong)."""
    xs = [batch("llama", 64, 2, i, 0, torch.float32) for i in range(3)]
    ref_losses, ref = micro_batch_major(_mixtral(False), xs)
    losses, got, _ = layer_major(_mixtral(False), xs)
    assert losses == ref_losses and sorted(got.acc) == sorted(ref)
    assert all(torch.equal(got.acc[n], g) for n, g in ref.items())
    with pytest.raises(AidaptivConfigError, match="MoE router's auxiliary loss"):
        layer_major(_mixtral(True), xs)


# ------------------------------------------------------------------------------ one pass through the trunk
class _SideBlock(torch.nn.Module):
    """A block that may store its projection in a dict the next blocks read (HF's ``shared_kv_states``) and
    may scale by a tensor made before the trunk (per-layer inputs)."""

    def __init__(self, role=None):
        super().__init__()
        self.lin, self.role = torch.nn.Linear(4, 4), role

    def forward(self, x, side=None, extra=None):
        h = self.lin(x)
        if side is not None and self.role == "store":
            side["kv"] = h
        if side is not None and self.role == "reuse":
            h = h + side["kv"]
        if extra is not None:
            h = h * extra
        return x + torch.tanh(h)


class _SideNet(torch.nn.Module):
    _no_split_modules = ["_SideBlock"]

    def __init__(self, mode, order=(0, 1, 2)):
        super().__init__()
        self.mode, self.order = mode, order
        self.pre = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList([_SideBlock("store"), _SideBlock(), _SideBlock("reuse")])

    def forward(self, x):
        side = {} if self.mode == "side" else None
        extra = torch.sigmoid(self.pre.bias) if self.mode == "extra" else None
        h = self.pre(x)
        for i in self.order:
            h = self.blocks[i](h, side=side, extra=extra)
        return h.pow(2).mean()


@pytest.mark.parametrize("mode, order, match", [
    ("side", (0, 1, 2), "block 2 of blocks computes its output from more than its input"),
    ("extra", (0, 1, 2), "block 0 of blocks computes its output from more than its input"),
    ("none", (0, 1, 2, 0, 1, 2), "entered block 0 of blocks after 3 blocks"),   # the trunk run twice
    ("none", (0, 2), "entered block 2 of blocks after 1 blocks"),                # a block skipped (layerdrop)
    ("none", (0, 1), "ran 2 of the 3 blocks"),                                   # the last one skipped
])
def test_a_trunk_the_recompute_cannot_replay_is_refused(mode, order, match):
    """[Note: one pass through the trunk]: a side channel between blocks, a tensor from before the trunk in every
    block, blocks run out of order, twice or not at all: each gave wrong gradients or a bare error before; now
    refused during the forward, before any backward. The same model without them is exact."""
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    torch.manual_seed(0)
    model = _SideNet(mode, order)
    pieces = Accumulate(model, 3)
    trunk = find_trunk(model)
    with pytest.raises(AidaptivConfigError, match=match):
        layer_major_forward(model, trunk, xs, pieces, on_loss=LayerMajorBackward(trunk, 3, [], pieces).tail)
    assert pieces.acc == {} and torch.is_grad_enabled()
    torch.manual_seed(0)
    ref_losses, ref = micro_batch_major(_SideNet("none"), xs)
    torch.manual_seed(0)
    losses, got, _ = layer_major(_SideNet("none"), xs)
    assert losses == ref_losses and all(torch.equal(got.acc[n], g) for n, g in ref.items())


def test_gpt2_as_shipped_passes_its_cache_positionally_and_stays_exact():
    """GPT-2's config defaults to ``use_cache=True`` and its model hands each block the cache as a positional
    argument: the recompute appended its keys and values a second time (16 of 28 gradients wrong before); a KV
    cache is now dropped wherever it is passed."""
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.bench.fuzz_models import HFLoss, hf_config

    def model():
        torch.manual_seed(0)
        cfg = hf_config("gpt2", 64, 3)
        cfg.use_cache = True
        cfg._attn_implementation = "sdpa"
        return HFLoss(AutoModelForCausalLM.from_config(cfg))
    xs = _batches("gpt2", 3)
    ref_losses, ref = micro_batch_major(model(), xs)
    losses, got, _ = layer_major(model(), xs)
    assert losses == ref_losses and all(torch.equal(got.acc[n], g) for n, g in ref.items())


def test_a_frozen_trunk_with_a_trained_head():
    """Everything up to the trunk's output frozen (linear probing): no gradient flows into the trunk, so its
    blocks are not recomputed; the head's gradients equal autograd's (a bare PyTorch error before)."""
    def model():
        m = _model("llama")
        for n, p in m.named_parameters():
            p.requires_grad = "lm_head" in n or n.endswith("model.norm.weight")
        return m
    xs = _batches("llama", 2)
    ref_losses, ref = micro_batch_major(model(), xs)
    losses, got, _ = layer_major(model(), xs)
    assert losses == ref_losses and sorted(got.acc) == sorted(ref) and len(ref) == 2
    assert all(torch.equal(got.acc[n], g) for n, g in ref.items())
