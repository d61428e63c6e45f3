"""Medusa heads (Cai et al. 2024): ``K`` extra next-next-token predictors on the backbone's
top-layer features, verified as a static tree. Registered as ``KIND`` (see :mod:`heads.kinds`).

Under lossless sampling the tree's tokens are drawn from the heads' warped distributions
(``sample="auto"``, the default) or are their top-k tokens (``sample="never"``); see
:class:`MedusaConfig`."""

from __future__ import annotations

from ..lazy import entry_names
from . import cli  # the kind's `selfdraft train` flags, importable without torch

FORMAT_NAMES = ("medusa-vllm", "medusa")
"""The other projects' checkpoint layouts ``selfdraft export --format`` writes for this kind (the names
of ``KIND.formats``, checked by a test), listed without torch."""


def _entry():
    from . import entry

    return entry


__getattr__ = entry_names(__name__, _entry)  # ``KIND`` and the kind's public names (:mod:`.entry`), loaded on first use
