"""docs/cli.md holds every command's ``--help`` as the program prints it (100 columns wide)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["", "train", "bench", "corpus", "check", "select", "export", "push"]


def documented(command: str) -> str:
    """The fenced block under ``## `selfdraft COMMAND``` in docs/cli.md."""
    text = (ROOT / "docs" / "cli.md").read_text()
    title = re.escape(f"## `selfdraft{' ' + command if command else ''}`")
    match = re.search(title + r"\n\n```\n(.*?)```", text, re.S)
    assert match, f"docs/cli.md has no section for selfdraft {command}"
    return match.group(1)


@pytest.mark.parametrize("command", COMMANDS, ids=[command or "selfdraft" for command in COMMANDS])
def test_docs_show_each_commands_help(command):
    environment = {**os.environ, "COLUMNS": "100"}
    printed = subprocess.run([sys.executable, "-m", "training.cli", *([command] if command else []), "--help"],
                             cwd=ROOT, env=environment, capture_output=True, text=True, check=True).stdout
    printed = printed.replace("training.cli", "selfdraft").replace("cli.py", "selfdraft")
    assert printed == documented(command), (
        f"docs/cli.md is out of date for `selfdraft {command} --help`; regenerate it (see the page's loop)")
