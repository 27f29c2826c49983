"""``aidaptiv-ds bench-io``: engine read/write GB/s on a cache path next to raw ``O_DIRECT`` (dd or fio)
and, where it is built, DeepSpeed's compiled aio handle, all measured in the same run.

Example::

    aidaptiv-ds bench-io --path /mnt/cache0 --size 2GiB                 # 1 MiB and 8 MiB requests
    aidaptiv-ds bench-io --path /mnt/cache0 --size 8GiB --block 4MiB --block 16MiB --threads 8 --json

The JSON has ``engine_read_gbps``, ``engine_write_gbps``, ``raw_read_gbps``, ``raw_write_gbps`` (and
``read_ratio``/``write_ratio``) for the largest request size of at least 4 MiB, plus a per-size
``table`` and ``ratios``; see :mod:`aidaptiv_ds.bench.bench_io` for the method.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..bench.bench_io import bench_io, format_table
from ..io.errors import StorageError
from ..units import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench-io`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "bench-io", help="engine vs raw O_DIRECT read/write throughput of a cache path",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="directory on the drive to test (a cache path)")
    p.add_argument("--size", required=True, type=_size,
                   help="size of the test file, e.g. 2GiB (larger than the drive's cache gives steady-state numbers)")
    p.add_argument("--block", action="append", type=_size, metavar="SIZE",
                   help="request size; repeat for several (default: --block 1MiB --block 8MiB)")
    p.add_argument("--threads", type=int, default=4, help="engine worker threads for the drive (default 4)")
    p.add_argument("--queue-depth", type=int, default=None, help="requests in flight (default 2 x threads)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per request size; the median is reported (default 3)")
    p.add_argument("--raw-tool", choices=("auto", "dd", "fio"), default="auto",
                   help="raw O_DIRECT baseline: fio if installed, else dd (default auto)")
    ds = p.add_mutually_exclusive_group()
    ds.add_argument("--with-deepspeed-aio", action="store_true",
                    help="JIT-build DeepSpeed's async_io op if it is not prebuilt (minutes; needs libaio-dev)")
    ds.add_argument("--no-deepspeed-aio", action="store_true", help="do not measure DeepSpeed's aio handle")
    p.add_argument("--keep-file", action="store_true", help="leave the test file behind")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Run the benchmark for parsed ``args``; print the table (or JSON). Returns the exit code.

    Raises:
        ValueError: bad arguments (the CLI prints them as a usage error).
    """
    if args.threads < 1 or (args.queue_depth is not None and args.queue_depth < 1) or args.repeats < 1:
        raise ValueError("--threads, --queue-depth and --repeats must be >= 1")
    mode = "build" if args.with_deepspeed_aio else "off" if args.no_deepspeed_aio else "auto"
    progress = None if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        result = bench_io(args.path, args.size, blocks=args.block or [1 << 20, 8 << 20], threads=args.threads,
                          queue_depth=args.queue_depth, repeats=args.repeats, raw_tool=args.raw_tool,
                          deepspeed_aio=mode, keep_file=args.keep_file, progress=progress)
    except StorageError as e:  # unusable path, not enough space: the message says what to do
        print(str(e), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_table(result))
    return 0
