"""EAGLE (Li et al. 2024; EAGLE-2's dynamic tree, EAGLE-3's fused features): an autoregressive
drafter in the backbone's feature space. Registered as ``KIND`` (see :mod:`heads.kinds`).

Under lossless sampling the sequential drafter's candidates are drawn from its warped distribution
(``sample="auto"``, the default) or are its top-k tokens (``sample="never"``); see
:class:`EagleConfig`. Parallel drafting (``parallel`` > 1) drafts its top-k tokens."""

from __future__ import annotations

from ..lazy import entry_names
from . import cli  # the kind's `selfdraft train` flags, importable without torch

FORMAT_NAMES = ("speculators", "eagle3", "eagle")
"""The other projects' checkpoint layouts ``selfdraft export --format`` writes for this kind (the names
of ``KIND.formats``, checked by a test), listed without torch."""


def _entry():
    from . import entry

    return entry


__getattr__ = entry_names(__name__, _entry)  # ``KIND`` and the kind's public names (:mod:`.entry`), loaded on first use
