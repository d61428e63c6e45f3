"""`selfdraft --help` and the help of the subcommands that need no drafter registry import neither
torch nor transformers (issue 36 item 18: 30 s on a loaded machine to print help)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from training.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import contextlib, io, sys
from training.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(sys.argv[1:])
    except SystemExit as done:
        assert done.code == 0, done.code
assert "usage: selfdraft" in out.getvalue(), out.getvalue()
print(sorted(name for name in ("torch", "transformers", "accelerate") if name in sys.modules))
"""


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["bench", "--help"], ["check", "--help"],
                                  ["corpus", "--help"], ["select", "--help"], ["push", "--help"]])
def test_help_imports_no_torch(argv):
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_the_listing_matches_each_subcommands_own_help():
    """``selfdraft --help`` lists ``COMMANDS``' one-liners; each module's ``add_parser`` says the same."""
    full = build_parser()._subparsers._group_actions[0]
    listed = build_parser(only="")._subparsers._group_actions[0]
    assert list(full.choices) == list(COMMANDS) == list(listed.choices)
    assert {action.dest: action.help for action in full._choices_actions} == COMMANDS
    assert {action.dest: action.help for action in listed._choices_actions} == COMMANDS
