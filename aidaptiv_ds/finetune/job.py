"""One fine-tuning run, end to end: config, data, model, DeepSpeed engine, training, saved HF model.

Files written to ``output_dir`` (rank 0):

* ``finetune_args.json``: the flags, the resolved DeepSpeed config, counts of the splits;
* ``eval_split.jsonl``: the held-out records (Dolly format), so the saved model can be re-scored;
* ``metrics.jsonl``: eval, per-step and summary lines (:class:`aidaptiv_ds.telemetry.metrics.MetricsWriter`;
  TensorBoard event files too when tensorboard is installed), a new file per run;
* the fine-tuned model as an HF directory: ``config.json``, ``model.safetensors``, tokenizer files
  (streamed one parameter at a time, :func:`~.model_io.save_hf_model`);
* ``checkpoint-N/`` every ``--save_steps`` steps and at the end (:mod:`.checkpoints`, HF's layout);
* ``demo_inputs/`` for the embedded demo: the generated data set and initial model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
import warnings
from typing import Literal

import torch

from . import distributed
from .data import filter_category, load_records, split_train_eval, write_dolly
from . import checkpoints
from .cost import run_cost
from .ds_config import cache_dirs, describe_created_dir, is_zero3, load_ds_config, model_dtype, resolve, uses_nvme
from .evaluate import EVAL_SPLIT_FILE, RUN_ARGS_FILE
from .loop import LoopSettings, ResumeState, plan_steps, train
from ..process_group import destroy_gloo_group_at_exit
from ..telemetry import sysinfo
from ..telemetry.metrics import MetricsWriter
from ..units import format_bytes
from .memory import describe as describe_memory
from .memory import memory_parts, planned_parts
from .model_io import count_parameters, load_model, load_tokenizer, resolve_source, save_hf_model
from .template import encode_records, pad_token_id

DEMO_DIR = "demo_inputs"
DEMO_LEARNING_RATE = 1e-3


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DEEPSPEED_CONFIG = os.path.join(_REPO, "ds_configs", "aidaptiv_zero3.json")


def _flag(help: str, **kw) -> dict:
    return {"metadata": {"help": help, **kw}}


@dataclasses.dataclass
class FinetuneArgs:
    """The command-line flags, defined once: ``launch/finetune.py`` parses them with
    ``transformers.HfArgumentParser`` (:func:`parse_args`); names are HF ``TrainingArguments``'
    where one exists.

    ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and ``learning_rate`` are None
    when not given (the DeepSpeed config's number, or the HF default for ``"auto"``, is used; the demo
    uses a learning rate of 1e-3). ``cache_path``: directories for the cache tier (see
    :mod:`.ds_config`). ``save_*`` / ``resume_from_checkpoint``: see :mod:`.checkpoints`.
    """
    output_dir: str = dataclasses.field(default="output/finetune", **_flag(
        "metrics.jsonl, the checkpoints and the fine-tuned HF model go here"))
    deepspeed: str = dataclasses.field(default=DEFAULT_DEEPSPEED_CONFIG, **_flag("DeepSpeed JSON config"))
    model_name_or_path: str | None = dataclasses.field(default=None, **_flag(
        "local HF model directory, a .gguf file, or a hub id (default: the embedded demo model)"))
    data_path: str | None = dataclasses.field(default=None, **_flag(
        "Dolly-format data (instruction, context, response[, category]): a JSONL file, a Hugging Face dataset id "
        "such as databricks/databricks-dolly-15k[:split] (pip install datasets), or a downloaded dataset's directory "
        "(default: the embedded demo data)"))
    category: str | None = dataclasses.field(default=None, **_flag(
        "train and evaluate only on records of this Dolly category"))
    num_train_epochs: float = dataclasses.field(default=3.0, **_flag("epochs (HF's default 3)"))
    max_steps: int = dataclasses.field(default=-1, **_flag("optimizer steps; > 0 overrides --num_train_epochs"))
    max_seq_length: int = dataclasses.field(default=512, **_flag("tokens per example (prompt + response)"))
    per_device_train_batch_size: int | None = dataclasses.field(default=None, **_flag(
        "micro-batch per rank (default: the config's number, 8 for \"auto\")"))
    gradient_accumulation_steps: int | None = dataclasses.field(default=None, **_flag(
        "micro-batches per optimizer step (default: the config's number, 1 for \"auto\")"))
    learning_rate: float | None = dataclasses.field(default=None, **_flag(
        "peak learning rate (default: the config's number, 5e-5 for \"auto\", 1e-3 for the demo)"))
    eval_fraction: float = dataclasses.field(default=0.1, **_flag("share of the records held out for eval"))
    seed: int = dataclasses.field(default=42, **_flag("seed of the data split, the shuffling and torch"))
    demo: bool = dataclasses.field(default=False, **_flag(
        "run the embedded offline demo (also the default when neither --model_name_or_path nor --data_path is given)"))
    cache_path: list[str] | None = dataclasses.field(default=None, **_flag(
        "cache directory (repeatable): sets the config's nvme_path and aidaptiv.cache_paths; a missing one is "
        "created (and said where)", action="extend", metavar="DIR"))
    dram_budget: str | None = dataclasses.field(default=None, **_flag(
        "aidaptiv.dram_budget: host memory for resident and cached state (0, 8GiB, auto)", metavar="SIZE"))
    bf16: Literal["auto", "true", "false"] = dataclasses.field(default="auto", **_flag(
        "override bf16.enabled; auto keeps the config (its \"auto\": on with GPU bf16, off on CPU)"))
    aio_handle: Literal["deepspeed", "aidaptiv"] = dataclasses.field(default="deepspeed", **_flag(
        "aio op for DeepSpeed's own nvme offload: its compiled async_io, or aidaptiv_ds's pure-Python handle "
        "(no compiler, no libaio)"))
    save_strategy: Literal["steps", "no"] = dataclasses.field(default="steps", **_flag(
        "steps: save OUTPUT_DIR/checkpoint-N every --save_steps steps and after the last step (HF's default); "
        "no: no checkpoints (the final HF model is saved either way)"))
    save_steps: int = dataclasses.field(default=500, **_flag("optimizer steps between checkpoints (HF's default 500)"))
    save_total_limit: int | None = dataclasses.field(default=None, **_flag(
        "keep at most this many checkpoints; older ones are deleted once a newer one is complete (default: all)"))
    resume_from_checkpoint: str | None = dataclasses.field(default=None, **_flag(
        "OUTPUT_DIR/checkpoint-N, or 'latest' (the newest complete checkpoint in --output_dir): continue that run "
        "bit for bit (weights, optimizer, LR schedule, data order, RNG)", metavar="PATH|latest"))
    gradient_checkpointing: Literal["auto", "true", "false"] = dataclasses.field(default="auto", **_flag(
        "recompute each decoder layer's activations in backward (HF's gradient checkpointing, non-reentrant); "
        "auto: on where the ranks are CPU ranks (their activations are host memory beside the training state)"))
    response_logits_only: Literal["auto", "true", "false"] = dataclasses.field(default="auto", **_flag(
        "compute the LM head's logits only at the positions that predict a response token (the model's "
        "boolean logits_to_keep); auto: where the model's forward allows it"))
    layer_major: bool = dataclasses.field(default=False, **_flag(
        "run each optimizer step's micro-batches block by block (engine.train_batch, aidaptiv_ds): every parameter "
        "is fetched once per step in forward and once in backward instead of once per micro-batch each, and no "
        "partial gradient is written between micro-batches; the same numbers bit for bit. Needs the \"aidaptiv\" "
        "section and a model whose blocks HF names (_no_split_modules)"))
    local_rank: int = dataclasses.field(default=-1, **_flag(argparse.SUPPRESS))  # passed by the deepspeed launcher


def build_parser():
    """The ``transformers.HfArgumentParser`` of :class:`FinetuneArgs` (help shows the defaults)."""
    from transformers import HfArgumentParser

    return HfArgumentParser(FinetuneArgs, description="Fine-tune a causal LM on Dolly-format instructions with "
                            "DeepSpeed ZeRO-3 (aidaptiv_ds when the config says so).",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def parse_args(argv: list[str] | None = None) -> FinetuneArgs:
    """Parse the command line (``argv``; default ``sys.argv[1:]``); unknown flags are an error."""
    (args,) = build_parser().parse_args_into_dataclasses(args=argv)
    return args


def _say(msg: str) -> None:
    if distributed.rank() == 0:
        print(f"[finetune] {msg}", file=sys.stderr, flush=True)


def _inputs(args: FinetuneArgs) -> tuple[str, str, bool]:
    """``(model, data, is_demo)``; prepares the demo files on rank 0 when the demo runs."""
    given = [f for f, v in (("--model_name_or_path", args.model_name_or_path), ("--data_path", args.data_path)) if v]
    if args.demo and given:
        raise ValueError(f"--demo runs the embedded model and data; drop {' and '.join(given)} or drop --demo")
    if len(given) == 1:
        missing = "--data_path" if given[0] == "--model_name_or_path" else "--model_name_or_path"
        raise ValueError(f"{given[0]} is given but {missing} is not; give both, or neither to run the embedded demo")
    if given:
        return args.model_name_or_path, args.data_path, False
    from .demo import DATA_FILE, MODEL_DIR, prepare_demo

    work = os.path.join(args.output_dir, DEMO_DIR)
    if distributed.rank() == 0:
        prepare_demo(work, seed=0)
    distributed.barrier()
    return os.path.join(work, MODEL_DIR), os.path.join(work, DATA_FILE), True


def _setup_aio(cfg: dict, choice: str) -> None:
    """Make DeepSpeed's nvme offload find an aio handle (ours, or a check that its op can load)."""
    if not uses_nvme(cfg):
        return
    if choice == "aidaptiv":
        from ..integration.aio_handle import register_with_deepspeed

        register_with_deepspeed()
        return
    if choice != "deepspeed":
        raise ValueError(f"--aio_handle {choice!r}: use deepspeed or aidaptiv")
    if isinstance(cfg.get("aidaptiv"), dict) and cfg["aidaptiv"].get("enabled"):
        return  # the aidaptiv_ds swappers do their own I/O
    from ..integration.aio_ops import async_io_buildable, async_io_installed

    if not async_io_installed() and not async_io_buildable():
        raise RuntimeError("the DeepSpeed config offloads to nvme, but DeepSpeed's async_io op is not installed and "
                           "cannot be built here (it needs libaio-dev); pass --aio_handle aidaptiv to use aidaptiv_ds's "
                           "pure-Python aio handle instead")


