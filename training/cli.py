"""The ``selfdraft`` command line: the subcommands of :mod:`training.commands` (``train``,
``bench``, ``corpus``, ``check``, ``select``, ``export``, ``push``) under one parser.

Multi-process training runs the same command under accelerate, e.g.
``accelerate launch --num_processes 2 -m training.cli train ...`` (add ``--cpu`` on a CPU machine).
"""

from __future__ import annotations

import argparse
import logging
import sys

from .commands import bench, check, corpus, export, push, select, train

SUBCOMMANDS = (train, bench, corpus, check, select, export, push)
"""Each module's ``add_parser(commands)`` registers its subcommand, in this order."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfdraft",
        description="Make a frozen Hugging Face causal LM draft for itself: train draft heads by self-distillation, "
                    "benchmark them against plain generation.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit code. A user mistake (:class:`~training.commands.common.UsageError`,
    a bad adapter, checkpoint or data file) is printed as one line and gives exit code 2, as does no
    subcommand (after the usage); Ctrl-C prints one line (what was kept, e.g. where training can
    resume from) and gives 130, the shell's code for SIGINT."""
    from heads.adapter import AdapterError

    from .checkpoint import CheckpointError
    from .commands.common import UsageError
    from .prompts import DataFormatError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        names = ", ".join(command.__name__.rsplit(".", 1)[-1] for command in SUBCOMMANDS)
        print(f"selfdraft: error: a command is required ({names}); selfdraft --help "
              "describes them", file=sys.stderr)
        return 2
    try:
        return args.handler(args)
    except (UsageError, AdapterError, CheckpointError, DataFormatError) as error:
        print(f"selfdraft {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        print(f"\nselfdraft {args.command}: interrupted" + (f": {interrupt}" if str(interrupt) else ""),
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
