"""A Llama whose training state is larger than this machine's RAM, 3 optimizer steps per backend (issue 8, item 3).

Default: the 2.7B preset (hidden 2560, 32 layers, MLP 6912, 20 heads, vocab 32000, untied:
2,702,599,680 parameters), fp32 (about 80x faster than bf16 on a CPU without bf16 hardware),
seq 128, micro-batch 1; training state 20 B/param = 50.3 GiB = 2.1 x 24 GiB of RAM. Backends, one
after another in their own processes: aidaptiv_ds with DRAM budget "auto", aidaptiv_ds with budget
0, DeepSpeed native NVMe, DeepSpeed CPU offload. A run that outgrows memory is stopped by a
watchdog (RSS over --mem-limit, default 90% of RAM, or MemAvailable under 1 GiB) and reported
with the phase it reached. It needs the whole machine: about 55 GiB free on --cache and, on 2
cores, of the order of an hour for all four backends.

One command (the README's)::

    python launch/large_model.py --cache /tmp/aidaptiv_large --json large.json \\
        --torch-extensions-dir /tmp/aid/torch_ext --libaio-root /tmp/aid/libaio/root

At a small size, to check the script: ``python launch/large_model.py --params 20M --steps 2``.
``--dry-run`` prints the model, its state against RAM and the disk it needs, and runs nothing.
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

from aidaptiv_ds.cli.compare import _size, add_model_args, shape_from_args  # noqa: E402


def parse(argv):
    from aidaptiv_ds.bench.large import LARGE_BACKENDS

    p = argparse.ArgumentParser(prog="launch/large_model.py", description=__doc__.split("\n\n")[0])
    add_model_args(p, "2.7B")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="default fp32")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per backend (default 3)")
    p.add_argument("--sub-group-size", type=float, default=2e7, help="zero_optimization.sub_group_size (default 2e7)")
    p.add_argument("--backends", default=",".join(LARGE_BACKENDS),
                   help=f"comma-separated, in run order (default {','.join(LARGE_BACKENDS)})")
    p.add_argument("--cache", default="/tmp/aidaptiv_large", help="work directory and cache path")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem-limit", type=_size, default=None,
                   help="kill a run whose RSS exceeds this (default 90%% of RAM)")
    p.add_argument("--timeout", type=float, default=7200, help="kill a run after this many seconds (default 7200)")
    p.add_argument("--aio", choices=("compiled", "python"), default="compiled")
    p.add_argument("--build-aio", action="store_true", help="JIT-build DeepSpeed's async_io op once if not cached")
    p.add_argument("--torch-extensions-dir", default=None)
    p.add_argument("--libaio-root", default=None)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from aidaptiv_ds.bench.backends import TrainSettings
    from aidaptiv_ds.bench.large import drive_bytes_needed, large_run
    from aidaptiv_ds.bench.models import describe, state_vs_ram
    from aidaptiv_ds.bench.runner import stop_children_on_sigterm
    from aidaptiv_ds.telemetry.sysinfo import host_memory

    args = parse(argv)
    try:
        shape = shape_from_args(args, "2.7B")
    except ValueError as e:
        print(f"launch/large_model.py: error: {e}", file=sys.stderr)
        return 2
    settings = TrainSettings(dtype=args.dtype, micro_batch=args.micro_batch, seq=args.seq,
                             sub_group_size=int(args.sub_group_size))
    ram = host_memory().get("total_bytes") or 0
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    needs = ", ".join(f"{b} {drive_bytes_needed(shape, args.dtype, b) / 2 ** 30:.1f} GiB" for b in backends if b != "cpu")
    print(f"{describe(shape)}, {args.dtype}: {state_vs_ram(shape, args.dtype, ram)}; free space needed on "
          f"{args.cache} per run: {needs or 'none'}; backends {', '.join(backends)}", file=sys.stderr)
    if args.dry_run:
        return 0
    stop_children_on_sigterm()
    command = " ".join(shlex.quote(a) for a in ["python", "launch/large_model.py"] +
                       (sys.argv[1:] if argv is None else list(argv)))
    res = large_run(shape, settings, steps=args.steps, backends=backends, work_dir=args.cache, seed=args.seed,
                    aio=args.aio, build_aio=args.build_aio, extensions_dir=args.torch_extensions_dir,
                    libaio_root=args.libaio_root, mem_limit_bytes=args.mem_limit, timeout_s=args.timeout,
                    command=command, say=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"Command: {command}\n")
    print(res["table"])
    return 0 if any(o["finished"] for o in res["outcomes"] if o["backend"].startswith("aidaptiv")) else 1


if __name__ == "__main__":
    sys.exit(main())
