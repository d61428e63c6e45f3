"""EAGLE (Li et al. 2024; EAGLE-2's dynamic tree, EAGLE-3's fused features): an autoregressive
drafter in the backbone's feature space. Registered as ``KIND`` (see :mod:`heads.kinds`).

Under lossless sampling the sequential drafter's candidates are drawn from its warped distribution
(``sample="auto"``, the default) or are its top-k tokens (``sample="never"``); see
:class:`EagleConfig`. Parallel drafting (``parallel`` > 1) drafts its top-k tokens."""

from __future__ import annotations

from . import cli  # the kind's `selfdraft train` flags, importable without torch

FORMAT_NAMES = ("speculators", "eagle3", "eagle")
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
