"""The training loop: a DeepSpeed engine over the tokenized train split, eval lines, per-step metrics.

Per epoch every rank iterates its ``DistributedSampler`` share (shuffled with ``seed`` + epoch) in
micro-batches; ``gradient_accumulation_steps`` micro-batches make one optimizer step, windows are
aligned to the epoch and the epoch's last window may be shorter (its loss is rescaled so the update
is the mean over the micro-batches it has). The held-out split is scored before training, after
every epoch and, when ``--max_steps`` stops the run inside an epoch, once more at the end.

Per optimizer step one metrics line is written (:class:`aidaptiv_ds.telemetry.metrics.MetricsWriter`:
``metrics.jsonl``, and TensorBoard when installed; fields of :func:`~aidaptiv_ds.telemetry.metrics.build_record`
plus ``epoch`` and ``writeback_wait_s``, the seconds the step's end waited for its own write-back
(the slowest rank); counters summed over ranks, ``rss_bytes``/``peak_rss_bytes`` the largest rank's).

Accounting: the run's I/O is cut into back-to-back *windows* (:class:`_Windows`): everything before
the first step (initialisation, the first eval), each optimizer step, each eval and each checkpoint
save. A window ends with a settled :func:`~aidaptiv_ds.telemetry.counters.snapshot` (write-back
still in flight completes and is booked in the endurance ledger first), and the next one starts
there, so every byte lands in exactly one window: a step's figures are its own bytes, the steps'
bytes sum with the other windows to what the ledger booked, and per step they are the bytes
``/proc/self/io`` saw (plus the few KB of the metrics and ledger files), on every rank and under
every launcher.

Checkpoints (:mod:`.checkpoints`): after a step (and after the eval that ends an epoch or the
run), every ``save_steps`` steps and at the end, ``on_save`` saves; a resumed run starts from the
saved step: it skips the micro-batches of the epoch already trained on and restores the RNG
states where they were saved, so it continues bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import time
from typing import Callable

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..telemetry import counters
from . import distributed
from .evaluate import evaluate, hf_forward
from ..telemetry import nvml, sysinfo
from ..telemetry.metrics import MetricsWriter, build_record, format_step_summary
from .template import IGNORE_INDEX, Example, collate


@dataclasses.dataclass
class LoopSettings:
    """Loop parameters (flags of the same names; ``max_steps`` <= 0 means "use the epochs").

    ``save_steps``: checkpoint every this many optimizer steps (0: never); ``save_at_end``: also after
    the last step (HF's ``save_strategy="steps"``). ``response_logits_only``: the model computes logits at
    the positions that predict a response token only (:func:`training_loss`). ``layer_major``: each full
    accumulation window is one ``engine.train_batch`` (aidaptiv_ds's layer-major step); a short last window of
    an epoch runs micro-batch by micro-batch (its loss scaled to its length).
    """
    num_train_epochs: float
    max_steps: int
    micro_batch: int
    grad_accum: int
    eval_batch_size: int
    seed: int
    pad_id: int
    save_steps: int = 0
    save_at_end: bool = False
    response_logits_only: bool = False
    layer_major: bool = False


@dataclasses.dataclass
class StepPlan:
    """How many micro-batches and optimizer steps the run has (per rank)."""
    micro_batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int


def plan_steps(n_train: int, world: int, s: LoopSettings) -> StepPlan:
    """Micro-batches per epoch (``DistributedSampler`` gives each rank ceil(n/world) examples),
    optimizer steps per epoch (last window may be short) and the run's total steps.

    Raises:
        ValueError: no training example, or neither a positive ``--num_train_epochs`` nor ``--max_steps``.
    """
    if n_train < 1:
        raise ValueError("the train split is empty (every record was dropped by --max_seq_length); "
                         "raise --max_seq_length or check --data_path/--category")
    micro = math.ceil(math.ceil(n_train / world) / s.micro_batch)
    per_epoch = math.ceil(micro / s.grad_accum)
    if s.max_steps > 0:
        total = s.max_steps
    elif s.num_train_epochs > 0:
        total = math.ceil(s.num_train_epochs * per_epoch)
    else:
        raise ValueError(f"--num_train_epochs {s.num_train_epochs} and --max_steps {s.max_steps}: one of them must be > 0")
    return StepPlan(micro, per_epoch, total)


#: gauges summed over ranks (the DRAM tier and the buffer pool of every rank)
_SUMMED_GAUGES = ("dram_bytes", "dram_peak_bytes", "dram_budgeted_bytes", "dram_budgeted_peak_bytes", "dram_budget_bytes",
                  "buffer_pool_bytes")


def _combine(deltas: list[dict]) -> dict:
    """Sum per-rank counter deltas (``io_wait_s``: the slowest rank; RSS: the largest rank)."""
    out = {"bytes_read": {}, "bytes_written": {}, "per_path": {}, "proc_read_bytes": 0, "proc_write_bytes": 0,
           "io_wait_s": 0.0, "rss_bytes": 0, "peak_rss_bytes": 0, **{k: 0 for k in _SUMMED_GAUGES}}
    for d in deltas:
        for key in ("bytes_read", "bytes_written"):
            for tier, v in d[key].items():
                out[key][tier] = out[key].get(tier, 0) + v
        for path, v in d.get("per_path", {}).items():
            cur = out["per_path"].setdefault(path, {"bytes_read": 0, "bytes_written": 0})
            for k in cur:
                cur[k] += v.get(k, 0)
        for key in ("proc_read_bytes", "proc_write_bytes", *_SUMMED_GAUGES):
            out[key] += d.get(key, 0)
        out["io_wait_s"] = max(out["io_wait_s"], d["io_wait_s"])
        out["settle_s"] = max(out.get("settle_s", 0.0), d.get("settle_s", 0.0))
        for key in ("rss_bytes", "peak_rss_bytes"):
            out[key] = max(out[key], d.get(key) or 0)
    return out


class _Windows:
    """Back-to-back accounting windows (module docstring): :meth:`close` ends the current one and
    returns its counters summed over ranks (collective: every rank calls it at the same point)."""

    def __init__(self) -> None:
        self.prev = counters.snapshot(settle_first=True)

    def setup(self) -> dict:
        """The counters before the first window (cumulative since the store opened: model loading,
        ``deepspeed.initialize`` and the training state's first write), summed over ranks; its peak RSS is
        the process's since it started (model loading included)."""
        d = {**self.prev, **sysinfo.process_rss()}
        self.exact_peaks = sysinfo.reset_peak_rss()
        return _combine(distributed.gather_objects(d))

    def close(self) -> dict:
        """The window's counters; its ``peak_rss_bytes`` is the window's own peak (``VmHWM`` is reset as each
        window starts; where the kernel does not allow that, the process's peak so far)."""
        t0 = time.perf_counter()
        now = counters.snapshot(settle_first=True)
        d = counters.delta(now, self.prev)
        d.update(sysinfo.process_rss())
        sysinfo.reset_peak_rss()
        d["settle_s"] = time.perf_counter() - t0
        self.prev = now
        return _combine(distributed.gather_objects(d))


class _Totals:
    """Running sums over the timed steps (every step of this process but its first, which also builds
    the ZeRO-3 trace) and over every window of the run."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.time_s = 0.0
        self.written: dict[str, int] = {}
        self.read: dict[str, int] = {}
        self.path_written: dict[str, int] = {}
        self.path_read: dict[str, int] = {}
        self.proc_written = 0
        self.proc_read = 0
        self.all_written: dict[str, int] = {}   # every window: init, steps, evals, saves
        self.all_read: dict[str, int] = {}
        self.all_path: dict[str, dict] = {}
        self.windows: dict[str, dict] = {}      # kind -> {"bytes_written", "bytes_read"} on the cache tier
        self.peak_rss = 0
        self.dram_peak = 0
        self.logits_tokens = 0  # the most positions of one micro-batch the LM head computed logits for
        self.memory = {"dram_budgeted_peak_bytes": 0, "dram_budget_bytes": 0, "buffer_pool_bytes": 0,
                       "setup_peak_rss_bytes": 0, "steps_peak_rss_bytes": 0}

    def window(self, kind: str, c: dict) -> None:
        for tier, v in c["bytes_written"].items():
            self.all_written[tier] = self.all_written.get(tier, 0) + v
        for tier, v in c["bytes_read"].items():
            self.all_read[tier] = self.all_read.get(tier, 0) + v
        for path, v in c["per_path"].items():
            cur = self.all_path.setdefault(path, {"bytes_read": 0, "bytes_written": 0})
            for k in cur:
                cur[k] += v.get(k, 0)
        w = self.windows.setdefault(kind, {"bytes_written": 0, "bytes_read": 0})
        w["bytes_written"] += c["bytes_written"].get("cache", 0)
        w["bytes_read"] += c["bytes_read"].get("cache", 0)
        self.peak_rss = max(self.peak_rss, c.get("peak_rss_bytes") or 0)
        self.dram_peak = max(self.dram_peak, c.get("dram_peak_bytes") or 0)
        self.memory["dram_budgeted_peak_bytes"] = max(self.memory["dram_budgeted_peak_bytes"],
                                                      c.get("dram_budgeted_peak_bytes") or 0)
        self.memory["dram_budget_bytes"] = c.get("dram_budget_bytes") or self.memory["dram_budget_bytes"]
        self.memory["buffer_pool_bytes"] = max(self.memory["buffer_pool_bytes"], c.get("buffer_pool_bytes") or 0)
        key = "setup_peak_rss_bytes" if kind == "setup" else "steps_peak_rss_bytes" if kind == "steps" else None
        if key:
            self.memory[key] = max(self.memory[key], c.get("peak_rss_bytes") or 0)

    def add(self, tokens: int, dt: float, c: dict) -> None:
        self.steps += 1
        self.tokens += tokens
        self.time_s += dt
        for tier, v in c["bytes_written"].items():
            self.written[tier] = self.written.get(tier, 0) + v
        for tier, v in c["bytes_read"].items():
            self.read[tier] = self.read.get(tier, 0) + v
        for path, v in c["per_path"].items():
            self.path_written[path] = self.path_written.get(path, 0) + v.get("bytes_written", 0)
            self.path_read[path] = self.path_read.get(path, 0) + v.get("bytes_read", 0)
        self.proc_written += c["proc_write_bytes"]
        self.proc_read += c["proc_read_bytes"]

    def per_param_step(self, n_params: int) -> dict:
        def f(v):
            return None if self.steps == 0 else v / n_params / self.steps
        return {
            "bytes_written_per_param_per_step": f(self.written["cache"]) if "cache" in self.written else None,
            "bytes_read_per_param_per_step": f(self.read["cache"]) if "cache" in self.read else None,
            "bytes_written_per_param_per_step_by_tier": {t: f(v) for t, v in self.written.items()},
            "bytes_read_per_param_per_step_by_tier": {t: f(v) for t, v in self.read.items()},
            "proc_bytes_written_per_param_per_step": f(self.proc_written),
            "proc_bytes_read_per_param_per_step": f(self.proc_read),
            "timed_steps": self.steps,
            "timed_time_s": round(self.time_s, 4),
            "mean_tokens_per_s": self.tokens / self.time_s if self.time_s > 0 else None,
            "mean_step_time_s": self.time_s / self.steps if self.steps else None,
            "timed_bytes_written_per_path": dict(self.path_written),
            "timed_bytes_read_per_path": dict(self.path_read),
            "cache_bytes_written_total": self.all_written.get("cache"),
            "cache_bytes_read_total": self.all_read.get("cache"),
            "bytes_per_path_total": {p: dict(v) for p, v in self.all_path.items()},
            "cache_bytes_by_window": {k: dict(v) for k, v in self.windows.items()},
            "peak_rss_bytes": self.peak_rss or None,
            "max_logits_tokens": self.logits_tokens or None,
            **self.memory,
        }


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="finetune", unit="step", disable=not enabled, dynamic_ncols=True)


def training_loss(engine, batch: dict, response_logits_only: bool):
    """The micro-batch's mean next-token cross-entropy over its response tokens, by the model's own loss.

    [Note: logits at the response positions only] The labels are ``IGNORE_INDEX`` on the prompt and on the
    padding, so the logits there are computed and thrown away: ``[B, T, V]`` in fp32 (402 MB for a batch of
    4 x 512 tokens over SmolLM2's 49,152 tokens), and the loss takes an fp32 copy, ``log_softmax`` another
    and backward their gradients. Where the model's forward takes a boolean ``logits_to_keep`` mask
    (transformers' ``slice_logits_to_keep``: ``LlamaForCausalLM`` and the other causal LMs of transformers 5),
    ``response_logits_only`` asks for the logits at the positions that predict a response token (position
    ``t`` predicts token ``t + 1``) and passes their targets as ``shift_labels``: the same tokens, the same
    mean, only the positions no loss is taken at are not computed. The float sum runs over fewer terms in
    another order, so the last bits of the loss can differ from the full-logits loss.
    """
    return engine(**training_inputs(batch, response_logits_only)).loss


def training_inputs(batch: dict, response_logits_only: bool) -> dict:
    """The keyword arguments of the model's forward for :func:`training_loss` (also a micro-batch of
    ``engine.train_batch``, which calls the model with them)."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    if not response_logits_only:
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}
    target = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    keep = target != IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False, "logits_to_keep": keep,
            "shift_labels": target[keep]}


def logits_positions(batch: dict, response_logits_only: bool) -> int:
    """How many positions of ``batch`` :func:`training_loss` computes logits for: every one (``B x T``), or
    with ``response_logits_only`` those that predict a labelled token."""
    if not response_logits_only:
        return int(batch["input_ids"].numel())
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def run_eval(engine, examples: list[Example], s: LoopSettings) -> dict:
    """Score ``examples`` with the engine in eval mode (no grad); returns ``eval_loss``/``eval_tokens``."""
    engine.eval()
    try:
        return evaluate(hf_forward(engine, s.response_logits_only), examples, s.eval_batch_size, s.pad_id)
    finally:
        engine.train()


@dataclasses.dataclass
class ResumeState:
    """Where a resumed run starts: the saved loop state (:func:`loop_state`) and a callable that
    restores the RNG states saved with it."""
    step: int
    eval_loss_before: float
    last_eval: dict
    log_history: list
    restore_rng: Callable[[], object]


_KILL_ENV = "AIDAPTIV_TEST_KILL_AFTER_STEP"


def _kill_after(step: int) -> None:
    """Test hook: ``AIDAPTIV_TEST_KILL_AFTER_STEP=N`` sends SIGKILL to this process after step N (and its save)."""
    if os.environ.get(_KILL_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def train(engine, train_examples: list[Example], eval_examples: list[Example], s: LoopSettings,
          log: MetricsWriter | None, n_params: int, *, on_save: Callable[[int, dict], None] | None = None,
          resume: ResumeState | None = None) -> dict:
    """Run the whole training (or the rest of it, from ``resume``); returns the summary fields of the
    loop (see :class:`_Totals`) plus ``steps``, ``epochs``, ``eval_loss_before``, ``final_eval_loss``,
    ``train_time_s``, ``dram_peak_bytes`` and ``resumed_from_step``.

    ``on_save(step, loop_state)`` is called (on every rank) at each checkpoint point of
    :class:`LoopSettings`; ``loop_state`` is what :class:`ResumeState` needs to continue.

    Collective: every rank calls it with the same splits and settings.
    """
    rank, world = distributed.rank(), distributed.world_size()
    plan = plan_steps(len(train_examples), world, s)
    sampler = DistributedSampler(train_examples, num_replicas=world, rank=rank, shuffle=True, seed=s.seed)
    loader = DataLoader(train_examples, batch_size=s.micro_batch, sampler=sampler,
                        collate_fn=functools.partial(collate, pad_id=s.pad_id))
    assert len(loader) == plan.micro_batches_per_epoch, (len(loader), plan)

    def write(record: dict) -> None:
        if log is not None:
            log.write(record)

    totals = _Totals()
    windows = _Windows()
    cs = windows.setup()
    totals.window("setup", cs)
    # the setup window's bytes and peak (model loading), so a report of a resumed run counts every process's
    write({"setup": True, "step": resume.step if resume is not None else 0, "peak_rss_bytes": cs["peak_rss_bytes"],
           **_io_fields(cs)})
    if resume is None:
        ev = run_eval(engine, eval_examples, s)
        step, eval_before, history = 0, ev["eval_loss"], []
        c = windows.close()
        totals.window("eval", c)
        rec = {**ev, "step": 0, "epoch": 0.0, **_io_fields(c)}
        write(rec)
        history.append({"step": 0, "epoch": 0.0, "eval_loss": ev["eval_loss"]})
        last_eval = ev
    else:
        step, eval_before, last_eval = resume.step, resume.eval_loss_before, resume.last_eval
        history = list(resume.log_history)
    start_step = step
    epoch, done_in_epoch = divmod(step, plan.steps_per_epoch)
    skip = done_in_epoch * s.grad_accum  # micro-batches of this epoch the checkpoint already trained on
    rng_pending = resume is not None

    def state() -> dict:
        return {"step": step, "eval_loss_before": eval_before, "last_eval": last_eval, "log_history": history}

    t_start = time.perf_counter()
    bar = _progress(plan.total_steps, rank == 0)
    bar.update(step)
    engine.train()
    while step < plan.total_steps:
        sampler.set_epoch(epoch)
        if rng_pending and skip == 0:  # the saved run drew the loader's seed after this point
            resume.restore_rng()
            rng_pending = False
        it = iter(loader)
        for _ in range(skip):
            next(it)
        if rng_pending:  # the saved run had drawn the loader's seed before this point
            resume.restore_rng()
            rng_pending = False
        first_i, skip = skip, 0
        t_mark = time.perf_counter()
        losses: list[float] = []
        tokens = width = 0
        window: list[dict] = []  # layer-major: the window's micro-batches, trained at its boundary
        for i, batch in enumerate(it, start=first_i):
            win_start = (i // s.grad_accum) * s.grad_accum
            win_len = min(s.grad_accum, plan.micro_batches_per_epoch - win_start)
            boundary = i - win_start == win_len - 1
            width = max(width, int(batch["input_ids"].shape[1]))
            totals.logits_tokens = max(totals.logits_tokens, logits_positions(batch, s.response_logits_only))
            tokens += int(batch["attention_mask"].sum())
            if s.layer_major and win_len == s.grad_accum:  # a short last window runs micro-batch by micro-batch
                window.append(training_inputs(batch, s.response_logits_only))
                if not boundary:
                    continue
                lr = engine.get_lr()[0]
                engine.train_batch(iter(window))
                losses.extend(float(x) for x in engine.aidaptiv_losses)
                window = []
            else:
                engine.set_gradient_accumulation_boundary(boundary)
                loss = training_loss(engine, batch, s.response_logits_only)
                engine.backward(loss * (s.grad_accum / win_len) if win_len != s.grad_accum else loss)
                losses.append(float(loss.detach()))
                lr = engine.get_lr()[0] if boundary else None
                engine.step()
                if not boundary:
                    continue
            step += 1
            c = windows.close()
            dt = time.perf_counter() - t_mark  # with the wait for the step's own write-back
            totals.window("steps", c)
            loss_sum, n_loss, tok_all = distributed.sum_floats([sum(losses), len(losses), tokens])
            dt_max = max(distributed.gather_objects(dt))
            if step > start_step + 1:
                totals.add(int(tok_all), dt_max, c)
            ep = round(epoch + (i + 1) / plan.micro_batches_per_epoch, 4)
            rec = build_record(step, c, step_time_s=round(dt_max, 4), loss=loss_sum / n_loss, tokens=int(tok_all),
                               lr=lr, vram=nvml.nvml_status() if rank == 0 else None,
                               rss={"rss_bytes": c["rss_bytes"], "peak_rss_bytes": c["peak_rss_bytes"]},
                               host_mem=sysinfo.host_memory(),
                               extra={"epoch": ep, "writeback_wait_s": round(c["settle_s"], 4), "batch_width": width})
            write(rec)
            history.append({"step": step, "epoch": ep, "loss": rec["loss"], "learning_rate": lr})
            bar.set_postfix_str(format_step_summary(rec), refresh=False)
            bar.update(1)
            losses, tokens, width = [], 0, 0
            end_of_epoch = i == plan.micro_batches_per_epoch - 1
            stop = step >= plan.total_steps
            if end_of_epoch or stop:
                last_eval = run_eval(engine, eval_examples, s)
                ev_epoch = float(epoch + 1) if end_of_epoch else round(step / plan.steps_per_epoch, 4)
                ce = windows.close()
                totals.window("eval", ce)
                write({**last_eval, "step": step, "epoch": ev_epoch, **_io_fields(ce)})
                history.append({"step": step, "epoch": ev_epoch, "eval_loss": last_eval["eval_loss"]})
            if on_save is not None and ((s.save_steps > 0 and step % s.save_steps == 0) or (stop and s.save_at_end)):
                t_save = time.perf_counter()
                path = on_save(step, state())
                cs = windows.close()
                totals.window("save", cs)
                write({"checkpoint": path, "step": step, "save_time_s": round(time.perf_counter() - t_save, 3),
                       **_io_fields(cs)})
            _kill_after(step)
            t_mark = time.perf_counter()
            if stop:
                break
        else:
            epoch += 1
    bar.close()
    return {"steps": step, "epochs": round(step / plan.steps_per_epoch, 4), "eval_loss_before": eval_before,
            "final_eval_loss": last_eval["eval_loss"], "eval_tokens": last_eval["eval_tokens"],
            "train_time_s": round(time.perf_counter() - t_start, 3), "dram_peak_bytes": totals.dram_peak,
            "steps_per_epoch": plan.steps_per_epoch, "resumed_from_step": start_step if resume is not None else None,
            **totals.per_param_step(n_params)}


def _io_fields(c: dict) -> dict:
    """The cache-tier and ``/proc`` bytes of a window that is not a step (an eval, a save), for its line."""
    return {"cache_read_bytes": c["bytes_read"].get("cache", 0), "cache_write_bytes": c["bytes_written"].get("cache", 0),
            "proc_read_bytes": c["proc_read_bytes"], "proc_write_bytes": c["proc_write_bytes"]}