def _check_aidaptiv_early(cfg: dict, src) -> None:
    """With an enabled ``"aidaptiv"`` section: its checks, and the whole job's need on the cache paths for
    the model's parameter count (from its ``config.json``, where it has one), before the model is loaded
    (:mod:`aidaptiv_ds.integration.startup`), so a bad config or a drive too small is refused in seconds,
    with the job's numbers. ``deepspeed.initialize`` checks the same again."""
    from ..integration.config import section_enabled, validate

    if not section_enabled(cfg):
        return
    from ..integration.startup import preflight_params, quiet_errors

    quiet_errors()
    acfg = validate(cfg)
    if src.kind != "local":
        return  # a GGUF file or a hub id: deepspeed.initialize checks with the loaded model
    from ..planner.model_size import load_model_shape

    try:
        n = load_model_shape(src.path).n_params
    except (ValueError, KeyError, OSError):
        return  # a config the planner does not know: deepspeed.initialize checks with the loaded model
    preflight_params(acfg, cfg, n)


def _check_save_flags(args: FinetuneArgs) -> None:
    if args.save_strategy == "steps" and args.save_steps < 1:
        raise ValueError(f"--save_steps {args.save_steps}: must be >= 1 with --save_strategy steps "
                         f"(or pass --save_strategy no for no checkpoints)")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise ValueError(f"--save_total_limit {args.save_total_limit}: must be >= 1 (or leave it out to keep all)")


