"""Accuracy of Adam's moments in bf16 and int8 against fp32 (``aidaptiv.optimizer_state.moments``): the main job
once per format.

bf16 and int8 moments are opt-in and not bit-identical (``integration/optimizer_swapper.py`` [Note: moment dtype]), so
their cost in accuracy is measured on a real fine-tune: ``launch/finetune.py`` (SmolLM2-135M-Instruct on the
shipped Dolly sample by default) runs once per moment dtype with the same seed, data order and settings, each
in its own process, and the final eval losses are compared (the issue's bounds: within 1% for bf16, 2% for int8), with the bytes
written per parameter per step and the step time beside them (from each job's ``metrics.jsonl`` summary).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FINETUNE = os.path.join(REPO, "launch", "finetune.py")
BASE_CONFIG = os.path.join(REPO, "ds_configs", "aidaptiv_zero3.json")


def job_config(moments: str, cache: str, budget: str | int) -> dict:
    """The main job's DeepSpeed config (``ds_configs/aidaptiv_zero3.json``) with ``moments`` and ``budget``."""
    with open(BASE_CONFIG) as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = cache
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = cache
    cfg["aidaptiv"].update(cache_paths=[cache], dram_budget=budget, optimizer_state={"moments": moments})
    return cfg


def summary_of(output_dir: str) -> dict:
    """The summary line of a finished job's ``metrics.jsonl`` (the last line with ``"summary": true``).

    Raises:
        RuntimeError: the job wrote no summary.
    """
    found = None
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("summary") is True and rec.get("final_eval_loss") is not None:
                found = rec
    if found is None:
        raise RuntimeError(f"{output_dir}/metrics.jsonl has no summary line with final_eval_loss")
    return found


def run(model: str, data: str, work: str, *, steps: int = 200, seq: int = 256, batch: int = 1, lr: float = 5e-5,
        budget: str | int = "auto", seed: int = 0, moments: tuple[str, ...] = ("fp32", "bf16", "int8"),
        timeout: float = 7200) -> dict:
    """Run the job once per moment dtype (in turn, each a fresh process) and return
    ``{"settings", "rows": [{"moments", "final_eval_loss", "eval_loss_before", "written_b_per_param_step",
    "s_per_step", "wall_s"}], "relative_diff"}`` (``relative_diff``: |x - fp32| / fp32 of the final eval loss).

    Raises:
        RuntimeError: a job failed (its output tail is in the message).
    """
    rows = []
    for m in moments:
        out = os.path.join(work, f"out_{m}")
        cache = os.path.join(work, f"cache_{m}")
        os.makedirs(out, exist_ok=True)
        cfg_path = os.path.join(work, f"ds_{m}.json")
        with open(cfg_path, "w") as f:
            json.dump(job_config(m, cache, budget), f, indent=1)
        cmd = [sys.executable, FINETUNE, "--model_name_or_path", model, "--data_path", data, "--output_dir", out,
               "--deepspeed", cfg_path, "--max_steps", str(steps), "--num_train_epochs", "100",
               "--max_seq_length", str(seq), "--per_device_train_batch_size", str(batch), "--learning_rate", str(lr),
               "--seed", str(seed), "--save_strategy", "no", "--cache_path", cache]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"moments {m}: the job failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        s = summary_of(out)
        rows.append({"moments": m, "final_eval_loss": s["final_eval_loss"], "eval_loss_before": s["eval_loss_before"],
                     "steps": s.get("steps"),
                     "written_b_per_param_step": s.get("bytes_written_per_param_per_step"),
                     "read_b_per_param_step": s.get("bytes_read_per_param_per_step"),
                     "s_per_step": s.get("mean_step_time_s"), "wall_s": round(wall, 1),
                     "dram_budget_bytes": s.get("dram_budget_bytes")})
    ref = next((r for r in rows if r["moments"] == "fp32"), None)
    for r in rows:
        r["relative_diff"] = None if ref is None else abs(r["final_eval_loss"] - ref["final_eval_loss"]) / \
            ref["final_eval_loss"]
    return {"settings": {"model": model, "data": data, "steps": steps, "seq": seq, "batch": batch, "lr": lr,
                         "budget": budget, "seed": seed}, "rows": rows}


def markdown(res: dict) -> str:
    """The result as a table (one row per moment dtype)."""
    lines = ["| moments | eval loss before → after | vs fp32 moments | written / read B/param/step | s/step |",
             "|---|---|---|---|---|"]
    for r in res["rows"]:
        rel = "" if r["relative_diff"] is None else f"{r['relative_diff'] * 100:+.3f}%".replace("+", "")
        w = r["written_b_per_param_step"]
        rd = r["read_b_per_param_step"]
        lines.append(f"| {r['moments']} | {r['eval_loss_before']:.4f} → {r['final_eval_loss']:.4f} | {rel} | "
                     f"{'n/a' if w is None else f'{w:.2f}'} / {'n/a' if rd is None else f'{rd:.2f}'} | "
                     f"{'n/a' if r['s_per_step'] is None else format(r['s_per_step'], '.2f')} |")
    return "\n".join(lines)
