"""One fine-tuning run, end to end: config, data, model, DeepSpeed engine, training, saved HF model.

Files written to ``output_dir`` (rank 0):

* ``finetune_args.json``: the flags, the resolved DeepSpeed config, counts of the splits;
* ``eval_split.jsonl``: the held-out records (Dolly format), so the saved model can be re-scored;
* ``metrics.jsonl``: eval, per-step and summary lines (:class:`aidaptiv_ds.telemetry.metrics.MetricsWriter`;
  TensorBoard event files too when tensorboard is installed), a new file per run;
* the fine-tuned model as an HF directory: ``config.json``, ``model.safetensors``, tokenizer files;
* ``demo_inputs/`` for the embedded demo: the generated data set and initial model.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
import warnings

import torch

from . import distributed
from .data import filter_category, read_dolly, split_train_eval, write_dolly
from .ds_config import is_zero3, load_ds_config, model_dtype, resolve, uses_nvme
from .evaluate import EVAL_SPLIT_FILE, RUN_ARGS_FILE
from .loop import LoopSettings, plan_steps, train
from ..telemetry.metrics import MetricsWriter
from .model_io import count_parameters, load_model, load_tokenizer, resolve_source, save_hf_model
from .template import encode_records, pad_token_id

DEMO_DIR = "demo_inputs"
DEMO_LEARNING_RATE = 1e-3


@dataclasses.dataclass
class FinetuneArgs:
    """The command-line flags (HF ``TrainingArguments`` names where one exists).

    ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and ``learning_rate`` are None
    when not given (the DeepSpeed config's number, or the HF default for ``"auto"``, is used; the demo
    uses a learning rate of 1e-3). ``cache_path``: directories for the cache tier (see
    :mod:`.ds_config`). ``bf16``: ``auto``/``true``/``false``. ``aio_handle``: ``deepspeed`` (its
    compiled ``async_io`` op) or ``aidaptiv`` (aidaptiv_ds's pure-Python handle) for nvme offload.
    """
    output_dir: str
    deepspeed: str
    model_name_or_path: str | None = None
    data_path: str | None = None
    category: str | None = None
    num_train_epochs: float = 3.0
    max_steps: int = -1
    max_seq_length: int = 512
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    learning_rate: float | None = None
    eval_fraction: float = 0.1
    seed: int = 42
    demo: bool = False
    cache_path: list[str] | None = None
    bf16: str = "auto"
    aio_handle: str = "deepspeed"
    dram_budget: str | None = None


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
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not installed_ops.get("async_io") and not AsyncIOBuilder().is_compatible(verbose=False):
        raise RuntimeError("the DeepSpeed config offloads to nvme, but DeepSpeed's async_io op is not installed and "
                           "cannot be built here (it needs libaio-dev); pass --aio_handle aidaptiv to use aidaptiv_ds's "
                           "pure-Python aio handle instead")


def run(args: FinetuneArgs) -> dict:
    """Fine-tune and save; returns the summary line (on every rank; rank 0 writes the files).

    Raises:
        ValueError / FileNotFoundError: a bad flag, config or data file (messages name the flag and fix).
    """
    t0 = time.perf_counter()
    # DeepSpeed 0.19.8 calls collectives torch 2.13 deprecates; the warning would interleave every progress line
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    distributed.ensure_env()
    distributed.init()
    rank, world = distributed.rank(), distributed.world_size()
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    raw_cfg = load_ds_config(args.deepspeed)
    model_path, data_path, is_demo = _inputs(args)
    lr = args.learning_rate if args.learning_rate is not None or not is_demo else DEMO_LEARNING_RATE
    resolve_kw = dict(world_size=world, micro_batch=args.per_device_train_batch_size,
                      grad_accum=args.gradient_accumulation_steps, learning_rate=lr, bf16=args.bf16,
                      cache_paths=args.cache_path, dram_budget=args.dram_budget)
    cfg = resolve(raw_cfg, **resolve_kw)
    dtype = model_dtype(cfg)
    _setup_aio(cfg, args.aio_handle)

    src = resolve_source(model_path)
    tokenizer = load_tokenizer(src)
    records = filter_category(read_dolly(data_path), args.category)
    train_recs, eval_recs = split_train_eval(records, args.eval_fraction, args.seed)
    train_split = encode_records(tokenizer, train_recs, args.max_seq_length)
    eval_split = encode_records(tokenizer, eval_recs, args.max_seq_length)
    dropped = train_split.n_dropped + eval_split.n_dropped
    truncated = train_split.n_truncated + eval_split.n_truncated
    _say(f"data: {len(records)} records -> {len(train_split.examples)} train / {len(eval_split.examples)} eval examples; "
         f"{dropped} dropped (prompt alone >= --max_seq_length {args.max_seq_length}), {truncated} truncated")
    settings = LoopSettings(args.num_train_epochs, args.max_steps, cfg["train_micro_batch_size_per_gpu"],
                            cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"], args.seed,
                            pad_token_id(tokenizer))
    plan = plan_steps(len(train_split.examples), world, settings)
    cfg = resolve(raw_cfg, **resolve_kw, total_steps=plan.total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        write_dolly(eval_recs, os.path.join(args.output_dir, EVAL_SPLIT_FILE))
        with open(os.path.join(args.output_dir, RUN_ARGS_FILE), "w", encoding="utf-8") as f:
            json.dump({**dataclasses.asdict(args), "model_name_or_path": model_path, "data_path": data_path,
                       "demo": is_demo, "world_size": world, "eval_batch_size": settings.eval_batch_size,
                       "dtype": str(dtype).replace("torch.", ""), "ds_config_resolved": cfg}, f, indent=1)
    log = MetricsWriter(args.output_dir, fresh=True) if rank == 0 else None

    import deepspeed

    loaded = load_model(src, dtype, cfg, is_zero3(cfg), tokenizer=tokenizer)
    model = loaded.model
    max_pos = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(e.input_ids) for e in train_split.examples + eval_split.examples)
    if max_pos is not None and longest > max_pos:
        raise ValueError(f"--max_seq_length {args.max_seq_length}: examples reach {longest} tokens but the model "
                         f"handles at most {max_pos} positions (max_position_embeddings); use --max_seq_length {max_pos}")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=cfg)
    n_params = count_parameters(engine.module)
    _say(f"model: {src.kind} {model_path}, {n_params:,} parameters, {dtype}; {plan.total_steps} optimizer steps "
         f"({plan.steps_per_epoch}/epoch), world size {world}")
    try:
        stats = train(engine, train_split.examples, eval_split.examples, settings, log, n_params)
        # DeepSpeed's coordinator may still have parameters in flight that it prefetched after the last eval
        # forward; gathering one of them for the save asserts ("Cannot partition a param in flight")
        engine.empty_partition_cache()
        saved = save_hf_model(engine.module, tokenizer, args.output_dir, dtype, rank)
        summary = {"summary": True, **stats, "total_params": n_params, "saved_model": saved or args.output_dir,
                   "dtype": str(dtype).replace("torch.", ""), "world_size": world,
                   "n_train_examples": len(train_split.examples), "n_eval_examples": len(eval_split.examples),
                   "dropped_examples": dropped, "truncated_examples": truncated,
                   "deepspeed_config": args.deepspeed, "wall_time_s": round(time.perf_counter() - t0, 3)}
        if log is not None:
            log.write(summary)
    finally:
        if log is not None:
            log.close()
    distributed.barrier()
    tps = summary["mean_tokens_per_s"]
    _say(f"eval loss {summary['eval_loss_before']:.4f} -> {summary['final_eval_loss']:.4f}; {summary['steps']} steps, "
         f"{'%.0f' % tps if tps is not None else 'n/a (one step)'} tokens/s after step 1; "
         f"model saved to {summary['saved_model']}")
    return summary