def _report_cache_dirs(cfg: dict, created: list, output_dir: str) -> None:
    """Say where created cache directories landed, and warn for every cache directory (created or not)
    that is not on a cache drive of its own (rank 0, once per directory of any rank)."""
    seen = set()
    made = {os.path.abspath(d) for _, d in created}
    for per_rank in distributed.gather_objects([(k, os.path.abspath(d), os.path.abspath(d) in made)
                                                for k, d in cache_dirs(cfg)]):
        for key, d, new in per_rank:
            if distributed.rank() != 0 or d in seen:
                continue
            seen.add(d)
            where, warning = describe_created_dir(d, output_dir, created=new)
            if new:
                _say(f"--cache_path ({key}): {where}")
            if warning:
                _say(f"WARNING: {warning}")


def _resume_state(engine, path: str) -> ResumeState:
    st = checkpoints.load(engine, path)
    return ResumeState(step=int(st["step"]), eval_loss_before=st["eval_loss_before"], last_eval=st["last_eval"],
                       log_history=st["log_history"], restore_rng=lambda: checkpoints.restore_rng(path))


def _restart_metrics(output_dir: str, resumed_step: int, path: str) -> MetricsWriter:
    """Rank 0's metrics writer of a resumed run: the lines of earlier runs in ``metrics.jsonl`` up to
    the checkpoint's step are kept (later ones are redone now, and summaries dropped), then a
    ``resumed_from`` line."""
    keep = []
    file = os.path.join(output_dir, MetricsWriter.FILE)
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by the kill
                if not rec.get("summary") and int(rec.get("step", 0)) <= resumed_step:
                    keep.append(line if line.endswith("\n") else line + "\n")
    log = MetricsWriter(output_dir, fresh=True)
    for line in keep:
        log.write(json.loads(line))
    log.write({"resumed_from": path, "step": resumed_step})
    return log


