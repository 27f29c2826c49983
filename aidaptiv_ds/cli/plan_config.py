"""What ``aidaptiv-ds plan --deepspeed CONFIG`` takes from the DeepSpeed config: the run's settings that change
the plan, where the command line leaves them out.

A flag given on the command line wins; a setting the config has comes next; then the plan's default. The
settings and where each comes from in the config (DeepSpeed 0.19.8's defaults where the config leaves a key
out, as the runtime would run it):

=============================== ================================================= ==========================
flag                            config key                                        left out of the config
=============================== ================================================= ==========================
``--dtype``                     ``bf16`` (or ``bfloat16``) / ``fp16`` ``.enabled``  fp32
``--gradient-clipping``         ``gradient_clipping``                             1.0 (DeepSpeed's default)
``--micro-batch``               ``train_micro_batch_size_per_gpu``                from ``train_batch_size``
``--grad-accum``                ``gradient_accumulation_steps``                   from ``train_batch_size``, else 1
``--sub-group-size``            ``zero_optimization.sub_group_size``              aidaptiv_ds's pick (below)
``--max-live-parameters``       ``zero_optimization.stage3_max_live_parameters``  1e9
``--max-reuse-distance``        ``zero_optimization.stage3_max_reuse_distance``   1e9
``--param-persistence-threshold`` ``zero_optimization.stage3_param_persistence_threshold`` 1e5
``--reduce-bucket-size``        ``zero_optimization.reduce_bucket_size``          the flag's default
``--dram-budget``               ``aidaptiv.dram_budget`` (per rank) x ranks       ``"auto"``
``--step-in-backward``          ``aidaptiv.step_in_backward`` (as the runtime reads it) ``"auto"``
``--offload-param``             ``zero_optimization.offload_param.device``        ``none`` (named among the notes)
=============================== ================================================= ==========================

Where ``sub_group_size`` is left out (of the config and the command line) the plan uses what the runtime
picks then (:func:`aidaptiv_ds.planner.auto.auto_sub_group_numel`), not DeepSpeed's 1e9, and names it among the
assumptions. A value HF Trainer fills at run time (``"auto"``) is not known here: the plan keeps the flag's default and
says so in its assumptions, naming the flag that gives it.
"""
from __future__ import annotations

import dataclasses
import os

#: flag destination -> (config path, what DeepSpeed uses when the key is left out; None: the flag's default)
SETTINGS: dict[str, tuple[tuple[str, ...], object]] = {
    "gradient_clipping": (("gradient_clipping",), 1.0),
    "micro_batch": (("train_micro_batch_size_per_gpu",), None),
    "grad_accum": (("gradient_accumulation_steps",), None),
    "sub_group_size": (("zero_optimization", "sub_group_size"), None),
    "max_live_parameters": (("zero_optimization", "stage3_max_live_parameters"), None),
    "max_reuse_distance": (("zero_optimization", "stage3_max_reuse_distance"), None),
    "param_persistence_threshold": (("zero_optimization", "stage3_param_persistence_threshold"), None),
    "reduce_bucket_size": (("zero_optimization", "reduce_bucket_size"), None),
}



def _flag(dest: str) -> str:
    """The ``plan`` flag of a setting (``grad_accum`` -> ``--grad-accum``)."""
    return "--" + dest.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class ConfigSettings:
    """The plan's settings a DeepSpeed config gives.

    Attributes:
        values: flag destination -> value, as the command line would give it (``dtype`` a name, ``dram_budget``
            bytes per rank or ``"auto"``, ``step_in_backward`` ``"auto"``/``"true"``/``"false"``).
        unknown: the keys whose value is ``"auto"`` (HF fills them at run time), as ``"<config key> (<flag>)"``.
        notes: what else the plan should say about the config (a ZeRO stage other than 3).
        endurance: ``aidaptiv.endurance``'s ``rated_dwpd`` and ``warranty_years`` where the section sets them.
        moments: ``aidaptiv.optimizer_state.moments`` where the section sets it, else None.
        cache_paths: the cache paths the run would use (``aidaptiv.cache_paths``, else the config's ``nvme_path``,
            as the runtime defaults them), for a plan given no ``--cache``.
    """
    values: dict
    unknown: tuple[str, ...]
    notes: tuple[str, ...] = ()
    endurance: dict = dataclasses.field(default_factory=dict)
    moments: str | None = None
    cache_paths: tuple[str, ...] = ()


