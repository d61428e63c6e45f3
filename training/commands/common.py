"""Helpers every ``selfdraft`` subcommand shares: loading a model with its tokenizer, writing a
JSON report, and the checks of arguments and paths that run before any expensive work.

A user mistake (a bad count, a missing file, an output path that cannot be written, a bad
adapter) raises :class:`UsageError`; :func:`training.cli.main` prints it as one line,
``selfdraft COMMAND: error: ...``, and exits 2, as argparse does for its own errors.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ..files import write_json as _write_json

logger = logging.getLogger("selfdraft")

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class UsageError(Exception):
    """A mistake in a command's arguments or inputs: printed as one line, exit code 2."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a command's long step; the message says what was kept (e.g. where training
    can resume from). :func:`training.cli.main` prints it as one line and exits 130."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def check_int(value, flag: str, minimum: int, meaning: str = "") -> None:
    """UsageError unless ``value`` (an int flag's value; None: not given) is ``>= minimum``."""
    if value is not None:
        require(value >= minimum, f"{flag} must be an integer >= {minimum}{meaning}; got {value}")


def check_number(value, flag: str, minimum: float = 0.0, inclusive: bool = True, maximum: float | None = None) -> None:
    """UsageError unless the float flag ``value`` (None: not given) lies in the range."""
    if value is None:
        return
    low = value >= minimum if inclusive else value > minimum
    high = maximum is None or value <= maximum
    bound = f"{'>=' if inclusive else '>'} {minimum:g}" + ("" if maximum is None else f" and <= {maximum:g}")
    require(low and high and value == value, f"{flag} must be a number {bound}; got {value}")


def check_input_file(path: str | None, flag: str) -> None:
    """UsageError unless ``path`` (None: not given) is an existing file."""
    if path is None:
        return
    require(Path(path).exists(), f"{flag} {path}: no such file")
    require(Path(path).is_file(), f"{flag} {path}: not a file")


def check_input_directory(path: str | None, flag: str) -> None:
    if path is None:
        return
    require(Path(path).exists(), f"{flag} {path}: no such directory")
    require(Path(path).is_dir(), f"{flag} {path}: not a directory")


def _writable_parent(path: Path, flag: str) -> None:
    """UsageError unless ``path``'s parent exists as a writable directory or can be created."""
    ancestor = path.parent
    while not ancestor.exists():
        if ancestor.is_symlink():  # a dangling link in the chain
            raise UsageError(f"{flag} {path}: {ancestor} is a dangling symbolic link")
        ancestor = ancestor.parent
    require(ancestor.is_dir(), f"{flag} {path}: {ancestor} is a file, not a directory")
    require(os.access(ancestor, os.W_OK | os.X_OK), f"{flag} {path}: {ancestor} is not writable")


def check_output_file(path: str | None, flag: str) -> None:
    """UsageError unless ``path`` (None: not given) can be written as a file."""
    if path is None:
        return
    path = Path(path)
    require(not path.is_dir(), f"{flag} {path}: is a directory, expected a file path")
    _writable_parent(path, flag)


def check_output_directory(path: str | None, flag: str, replaceable: tuple[str, ...] = ()) -> None:
    """UsageError unless ``path`` can be written as a directory: new, empty, or holding only the
    ``replaceable`` names (an earlier output of the same kind), never under a file."""
    if path is None:
        return
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise UsageError(f"{flag} {path}: a dangling symbolic link (to {os.readlink(path)})")
    if path.exists():
        require(path.is_dir(), f"{flag} {path}: exists and is not a directory")
        foreign = sorted(entry.name for entry in path.iterdir() if entry.name not in replaceable)
        require(not foreign, f"{flag} {path}: already holds other files ({', '.join(foreign[:5])}); give a new "
                             "or empty directory")
        require(os.access(path.resolve().parent, os.W_OK | os.X_OK), f"{flag} {path}: its parent is not writable")
        return
    _writable_parent(path, flag)


def check_model(directory: str, flag: str = "--model") -> None:
    """UsageError unless ``directory`` is a model directory (with ``config.json``) or could be a
    hub id (``NAME`` or ``OWNER/NAME``)."""
    path = Path(directory)
    if path.exists():
        require(path.is_dir(), f"{flag} {directory}: not a directory")
        require((path / "config.json").is_file(), f"{flag} {directory}: no config.json (not a Hugging Face model "
                                                  "directory)")
        return
    require(bool(_HUB_ID.match(directory)) and not directory.startswith((".", "~")),
            f"{flag} {directory}: no such directory (and not a hub id OWNER/NAME)")


def load_model(directory: str, dtype: str = "float32", revision: str | None = None):
    """``(model, tokenizer)`` from a local directory or hub id, the model in eval mode; a
    directory or hub id that cannot be loaded is a :class:`UsageError` naming it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model(directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), revision=revision)
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"--model {directory}: cannot load it: {first}") from error
    model.eval()
    return model, tokenizer


def add_paragraphs_argument(parser) -> None:
    """``--paragraphs``: how a command reads plain-text prompt files (``args.paragraphs``)."""
    parser.add_argument("--paragraphs", action="store_true",
                        help="plain-text prompt files hold one prompt per blank-line-separated paragraph (prompts "
                             "that span lines, such as code) instead of one prompt per line")


def read_prompts(path: str, tokenizer=None, flag: str = "--data", paragraphs: bool = False) -> list[str]:
    """:func:`training.prompts.load_prompts`, its errors as one-line :class:`UsageError`; a plain-text
    file is one prompt per line, or per blank-line-separated paragraph with ``paragraphs``."""
    from ..prompts import DataFormatError, load_prompts

    check_input_file(path, flag)
    try:
        return load_prompts(path, tokenizer, paragraphs=paragraphs)
    except DataFormatError as error:
        raise UsageError(f"{flag}: {error}") from error


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (a command's ``--json``); nothing when ``path`` is None."""
    if path:
        _write_json(path, payload)