def _trainer_state(step: int, loop_state: dict, plan, args: FinetuneArgs, settings: LoopSettings, world: int) -> dict:
    """HF ``TrainerState``'s fields (``trainer_state.json``) for a checkpoint at ``step``."""
    return {"global_step": step, "epoch": round(step / plan.steps_per_epoch, 4), "max_steps": plan.total_steps,
            "num_train_epochs": args.num_train_epochs, "save_steps": args.save_steps,
            "train_batch_size": settings.micro_batch, "logging_steps": 1, "eval_steps": plan.steps_per_epoch,
            "log_history": loop_state["log_history"], "is_world_process_zero": True, "world_size": world,
            "best_metric": None, "best_model_checkpoint": None}


def _memory_settings(args: FinetuneArgs, model) -> tuple[bool, bool]:
    """``(gradient checkpointing, response logits only)`` resolved from the flags (``auto``, module defaults:
    checkpointing on CPU ranks unless ``--layer_major``, response-only logits where the model allows: README
    "The main job").

    Raises:
        ValueError: ``--response_logits_only true`` for a model whose forward does not take a boolean
            ``logits_to_keep``, or ``--gradient_checkpointing true`` for one without HF's checkpointing.
    """
    from deepspeed.accelerator import get_accelerator

    from .evaluate import response_logits_supported

    can_ckpt = bool(getattr(model, "supports_gradient_checkpointing", False))
    # --layer_major keeps only each block's input and recomputes the block in backward already: HF's checkpointing
    # would recompute it a second time there
    ckpt = args.gradient_checkpointing == "true" or (
        args.gradient_checkpointing == "auto" and can_ckpt and get_accelerator().device_name() == "cpu"
        and not args.layer_major)
    if ckpt and not can_ckpt:
        raise ValueError(f"--gradient_checkpointing true: {type(model).__name__} does not support HF's gradient "
                         f"checkpointing; use --gradient_checkpointing false")
    can_keep = response_logits_supported(model)
    kept = args.response_logits_only == "true" or (args.response_logits_only == "auto" and can_keep)
    if kept and not can_keep:
        raise ValueError(f"--response_logits_only true: {type(model).__name__}.forward takes no boolean "
                         f"logits_to_keep (transformers 5 causal LMs do); use --response_logits_only false")
    return ckpt, kept


