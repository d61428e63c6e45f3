"""The manual's shell commands run as written: every command starting with ``selfdraft`` in a
```bash block of README.md and docs/*.md (backslash-continued lines joined, a trailing ``# comment``
dropped)

- parses with the real command line (``training.cli.build_parser``, abbreviated flags refused), each
  upper-case placeholder (KIND, LOSS, OUT, OWNER) replaced by every example value of ``PLACEHOLDERS``
  and each optional ``[--flag value]`` both given and left out, so that a flag renamed or a choice
  removed in the code fails here;
- is run, in its block's order, when the block is cheap to run: every path its commands read exists in
  the repository or is written by an earlier command of the same block, none names a hub model or a
  placeholder, none uploads (``push``) or writes into the repository. It runs as a separate process
  in a temporary directory that links the repository's ``benchmarks`` folder, with the distillation
  cache in a temporary directory too, and must exit 0 (``EXIT_CODES``: documented other codes) and
  write the outputs it names. Blocks that take minutes on one core are marked ``slow`` with their
  measured time (``SLOW``); ``pytest --run-slow`` runs them.

Commands quoted in the text (`` `selfdraft bench --tree 8` ``) name only real flags, and real choices
of flags that have choices. The README's synopsis (the plain ``` block under "Command line") names flags and choice lists with
placeholders that do not form one command line: each flag it names must exist, exactly, in its
subcommand, and each ``{a,b,...}`` after a flag must be that flag's choices. docs/cli.md, the
``--help`` output, is compared with the program in tests/training/test_docs_cli.py."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from training.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PLACEHOLDERS = {
    "KIND": ["medusa", "eagle"],  # the kinds of docs/training.md's loss table
    "LOSS": ["fkl", "tvd", "lk_hybrid", "nla"],  # the losses of that table
    "OUT": ["stories-medusa-fkl"],
    "OWNER": ["my-org"],  # a hub account: OWNER/NAME
}
"""Example values of the upper-case words documented commands use as placeholders; a command is
parsed with every combination."""

READS = ("model", "data", "adapter", "draft", "lookup_corpus", "eval_data")
"""Parsed arguments (any subcommand) that name files or folders the command reads (push's
``hub_dir`` too: see ``reads``)."""

WRITES = ("out", "json", "hub_dir", "checkpoint_dir", "cache_dir")
"""Parsed arguments that name what the command writes."""

NEVER_RUN = {"push": "uploads to the Hugging Face hub: needs a token and a network"}

EXIT_CODES: dict[str, int] = {}
"""A command (as written, continuation lines joined) with a documented exit code other than 0."""

SLOW = {
    "--out my-adapter": "README quick start: train 300 steps (generating the distillation data first) and bench, "
                        "242-316 s",
    "--out stories-eagle ": "train --kind eagle, 300 steps: 122-139 s",
    "--out stories-medusa ": "train --kind medusa, 300 steps: 154 s",
    "--out stories-medusa2": "train --kind medusa --joint (LoRA), 300 steps: 223-279 s",
    "--out stories-eagle-T0.7": "train --kind eagle --for hf --on-policy, its T=0.7 data generated, 300 steps: "
                                "321-401 s",
    "--out stories-corpus.jsonl": "corpus, 150 prompts x 96 tokens: 59-63 s",
}
"""Runnable blocks that take about a minute or more, by a fragment of their text, with their time
pinned to one core of the CI machine (2-core AMD EPYC, torch 2.13.0+cpu; two runs, 2026-12-05), the
distillation data of stories_train.jsonl already generated unless said. All of them: about 21
minutes (``pytest tests/docs --run-slow``). Not slow: docs/adapters.md's ``check`` (18-23 s)."""


def bash_blocks(page: Path) -> list[str]:
    """The ```bash fenced blocks of a page, line by line (a fence closes on a line of its own, so an
    ``echo '```'`` inside a block does not end it)."""
    blocks, current = [], None
    for line in page.read_text().splitlines():
        if current is None and re.fullmatch(r"```bash\s*", line):
            current = []
        elif current is not None and re.fullmatch(r"\s{0,3}```\s*", line):
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def commands_of(block: str) -> list[str]:
    """The ``selfdraft`` commands of a block: continuation lines joined, trailing comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = (re.sub(r"(^|\s)#.*$", "", line).strip() for line in joined.splitlines())
    return [re.sub(r"\s+", " ", line) for line in lines if line.split()[:1] == ["selfdraft"]]


def documented_blocks() -> list[tuple[str, list[str]]]:
    """(name, commands) of every bash block with a ``selfdraft`` command, name ``page[index]``
    counting the page's bash blocks from 0."""
    found = []
    for page in PAGES:
        for index, block in enumerate(bash_blocks(page)):
            commands = commands_of(block)
            if commands:
                found.append((f"{page.relative_to(ROOT)}[{index}]", commands))
    return found


