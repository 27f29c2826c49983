"""aidaptiv_ds vs DeepSpeed's native NVMe offload and its CPU offload on the same Llama (``aidaptiv-ds compare``).

Each backend trains in its own process; the table gives median step time after warm-up, bytes
written/read per parameter per step, I/O wait share, peak RSS and launch-to-first-step, with ratios
to DeepSpeed native NVMe. Example (both regimes, the README's command)::

    python launch/compare.py --params 150M --dtype fp32,bf16 --seq 256 --steps 6 --repeats 2 \\
        --cache /tmp/aidaptiv_compare --json compare.json \\
        --torch-extensions-dir /tmp/aid/torch_ext --libaio-root /tmp/aid/libaio/root

``python launch/compare.py --help`` lists every option.
"""
from __future__ import annotations

import argparse
import os
import sys

# this checkout's package ahead of any installed copy (an editable install of another checkout included):
# what a launch script runs and measures is the code beside it
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aidaptiv_ds.cli import compare as compare_cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch/compare.py", description=__doc__.split("\n\n")[0])
    compare_cli.configure(p)
    args = p.parse_args(argv)
    args.argv = ["python", "launch/compare.py"] + (sys.argv[1:] if argv is None else list(argv))
    try:
        return compare_cli.run(args)
    except ValueError as e:
        print(f"launch/compare.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
