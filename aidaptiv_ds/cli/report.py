"""``aidaptiv-ds report RUN_DIR``: plots of a run and a one-page Markdown report, from its metrics.jsonl.

Writes ``loss.png``, ``io.png``, ``io_wait.png``, ``memory.png`` and ``report.md`` into RUN_DIR
(or ``--output DIR``); :mod:`aidaptiv_ds.telemetry.report` describes each plot. Needs matplotlib
(``pip install 'aidaptiv_ds[report]'``; the ``test`` and ``demo`` extras include it).
"""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("report", help="PNG plots and a one-page report from a run's metrics.jsonl",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --output_dir of a launch/finetune.py run (or a metrics.jsonl)")
    p.add_argument("--output", metavar="DIR", help="where to write the PNGs and report.md (default: RUN_DIR)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..telemetry.report import write_report

    try:
        out = write_report(args.run_dir, args.output)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    print(f"wrote {out['report']} and {len(out['plots'])} plots: " + ", ".join(out["plots"]))
    return 0
