"""Per-step training metrics: one JSON line per optimizer step, TensorBoard scalars when installed.

A training loop calls :meth:`MetricsWriter.step` once per optimizer step; the writer takes a
:func:`aidaptiv_ds.telemetry.counters.snapshot`, subtracts the previous one
(:func:`~aidaptiv_ds.telemetry.counters.delta`), adds VRAM through NVML and this process's RSS,
appends the record to ``<output_dir>/metrics.jsonl`` and returns it; :func:`format_step_summary`
turns it into the one-liner for a progress bar (``tqdm.set_postfix_str``)::

    writer = MetricsWriter(output_dir)
    for step, batch in enumerate(loader):
        t0 = time.perf_counter(); loss = train_step(batch)
        rec = writer.step(step, loss=loss, tokens=n_tokens, step_time_s=time.perf_counter() - t0)
        bar.set_postfix_str(format_step_summary(rec))
    writer.close()

Record fields (bytes, seconds; GB/s = 10^9 bytes per second of step wall time, not of busy time):
``step``, ``time`` (Unix seconds), ``step_time_s``, ``loss``, ``tokens``, ``tokens_per_s``, ``lr``;
``bytes_read`` / ``bytes_written`` (tier -> bytes this step), ``cache_read_bytes``,
``cache_write_bytes``, ``cache_read_gbps``, ``cache_write_gbps``; ``per_path`` (cache path ->
``read_bytes``, ``write_bytes``, ``read_gbps``, ``write_gbps``); ``io_wait_s`` and
``io_wait_fraction`` (of the step time); ``dram_bytes``, ``dram_peak_bytes`` (the DRAM tier with its
working memory), ``dram_budgeted_bytes``, ``dram_budgeted_peak_bytes``, ``dram_budget_bytes`` (what the
budget books, and the budget), ``buffer_pool_bytes`` (the swap buffers' pool, :mod:`aidaptiv_ds.io.pool`);
``proc_read_bytes``, ``proc_write_bytes`` (``/proc/self/io`` this step); ``rss_bytes``,
``peak_rss_bytes``, ``host_available_bytes``; ``vram_used_bytes`` (list per GPU, or None with
``vram_status`` saying why); plus any ``extra`` given. Non-finite floats (a NaN loss) are written as ``null``.
"""
from __future__ import annotations

import json
import os
import threading
import time

from ..jsonsafe import finite
from . import counters, nvml, sysinfo

GB = 1e9
GiB = float(1 << 30)


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / GB if seconds and seconds > 0 else None


def build_record(step: int, d: dict, *, step_time_s: float | None = None, loss: float | None = None,
                 tokens: int | None = None, lr: float | None = None, vram: dict | None = None,
                 rss: dict | None = None, host_mem: dict | None = None, extra: dict | None = None) -> dict:
    """One step's record from a counters ``delta`` ``d`` and the gauges (pure; fields in the module docstring).

    Args:
        step: optimizer step index.
        d: :func:`~aidaptiv_ds.telemetry.counters.delta` of two snapshots around the step.
        step_time_s: wall seconds of the step (rates are None without it).
        vram: :func:`~aidaptiv_ds.telemetry.nvml.nvml_status` result; rss: :func:`sysinfo.process_rss`;
        host_mem: :func:`sysinfo.host_memory`.
    """
    cr = int(d.get("bytes_read", {}).get("cache", 0))
    cw = int(d.get("bytes_written", {}).get("cache", 0))
    rec = {"step": int(step), "time": time.time(), "step_time_s": step_time_s,
           "loss": float(loss) if loss is not None else None, "tokens": tokens,
           "tokens_per_s": tokens / step_time_s if tokens and step_time_s else None, "lr": lr,
           "bytes_read": dict(d.get("bytes_read", {})), "bytes_written": dict(d.get("bytes_written", {})),
           "cache_read_bytes": cr, "cache_write_bytes": cw,
           "cache_read_gbps": _gbps(cr, step_time_s), "cache_write_gbps": _gbps(cw, step_time_s),
           "per_path": {p: {"read_bytes": v.get("bytes_read", 0), "write_bytes": v.get("bytes_written", 0),
                            "read_gbps": _gbps(v.get("bytes_read", 0), step_time_s),
                            "write_gbps": _gbps(v.get("bytes_written", 0), step_time_s)}
                        for p, v in d.get("per_path", {}).items()},
           "io_wait_s": d.get("io_wait_s", 0.0),
           "io_wait_fraction": d.get("io_wait_s", 0.0) / step_time_s if step_time_s else None,
           "dram_bytes": d.get("dram_bytes", 0), "dram_peak_bytes": d.get("dram_peak_bytes", 0),
           **{k: d[k] for k in ("dram_budgeted_bytes", "dram_budgeted_peak_bytes", "dram_budget_bytes",
                                "buffer_pool_bytes") if k in d},
           "proc_read_bytes": d.get("proc_read_bytes", 0), "proc_write_bytes": d.get("proc_write_bytes", 0)}
    rss = rss or {}
    rec["rss_bytes"], rec["peak_rss_bytes"] = rss.get("rss_bytes"), rss.get("peak_rss_bytes")
    rec["host_available_bytes"] = (host_mem or {}).get("available_bytes")
    if vram is not None and vram.get("available"):
        rec["vram_used_bytes"] = [g["used_bytes"] for g in vram["gpus"]]
        rec["vram_total_bytes"] = [g["total_bytes"] for g in vram["gpus"]]
        rec["vram_status"] = vram["status"]
    else:
        rec["vram_used_bytes"] = None
        rec["vram_status"] = vram["status"] if vram else "not queried"
    if extra:
        rec.update(extra)
    return rec