def _get(cfg: dict, path: tuple[str, ...]):
    node = cfg
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def read_config_settings(path: str) -> ConfigSettings:
    """The settings of the DeepSpeed config file at ``path`` (module docstring).

    Raises:
        ValueError: the file does not exist or is not JSON, or a setting is not a number where one is needed
            (naming the key, the value and the fix); AidaptivConfigError: the ``"aidaptiv"`` section is invalid.
    """
    from ..integration.config import load_ds_dict, parse_section, section_enabled
    from ..planner.plan import OFFLOAD_PARAM_DEVICES

    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed {path!r}: no such file. Fix: give the path of your DeepSpeed JSON config")
    try:
        cfg = load_ds_dict(path) or {}
    except (OSError, ValueError) as e:
        raise ValueError(f"--deepspeed {path!r}: {e}") from None
    values: dict = {}
    unknown: list[str] = []
    notes: list[str] = []

    def number(key: str, v):
        if isinstance(v, str):  # DeepSpeed's config model takes numbers written as strings too
            try:
                v = float(v)
            except ValueError:
                v = None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"--deepspeed {path!r}: {key} is {_get(cfg, tuple(key.split('.')))!r}, not a number. "
                             f"Fix: give a number (or \"auto\" under HF Trainer)")
        return v

    for dest, (keys, left_out) in SETTINGS.items():
        key = ".".join(keys)
        v = _get(cfg, keys)
        if v == "auto":
            unknown.append(f"{key} ({_flag(dest)})")
        elif v is None:
            if left_out is not None:
                values[dest] = left_out
        else:
            values[dest] = number(key, v)
    tbs = _get(cfg, ("train_batch_size",))
    if tbs not in (None, "auto") and ("micro_batch" not in values or "grad_accum" not in values):
        # DeepSpeed derives the missing one of micro-batch and accumulation from the batch and the ranks
        values["train_batch_size"] = number("train_batch_size", tbs)
    flags = [_get(cfg, (k, "enabled")) for k in ("bf16", "bfloat16", "fp16")]  # bfloat16: DeepSpeed's older key
    if "auto" in flags:
        unknown.append("bf16/fp16.enabled (--dtype)")
    else:
        values["dtype"] = "bf16" if True in flags[:2] else "fp16" if flags[2] is True else "fp32"
    stage = _get(cfg, ("zero_optimization", "stage"))
    if stage not in (None, 3, "3"):
        notes.append(f"zero_optimization.stage {stage!r} in --deepspeed {path}: aidaptiv_ds runs ZeRO-3 only "
                     f"(planned as stage 3)")
    device = _get(cfg, ("zero_optimization", "offload_param", "device"))
    if device is None:  # DeepSpeed's default: no parameter offload
        notes.append(f"zero_optimization.offload_param left out of --deepspeed {path}: the parameters stay where "
                     f"DeepSpeed keeps them (on the GPU; host memory on CPU ranks), planned so; set "
                     f"\"offload_param\": {{\"device\": \"nvme\"}} for aidaptiv_ds to swap them")
    device = "none" if device is None else str(device).lower()
    if device not in OFFLOAD_PARAM_DEVICES:
        raise ValueError(f"--deepspeed {path!r}: zero_optimization.offload_param.device is {device!r}. Fix: give "
                         f"\"nvme\", \"cpu\" or \"none\"")
    values["offload_param"] = device
    endurance, moments, cache_paths = {}, None, ()
    nvme = [_get(cfg, ("zero_optimization", k, "nvme_path")) for k in ("offload_param", "offload_optimizer")]
    if section_enabled(cfg):
        raw = cfg["aidaptiv"]
        sec = parse_section(raw)  # the section's own checks and coercions, as the runtime reads it
        values["dram_budget"] = sec.dram_budget  # bytes per rank, or "auto"
        values["step_in_backward"] = {True: "true", False: "false"}.get(sec.step_in_backward, "auto")
        endurance = {k: getattr(sec.endurance, k) for k in ("rated_dwpd", "warranty_years")
                     if k in (raw.get("endurance") or {})}
        moments = sec.optimizer_state.moments if "optimizer_state" in raw else None
        given = raw.get("cache_paths")
        cache_paths = tuple(str(p) for p in given) if isinstance(given, list) and given else \
            tuple(str(p) for p in nvme if isinstance(p, str) and p)[:1]
    return ConfigSettings(values, tuple(unknown), tuple(notes), endurance, moments, cache_paths)
