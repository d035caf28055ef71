"""The `expertflow` command: one sub-command per module in `expertflow.commands`.

Owns: the top-level parser and dispatch. Does not know: what any sub-command does.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from expertflow import __version__

__all__ = ["main", "build_parser"]

_COMMANDS = ("demo", "trace", "simulate", "predictor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertflow",
        description="Run Mixture-of-Experts models with experts offloaded to host memory; trace, simulate, predict.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    parser.add_argument("--version", action="version", version=f"expertflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"expertflow.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"expertflow.commands.{name}":
                raise
            continue  # a command that this build does not ship
        module.register(sub)
    _add_verbose_everywhere(parser)
    return parser


def _add_verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """`-v` also after a sub-command (`expertflow simulate … -v`); name each command group's choices in its usage."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            if action.metavar is None:
                action.metavar = "{" + ",".join(action.choices) + "}"
            for child in action.choices.values():
                child.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                   help="log progress details to stderr")
                _add_verbose_everywhere(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that stopped early (`| head`) shows here, not as a warning at exit
        return code
    except BrokenPipeError:  # the reader of our output is gone: nothing left to say, and no one to say it to
        _silence_stdout()
        return 141  # as a shell reports a process ended by SIGPIPE
    except (ValueError, OSError) as err:  # user errors (bad values, missing or unreadable files): one clear line
        print(f"expertflow {_command_name(args)}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # traces and predictors are written under a temporary name: none is left half-written
        print(f"\nexpertflow {_command_name(args)}: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush at exit finds no closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout replaced by an object without a descriptor (tests): nothing to redirect
        pass
    finally:
        os.close(devnull)


def _command_name(args: argparse.Namespace) -> str:
    return " ".join([args.command] + [v for k, v in vars(args).items() if k.endswith("_command") and v])


if __name__ == "__main__":
    sys.exit(main())
