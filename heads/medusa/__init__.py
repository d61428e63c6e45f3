"""Medusa heads (Cai et al. 2024): ``K`` extra next-next-token predictors on the backbone's
top-layer features, verified as a static tree. Registered as ``KIND`` (see :mod:`heads.kinds`).

Under lossless sampling the tree's tokens are drawn from the heads' warped distributions
(``sample="auto"``, the default) or are their top-k tokens (``sample="never"``); see
:class:`MedusaConfig`."""

from __future__ import annotations

from . import cli  # the kind's `selfdraft train` flags, importable without torch

FORMAT_NAMES = ("medusa-vllm", "medusa")
"""The other projects' checkpoint layouts ``selfdraft export --format`` writes for this kind (the names
of ``KIND.formats``, checked by a test), listed without torch."""


def __getattr__(name: str):
    """``KIND`` and the kind's public names (:mod:`.entry`), imported with torch on first use; other
    names (a submodule not imported yet, which the import system then imports) are AttributeErrors."""
    if name == "entry" or name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import entry

    try:
        return getattr(entry, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
