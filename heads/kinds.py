"""The registry of drafter kinds: one ``KIND`` object per ``heads/<kind>/`` package.

Adding a kind is one folder under ``heads/`` plus its line in :data:`PACKAGES` (a function importing
its package) and its name in :data:`COMMAND_LINES` when ``selfdraft train`` trains it.

A trainable kind's package imports only its ``cli`` module (flags, no torch); ``KIND`` and the rest
load on first use, so the command line lists kinds and their flags without importing torch. Each
kind's package is imported explicitly, by a function called on first use, so the import graph
stays visible (no ``importlib``) and no kind is imported before it is asked for.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .kind import CheckpointFormat, DrafterKind


def _medusa() -> ModuleType:
    from . import medusa
    return medusa


def _eagle() -> ModuleType:
    from . import eagle
    return eagle


def _lookup() -> ModuleType:
    from . import lookup
    return lookup


def _draft() -> ModuleType:
    from . import draft
    return draft


PACKAGES: dict[str, Callable[[], ModuleType]] = {"medusa": _medusa, "eagle": _eagle, "lookup": _lookup,
                                                  "draft": _draft}
"""``{name: function importing heads.<name>}``: the kinds' packages, in the order formats are detected
and kinds listed."""
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


def hybrid() -> DrafterKind:
    """The kind whose drafting joins any other kind's trees (``DrafterKind.hybrid`` set: lookup), what
    ``SpeculativeModel.set_lookup`` adds; LookupError unless exactly one kind has it."""
    found = [kind for kind in registry().values() if kind.hybrid is not None]
    if len(found) != 1:
        raise LookupError(f"one registered kind must join other kinds' trees (DrafterKind.hybrid); found "
                          f"{[kind.name for kind in found]}")
    return found[0]


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


def _package(name: str) -> ModuleType:
    """The kind package ``heads.<name>`` (imported by its :data:`PACKAGES` function)."""
    return PACKAGES[name]()
