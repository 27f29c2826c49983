"""The DeepSpeed JSON config of a fine-tuning run: load it, fill it from the command line, check it.

Command-line values replace ``"auto"`` (and explicit values, the command line wins) in:

* ``train_micro_batch_size_per_gpu`` <- ``--per_device_train_batch_size``;
* ``gradient_accumulation_steps`` <- ``--gradient_accumulation_steps``;
* ``train_batch_size`` <- micro batch x accumulation x world size (always, so the three agree);
* ``optimizer.params.lr`` <- ``--learning_rate``;
* ``scheduler.params`` ``"auto"`` entries: ``total_num_steps`` <- the run's optimizer steps,
  ``warmup_max_lr`` <- the learning rate, ``warmup_min_lr`` and ``warmup_num_steps`` <- 0;
* ``gradient_clipping: "auto"`` <- 1.0 (the HF Trainer default ``max_grad_norm``);
* ``bf16.enabled`` <- ``--bf16 true|false``; with ``--bf16 auto`` a config ``"auto"`` becomes true
  on an accelerator with bf16 support and false on CPU; ``fp16.enabled: "auto"`` becomes false;
* ``--cache_path DIR`` (repeatable): ``nvme_path`` of every offload section whose device is
  ``nvme`` (the first DIR) and ``aidaptiv.cache_paths`` (all DIRs); missing cache directories are
  created (``mkdir -p``);
* ``--dram_budget SIZE``: ``aidaptiv.dram_budget`` (``0``, ``"8GiB"``, ``"auto"``).

When a flag is not given, a number in the config is kept; an ``"auto"`` takes the HF Trainer
default (batch 8, accumulation 1, learning rate 5e-5). Any ``"auto"`` left afterwards is an error.
"""
from __future__ import annotations

import copy
import json
import os

import torch

HF_DEFAULT_MICRO_BATCH = 8
HF_DEFAULT_GRAD_ACCUM = 1
HF_DEFAULT_LR = 5e-5
OFFLOAD_SECTIONS = ("offload_param", "offload_optimizer")


def load_ds_config(path: str | os.PathLike) -> dict:
    """Parse a DeepSpeed JSON config file.

    Raises:
        FileNotFoundError: no such file (names ``--deepspeed`` and the shipped configs).
        ValueError: not valid JSON or not an object (file, line and column named).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--deepspeed {path!r}: no such file; pass a DeepSpeed JSON config, e.g. "
                                f"ds_configs/cpu_offload.json (DRAM offload) or ds_configs/aidaptiv_zero3.json")
    with open(path, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--deepspeed {path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"--deepspeed {path}: the config must be a JSON object, got {type(cfg).__name__}")
    return cfg


def _is_auto(v) -> bool:
    return isinstance(v, str) and v == "auto"


def _pick(flag_value, cfg_value, default):
    if flag_value is not None:
        return flag_value
    if cfg_value is None or _is_auto(cfg_value):
        return default
    return cfg_value


def bf16_available() -> bool:
    """True on an accelerator (not the CPU) that supports bf16."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return acc.device_name() != "cpu" and bool(acc.is_bf16_supported())


