"""The `expertflow` command: one sub-command per module in `expertflow.commands`.

Owns: the top-level parser and dispatch. Does not know: what any sub-command does.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

__all__ = ["main", "build_parser"]

_COMMANDS = ("demo", "trace", "simulate", "predictor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertflow",
        description="Run Mixture-of-Experts models with experts offloaded to host memory; trace, simulate, predict.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"expertflow.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"expertflow.commands.{name}":
                raise
            continue  # a command that this build does not ship
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:  # user errors: one clear line, no traceback
        print(f"expertflow {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