def format_step_summary(record: dict) -> str:
    """One line for a progress bar: loss, tokens/s, cache read/write GB/s, I/O wait, DRAM and VRAM GiB.

    Fields that are missing or None are left out, e.g.
    ``"loss 2.3456 | 1,234 tok/s | cache R 1.20 W 0.80 GB/s | io-wait 12% | DRAM 45.2 GiB | VRAM 70.1 GiB"``.
    """
    parts = []
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("tokens_per_s") is not None:
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    r, w = record.get("cache_read_gbps"), record.get("cache_write_gbps")
    if r is not None or w is not None:
        parts.append(f"cache R {r or 0:.2f} W {w or 0:.2f} GB/s")
    if record.get("io_wait_fraction") is not None:
        parts.append(f"io-wait {record['io_wait_fraction']:.0%}")
    if record.get("dram_bytes") and "dram_budgeted_bytes" in record:  # the budget's part, then the working memory
        parts.append(f"DRAM tier {record['dram_budgeted_bytes'] / GiB:.1f} + working "
                     f"{(record['dram_bytes'] - record['dram_budgeted_bytes']) / GiB:.1f} GiB")
    elif record.get("dram_bytes"):
        parts.append(f"DRAM {record['dram_bytes'] / GiB:.1f} GiB")
    if record.get("vram_used_bytes"):
        parts.append(f"VRAM {max(record['vram_used_bytes']) / GiB:.1f} GiB")
    return " | ".join(parts)


def tensorboard_writer(log_dir: str):
    """A ``torch.utils.tensorboard.SummaryWriter`` for ``log_dir``, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=log_dir)


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of ``record`` as ``{"a/b": value}`` (for TensorBoard); lists become ``name/i``."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k in ("step", "time"):
            continue
        name = f"{prefix}{k}"
        if isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        if isinstance(v, (int, float)):
            out[name] = float(v)
        elif isinstance(v, dict):
            out.update(scalars(v, name + "/"))
        elif isinstance(v, list):
            out.update(scalars({str(i): x for i, x in enumerate(v)}, name + "/"))
    return out


class MetricsWriter:
    """Appends one JSON line per step to ``<output_dir>/metrics.jsonl`` and mirrors scalars to TensorBoard.

    Args:
        output_dir: directory for ``metrics.jsonl`` (created) and the TensorBoard event files.
        tensorboard: True/False forces it on/off (True without tensorboard installed raises
            ImportError); None (default) uses it when importable.
        nvml_backend: NVML backend for VRAM (default: the process-wide one, see :mod:`.nvml`).
        query_vram: ask NVML each step (False skips it, e.g. on CPU-only runs).
        fresh: start a new file instead of appending (one run per file).
    """

    FILE = "metrics.jsonl"

    def __init__(self, output_dir: str, tensorboard: bool | None = None, nvml_backend=None,
                 query_vram: bool = True, fresh: bool = False) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, self.FILE)
        self._f = open(self.path, "w" if fresh else "a")
        self._lock = threading.Lock()
        self._nvml = nvml_backend
        self._query_vram = query_vram
        self._tb = None
        if tensorboard or tensorboard is None:
            self._tb = tensorboard_writer(output_dir)
            if self._tb is None and tensorboard:
                raise ImportError("MetricsWriter(tensorboard=True): tensorboard is not installed; "
                                  "pip install tensorboard, or pass tensorboard=None to skip it")
        self._prev = counters.snapshot(settle_first=True)

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def step(self, step: int, *, loss: float | None = None, tokens: int | None = None,
             step_time_s: float | None = None, lr: float | None = None, extra: dict | None = None) -> dict:
        """Record one optimizer step: counters since the previous call (settled: the step's write-back
        in flight completes and is booked first, see :mod:`.counters`), gauges now; returns the record."""
        snap = counters.snapshot(settle_first=True)
        d = counters.delta(snap, self._prev)
        self._prev = snap
        vram = nvml.nvml_status(self._nvml) if self._query_vram else None
        rec = build_record(step, d, step_time_s=step_time_s, loss=loss, tokens=tokens, lr=lr, vram=vram,
                           rss=sysinfo.process_rss(), host_mem=sysinfo.host_memory(), extra=extra)
        self.write(rec)
        return rec

    def write(self, record: dict) -> None:
        """Append ``record`` (with ``time`` if absent) as one JSON line (flushed; NaN/inf as null) and its
        scalars to TensorBoard."""
        record = {"time": round(time.time(), 3), **record}
        with self._lock:
            self._f.write(json.dumps(finite(record), sort_keys=True, allow_nan=False) + "\n")
            self._f.flush()
            if self._tb is not None:
                for k, v in scalars(record).items():
                    self._tb.add_scalar(k, v, record.get("step", 0))

    def close(self) -> None:
        """Flush and close the files (idempotent)."""
        with self._lock:
            if not self._f.closed:
                self._f.close()
            if self._tb is not None:
                self._tb.close()
                self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
