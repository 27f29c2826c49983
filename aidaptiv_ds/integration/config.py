"""The ``"aidaptiv"`` section of a DeepSpeed JSON config: typed model, validation, clear errors.

Fixed keys (users and scripts rely on them): ``enabled``, ``cache_paths``, ``dram_budget``.
Everything else is documented on :class:`AidaptivConfig` and in the README's config reference.

Validation runs at ``deepspeed.initialize`` and ``deepspeed.zero.Init`` time, before any data is
touched. Every error names the key, the value and the fix; unknown keys get the closest valid name;
DeepSpeed settings that cannot work with aidaptiv_ds come with the exact lines to change.
"""
from __future__ import annotations

import copy
import difflib
import enum
import json
import logging
import math
import os
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from ..errors import AidaptivConfigError, AidaptivWarning
from ..store.layout import CachePathError, check_cache_path
from ..units import parse_size

SECTION = "aidaptiv"
log = logging.getLogger("aidaptiv_ds")


class BudgetWarning(AidaptivWarning):
    """``dram_budget`` is more than the host memory available now (but less than the machine's)."""


def _size_or_auto(v: Any, field: str) -> int | str:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    return parse_size(v, f"{SECTION}.{field}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EnduranceConfig(_Model):
    """The cache drives' endurance rating (for the ledger's DWPD and days-to-TBW projections).

    ``capacity``: drive capacity (bytes or "8TB"; default: the filesystem size of each cache path).
    ``rated_dwpd``: drive writes per day the vendor rates (Phison aiDAPTIV+ cache SSDs: 100).
    ``warranty_years``: warranty period of that rating.
    """
    capacity: Union[int, str, None] = None
    rated_dwpd: float = Field(1.0, gt=0)
    warranty_years: float = Field(5.0, gt=0)

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity(cls, v):
        return None if v is None else parse_size(v, f"{SECTION}.endurance.capacity")


class IOConfig(_Model):
    """I/O engine settings.

    ``block_size``: largest single read/write (bytes, default 8 MiB).
    ``threads_per_drive``: worker threads per cache path (default 4).
    ``direct``: use O_DIRECT where the filesystem allows (default true).
    ``max_retries``: retries of EIO/EAGAIN before a request fails (default 3).
    ``reuse_host_memory``: keep freed large host buffers in the heap for reuse instead of unmapping
    them (glibc ``mallopt``, process-wide; see :func:`aidaptiv_ds.io.heap.reuse_freed_host_memory`):
    ``true``, ``false``, or ``"auto"`` (default): on once the plan shows that the part of the DRAM
    budget the residency plan leaves free can hold a heap of the working windows (read-ahead,
    write-back, optimizer pipeline, gradient window), so the retained heap is inside the budget; off
    otherwise (always at a budget of 0), and then freed memory is kept only within a phase: the heap is
    trimmed after each backward pass and optimizer step (:func:`aidaptiv_ds.io.heap.return_freed_host_memory`).
    ``buffer_pool``: carve swap buffers (parameter reads, optimizer and gradient slices, write staging)
    from one fixed region of host memory sized by the plan's backward windows, reused step after step,
    instead of fresh memory for each (:mod:`aidaptiv_ds.io.pool`): ``"auto"`` (default): where no heap
    is kept (``reuse_host_memory`` off); ``true``: also where it is; ``false``: never. Unpinned (CPU-rank)
    buffers only.
    """
    block_size: Union[int, str] = 8 << 20
    threads_per_drive: int = Field(4, ge=1, le=64)
    direct: bool = True
    max_retries: int = Field(3, ge=0, le=20)
    reuse_host_memory: Union[bool, Literal["auto"]] = "auto"
    buffer_pool: Union[bool, Literal["auto"]] = "auto"

    @field_validator("block_size", mode="before")
    @classmethod
    def _block(cls, v):
        n = parse_size(v, f"{SECTION}.io.block_size")
        if n < 4096 or n % 4096:
            raise ValueError(f"{SECTION}.io.block_size: {v!r} must be a positive multiple of 4096 bytes, e.g. '8MiB'")
        return n


class ProfileConfig(_Model):
    """A timeline of some training steps, per rank (:mod:`aidaptiv_ds.telemetry.timeline`; ``docs/profiling.md``).

    ``steps``: optimizer steps to record (counted from 1): ``3``, ``"3-4"`` or ``[3, 4]``; default
    none (off). ``dir``: directory of ``timeline-rank<R>.json`` (default: the current directory).
    ``modules``: ``"blocks"`` (the layers, embeddings and head; default) or ``"all"`` (every module
    with parameters of its own).
    """
    steps: Union[int, str, list[int], None] = None
    dir: Union[str, None] = None
    modules: Literal["blocks", "all"] = "blocks"

    @field_validator("steps", mode="before")
    @classmethod
    def _steps(cls, v):
        from ..telemetry.timeline import parse_steps

        return None if v is None else list(parse_steps(v, f"{SECTION}.profile.steps"))

    @field_validator("dir")
    @classmethod
    def _dir(cls, v):
        if v is not None and not v.strip():
            raise ValueError(f"{SECTION}.profile.dir: {v!r} is empty. Fix: give a directory such as \"output/run\"")
        return v


class OptimizerStateConfig(_Model):
    """How the optimizer's per-element state is stored on the tiers (``tiers/unit.py``, the sub-group's layout).

    ``moments``: how Adam's ``exp_avg`` and ``exp_avg_sq`` are stored: ``"fp32"`` (default; bit-identical with
    DeepSpeed's CPU offload), ``"bf16"`` or ``"int8"`` (opt-in, *not* bit-identical; the master weights stay fp32).
    bf16 rounds each moment to bf16 (round-to-nearest-even) after every step: the optimizer state goes from 12 to 8
    bytes per parameter, on the drives and in every transfer. int8 quantizes each block of 256 elements with
    torchao's dynamic map and an fp32 scale (``tiers/blockwise.py``; needs torchao, the ``int8`` extra): 6.03
    bytes per parameter. Both need torch's Adam or AdamW (``"torch_adam": true`` in the optimizer's params),
    stepped in tiles (``integration/host_step.py``).

    ``fused_step``: with bf16 or int8 moments, step each tile in one loop compiled by ``torch.compile``
    (``tiers/fused_adam.py``: torch's formulas, not its bits; about 2x faster than the eager tile): ``"auto"``
    (default: where it compiles, else the eager tile with a warning), ``"on"`` (refuse without it) or ``"off"``
    (the eager tile, bit-identical with DeepSpeed's CPU offload whose moments are rounded to bf16 or quantized
    and dequantized after every step).
    """
    moments: Literal["fp32", "bf16", "int8"] = "fp32"
    fused_step: Literal["auto", "on", "off"] = "auto"


class AidaptivConfig(_Model):
    """The ``"aidaptiv"`` section.

    Attributes:
        enabled: route ZeRO-3 NVMe offload through aidaptiv_ds (default true when the section exists).
        cache_paths: directories on the cache drives (default: ``[offload_param.nvme_path]``).
        dram_budget: bytes of host memory for resident and cached state: an int, a string such as
            ``"8GiB"``, or ``"auto"`` (free host memory minus a safety margin, from the planner).
        run_name: namespace of this run under each cache path; ``"auto"`` gives each run its own.
        placement: ``"striped"`` (every rank stripes over all paths) or ``"affinity"`` (each rank
            fills its primary path first, spilling to the others).
        path_weights: relative bandwidth of each cache path (stripe shares); default equal.
        primary_path: for ``"affinity"``: the index of a rank's primary path, or ``"local_rank"``
            (``local_rank % len(cache_paths)``, the default).
        stripe_unit: RAID-0 stripe unit in bytes (default 1 MiB).
        prefetch_bytes: most bytes read ahead of compute, outside the budget ("auto": 2 x the largest
            partition, at least 256 MiB).
        writeback_bytes: most bytes of write-back in flight ("auto": 512 MiB).
        step_in_backward: run each optimizer sub-group's step inside the backward pass as soon as its
            gradient is final, speculatively (``integration/backward_step.py``): ``"auto"`` (default:
            where exact and the drives have room for a second copy of the optimizer state), ``true``
            (refuse to start without that room) or ``false`` (every sub-group steps after backward).
        step_rides_forward: optimizer sub-groups whose state is on the cache drives and that were not stepped
            inside backward are updated when the next forward needs their parameters, so their I/O overlaps
            the forward (``integration/step_pipeline.py``): ``"auto"`` (default: on where the forward runs on
            an accelerator, off on CPU ranks, where the update would take the forward's own cores; never for
            fp16 and hpZ engines), ``true`` (on CPU ranks too) or ``false`` (every sub-group steps inside
            ``step()``); bit-identical either way.
        min_swap_bytes: partitions smaller than this stay in CPU memory like DeepSpeed's 1 MiB
            threshold (default 0: every partition goes through the store).
        checksum: CRC32 of every written block, verified on read (default false).
        keep_files: keep the slab files after a clean shutdown (default false: they are deleted).
        from_unpacked: take the initial weights from a store written by ``aidaptiv-ds unpack`` under
            ``run_name`` (needs an explicit ``run_name``; the namespace is kept).
        checkpoint_dir: where this run will save checkpoints (optional): at start, before step 1, the
            preflight checks that one checkpoint fits there beside the slabs when they share a
            filesystem (each save checks again, whatever the directory).
        endurance: the drives' endurance rating.
        io: I/O engine settings.
        profile: a timeline of some training steps (off by default).
        optimizer_state: how the optimizer's moments are stored (:class:`OptimizerStateConfig`).
    """
    enabled: bool = True
    cache_paths: Union[list[str], None] = None
    dram_budget: Union[int, str] = "auto"
    run_name: str = "auto"
    placement: Literal["striped", "affinity"] = "striped"
    path_weights: Union[list[float], None] = None
    primary_path: Union[int, Literal["local_rank"]] = "local_rank"
    stripe_unit: Union[int, str] = 1 << 20
    prefetch_bytes: Union[int, str] = "auto"
    writeback_bytes: Union[int, str] = "auto"
    step_in_backward: Union[bool, Literal["auto"]] = "auto"
    step_rides_forward: Union[bool, Literal["auto"]] = "auto"
    min_swap_bytes: Union[int, str] = 0
    checksum: bool = False
    keep_files: bool = False
    from_unpacked: bool = False
    checkpoint_dir: Union[str, None] = None
    endurance: EnduranceConfig = Field(default_factory=EnduranceConfig)
    io: IOConfig = Field(default_factory=IOConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    optimizer_state: OptimizerStateConfig = Field(default_factory=OptimizerStateConfig)

    @field_validator("dram_budget", "prefetch_bytes", "writeback_bytes", mode="before")
    @classmethod
    def _auto_sizes(cls, v, info):
        return _size_or_auto(v, info.field_name)

    @field_validator("stripe_unit", "min_swap_bytes", mode="before")
    @classmethod
    def _sizes(cls, v, info):
        n = parse_size(v, f"{SECTION}.{info.field_name}")
        if info.field_name == "stripe_unit" and (n < 4096 or n % 4096):
            raise ValueError(f"{SECTION}.stripe_unit: {v!r} must be a positive multiple of 4096 bytes, e.g. '1MiB'")
        return n

    @field_validator("cache_paths", mode="before")
    @classmethod
    def _paths(cls, v):
        if v is None:
            return None
        if isinstance(v, str):
            raise ValueError(f"{SECTION}.cache_paths: {v!r} is a string; give a list, e.g. {json.dumps([v], ensure_ascii=False)}")
        if not isinstance(v, list) or not v or not all(isinstance(p, str) and p for p in v):
            raise ValueError(f"{SECTION}.cache_paths: {v!r} must be a non-empty list of directory paths, "
                             f"e.g. [\"/mnt/cache0\", \"/mnt/cache1\"]")
        if len(set(os.path.abspath(p) for p in v)) != len(v):
            raise ValueError(f"{SECTION}.cache_paths: {v!r} lists a path twice. Fix: list each cache directory once")
        return v

    @field_validator("checkpoint_dir", mode="before")
    @classmethod
    def _ckpt_dir(cls, v):
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ValueError(f"{SECTION}.checkpoint_dir: {v!r} must be a directory path, e.g. \"/data/ckpt\", or absent")
        return v

    @field_validator("run_name")
    @classmethod
    def _run(cls, v):
        if not v or "/" in v or v in (".", ".."):
            raise ValueError(f"{SECTION}.run_name: {v!r} must be a plain name (no '/'), e.g. \"run1\", or \"auto\"")
        return v

    @model_validator(mode="after")
    def _unpacked(self):
        if self.from_unpacked and self.run_name == "auto":
            raise ValueError(f"{SECTION}.from_unpacked: needs the run_name given to `aidaptiv-ds unpack` (run_name is "
                             f"\"auto\"). Fix: set \"run_name\": \"<the unpack's name>\"")
        return self

    @model_validator(mode="after")
    def _weights(self):
        if self.path_weights is not None:
            n = len(self.cache_paths) if self.cache_paths else None
            # finite and at most 1e9 (GB/s): the stripe pattern divides by their sum
            if not all(math.isfinite(w) and 0 < w <= 1e9 for w in self.path_weights):
                raise ValueError(f"{SECTION}.path_weights: {self.path_weights} must all be finite numbers > 0 (relative "
                                 f"GB/s, at most 1e9), e.g. [7.0, 3.5]")
            if n is not None and len(self.path_weights) != n:
                raise ValueError(f"{SECTION}.path_weights: {len(self.path_weights)} weights for {n} cache_paths. "
                                 f"Fix: give one weight per path")
        if isinstance(self.primary_path, int) and self.cache_paths and not (
                0 <= self.primary_path < len(self.cache_paths)):
            raise ValueError(f"{SECTION}.primary_path: {self.primary_path} is not an index of cache_paths "
                             f"(0..{len(self.cache_paths) - 1}). Fix: give such an index, or \"local_rank\"")
        return self


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


#: What a valid value looks like, per key: the fix appended to pydantic's own messages (keys missing
#: here get their default as the example).
_EXAMPLES = {
    "enabled": "true or false", "cache_paths": '["/mnt/cache0", "/mnt/cache1"]',
    "dram_budget": 'a size such as "48GiB", a number of bytes, or "auto"',
    "run_name": '"auto" or a plain name such as "run1"', "placement": '"striped" or "affinity"',
    "path_weights": "one positive number per cache path, e.g. [7.0, 3.5]",
    "primary_path": '"local_rank" or an index of cache_paths such as 0', "stripe_unit": 'a size such as "1MiB"',
    "prefetch_bytes": '"auto" or a size such as "1GiB"', "writeback_bytes": '"auto" or a size such as "512MiB"',
    "min_swap_bytes": '0 or a size such as "1MiB"', "step_rides_forward": '"auto" or false', "checksum": "true or false", "keep_files": "true or false",
    "checkpoint_dir": 'a directory such as "/data/ckpt"',
    "endurance": 'an object such as {"rated_dwpd": 100, "capacity": "8TB"}',
    "endurance.capacity": 'a size such as "8TB"', "endurance.rated_dwpd": "a number > 0 such as 100",
    "endurance.warranty_years": "a number > 0 such as 5",
    "io": 'an object such as {"block_size": "8MiB", "threads_per_drive": 4}',
    "io.block_size": 'a size such as "8MiB"', "io.threads_per_drive": "an integer from 1 to 64 such as 4",
    "io.direct": "true or false", "io.max_retries": "an integer from 0 to 20 such as 3",
    "profile": 'an object such as {"steps": "3-4", "dir": "output/run"}',
    "profile.steps": 'a step such as 3, or a range such as "3-4" or [3, 4]',
    "profile.dir": 'a directory such as "output/run"', "profile.modules": '"blocks" or "all"',
    "optimizer_state": 'an object such as {"moments": "bf16"}', "optimizer_state.moments": '"fp32", "bf16" or "int8"',
    "optimizer_state.fused_step": '"auto", "on" or "off"',
}


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` of a user value, cut to ``limit`` characters (a huge value must not drown the message); an
    enum (DeepSpeed's ``OffloadDeviceEnum``, ...) shows its plain value."""
    if isinstance(value, enum.Enum):
        value = value.value
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _example(dotted: str, field) -> str:
    if dotted in _EXAMPLES:
        return _EXAMPLES[dotted]
    default = field.get_default(call_default_factory=True) if field is not None else None
    if isinstance(default, BaseModel):
        default = default.model_dump()
    try:
        return f"a value like the default, e.g. {json.dumps(default)}"
    except (TypeError, ValueError):
        return f"a value like the default, e.g. {default!r}"


def _resolve(loc: tuple, unknown_last: bool) -> tuple[list, Any, type[BaseModel] | None]:
    """The key path of an error location (pydantic inserts union member tags such as ``'int'`` or
    ``"literal['local_rank']"``, which are not keys), the field it ends at, and the model holding
    the last part."""
    model: type[BaseModel] | None = AidaptivConfig
    parts: list = []
    field = None
    holder = model
    for i, part in enumerate(loc):
        if unknown_last and i == len(loc) - 1:
            holder = model
            parts.append(str(part))
        elif isinstance(part, int):
            parts.append(part)
        elif model is not None and part in model.model_fields:
            holder = model
            field = model.model_fields[part]
            parts.append(part)
            ann = field.annotation
            model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return parts, field, holder


def _dotted(parts: list) -> str:
    """``aidaptiv.io.block_size``, ``aidaptiv.path_weights[1]``; an unknown key that is not a plain
    word (control characters, dots, spaces) is shown quoted: ``aidaptiv['a b']``."""
    out = SECTION
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p.isidentifier() and p.isascii():
            out += f".{p}"
        else:
            out += f"[{p!r}]"
    return out


def _key_hint(unknown: Any, names: list[str]) -> str:
    """The fix for an unknown key: the closest valid name (``difflib``, ratio >= 0.5), else all of them."""
    close = difflib.get_close_matches(str(unknown), names, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(names)}"


def _explain(err: ValidationError, section: dict) -> str:
    """One line per problem (several pydantic errors of one key become one line), each naming the
    key, the value and the fix."""
    lines: list[str] = []
    generic: dict[str, list] = {}  # key -> [value, field, messages]
    for e in err.errors():
        if e["type"] == "extra_forbidden":
            parts, _, model = _resolve(e["loc"], unknown_last=True)
            names = _field_names(model or AidaptivConfig)
            lines.append(f"{_dotted(parts)}: unknown key; {_key_hint(parts[-1], names)}")
            continue
        parts, field, _ = _resolve(e["loc"], unknown_last=False)
        key = _dotted(parts)
        msg = e["msg"]
        if msg.startswith("Value error, "):  # our validators' messages name key, value and fix already
            msg = msg[len("Value error, "):]
            line = msg if msg.startswith(SECTION) else f"{key}: {msg}"
            if line not in lines:
                lines.append(line)
            continue
        value = section
        for part in parts:
            if isinstance(value, dict):
                value = value.get(part)
            elif isinstance(value, list) and isinstance(part, int) and part < len(value):
                value = value[part]
            else:
                value = None
        entry = generic.setdefault(key, [value, field, []])
        if msg not in entry[2]:
            entry[2].append(msg)
    for key, (value, field, msgs) in generic.items():
        example = _example(key[len(SECTION) + 1:].split("[")[0], field)
        lines.append(f"{key}: {_short(value)} is invalid: {'; or: '.join(msgs)}. Fix: use {example}")
    return "\n  ".join(lines)


def parse_section(section: Any) -> AidaptivConfig:
    """Validate a raw ``"aidaptiv"`` section (no cross-checks with the DeepSpeed config).

    Raises:
        AidaptivConfigError: every problem, one per line, each naming key, value and fix.
    """
    if not isinstance(section, dict):
        raise AidaptivConfigError(f"{SECTION}: {section!r} must be a JSON object such as "
                                  f"{{\"enabled\": true, \"cache_paths\": [\"/mnt/cache0\"]}}")
    try:
        return AidaptivConfig.model_validate(section)
    except ValidationError as e:
        raise AidaptivConfigError("invalid \"aidaptiv\" section:\n  " + _explain(e, section)) from None
    except UnicodeError as e:  # a path with a lone surrogate reaches the filesystem checks (os.stat encodes it)
        bad = e.object[max(e.start - 20, 0):e.end + 20] if isinstance(e.object, str) else e.object
        raise AidaptivConfigError(f"{SECTION}: a string is not valid UTF-8 text ({e.reason}, near {bad!r}). "
                                  f"Fix: give paths and names as plain UTF-8 text") from None


def load_ds_dict(config: Any) -> dict | None:
    """The DeepSpeed config as a dict from a dict, a JSON file path, or None."""
    if config is None:
        return None
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as e:
                raise AidaptivConfigError(f"DeepSpeed config {config}: not valid JSON ({e}). Fix: correct the JSON "
                                          f"at that line and column") from None
    return None


_BOOL = TypeAdapter(bool)


def section_enabled(ds: dict | None) -> bool:
    """True when the DeepSpeed config dict has an ``"aidaptiv"`` section that is not disabled.

    ``enabled`` is read as :func:`parse_section` reads it (``false``, ``0``, ``"false"``, ``"off"``,
    ``"no"`` ... all disable), so a section never parses as disabled while the hooks treat it as on;
    a value that is no boolean at all counts as enabled, so that validation reports it.
    """
    if not isinstance(ds, dict) or SECTION not in ds:
        return False
    sec = ds[SECTION]
    if not isinstance(sec, dict) or "enabled" not in sec:
        return True
    try:
        return bool(_BOOL.validate_python(sec["enabled"]))
    except ValidationError:
        return True


_DEVICES = ("nvme", "cpu", "none")


def _device(v: Any) -> Any:
    """An offload ``device`` as DeepSpeed reads it: its string, also from an ``OffloadDeviceEnum``."""
    v = getattr(v, "value", v)
    return v


def _number(v: Any) -> bool:
    """A JSON number (``bool`` is not one, though Python says it is an ``int``)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def trains(ds: dict, training: bool | None = None) -> bool:
    """Whether DeepSpeed builds an optimizer for ``ds``: ``training`` when the caller knows (a client
    optimizer was passed to ``deepspeed.initialize``), else whether the config has an ``"optimizer"``
    section (DeepSpeed's own test, ``engine.py:655``: ``optimizer or self.optimizer_name()``)."""
    return bool(training) or (training is None and isinstance(ds, dict) and bool(ds.get("optimizer")))


def _deepspeed_problems(ds: dict, cfg: AidaptivConfig, training: bool | None = None) -> list[str]:
    """What in the DeepSpeed config cannot work with aidaptiv_ds, or would be refused later by
    DeepSpeed's own config model, for the keys aidaptiv_ds depends on (each with the lines to change).

    Without an optimizer (ZeRO-Inference, see :func:`trains`) DeepSpeed builds no Stage-3 optimizer:
    ``offload_optimizer`` and ``max_in_cpu`` (which only the Stage-3 optimizer reads) are not checked."""
    problems: list[str] = []
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        return [f"zero_optimization is {_short(zero)}; it must be an object. Fix: set\n      \"zero_optimization\": "
                f"{{\"stage\": 3, \"offload_param\": {{\"device\": \"nvme\", \"nvme_path\": \"/mnt/cache0\", "
                f"\"max_in_cpu\": 0}}, \"offload_optimizer\": {{\"device\": \"nvme\", \"nvme_path\": \"/mnt/cache0\"}}}}"]
    stage = zero.get("stage", 0)
    if not (isinstance(stage, int) and not isinstance(stage, bool) and stage == 3):
        problems.append(f"zero_optimization.stage is {_short(stage)}; aidaptiv_ds drives ZeRO stage 3 offload. Fix: "
                        f"set\n      \"zero_optimization\": {{\"stage\": 3, ...}}")
    if "sub_group_size" in zero:
        n = zero["sub_group_size"]
        # below 2**63: DeepSpeed's config model parses it as a 64-bit integer (pydantic refuses 2**63 and up)
        if not (_number(n) and math.isfinite(n) and 1 <= n < 2 ** 63 and float(n).is_integer()):
            problems.append(f"zero_optimization.sub_group_size is {_short(n)}; it must be a whole number of "
                            f"parameters from 1 to 2**63-1 (the optimizer state moves in sub-groups of that size). "
                            f"Fix: e.g. \"sub_group_size\": 1e9")
    sections = {}
    for which in ("offload_param", "offload_optimizer"):
        sec = zero.get(which)
        if sec is not None and not isinstance(sec, dict):
            problems.append(f"zero_optimization.{which} is {_short(sec)}; it must be an object. Fix: set\n      "
                            f"\"{which}\": {{\"device\": \"nvme\", \"nvme_path\": \"/mnt/cache0\"}}")
            sec = None
        sections[which] = sec or {}
    op, oo = sections["offload_param"], sections["offload_optimizer"]
    candidates = list(cfg.cache_paths or []) + [op.get("nvme_path"), oo.get("nvme_path"), "/mnt/cache0"]
    path_hint = next(p for p in candidates if isinstance(p, str) and p.strip())
    for which, sec in sections.items():
        p = sec.get("nvme_path")
        if p is not None and not (isinstance(p, str) and p.strip()):
            problems.append(f"zero_optimization.{which}.nvme_path is {_short(p)}; it must be one directory path as "
                            f"a string. Fix: \"nvme_path\": {json.dumps(path_hint, ensure_ascii=False)} (list several drives in "
                            f"aidaptiv.cache_paths)")
    training = trains(ds, training)
    devices = {which: _device(sec.get("device", "none")) for which, sec in sections.items()}
    for which, dev in devices.items():
        if dev not in _DEVICES:
            problems.append(f"zero_optimization.{which}.device is {_short(sections[which].get('device'))}; DeepSpeed "
                            f"offloads to \"nvme\", \"cpu\" or \"none\". Fix: \"device\": \"nvme\" (with "
                            f"\"nvme_path\": {json.dumps(path_hint, ensure_ascii=False)})")
    if "max_in_cpu" in op and not (_number(op["max_in_cpu"]) and math.isfinite(op["max_in_cpu"])
                                   and 0 <= op["max_in_cpu"] < 2 ** 63):
        problems.append(f"zero_optimization.offload_param.max_in_cpu is {_short(op['max_in_cpu'])}; it must be a "
                        f"number of parameter elements >= 0 (kept in DRAM within aidaptiv.dram_budget). Fix: e.g. "
                        f"\"max_in_cpu\": 1e9 (DeepSpeed's default), or leave it out")
    if not training:
        if devices["offload_param"] != "nvme":
            problems.append(f"zero_optimization.offload_param.device is {_short(devices['offload_param'])} and this "
                            f"engine has no optimizer (ZeRO-Inference), so aidaptiv_ds would have nothing to serve. Fix: "
                            f"set\n      \"offload_param\": {{\"device\": \"nvme\", \"nvme_path\": {json.dumps(path_hint, ensure_ascii=False)}}}")
        return problems
    if devices["offload_optimizer"] != "nvme":
        where = ("the parameters are on nvme but the optimizer state is not: aidaptiv_ds serves the optimizer state "
                 "(with or without the parameters)" if devices["offload_param"] == "nvme"
                 else "nothing is offloaded to nvme, so aidaptiv_ds would have nothing to serve")
        problems.append(f"zero_optimization.offload_optimizer.device is {_short(devices['offload_optimizer'])}; "
                        f"{where}. Fix: set\n      \"offload_optimizer\": {{\"device\": \"nvme\", \"nvme_path\": "
                        f"{json.dumps(path_hint, ensure_ascii=False)}}}\n    or remove the \"aidaptiv\" section to run DeepSpeed's own offload")
    if "ratio" in oo and not (_number(oo["ratio"]) and oo["ratio"] == 1):
        problems.append(f"zero_optimization.offload_optimizer.ratio is {_short(oo['ratio'])}; partial optimizer "
                        f"offload is CPU-only in DeepSpeed. Fix: remove \"ratio\" (aidaptiv.dram_budget keeps "
                        f"sub-groups in DRAM)")
    return problems


def _zero_model_keys(loc: tuple) -> list[str]:
    """The keys DeepSpeed's ZeRO config model accepts at ``loc`` (field names and their aliases)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    model = {"offload_param": DeepSpeedZeroOffloadParamConfig,
             "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig}.get(str(loc[0]) if len(loc) > 1 else "",
                                                                           DeepSpeedZeroConfig)
    return sorted({n for k, f in model.model_fields.items() for n in (k, f.alias) if n})


def _deepspeed_model_problems(zero: Any) -> list[str]:
    """What DeepSpeed's own ZeRO config model (``DeepSpeedZeroConfig``, pydantic, ``extra="forbid"``)
    refuses in ``zero_optimization``, found before any data is touched and worded as our messages are
    (key, value, fix). Everything aidaptiv_ds accepts, DeepSpeed's model accepts too, so a config never
    passes our check only to fail later inside ``deepspeed.initialize``."""
    if not isinstance(zero, dict):
        return []
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:  # the planner and doctor run without DeepSpeed installed
        return []
    try:
        DeepSpeedZeroConfig(**copy.deepcopy(zero))
    except ValidationError as err:
        out = []
        for e in err.errors():
            loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            key = "zero_optimization" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
            if e["type"] == "extra_forbidden":
                names = _zero_model_keys(loc)
                out.append(f"{key}: unknown key, DeepSpeed's ZeRO config refuses it; "
                           f"{_key_hint(loc[-1] if loc else '', names)}")
            else:
                out.append(f"{key} is {_short(e.get('input'))}: {e['msg']} (DeepSpeed's ZeRO config refuses it). "
                           f"Fix: correct or remove it, as DeepSpeed's config reference describes")
        return out
    except Exception as e:  # noqa: BLE001 - a validator of DeepSpeed's raised something else
        return [f"zero_optimization: DeepSpeed's ZeRO config refuses it ({type(e).__name__}: {e}). Fix: correct the "
                f"key it names, as DeepSpeed's config reference describes"]
    return []


def validate(ds: dict, check_paths: bool = True, training: bool | None = None) -> AidaptivConfig:
    """Validate the section and its combination with the rest of the DeepSpeed config.

    ``training``: whether an optimizer is built (None: whether the config has an ``"optimizer"``
    section, :func:`trains`); without one (ZeRO-Inference) the optimizer offload is not required.

    Fills ``cache_paths`` from ``offload_param.nvme_path`` when absent. The DeepSpeed keys
    aidaptiv_ds depends on are checked here with our messages (``zero_optimization`` and its
    ``stage``, ``sub_group_size``, ``offload_param`` / ``offload_optimizer`` with ``device``,
    ``nvme_path``, ``max_in_cpu``, ``ratio``); other keys of DeepSpeed's sections are left to
    DeepSpeed's own config model, whose errors name them.

    Raises:
        AidaptivConfigError: naming each key, its value and the exact lines to change.
    """
    if not isinstance(ds, dict):
        raise AidaptivConfigError(f"DeepSpeed config: {_short(ds)} must be a JSON object. Fix: pass the config as a "
                                  f"dict or the path of a JSON file holding one, e.g. {{\"{SECTION}\": {{...}}}}")
    section = ds.get(SECTION, {})
    cfg = parse_section(section)
    problems = _deepspeed_problems(ds, cfg, training)
    if not problems:
        problems = _deepspeed_model_problems(ds.get("zero_optimization"))
    if problems:
        raise AidaptivConfigError("DeepSpeed config cannot run with \"aidaptiv\" enabled:\n  - " +
                                  "\n  - ".join(problems))
    if not cfg.cache_paths:
        zero = ds["zero_optimization"]
        which = next((w for w in ("offload_param", "offload_optimizer")
                      if _device((zero.get(w) or {}).get("device")) == "nvme" and (zero.get(w) or {}).get("nvme_path")),
                     None)
        if which is None:
            raise AidaptivConfigError(f"{SECTION}.cache_paths is not set and no offload section on nvme has a nvme_path. "
                                      f"Fix: add \"cache_paths\": [\"/mnt/cache0\"] to the \"aidaptiv\" section")
        nvme = zero[which]["nvme_path"]
        try:  # parse again with the path filled in, so every cross-check sees it
            cfg = parse_section({**section, "cache_paths": [nvme]})
        except AidaptivConfigError as e:
            raise AidaptivConfigError(
                f"{e}\n  {SECTION}.cache_paths: not set, so it is [{nvme!r}] from zero_optimization.{which}."
                f"nvme_path. Fix: set aidaptiv.cache_paths to list every cache directory") from None
    else:
        _warn_unused_nvme_paths(ds.get("zero_optimization") or {}, cfg.cache_paths)
    if check_paths:
        for i, p in enumerate(cfg.cache_paths):
            try:
                create_cache_path(p, f"{SECTION}.cache_paths[{i}]")
                check_cache_path(p, f"{SECTION}.cache_paths[{i}]")
            except CachePathError as e:
                raise AidaptivConfigError(str(e)) from None
        check_dram_budget(section.get("dram_budget") if isinstance(section, dict) else None, cfg.dram_budget)
    return cfg


_CREATED: set = set()
_WARNED_NVME: set = set()


def _warn_unused_nvme_paths(zero: dict, cache_paths: list) -> None:
    """Warn once per path when an offload section's ``nvme_path`` is not among ``aidaptiv.cache_paths``: the state
    goes to the cache paths and that directory is not used (a user who meant it as the drive would not know)."""
    mine = {os.path.realpath(os.path.expanduser(str(p))) for p in cache_paths}
    for which in ("offload_param", "offload_optimizer"):
        sec = zero.get(which) or {}
        nvme = sec.get("nvme_path") if isinstance(sec, dict) and _device(sec.get("device")) == "nvme" else None
        if not isinstance(nvme, str) or os.path.realpath(os.path.expanduser(nvme)) in mine or nvme in _WARNED_NVME \
                or os.environ.get("RANK", "0") != "0":  # one line per job: rank 0 says it
            continue
        _WARNED_NVME.add(nvme)
        log.warning("aidaptiv_ds: zero_optimization.%s.nvme_path %s is not among aidaptiv.cache_paths %s: the state "
                    "is written to the cache paths and %s is not used. Fix: list it in aidaptiv.cache_paths, or set "
                    "nvme_path to one of them", which, nvme, list(cache_paths), nvme)


def create_cache_path(path: str, field: str = f"{SECTION}.cache_paths") -> bool:
    """Create a missing cache directory, as DeepSpeed creates a missing ``nvme_path`` (``os.makedirs``), with
    one log line naming it and its filesystem; returns whether it was created.

    Raises:
        CachePathError: it cannot be created (naming the path, the reason and the fix).
    """
    from ..store.layout import CachePathError, filesystem_of

    ap = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.exists(ap) or os.path.islink(ap):
        return False
    try:
        os.makedirs(ap, exist_ok=True)
    except OSError as e:
        raise CachePathError(f"{field}: {path!r} does not exist and cannot be created ({e.strerror}; it would be on "
                             f"{filesystem_of(ap)}). Fix: create it (mkdir -p {ap}) or list an existing directory "
                             f"on the cache drive.") from None
    if ap not in _CREATED:
        _CREATED.add(ap)
        on_root = os.stat(ap).st_dev == os.stat("/").st_dev
        # a warning, shown by default: a mistyped path is created, and the state's writes go wherever it landed
        # (one rank creates it; the others find it there)
        log.warning("aidaptiv_ds: created the missing cache directory %s (on %s), as DeepSpeed creates a missing "
                    "nvme_path%s", ap, filesystem_of(ap),
                    "; it is on the root filesystem /, not on a cache drive of its own: the training state's writes "
                    "go there (if that is not meant, fix aidaptiv.cache_paths)" if on_root else "")
    return True


def host_memory_limit(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> tuple[int | None, str]:
    """The most host memory this process can have: ``MemTotal`` of ``/proc/meminfo``, or the memory
    limit of its cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) when that is smaller
    (containers, SLURM jobs). Returns ``(bytes or None when unknown, where the number comes from)``."""
    from ..telemetry.sysinfo import host_memory

    total = host_memory(proc_root).get("total_bytes")
    best, source = (int(total), "MemTotal in /proc/meminfo") if total else (None, "unknown")
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            with open(os.path.join(cgroup_root, name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and (best is None or int(text) < best):
            best, source = int(text), f"the cgroup limit {os.path.join(cgroup_root, name)}"
    return best, source


_BUDGET_WARNED: set = set()


def check_dram_budget(given: Any, budget: int | str, local_ranks: int | None = None) -> None:
    """Refuse a ``dram_budget`` the machine cannot hold; warn when it exceeds what is available now.

    The budget is per rank: the node needs ``budget x local ranks``. More than the machine's memory
    (:func:`host_memory_limit`) is refused -- such a budget bounds nothing, and the run would be
    killed by the OOM killer instead of spilling to the cache tier; more than ``MemAvailable`` is
    accepted with a warning (memory may be freed by then, or held by page cache).

    Raises:
        AidaptivConfigError: naming the value, the bytes per rank and per node, the machine's memory
            and the fix.
    """
    if budget == "auto" or not isinstance(budget, int) or budget <= 0:
        return
    from ..telemetry.sysinfo import host_memory
    from ..units import format_bytes
    from .runtime import local_world_size  # noqa: PLC0415 - runtime imports this module

    local = local_ranks or local_world_size()
    node = int(budget) * local
    limit, source = host_memory_limit()
    per = f"{format_bytes(budget)} per rank" + (f" x {local} ranks on this node = {format_bytes(node)}" if local > 1 else "")
    if limit is not None and node > limit:
        raise AidaptivConfigError(
            f"{SECTION}.dram_budget: {given!r} ({per}) is more than this machine's memory, {format_bytes(limit)} "
            f"({source}): it would not bound host memory. Fix: set it to at most {format_bytes(limit // local)} per rank "
            f"minus what the training process itself needs, e.g. \"{format_bytes(int(limit * 0.7) // local)}\", or "
            f"\"auto\" (available memory minus a safety margin)")
    avail = host_memory().get("available_bytes")
    if avail and node > avail and (node, local) not in _BUDGET_WARNED:  # validate runs at each entry point: once
        _BUDGET_WARNED.add((node, local))
        import warnings
        msg = (f"{SECTION}.dram_budget: {given!r} ({per}) is more than the memory available now, "
               f"{format_bytes(int(avail))} (MemAvailable in /proc/meminfo); if the state fills it, this node will "
               f"swap or hit the OOM killer. Fix: a smaller budget, or leave dram_budget out (its default, "
               f"\"auto\", sizes it from this host)")
        log.warning("aidaptiv_ds: %s", msg)
        warnings.warn(msg, BudgetWarning, stacklevel=3)