BLOCKS = documented_blocks()
COMMANDS = [(f"{name}:{position}", command) for name, commands in BLOCKS for position, command in enumerate(commands)]


def placeholders(command: str) -> list[str]:
    return sorted(set(re.findall(r"\b[A-Z][A-Z_]*[A-Z]\b", command)))


def variants(command: str) -> list[list[str]]:
    """The argument lists a documented command stands for (without the leading ``selfdraft``): every
    placeholder replaced by each of its example values, the optional ``[--flag ...]`` parts all
    given and all left out."""
    optional = r"\[(-[^\]]*)\]"
    forms = {re.sub(optional, r"\1", command), re.sub(optional, "", command)}
    names = placeholders(command)
    unknown = [name for name in names if name not in PLACEHOLDERS]
    assert not unknown, f"{command}: add example values for {unknown} to PLACEHOLDERS"
    result = []
    for form in sorted(forms):
        for values in itertools.product(*(PLACEHOLDERS[name] for name in names)):
            text = form
            for name, value in zip(names, values):
                text = re.sub(rf"\b{name}\b", value, text)
            result.append(shlex.split(text)[1:])
    return result


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return action.choices


def parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by the real ``selfdraft`` parser, a flag only as spelled in the code (argparse
    would otherwise take a renamed flag's old name as an abbreviation of the new one)."""
    parser = build_parser()
    for subparser in subcommand_parsers(parser).values():
        subparser.allow_abbrev = False
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`selfdraft {shlex.join(argv)}` does not parse: {errors.getvalue().strip()}")


def paths(args: argparse.Namespace, names) -> list[str]:
    found = []
    for name in names:
        value = getattr(args, name, None)
        found += [value] if isinstance(value, str) else list(value or [])
    return found


def reads(args: argparse.Namespace) -> list[str]:
    return paths(args, READS + (("hub_dir",) if args.command == "push" else ()))


def writes(args: argparse.Namespace) -> list[str]:
    return paths(args, tuple(name for name in WRITES if not (name == "hub_dir" and args.command == "push")))


def why_not_run(commands: list[str]) -> str | None:
    """Why a block is not run (None: it is): the first command that needs what the test lacks."""
    written: set[str] = set()
    for command in commands:
        if placeholders(command) or "[-" in command:
            return f"`{command}` is a template (placeholders {placeholders(command)})"
        try:
            args = parse(shlex.split(command)[1:])
        except pytest.fail.Exception:
            return f"`{command}` does not parse (test_command_parses says why)"
        if args.command in NEVER_RUN:
            return f"`selfdraft {args.command}` {NEVER_RUN[args.command]}"
        missing = [path for path in reads(args) if path not in written and not (ROOT / path).exists()]
        if missing:
            return f"`{command}` reads {missing}: not in the repository (a hub model or the reader's own files)"
        inside = [path for path in writes(args) if Path(path).parts[:1] == ("benchmarks",) or Path(path).is_absolute()]
        if inside:
            return f"`{command}` writes {inside}, outside the temporary directory"
        written.update(path.rstrip("/") for path in writes(args))
    return None


def runnable_blocks() -> list:
    """The blocks that run, identical blocks once (named by every page that holds them); those in
    ``SLOW`` marked slow."""
    names: dict[tuple[str, ...], list[str]] = {}
    for name, commands in BLOCKS:
        if why_not_run(commands) is None:
            names.setdefault(tuple(commands), []).append(name)
    params = []
    for commands, where in names.items():
        text = " ".join(commands) + " "
        slow = [reason for fragment, reason in SLOW.items() if fragment in text]
        marks = [pytest.mark.slow(reason="; ".join(slow))] if slow else []
        params.append(pytest.param(list(commands), id="+".join(where), marks=marks))
    return params


RUNNABLE = runnable_blocks()


def test_the_manual_has_commands():
    pages = {name.split("[")[0] for name, _ in BLOCKS}
    assert {"README.md", "docs/adapters.md", "docs/deployment.md", "docs/lookup.md", "docs/training.md"} <= pages, pages
    assert len(COMMANDS) >= 15, COMMANDS
    assert len(RUNNABLE) >= 6, [param.id for param in RUNNABLE]


def test_every_slow_fragment_names_a_runnable_block():
    texts = [" ".join(param.values[0]) + " " for param in RUNNABLE]
    assert [fragment for fragment in SLOW if not any(fragment in text for text in texts)] == []


@pytest.mark.parametrize("name, command", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_command_parses(name, command):
    for argv in variants(command):
        args = parse(argv)
        assert args.command == argv[0]


@pytest.fixture(scope="session")
def distillation_cache(tmp_path_factory) -> Path:
    """One distillation cache for every run (``SELFDRAFT_CACHE``): not the user's, shared by the
    trainings on the same data."""
    return tmp_path_factory.mktemp("selfdraft-cache")


@pytest.mark.parametrize("commands", RUNNABLE)
def test_block_runs_as_written(commands, tmp_path, distillation_cache):
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                   "SELFDRAFT_CACHE": str(distillation_cache)}
    for command in commands:
        argv = shlex.split(command)[1:]
        done = subprocess.run([sys.executable, "-m", "training.cli", *argv], cwd=tmp_path, env=environment,
                              capture_output=True, text=True)
        assert done.returncode == EXIT_CODES.get(command, 0), (
            f"`{command}` exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        missing = [path for path in writes(parse(argv)) if not (tmp_path / path).exists()]
        assert not missing, f"`{command}` did not write {missing}"


def readme_synopsis() -> list[str]:
    """Commands quoted in the text (`` `selfdraft bench --tree 8` ``) name only real flags, and real choices
of flags that have choices. The README's synopsis lines, one per subcommand (its indented continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## Command line\n\n```\n(.*?)\n```", text, re.S)
    assert match, "README.md has no synopsis block under '## Command line'"
    lines: list[str] = []
    for line in match.group(1).splitlines():
        if line.startswith("selfdraft "):
            lines.append(line)
        else:
            lines[-1] += " " + line.strip()
    return lines


SYNOPSIS = readme_synopsis()


@pytest.mark.parametrize("line", SYNOPSIS, ids=[line.split()[1] for line in SYNOPSIS])
def test_readme_synopsis_names_real_flags_and_choices(line):
    command = line.split()[1]
    options = subcommand_parsers(build_parser())[command]._option_string_actions
    line = re.sub(r"\s+#.*$", "", line)
    unknown = [flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line) if flag not in options]
    assert not unknown, f"README synopsis of `selfdraft {command}` names flags it lacks: {unknown}"
    for flag, listed in re.findall(r"(--[a-z][a-z0-9-]*) \{([^}]*)\}", line):
        assert set(listed.split(",")) == set(options[flag].choices), (
            f"README synopsis: `selfdraft {command} {flag}` lists {{{listed}}}, the code offers {options[flag].choices}")


def test_readme_synopsis_shows_every_subcommand():
    assert [line.split()[1] for line in SYNOPSIS] == list(subcommand_parsers(build_parser()))


def inline_commands() -> list[tuple[str, str, str]]:
    """(page, subcommand, the rest) of each ``selfdraft COMMAND ...`` code span outside fenced blocks."""
    found = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for command, rest in re.findall(r"`selfdraft\s+([a-z]+)([^`]*)`", text):
            found.append((str(page.relative_to(ROOT)), command, " ".join(rest.split())))
    return found


INLINE = [entry for entry in inline_commands() if re.search(r"--[a-z]", entry[2])]


@pytest.mark.parametrize("page, command, rest", INLINE, ids=[f"{page}:{command} {rest}" for page, command, rest in INLINE])
def test_quoted_commands_name_real_flags_and_choices(page, command, rest):
    parsers = subcommand_parsers(build_parser())
    assert command in parsers, f"{page}: `selfdraft {command}` is no subcommand"
    options = parsers[command]._option_string_actions
    words = rest.split()
    for position, word in enumerate(words):
        if not word.startswith("--"):
            continue
        assert word in options, f"{page}: `selfdraft {command}` has no flag {word}"
        choices = options[word].choices
        value = words[position + 1] if position + 1 < len(words) else ""
        if choices and value and not value.startswith("-") and not placeholders(value):
            assert set(value.split("|")) <= set(choices), f"{page}: `selfdraft {command} {word} {value}`: not among {choices}"