def resolve(cfg: dict, *, world_size: int, micro_batch: int | None = None, grad_accum: int | None = None,
            learning_rate: float | None = None, bf16: str = "auto", cache_paths: list[str] | None = None,
            total_steps: int | None = None, dram_budget: str | None = None,
            created: list[tuple[str, str]] | None = None) -> dict:
    """A filled copy of ``cfg`` (see the module docstring for the rules); ``cfg`` is not modified.

    Args:
        world_size: number of data-parallel ranks.
        bf16: ``"auto"``, ``"true"`` or ``"false"`` (the ``--bf16`` flag).
        total_steps: optimizer steps of the run, for a scheduler's ``"auto"`` total; None before it
            is known (a scheduler ``"auto"`` total is then left for a second call).
        created: when given, ``(config key, directory)`` of every cache directory this call created is
            appended (the caller says where they landed, see :func:`describe_created_dir`).

    Raises:
        ValueError: a value is not positive, ``--cache_path`` has no section to set, a cache path is
            not an existing directory, bf16 and fp16 are both enabled, or an ``"auto"`` is left.
    """
    cfg = copy.deepcopy(cfg)
    mb = int(_pick(micro_batch, cfg.get("train_micro_batch_size_per_gpu"), HF_DEFAULT_MICRO_BATCH))
    ga = int(_pick(grad_accum, cfg.get("gradient_accumulation_steps"), HF_DEFAULT_GRAD_ACCUM))
    for flag, v in (("--per_device_train_batch_size", mb), ("--gradient_accumulation_steps", ga)):
        if v < 1:
            raise ValueError(f"{flag} {v}: must be >= 1")
    cfg["train_micro_batch_size_per_gpu"] = mb
    cfg["gradient_accumulation_steps"] = ga
    cfg["train_batch_size"] = mb * ga * world_size

    opt = cfg.get("optimizer")
    lr = None
    if opt is not None:
        params = opt.setdefault("params", {})
        lr = float(_pick(learning_rate, params.get("lr"), HF_DEFAULT_LR))
        if not lr > 0:
            raise ValueError(f"--learning_rate {lr}: must be > 0")
        params["lr"] = lr
    elif learning_rate is not None:
        raise ValueError("--learning_rate: the DeepSpeed config has no 'optimizer' section to set it in; "
                         "add {\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\"}}}")

    sched = cfg.get("scheduler")
    if sched is not None:
        sp = sched.setdefault("params", {})
        fills = {"warmup_max_lr": lr, "warmup_min_lr": 0.0, "warmup_num_steps": 0, "total_num_steps": total_steps}
        for k, v in fills.items():
            if _is_auto(sp.get(k)) and v is not None:
                sp[k] = v

    if _is_auto(cfg.get("gradient_clipping")):
        cfg["gradient_clipping"] = 1.0

    bf16_sec = cfg.setdefault("bf16", {})
    if bf16 in ("true", "false"):
        bf16_sec["enabled"] = bf16 == "true"
    elif bf16 != "auto":
        raise ValueError(f"--bf16 {bf16!r}: use auto, true or false")
    elif _is_auto(bf16_sec.get("enabled")):
        bf16_sec["enabled"] = bf16_available()
    fp16_sec = cfg.get("fp16")
    if fp16_sec is not None and _is_auto(fp16_sec.get("enabled")):
        fp16_sec["enabled"] = False
    if bf16_sec.get("enabled") is True and fp16_sec is not None and fp16_sec.get("enabled") is True:
        raise ValueError("the DeepSpeed config enables both bf16 and fp16; enable one (or pass --bf16 false)")

    if cache_paths:
        _set_cache_paths(cfg, cache_paths)
    if dram_budget is not None:
        if not isinstance(cfg.get("aidaptiv"), dict):
            raise ValueError(f"--dram_budget {dram_budget}: the DeepSpeed config has no 'aidaptiv' section; use "
                             f"ds_configs/aidaptiv_zero3.json or drop the flag")
        cfg["aidaptiv"]["dram_budget"] = int(dram_budget) if dram_budget.isdigit() else dram_budget
    _check_cache_dirs(cfg, created)
    if total_steps is not None:
        left = find_auto(cfg)
        if left:
            raise ValueError(f"DeepSpeed config keys still 'auto' and not filled by any flag: {', '.join(left)}; "
                             f"give them values in the JSON file")
    return cfg


def _set_cache_paths(cfg: dict, cache_paths: list[str]) -> None:
    zero = cfg.get("zero_optimization", {})
    touched = False
    for sec in OFFLOAD_SECTIONS:
        s = zero.get(sec)
        if isinstance(s, dict) and s.get("device") == "nvme":
            s["nvme_path"] = cache_paths[0]
            touched = True
    if isinstance(cfg.get("aidaptiv"), dict):
        cfg["aidaptiv"]["cache_paths"] = list(cache_paths)
        touched = True
    if not touched:
        raise ValueError(f"--cache_path {' '.join(cache_paths)}: the DeepSpeed config offloads nothing to nvme and "
                         f"has no 'aidaptiv' section, so there is no cache path to set; drop the flag or use "
                         f"ds_configs/aidaptiv_zero3.json / ds_configs/native_nvme.json")


