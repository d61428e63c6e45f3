"""The registry of drafter kinds: one ``KIND`` object per ``heads/<kind>/`` package.

Adding a kind is one folder under ``heads/`` plus its package name in :data:`PACKAGES` (and in
:data:`COMMAND_LINES` when ``selfdraft train`` trains it).

A trainable kind's package imports only its ``cli`` module (flags, no torch); ``KIND`` and the rest
load on first use, so the command line lists kinds and their flags without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kind import CheckpointFormat, DrafterKind

PACKAGES = ("medusa", "eagle", "lookup", "draft")
"""The kinds' packages under ``heads/``, in the order formats are detected and kinds listed."""
COMMAND_LINES = ("medusa", "eagle", "draft")
"""The trainable kinds (``KIND.trainable``, checked by a test), whose ``heads/<kind>/cli.py`` declares
their ``selfdraft train`` flags."""

_REGISTRY: dict[str, DrafterKind] = {}


def registry() -> dict[str, DrafterKind]:
    """``{name: DrafterKind}`` of every registered kind (imported on first use)."""
    if not _REGISTRY:
        for package in PACKAGES:
            kind = _package(package).KIND
            _REGISTRY[kind.name] = kind
    return _REGISTRY


def names() -> tuple[str, ...]:
    return tuple(registry())


def get(name: object, what: str = "kind") -> DrafterKind:
    """The kind called ``name``; ValueError listing the known kinds otherwise."""
    kinds = registry()
    if not isinstance(name, str) or name not in kinds:
        raise ValueError(f"{what} must be one of {tuple(kinds)}; got {name!r}")
    return kinds[name]


def trainable() -> tuple[str, ...]:
    return tuple(name for name, kind in registry().items() if kind.trainable)


def formats() -> dict[str, tuple[DrafterKind, CheckpointFormat]]:
    """``{format name: (kind, format)}`` over every kind's checkpoint formats."""
    return {fmt.name: (kind, fmt) for kind in registry().values() for fmt in kind.formats}


def command_lines() -> dict[str, object]:
    """``{name: cli module}`` of the :data:`COMMAND_LINES` kinds, in :data:`PACKAGES` order: the
    ``selfdraft train`` flags each declares (``add_arguments(parser)``, ``options(args)``, ...),
    imported without torch; the same modules as ``get(name).cli``."""
    return {name: _package(name).cli for name in PACKAGES if name in COMMAND_LINES}


def format_names() -> tuple[str, ...]:
    """Every checkpoint layout ``selfdraft export --format`` writes (the names of :func:`formats`, in its
    order), read without torch from the :data:`COMMAND_LINES` kinds' packages (``FORMAT_NAMES``): only
    trained adapters are exported."""
    return tuple(fmt for name in PACKAGES if name in COMMAND_LINES for fmt in _package(name).FORMAT_NAMES)


def _package(name: str):
    """The kind package ``heads.<name>``."""
    return importlib.import_module(f"heads.{name}")
