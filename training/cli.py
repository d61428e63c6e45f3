"""The ``selfdraft`` command line: the subcommands of :mod:`training.commands` (``train``,
``bench``, ``corpus``, ``check``, ``select``, ``export``, ``push``) under one parser.

Multi-process training runs the same command under accelerate, e.g.
``accelerate launch --num_processes 2 -m training.cli train ...`` (add ``--cpu`` on a CPU machine).
"""

from __future__ import annotations

import argparse
import logging
import sys

COMMANDS = {
    "train": "distil draft heads against a frozen model",
    "bench": "speculative vs plain generation on your prompts",
    "corpus": "write the target's own continuations of your prompts, a corpus for lookup drafting",
    "check": "re-measure an adapter on a (possibly updated) target",
    "select": "rank candidate drafters on your prompts at your serving settings",
    "export": "write an adapter in another layout, or a folder ready for the Hugging Face hub",
    "push": "upload a folder written by `selfdraft export --hub-dir` to the Hugging Face hub",
}
"""The subcommands in order, with the one-line help ``selfdraft --help`` lists (each module's
``add_parser`` gives the same)."""


def command_module(name: str):
    """The module of subcommand ``name`` (``add_parser(commands)`` registers it), imported on use:
    some import torch through the drafter registry, which ``selfdraft --help`` does not need."""
    if name == "train":
        from .commands import train as module
    elif name == "bench":
        from .commands import bench as module
    elif name == "corpus":
        from .commands import corpus as module
    elif name == "check":
        from .commands import check as module
    elif name == "select":
        from .commands import select as module
    elif name == "export":
        from .commands import export as module
    elif name == "push":
        from .commands import push as module
    else:
        raise ValueError(f"no subcommand {name!r}; the subcommands are {list(COMMANDS)}")
    return module


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``selfdraft`` parser. ``only``: build that subcommand's arguments alone and list the
    others by name and help (``""``: none of them), so that a command line imports only what its
    own subcommand needs; None builds every subcommand."""
    parser = argparse.ArgumentParser(
        prog="selfdraft",
        description="Make a frozen Hugging Face causal LM draft for itself: train draft heads by self-distillation, "
                    "benchmark them against plain generation.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in COMMANDS.items():
        if only is None or name == only:
            command_module(name).add_parser(commands)
        else:
            commands.add_parser(name, help=summary, add_help=False)
    return parser


def _chosen_command(argv: list[str]) -> str:
    """The subcommand an argument list names (its first word that is one), ``""`` when none."""
    return next((word for word in argv if word in COMMANDS), "")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit code. A user mistake (:class:`~training.commands.common.UsageError`,
    a bad adapter, checkpoint or data file) is printed as one line and gives exit code 2, as does no
    subcommand (after the usage); Ctrl-C prints one line (what was kept, e.g. where training can
    resume from) and gives 130, the shell's code for SIGINT."""
    from .commands.common import UsageError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=_chosen_command(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print(f"selfdraft: error: a command is required ({', '.join(COMMANDS)}); selfdraft --help describes them",
              file=sys.stderr)
        return 2
    from heads.adapter import AdapterError  # the command runs: the library comes in

    from .checkpoint import CheckpointError
    from .prompts import DataFormatError

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
