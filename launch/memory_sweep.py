"""Peak host memory against model size, per backend (issue 16): does host memory grow with the model?

Trains each Llama size of the sweep for a few optimizer steps with each backend, one process per
run, and fits peak RSS of the steps against the parameter count (bytes per parameter = the slope;
the fixed part = the intercept). Default sweep: hidden 1024, 2/4/8/12 layers, vocab 8192 (34M to
163M parameters), fp32, seq 128, DeepSpeed's working-set knobs capped at 2e7 elements and
``stage3_max_reuse_distance`` 0::

    python launch/memory_sweep.py --backends aidaptiv0,native,cpu --json memory.json

``--layers 2,4,8,12`` and ``--hidden`` choose the sizes; ``--dtype bf16`` for the second table.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

# this checkout's package ahead of any installed copy (an editable install of another checkout included):
# what a launch script runs and measures is the code beside it
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    from aidaptiv_ds.bench.backends import TrainSettings
    from aidaptiv_ds.bench.memory import sweep
    from aidaptiv_ds.bench.models import resolve_shape
    from aidaptiv_ds.bench.runner import stop_children_on_sigterm

    p = argparse.ArgumentParser(prog="launch/memory_sweep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", default="2,4,8,12", help="comma-separated layer counts, one model each")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sub-group-size", type=float, default=2e7)
    p.add_argument("--ds-knobs", type=float, default=2e7,
                   help="reduce_bucket_size, stage3_prefetch_bucket_size, stage3_max_live_parameters (elements; "
                        "0 leaves DeepSpeed's defaults)")
    p.add_argument("--gradient-clipping", type=float, default=1.0,
                   help="gradient_clipping (default 1.0, HF Trainer's default; 0 turns it off)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="HF gradient checkpointing of every layer (non-reentrant): activations stop growing with "
                        "the layer count, so the fit measures the training state's share")
    p.add_argument("--aidaptiv-extra", default=None, metavar="JSON",
                   help='keys merged into the "aidaptiv" section of the aidaptiv_ds backends, for ablations, e.g. '
                        '\'{"writeback_bytes": "256MiB"}\'')
    p.add_argument("--backends", default="aidaptiv0,native,cpu")
    p.add_argument("--aio", choices=("python", "compiled"), default="python")
    p.add_argument("--zero-init-build", action="store_true",
                   help="build each model inside zero.Init (--build zero_init)")
    p.add_argument("--build", choices=("whole", "zero_init", "from_pretrained", "unpacked"), default=None,
                   help="how each model is built: whole then partitioned (default), inside zero.Init, "
                        "from_pretrained of a saved copy under ZeRO-3, or from the store `aidaptiv-ds unpack` filled")
    p.add_argument("--trace-detail", action="store_true",
                   help="each RSS trace sample in the JSON also says where the bytes are (C heap, DRAM tier, pool)")
    p.add_argument("--cache", default="/tmp/aidaptiv_memory")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    stop_children_on_sigterm()
    if not 0.0 <= a.gradient_clipping < float("inf"):
        p.error(f"--gradient-clipping {a.gradient_clipping}: must be a finite number >= 0 (0 turns clipping off)")
    knob = int(a.ds_knobs) or None
    settings = TrainSettings(dtype=a.dtype, seq=a.seq, sub_group_size=int(a.sub_group_size), clip=a.gradient_clipping,
                             activation_checkpointing=a.activation_checkpointing, reduce_bucket_size=knob,
                             prefetch_bucket_size=knob, max_live_parameters=knob,
                             aidaptiv_extra=json.loads(a.aidaptiv_extra) if a.aidaptiv_extra else None)
    shapes = [resolve_shape(None, a.hidden, int(n), vocab=a.vocab, seq=a.seq) for n in a.layers.split(",")]
    command = " ".join(shlex.quote(x) for x in ["python", "launch/memory_sweep.py"] +
                       (sys.argv[1:] if argv is None else list(argv)))
    res = sweep(shapes, settings, backends=[b.strip() for b in a.backends.split(",") if b.strip()], steps=a.steps,
                work_dir=a.cache, aio=a.aio, build_under_zero_init=a.zero_init_build, command=command,
                trace_detail=a.trace_detail, build=a.build,
                say=lambda m: print(m, file=sys.stderr, flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"Command: {command}\n")
    print(res["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
