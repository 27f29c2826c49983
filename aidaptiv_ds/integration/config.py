"""The ``"aidaptiv"`` section of a DeepSpeed JSON config: typed model, validation, clear errors.

Fixed keys (users and scripts rely on them): ``enabled``, ``cache_paths``, ``dram_budget``.
Everything else is documented on :class:`AidaptivConfig` and in the README's config reference.

Validation runs at ``deepspeed.initialize`` and ``deepspeed.zero.Init`` time, before any data is
touched. Every error names the key, the value and the fix; unknown keys get the closest valid name;
DeepSpeed settings that cannot work with aidaptiv_ds come with the exact lines to change.
"""
from __future__ import annotations

import difflib
import json
import os
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..store.layout import CachePathError, check_cache_path
from ..units import parse_size

SECTION = "aidaptiv"


class AidaptivConfigError(ValueError):
    """A bad ``"aidaptiv"`` section or a DeepSpeed setting that cannot work with it."""


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
    """
    block_size: Union[int, str] = 8 << 20
    threads_per_drive: int = Field(4, ge=1, le=64)
    direct: bool = True
    max_retries: int = Field(3, ge=0, le=20)

    @field_validator("block_size", mode="before")
    @classmethod
    def _block(cls, v):
        n = parse_size(v, f"{SECTION}.io.block_size")
        if n < 4096 or n % 4096:
            raise ValueError(f"{SECTION}.io.block_size: {v!r} must be a positive multiple of 4096 bytes, e.g. '8MiB'")
        return n


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
        prefetch_bytes: most bytes read ahead of compute ("auto": from the budget, at least 2 slices).
        writeback_bytes: most bytes of write-back in flight ("auto": 512 MiB).
        min_swap_bytes: partitions smaller than this stay in CPU memory like DeepSpeed's 1 MiB
            threshold (default 0: every partition goes through the store).
        checksum: CRC32 of every written block, verified on read (default false).
        keep_files: keep the slab files after a clean shutdown (default false: they are deleted).
        from_unpacked: take the initial weights from a store written by ``aidaptiv-ds unpack`` under
            ``run_name`` (needs an explicit ``run_name``; the namespace is kept).
        endurance: the drives' endurance rating.
        io: I/O engine settings.
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
    min_swap_bytes: Union[int, str] = 0
    checksum: bool = False
    keep_files: bool = False
    from_unpacked: bool = False
    endurance: EnduranceConfig = Field(default_factory=EnduranceConfig)
    io: IOConfig = Field(default_factory=IOConfig)

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
            raise ValueError(f"{SECTION}.cache_paths: {v!r} is a string; give a list, e.g. [\"{v}\"]")
        if not isinstance(v, list) or not v or not all(isinstance(p, str) and p for p in v):
            raise ValueError(f"{SECTION}.cache_paths: {v!r} must be a non-empty list of directory paths")
        if len(set(os.path.abspath(p) for p in v)) != len(v):
            raise ValueError(f"{SECTION}.cache_paths: {v!r} lists a path twice; list each cache directory once")
        return v

    @field_validator("run_name")
    @classmethod
    def _run(cls, v):
        if not v or "/" in v or v in (".", ".."):
            raise ValueError(f"{SECTION}.run_name: {v!r} must be a plain name (no '/'), or \"auto\"")
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
            if any(w <= 0 for w in self.path_weights):
                raise ValueError(f"{SECTION}.path_weights: {self.path_weights} must all be > 0 (relative GB/s)")
            if n is not None and len(self.path_weights) != n:
                raise ValueError(f"{SECTION}.path_weights: {len(self.path_weights)} weights for {n} cache_paths; "
                                 f"give one weight per path")
        if isinstance(self.primary_path, int) and self.cache_paths and not (
                0 <= self.primary_path < len(self.cache_paths)):
            raise ValueError(f"{SECTION}.primary_path: {self.primary_path} is not an index of cache_paths "
                             f"(0..{len(self.cache_paths) - 1})")
        return self


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _explain(err: ValidationError, section: dict) -> str:
    lines = []
    for e in err.errors():
        loc = [str(x) for x in e["loc"]]
        key = ".".join([SECTION] + loc)
        if e["type"] == "extra_forbidden":
            model: type[BaseModel] = AidaptivConfig
            for part in loc[:-1]:
                model = model.model_fields[part].annotation  # nested model
            names = _field_names(model)
            close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(names)}"
            lines.append(f"{key}: unknown key; {hint}")
            continue
        value = section
        for part in loc:
            value = value.get(part) if isinstance(value, dict) else None
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
            lines.append(msg if msg.startswith(SECTION) else f"{key}: {msg}")
        else:
            lines.append(f"{key}: {value!r} is invalid: {msg}")
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
                raise AidaptivConfigError(f"DeepSpeed config {config}: not valid JSON ({e})") from None
    return None


def section_enabled(ds: dict | None) -> bool:
    """True when the DeepSpeed config dict has an ``"aidaptiv"`` section that is not disabled."""
    if not ds or SECTION not in ds:
        return False
    sec = ds[SECTION]
    return not (isinstance(sec, dict) and sec.get("enabled", True) is False)


def _get(d: dict, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def validate(ds: dict, check_paths: bool = True) -> AidaptivConfig:
    """Validate the section and its combination with the rest of the DeepSpeed config.

    Fills ``cache_paths`` from ``offload_param.nvme_path`` when absent.

    Raises:
        AidaptivConfigError: naming each key, its value and the exact lines to change.
    """
    cfg = parse_section(ds.get(SECTION, {}))
    problems = []
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage != 3:
        problems.append(f"zero_optimization.stage is {stage!r}; aidaptiv_ds drives ZeRO stage 3 offload. Fix: set\n"
                        f"      \"zero_optimization\": {{\"stage\": 3, ...}}")
    op = _get(ds, "zero_optimization", "offload_param") or {}
    oo = _get(ds, "zero_optimization", "offload_optimizer") or {}
    path_hint = (cfg.cache_paths or [op.get("nvme_path") or oo.get("nvme_path") or "/mnt/cache0"])[0]
    if str(op.get("device", "none")).lower() != "nvme":
        problems.append(f"zero_optimization.offload_param.device is {op.get('device', 'none')!r}; aidaptiv_ds "
                        f"replaces the NVMe offload. Fix: set\n      \"offload_param\": {{\"device\": \"nvme\", "
                        f"\"nvme_path\": \"{path_hint}\", \"max_in_cpu\": 0}}")
    elif op.get("max_in_cpu", 1e9) != 0:
        problems.append(f"zero_optimization.offload_param.max_in_cpu is {op.get('max_in_cpu', '1e9 (default)')}; "
                        f"DeepSpeed would pin that many parameters in its own CPU buffers outside the aidaptiv DRAM "
                        f"budget. Fix: add\n      \"max_in_cpu\": 0\n    to offload_param (use aidaptiv.dram_budget "
                        f"to keep state in DRAM)")
    if str(oo.get("device", "none")).lower() != "nvme":
        problems.append(f"zero_optimization.offload_optimizer.device is {oo.get('device', 'none')!r}. Fix: set\n"
                        f"      \"offload_optimizer\": {{\"device\": \"nvme\", \"nvme_path\": \"{path_hint}\"}}")
    elif float(oo.get("ratio", 1.0)) < 1.0:
        problems.append(f"zero_optimization.offload_optimizer.ratio is {oo['ratio']}; partial optimizer offload is "
                        f"CPU-only in DeepSpeed. Fix: remove \"ratio\" (aidaptiv.dram_budget keeps sub-groups in DRAM)")
    if problems:
        raise AidaptivConfigError("DeepSpeed config cannot run with \"aidaptiv\" enabled:\n  - " +
                                  "\n  - ".join(problems))
    if not cfg.cache_paths:
        nvme = op.get("nvme_path")
        if not nvme:
            raise AidaptivConfigError(f"{SECTION}.cache_paths is not set and offload_param.nvme_path is empty. Fix: "
                                      f"add \"cache_paths\": [\"/mnt/cache0\"] to the \"aidaptiv\" section")
        cfg.cache_paths = [str(nvme)]
        if cfg.path_weights is not None and len(cfg.path_weights) != 1:
            raise AidaptivConfigError(f"{SECTION}.path_weights: {len(cfg.path_weights)} weights for 1 cache path")
    if check_paths:
        for i, p in enumerate(cfg.cache_paths):
            try:
                check_cache_path(p, f"{SECTION}.cache_paths[{i}]")
            except CachePathError as e:
                raise AidaptivConfigError(str(e)) from None
    return cfg