def cache_dirs(cfg: dict) -> list[tuple[str, str]]:
    """``(config key, directory)`` of every cache directory the config names (nvme_path, aidaptiv.cache_paths)."""
    out = []
    zero = cfg.get("zero_optimization", {})
    for sec in OFFLOAD_SECTIONS:
        s = zero.get(sec)
        if isinstance(s, dict) and s.get("device") == "nvme" and s.get("nvme_path"):
            out.append((f"zero_optimization.{sec}.nvme_path", str(s["nvme_path"])))
    aid = cfg.get("aidaptiv")
    if isinstance(aid, dict):
        for i, p in enumerate(aid.get("cache_paths") or []):
            out.append((f"aidaptiv.cache_paths[{i}]", str(p)))
    return out


def _check_cache_dirs(cfg: dict, created: list | None = None) -> None:
    """Create missing cache directories (``mkdir -p``); a path that cannot be one is an error."""
    for key, d in cache_dirs(cfg):
        missing = not os.path.isdir(d)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{key} = {d!r} cannot be created ({e.strerror}); point it at a writable directory on "
                             f"the cache SSD or pass --cache_path DIR") from None
        if missing and created is not None and (key, d) not in created:
            created.append((key, d))


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def describe_created_dir(d: str, output_dir: str | None = None, created: bool = True) -> tuple[str, str | None]:
    """``(where, warning)`` for a cache directory (``created``: this run just created it): where it is
    (absolute path, mount point, filesystem type, block device) and, when it shares a filesystem with
    ``/`` or with ``output_dir``, a warning that the cache tier is then not on a cache drive of its own
    (a mistyped ``--cache_path`` lands on the root filesystem). The job warns for every cache directory,
    created or not."""
    from ..telemetry.sysinfo import block_device, mount_of

    real = os.path.abspath(d)
    m = mount_of(real)
    dev = block_device(real)
    where = (f"{'created the missing' if created else 'the'} cache directory {real} "
             f"{'on' if created else 'is on'} the filesystem mounted at {m['mount_point']} "
             f"({m['fstype']}{', device ' + dev if dev else ''})")
    same = []
    st = os.stat(real).st_dev
    if os.stat("/").st_dev == st:
        same.append("the root filesystem /")
    if output_dir is not None and os.stat(_existing_parent(output_dir)).st_dev == st:
        same.append(f"the output directory {os.path.abspath(output_dir)}")
    warning = None
    if same:
        warning = (f"the cache directory {real} is on the same filesystem as {' and '.join(same)}, not on a cache drive "
                   f"of its own: the training state's writes go there. If that is a typo, stop and pass "
                   f"--cache_path DIR on the cache SSD's mount point")
    return where, warning


def uses_nvme(cfg: dict) -> bool:
    """True when DeepSpeed offloads parameters or optimizer state to nvme (its aio op is then needed)."""
    zero = cfg.get("zero_optimization", {})
    return any(isinstance(zero.get(s), dict) and zero[s].get("device") == "nvme" for s in OFFLOAD_SECTIONS)


def find_auto(cfg, prefix: str = "") -> list[str]:
    """Dotted keys whose value is the string ``"auto"`` (the ``aidaptiv`` section resolves its own)."""
    out = []
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            if not prefix and k == "aidaptiv":
                continue
            key = f"{prefix}.{k}" if prefix else str(k)
            out += [key] if _is_auto(v) else find_auto(v, key)
    return out


def model_dtype(cfg: dict) -> torch.dtype:
    """Parameter dtype of the run: bfloat16 if ``bf16.enabled``, float16 if ``fp16.enabled``, else float32."""
    if cfg.get("bf16", {}).get("enabled") is True:
        return torch.bfloat16
    if cfg.get("fp16", {}).get("enabled") is True:
        return torch.float16
    return torch.float32


def is_zero3(cfg: dict) -> bool:
    """True when the config selects ZeRO stage 3."""
    return int(cfg.get("zero_optimization", {}).get("stage", 0)) == 3
