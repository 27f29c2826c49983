"""``aidaptiv-ds timeline RUN_DIR``: one training step of a recorded timeline as a PNG, and its figures.

RUN_DIR holds ``timeline-rank<R>.json`` (recorded with ``"aidaptiv": {"profile": {"steps": "3-4",
"dir": RUN_DIR}}``, :func:`aidaptiv_ds.telemetry.timeline.enable` or ``aidaptiv-ds compare
--timeline 3-4``), or is such a file. Examples::

    aidaptiv-ds timeline output/run --output step.png            # the last step recorded, rank 0
    aidaptiv-ds timeline output/run --step 3 --rank 1 --json     # figures only, as JSON

The picture (:mod:`aidaptiv_ds.telemetry.timeline_plot`) has compute lanes, one lane per drive for
reads and one for writes, and the waits marked; the same file opens in Perfetto or
``chrome://tracing``. Needs matplotlib for the PNG (``pip install 'aidaptiv_ds[report]'``).
"""
from __future__ import annotations

import argparse
import json
import os


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``timeline`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser("timeline", help="draw one training step of a recorded timeline (PNG)",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory holding timeline-rank<R>.json, or the file itself")
    p.add_argument("--output", metavar="PNG", help="picture to write (default RUN_DIR/timeline-rank<R>-step<K>.png)")
    p.add_argument("--step", type=int, help="optimizer step to draw (default: the last one recorded whole)")
    p.add_argument("--rank", type=int, help="rank whose file to read (default: the lowest present)")
    p.add_argument("--json", action="store_true", help="print the step's figures as JSON")
    p.add_argument("--no-plot", action="store_true", help="print the figures only, draw nothing")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Draw the step and print its figures. Returns the exit code.

    Raises:
        ValueError: no timeline there, or not that step (printed as a usage error by the CLI).
    """
    from ..telemetry import timeline_trace

    try:
        path = timeline_trace.find(args.run_dir, args.rank)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    trace = timeline_trace.load(path)
    if args.no_plot:
        summary = timeline_trace.summarize_step(trace, args.step)
    else:
        from ..telemetry.timeline_plot import draw

        k, _, _ = trace.step_window(args.step)
        rank = trace.meta.get("rank", 0)
        base = os.path.dirname(os.path.abspath(path))
        out = args.output or os.path.join(base, f"timeline-rank{rank}-step{k}.png")
        summary = draw(trace, out, k)
    if args.json:
        print(json.dumps(dict(summary, trace=path), indent=1))
    else:
        print(timeline_trace.format_summary(summary))
        if summary.get("output"):
            print(f"wrote {summary['output']} (from {path}; open the JSON in https://ui.perfetto.dev for every span)")
    return 0
