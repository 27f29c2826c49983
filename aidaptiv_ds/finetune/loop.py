"""The training loop: a DeepSpeed engine over the tokenized train split, eval lines, per-step metrics.

Per epoch every rank iterates its ``DistributedSampler`` share (shuffled with ``seed`` + epoch) in
micro-batches; ``gradient_accumulation_steps`` micro-batches make one optimizer step, windows are
aligned to the epoch and the epoch's last window may be shorter (its loss is rescaled so the update
is the mean over the micro-batches it has). The held-out split is scored before training, after
every epoch and, when ``--max_steps`` stops the run inside an epoch, once more at the end.

Per optimizer step one metrics line is written (:class:`aidaptiv_ds.telemetry.metrics.MetricsWriter`:
``metrics.jsonl``, and TensorBoard when installed; fields of :func:`~aidaptiv_ds.telemetry.metrics.build_record`
plus ``epoch``; counters summed over ranks); counters come from
:func:`aidaptiv_ds.telemetry.counters.snapshot` taken at the start and end of the step (data loading,
forward, backward and optimizer step included) and are summed over ranks.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..telemetry import counters
from . import distributed
from .evaluate import evaluate, hf_forward
from ..telemetry import nvml, sysinfo
from ..telemetry.metrics import MetricsWriter, build_record, format_step_summary
from .template import Example, collate


@dataclasses.dataclass
class LoopSettings:
    """Loop parameters (flags of the same names; ``max_steps`` <= 0 means "use the epochs")."""
    num_train_epochs: float
    max_steps: int
    micro_batch: int
    grad_accum: int
    eval_batch_size: int
    seed: int
    pad_id: int


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


def _combine(deltas: list[dict]) -> dict:
    """Sum per-rank counter deltas (``io_wait_s``: the slowest rank)."""
    out = {"bytes_read": {}, "bytes_written": {}, "per_path": {}, "proc_read_bytes": 0, "proc_write_bytes": 0,
           "dram_bytes": 0, "dram_peak_bytes": 0, "io_wait_s": 0.0}
    for d in deltas:
        for key in ("bytes_read", "bytes_written"):
            for tier, v in d[key].items():
                out[key][tier] = out[key].get(tier, 0) + v
        for path, v in d.get("per_path", {}).items():
            cur = out["per_path"].setdefault(path, {"bytes_read": 0, "bytes_written": 0})
            for k in cur:
                cur[k] += v.get(k, 0)
        for key in ("proc_read_bytes", "proc_write_bytes", "dram_bytes", "dram_peak_bytes"):
            out[key] += d[key]
        out["io_wait_s"] = max(out["io_wait_s"], d["io_wait_s"])
    return out


class _Totals:
    """Running sums over the timed steps (every step but the first, which also builds the ZeRO-3 trace)."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.time_s = 0.0
        self.written: dict[str, int] = {}
        self.read: dict[str, int] = {}
        self.proc_written = 0
        self.proc_read = 0
        self.dram_peak = 0

    def add(self, tokens: int, dt: float, c: dict) -> None:
        self.steps += 1
        self.tokens += tokens
        self.time_s += dt
        for tier, v in c["bytes_written"].items():
            self.written[tier] = self.written.get(tier, 0) + v
        for tier, v in c["bytes_read"].items():
            self.read[tier] = self.read.get(tier, 0) + v
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
            "mean_tokens_per_s": self.tokens / self.time_s if self.time_s > 0 else None,
        }


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="finetune", unit="step", disable=not enabled, dynamic_ncols=True)


def run_eval(engine, examples: list[Example], s: LoopSettings) -> dict:
    """Score ``examples`` with the engine in eval mode (no grad); returns ``eval_loss``/``eval_tokens``."""
    engine.eval()
    try:
        return evaluate(hf_forward(engine), examples, s.eval_batch_size, s.pad_id)
    finally:
        engine.train()


def train(engine, train_examples: list[Example], eval_examples: list[Example], s: LoopSettings,
          log: MetricsWriter | None, n_params: int) -> dict:
    """Run the whole training; returns the summary fields of the loop (see :class:`_Totals`) plus
    ``steps``, ``epochs``, ``eval_loss_before``, ``final_eval_loss``, ``train_time_s`` and
    ``dram_peak_bytes``.

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

    ev = run_eval(engine, eval_examples, s)
    eval_before = ev["eval_loss"]
    write({**ev, "step": 0, "epoch": 0.0})
    last_eval = ev

    totals = _Totals()
    dram_peak = 0
    step, epoch = 0, 0
    t_start = time.perf_counter()
    bar = _progress(plan.total_steps, rank == 0)
    engine.train()
    while step < plan.total_steps:
        sampler.set_epoch(epoch)
        snap, t_mark = counters.snapshot(), time.perf_counter()
        losses: list[float] = []
        tokens = 0
        for i, batch in enumerate(loader):
            win_start = (i // s.grad_accum) * s.grad_accum
            win_len = min(s.grad_accum, plan.micro_batches_per_epoch - win_start)
            boundary = i - win_start == win_len - 1
            engine.set_gradient_accumulation_boundary(boundary)
            out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"], use_cache=False)
            loss = out.loss
            engine.backward(loss * (s.grad_accum / win_len) if win_len != s.grad_accum else loss)
            losses.append(float(loss.detach()))
            tokens += int(batch["attention_mask"].sum())
            lr = engine.get_lr()[0] if boundary else None
            engine.step()
            if not boundary:
                continue
            step += 1
            dt = time.perf_counter() - t_mark
            after = counters.snapshot()
            c = _combine(distributed.gather_objects(counters.delta(after, snap)))
            loss_sum, n_loss, tok_all = distributed.sum_floats([sum(losses), len(losses), tokens])
            dt_max = max(distributed.gather_objects(dt))
            dram_peak = max(dram_peak, c["dram_peak_bytes"])
            if step > 1:
                totals.add(int(tok_all), dt_max, c)
            rec = build_record(step, c, step_time_s=round(dt_max, 4), loss=loss_sum / n_loss, tokens=int(tok_all),
                               lr=lr, vram=nvml.nvml_status() if rank == 0 else None,
                               rss=sysinfo.process_rss(), host_mem=sysinfo.host_memory(),
                               extra={"epoch": round(epoch + (i + 1) / plan.micro_batches_per_epoch, 4)})
            write(rec)
            bar.set_postfix_str(format_step_summary(rec), refresh=False)
            bar.update(1)
            losses, tokens = [], 0
            snap, t_mark = counters.snapshot(), time.perf_counter()
            if step >= plan.total_steps:
                break
        else:
            epoch += 1
            last_eval = run_eval(engine, eval_examples, s)
            write({**last_eval, "step": step, "epoch": float(epoch)})
            continue
        # --max_steps stopped the run inside an epoch: score the final weights once more.
        last_eval = run_eval(engine, eval_examples, s)
        write({**last_eval, "step": step, "epoch": round(step / plan.steps_per_epoch, 4)})
    bar.close()
    return {"steps": step, "epochs": round(step / plan.steps_per_epoch, 4), "eval_loss_before": eval_before,
            "final_eval_loss": last_eval["eval_loss"], "eval_tokens": last_eval["eval_tokens"],
            "train_time_s": round(time.perf_counter() - t_start, 3), "dram_peak_bytes": dram_peak,
            "steps_per_epoch": plan.steps_per_epoch, **totals.per_param_step(n_params)}