def run(args: FinetuneArgs) -> dict:
    """Fine-tune and save; returns the summary line (on every rank; rank 0 writes the files).

    Raises:
        ValueError / FileNotFoundError: a bad flag, config, data file or checkpoint (messages name the
            flag and fix).
    """
    t0 = time.perf_counter()
    # DeepSpeed 0.19.8 calls collectives torch 2.13 deprecates; the warning would interleave every progress line
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    _check_save_flags(args)
    distributed.ensure_env()
    distributed.init()
    destroy_gloo_group_at_exit()  # the gloo group of a CPU run cannot abort the finished process (process_group.py)
    rank, world = distributed.rank(), distributed.world_size()
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    resume_path = checkpoints.resolve_resume(args.resume_from_checkpoint, args.output_dir) \
        if args.resume_from_checkpoint else None
    raw_cfg = load_ds_config(args.deepspeed)
    model_path, data_path, is_demo = _inputs(args)
    lr = args.learning_rate if args.learning_rate is not None or not is_demo else DEMO_LEARNING_RATE
    resolve_kw = dict(world_size=world, micro_batch=args.per_device_train_batch_size,
                      grad_accum=args.gradient_accumulation_steps, learning_rate=lr, bf16=args.bf16,
                      cache_paths=args.cache_path, dram_budget=args.dram_budget)
    created: list = []
    cfg = resolve(raw_cfg, **resolve_kw, created=created)
    _report_cache_dirs(cfg, created, args.output_dir)
    dtype = model_dtype(cfg)
    _setup_aio(cfg, args.aio_handle)

    src = resolve_source(model_path)
    _check_aidaptiv_early(cfg, src)
    tokenizer = load_tokenizer(src)
    records = filter_category(load_records(data_path), args.category)
    train_recs, eval_recs = split_train_eval(records, args.eval_fraction, args.seed)
    train_split = encode_records(tokenizer, train_recs, args.max_seq_length)
    eval_split = encode_records(tokenizer, eval_recs, args.max_seq_length)
    dropped = train_split.n_dropped + eval_split.n_dropped
    truncated = train_split.n_truncated + eval_split.n_truncated
    _say(f"data: {len(records)} records -> {len(train_split.examples)} train / {len(eval_split.examples)} eval examples; "
         f"{dropped} dropped (prompt alone >= --max_seq_length {args.max_seq_length}), {truncated} truncated")
    settings = LoopSettings(args.num_train_epochs, args.max_steps, cfg["train_micro_batch_size_per_gpu"],
                            cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"], args.seed,
                            pad_token_id(tokenizer), save_steps=args.save_steps if args.save_strategy == "steps" else 0,
                            save_at_end=args.save_strategy == "steps")
    plan = plan_steps(len(train_split.examples), world, settings)
    cfg = resolve(raw_cfg, **resolve_kw, total_steps=plan.total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        write_dolly(eval_recs, os.path.join(args.output_dir, EVAL_SPLIT_FILE))
        with open(os.path.join(args.output_dir, RUN_ARGS_FILE), "w", encoding="utf-8") as f:
            json.dump({**dataclasses.asdict(args), "model_name_or_path": model_path, "data_path": data_path,
                       "demo": is_demo, "world_size": world, "eval_batch_size": settings.eval_batch_size,
                       "dtype": str(dtype).replace("torch.", ""), "ds_config_resolved": cfg}, f, indent=1)

    import deepspeed

    loaded = load_model(src, dtype, cfg, is_zero3(cfg), tokenizer=tokenizer)
    model = loaded.model
    ckpt, kept = _memory_settings(args, model)
    settings.response_logits_only = kept
    settings.layer_major = args.layer_major
    if ckpt:  # non-reentrant: reentrant checkpointing and steps inside backward clash
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _say(f"activation checkpointing {'on' if ckpt else 'off'}; "
         f"logits {'at response positions only' if kept else 'at every position'}")
    if rank == 0:
        run_args = os.path.join(args.output_dir, RUN_ARGS_FILE)
        with open(run_args, encoding="utf-8") as f:
            saved = json.load(f)
        saved.update(gradient_checkpointing=ckpt, response_logits_only=kept)  # resolved: reload_eval_loss reads it
        with open(run_args, "w", encoding="utf-8") as f:
            json.dump(saved, f, indent=1)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(e.input_ids) for e in train_split.examples + eval_split.examples)
    if max_pos is not None and longest > max_pos:
        raise ValueError(f"--max_seq_length {args.max_seq_length}: examples reach {longest} tokens but the model "
                         f"handles at most {max_pos} positions (max_position_embeddings); use --max_seq_length {max_pos}")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=cfg)
    n_params = count_parameters(engine.module)
    resume = _resume_state(engine, resume_path) if resume_path else None
    if resume is not None:
        _say(f"resumed from {resume_path} at step {resume.step}")
    log = None
    if rank == 0:
        log = _restart_metrics(args.output_dir, resume.step, resume_path) if resume is not None \
            else MetricsWriter(args.output_dir, fresh=True)
    _say(f"model: {src.kind} {model_path}, {n_params:,} parameters, {dtype}; {plan.total_steps} optimizer steps "
         f"({plan.steps_per_epoch}/epoch), world size {world}")

    def on_save(step: int, loop_state: dict) -> str:
        return checkpoints.save(engine, args.output_dir, step, _trainer_state(step, loop_state, plan, args, settings,
                                                                             world),
                                loop_state, args.save_total_limit)

    try:
        stats = train(engine, train_split.examples, eval_split.examples, settings, log, n_params, on_save=on_save,
                      resume=resume)
        cost = run_cost(stats)
        # DeepSpeed's coordinator may still have parameters in flight that it prefetched after the last eval
        # forward; gathering one of them for the save asserts ("Cannot partition a param in flight")
        engine.empty_partition_cache()
        rss_before = sysinfo.process_rss()["rss_bytes"]
        sysinfo.reset_peak_rss()
        t_save = time.perf_counter()
        saved = save_hf_model(engine.module, tokenizer, args.output_dir, dtype, rank)
        save_s = time.perf_counter() - t_save
        save_rss = max(distributed.gather_objects(sysinfo.process_rss()["peak_rss_bytes"] or 0))
        summary = {"summary": True, **stats, **cost, "total_params": n_params, "saved_model": saved or args.output_dir,
                   "metrics_file": os.path.join(args.output_dir, MetricsWriter.FILE),
                   "checkpoints": [p for _, p in checkpoints.list_checkpoints(args.output_dir)],
                   "dtype": str(dtype).replace("torch.", ""), "world_size": world,
                   "n_train_examples": len(train_split.examples), "n_eval_examples": len(eval_split.examples),
                   "dropped_examples": dropped, "truncated_examples": truncated,
                   "deepspeed_config": args.deepspeed, "resumed_from": resume_path,
                   "save_time_s": round(save_s, 3), "save_rss_before_bytes": rss_before, "save_peak_rss_bytes": save_rss,
                   "wall_time_s": round(time.perf_counter() - t0, 3)}
        summary["memory"] = memory_parts(summary, planned_parts(
            engine.module.config.to_dict() if hasattr(engine.module, "config") else None, cfg, n_params,
            args.max_seq_length, settings.micro_batch, world, dtype.itemsize, _cpu_ranks(), checkpointing=ckpt,
            logits_tokens=stats.get("max_logits_tokens"), module=engine.module), world)
        if log is not None:
            log.write(summary)
    finally:
        if log is not None:
            log.close()
    distributed.barrier()
    _say(format_summary(summary))
    return summary


