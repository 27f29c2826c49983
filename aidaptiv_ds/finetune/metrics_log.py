"""``OUTPUT_DIR/metrics.jsonl``: one JSON object per line, appended and flushed as the run goes.

Line kinds (all carry ``time``, seconds since the epoch):

* step lines: ``step``, ``epoch`` (share of the epochs done), ``loss`` (mean over the step's
  micro-batches and ranks of each micro-batch's mean response-token loss), ``lr`` (used by this
  step), ``tokens`` (non-padding input tokens, all ranks), ``tokens_per_s``, ``step_time_s``,
  ``bytes_read`` / ``bytes_written`` (dict tier -> bytes in this step, summed over ranks, from
  :mod:`aidaptiv_ds.telemetry.counters`), ``proc_read_bytes`` / ``proc_write_bytes``
  (``/proc/self/io`` deltas, summed over ranks), ``dram_bytes`` / ``dram_peak_bytes`` (summed over
  ranks), ``io_wait_s`` (the slowest rank);
* eval lines: ``eval_loss``, ``eval_tokens``, ``step``, ``epoch``;
* one summary line: ``summary: true`` and the run totals (see :mod:`aidaptiv_ds.finetune.loop`).

Non-finite floats are written as ``null`` so every line is strict JSON.
"""
from __future__ import annotations

import json
import math
import os
import time


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


class MetricsLog:
    """Writes JSON lines to ``path`` (created with its directory); a no-op when ``enabled`` is False
    (ranks other than 0). ``fresh=True`` starts a new file (one run per file), else appends."""

    def __init__(self, path: str, enabled: bool = True, fresh: bool = True) -> None:
        self.path = path
        self._f = None
        if enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "w" if fresh else "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append ``record`` (plus ``time``) as one line and flush it to the OS."""
        if self._f is None:
            return
        line = json.dumps(_finite({**record, "time": round(time.time(), 3)}), allow_nan=False)
        self._f.write(line + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: str) -> list[dict]:
    """All lines of a metrics file, decoded."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
