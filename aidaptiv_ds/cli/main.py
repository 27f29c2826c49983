"""``aidaptiv-ds``: the console entry point; subcommands come from the modules in :data:`SUBCOMMAND_MODULES`.

Adding a subcommand: write ``aidaptiv_ds/cli/<name>.py`` with ``register(subparsers)`` that calls
``subparsers.add_parser(...)``, adds its arguments and ``set_defaults(func=run)`` where
``run(args) -> int`` is the exit code; then append the module name to :data:`SUBCOMMAND_MODULES`.
Every listed module is imported; a missing one fails loudly (it is a packaging bug, not an option).
A ``ValueError`` from ``run`` (:class:`~aidaptiv_ds.AidaptivConfigError` among them) is a user error:
printed as ``aidaptiv-ds <cmd>: error: <message>`` with exit code 2; any other
:class:`~aidaptiv_ds.AidaptivError` (a full drive, an incomplete checkpoint) is printed the same way
with exit code 1. Other exceptions are bugs and keep their traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from ..errors import AidaptivError

# One line per subcommand module; append yours (bench_io, unpack, export, compare, gc, ...).
SUBCOMMAND_MODULES = [
    "aidaptiv_ds.cli.plan",
    "aidaptiv_ds.cli.doctor",
    "aidaptiv_ds.cli.ledger",
    "aidaptiv_ds.cli.export",
    "aidaptiv_ds.cli.bench_io",
    "aidaptiv_ds.cli.site_hook",
    "aidaptiv_ds.cli.unpack",
    "aidaptiv_ds.cli.gc",
    "aidaptiv_ds.cli.compare",
    "aidaptiv_ds.cli.report",
    "aidaptiv_ds.cli.kv_cache",
    "aidaptiv_ds.cli.timeline",
]


def build_parser(modules: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser with every subcommand of ``modules`` (default :data:`SUBCOMMAND_MODULES`).

    Raises:
        ImportError: a listed module does not exist or fails to import.
        TypeError: a listed module has no ``register(subparsers)``.
    """
    parser = argparse.ArgumentParser(
        prog="aidaptiv-ds",
        description="aidaptiv_ds: DeepSpeed ZeRO-3 fine-tuning with the training state on cache SSDs.")
    parser.add_argument("--version", action="version", version=f"aidaptiv_ds {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES if modules is None else modules:
        mod = importlib.import_module(name)
        register = getattr(mod, "register", None)
        if not callable(register):
            raise TypeError(f"aidaptiv-ds: subcommand module {name} has no register(subparsers) function")
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except ValueError as e:  # bad input (AidaptivConfigError, CachePathError, ...): a usage error
        print(f"aidaptiv-ds {args.command}: error: {e}", file=sys.stderr)
        return 2
    except AidaptivError as e:  # a drive full, a checkpoint incomplete, ...: the message says what to do
        print(f"aidaptiv-ds {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
