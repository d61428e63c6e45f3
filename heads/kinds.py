"""The registry of drafter kinds: one ``KIND`` object per ``heads/<kind>/`` package.

Adding a kind is one folder under ``heads/`` plus its package name in :data:`PACKAGES`.
"""

from __future__ import annotations

import importlib

from .kind import CheckpointFormat, DrafterKind

PACKAGES = ("medusa", "eagle", "lookup", "draft")
"""The kinds' packages under ``heads/``, in the order formats are detected and kinds listed."""

_REGISTRY: dict[str, DrafterKind] = {}


def registry() -> dict[str, DrafterKind]:
    """``{name: DrafterKind}`` of every registered kind (imported on first use)."""
    if not _REGISTRY:
        for package in PACKAGES:
            kind = importlib.import_module(f"heads.{package}").KIND
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