def _cpu_ranks() -> bool:
    """The ranks train on DeepSpeed's CPU accelerator (activations and gathered parameters are host memory)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def format_summary(s: dict) -> str:
    """The run's last line: eval loss before -> after, steps, tokens/s, bytes per parameter per step
    (cache tier; ``/proc`` beside it), total written per drive and the DWPD it implies, peak RSS and its
    parts (:mod:`.memory`: model loading, ours with the DRAM tier against its budget, DeepSpeed's working
    set, activations and logits, the rest), and where the metrics and the model are."""
    def b(n):
        return "n/a" if n is None else format_bytes(n)

    tps = s.get("mean_tokens_per_s")
    parts = [f"eval loss {s['eval_loss_before']:.4f} -> {s['final_eval_loss']:.4f}",
             f"{s['steps']} steps" + (f" (resumed at {s['resumed_from_step']})" if s.get("resumed_from") else ""),
             f"{tps:.0f} tokens/s" if tps is not None else "tokens/s n/a (one step)"]
    w, r = s.get("bytes_written_per_param_per_step"), s.get("bytes_read_per_param_per_step")
    pw = s.get("proc_bytes_written_per_param_per_step")
    if w is not None:
        parts.append(f"cache {w:.2f} B/param/step written, {r:.2f} read (/proc: {pw:.2f} written)")
    elif pw is not None:
        parts.append(f"/proc {pw:.2f} B/param/step written")
    for path, d in (s.get("drives") or {}).items():
        dw = f", {d['dwpd']:.2f} DWPD at this pace" if d.get("dwpd") is not None else ""
        rated = f" (rated {d['rated_dwpd']:g})" if d.get("rated_dwpd") is not None and dw else ""
        parts.append(f"{path}: {b(d['bytes_written'])} written{dw}{rated}")
    if s.get("ledger_bytes_written") is not None:
        parts.append(f"ledger {b(s['ledger_bytes_written'])}")
    parts.append(describe_memory(s.get("memory")) if s.get("memory") else f"peak RSS {b(s.get('peak_rss_bytes'))}")
    parts.append(f"metrics {s['metrics_file']}")
    parts.append(f"model {s['saved_model']}")
    return "; ".join(parts)
