"""`selfdraft --help` and every subcommand's help (train: every kind's flags from the registry;
export: every kind's formats) import neither torch nor transformers (issue 36 item 18: 30 s on a loaded machine to print help)."""

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


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["train", "--help"], ["export", "--help"], ["bench", "--help"],
                                  ["check", "--help"], ["corpus", "--help"], ["select", "--help"], ["push", "--help"]])
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


def test_the_torch_free_registry_agrees_with_the_kinds():
    """``kinds.command_lines()`` (the ``--kind`` choices and flags, read without torch) are the
    trainable kinds' ``cli`` modules; EAGLE's flag choices are its config's."""
    from heads import kinds
    from heads.eagle import cli as eagle_cli
    from heads.eagle import config as eagle_config

    assert tuple(kinds.command_lines()) == kinds.trainable() == kinds.COMMAND_LINES
    assert kinds.format_names() == tuple(kinds.formats())  # the export --format choices
    assert all(kinds.command_lines()[name] is kinds.get(name).cli for name in kinds.trainable())
    for name in ("LAYOUTS", "DRAFTING_MODES", "PARALLEL_MODES", "HEAD_INPUTS"):
        assert getattr(eagle_cli, name) == getattr(eagle_config, name), name


def test_public_names_load_on_first_use():
    probe = ("import sys, heads; assert 'torch' not in sys.modules; "
             "from heads import EagleConfig, load_heads; import heads.eagle as eagle; "
             "assert eagle.KIND.config_class is EagleConfig and heads.SpeculativeModel and heads.lora")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        __import__("heads").nothing
