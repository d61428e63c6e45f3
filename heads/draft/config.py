"""Hyper-parameters of a draft-model drafter: its tree shape and how candidates are chosen."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from tree_attention.dynamic import DYNAMIC_FIELDS, check_dynamic_size, dynamic_shape_overrides

from .calibration import check_calibration

# Chains (every drafting level is one more forward of the draft model, so chains beat wide trees
# unless the draft is nearly free; see heads/eagle/config.py) of up to 8 nodes: with ``adaptive``
# the calibrated confidence chooses each step's length below that cap.
DEFAULT_DEPTH = 8
DEFAULT_TOP_K = 1
DEFAULT_TOTAL_TOKENS = 8
# Greedy adaptive chains also verify up to 3 of the draft's next-best tokens beside a chain node
# where their calibrated acceptance pays for a verified node (each costs a node, no draft forward;
# docs/draft.md).
DEFAULT_SIBLINGS = 3
SAMPLE_MODES = ("auto", "never", "always")
_TREE_FIELDS = DYNAMIC_FIELDS


def _positive_int(value: object, name: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"DraftConfig.{name} must be an int >= {low}; got {value!r}")


@dataclass
class DraftConfig:
    """How a separate draft model proposes trees (``attach_heads(model, kind="draft", ...)``)."""

    depth: int = DEFAULT_DEPTH
    """Deepest level of the draft tree (gamma for a chain): draft-model forwards per step beyond the first."""
    top_k: int = DEFAULT_TOP_K
    """Children per expanded node, and nodes expanded per level (1: a chain)."""
    total_tokens: int = DEFAULT_TOTAL_TOKENS
    """Drafted nodes verified per step, the best by the draft's path log-probability (root
    excluded). At least ``depth``; 0 drafts nothing (plain decoding, tau 1)."""
    sample: str = "auto"
    """Candidates under sampling: ``auto`` draws a chain's tokens from the draft's own warped
    distribution q (accepted with min(1, p/q) and the residual) when the serving rule samples and
    ``top_k`` is 1, else the top-k tokens (point masses); ``never`` always the top-k tokens;
    ``always`` like ``auto`` but a ValueError for ``top_k`` > 1. Greedy decoding always drafts
    the top-k tokens."""
    confidence: float = 0.0
    """Chains only: a chain stops growing below a node whose draft distribution's largest
    probability is under this (the node itself is still verified), saving draft forwards where the
    draft is unsure, like transformers' ``assistant_confidence_threshold``; 0 drafts ``depth``
    tokens every step. The choice depends on the draft's distribution, never on the drawn token,
    so sampled chains stay lossless."""
    adaptive: bool = True
    """Chains only: each step's length per row, up to ``depth``, from the draft's confidence at each
    position calibrated against what the target accepted, and the measured seconds of a draft
    forward and of a verified node (:mod:`heads.draft.calibration`); False drafts ``depth`` tokens
    every step (or fewer, with ``confidence``)."""
    siblings: int = DEFAULT_SIBLINGS
    """Adaptive chains under greedy decoding: at most this many of the draft's next-best tokens per
    level, verified as leaves beside the chain node there, each kept while its calibrated
    acceptance (by its own draft probability) times the chance that its parent is accepted pays
    for one more verified node; 0: plain chains. They count in ``total_tokens`` (shallower
    first); sampled chains never carry them."""
    calibration: dict | None = field(default=None, repr=False, compare=False)
    """The calibrated acceptance an adapter recorded (``ChainCalibration.to_dict``), the prior of
    the online calibration; None: the draft's confidence itself."""
    draft_model: object = field(default=None, repr=False, compare=False)
    """The draft ``PreTrainedModel`` (a live object: not part of :meth:`to_dict`)."""

    def __post_init__(self) -> None:
        _positive_int(self.depth, "depth")
        _positive_int(self.top_k, "top_k")
        _positive_int(self.total_tokens, "total_tokens", low=0)
        _positive_int(self.siblings, "siblings", low=0)
        check_dynamic_size(self.depth, self.top_k, self.total_tokens, "DraftConfig")
        if 0 < self.total_tokens < self.depth:
            raise ValueError(f"DraftConfig.total_tokens ({self.total_tokens}) must be >= depth ({self.depth}): a "
                             f"tree of {self.total_tokens} drafted nodes is at most {self.total_tokens} deep "
                             f"(total_tokens=0: no drafting)")
        if isinstance(self.confidence, bool) or not isinstance(self.confidence, (int, float)) or \
                not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"DraftConfig.confidence must be in [0, 1); got {self.confidence!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"DraftConfig.adaptive must be True or False; got {self.adaptive!r}")
        if self.calibration is not None:
            check_calibration(self.calibration)
        if self.sample not in SAMPLE_MODES:
            raise ValueError(f"DraftConfig.sample must be one of {SAMPLE_MODES}; got {self.sample!r}")
        if self.sample == "always" and self.top_k != 1:
            raise ValueError(f"DraftConfig.sample='always' draws chains (top_k=1); got top_k={self.top_k}. "
                             "Trees draft their top-k tokens (sample='auto')")

    @property
    def tree(self) -> dict:
        """The configured tree shape (what ``SpeculativeModel.set_tree(None)`` uses)."""
        return {name: getattr(self, name) for name in _TREE_FIELDS}

    def with_tree(self, tree: int | Mapping[str, int] | None) -> "DraftConfig":
        """This config with another tree shape: a node count (``total_tokens``; lowers ``depth``
        to fit, never widens) or a mapping of ``depth``/``top_k``/``total_tokens`` (None: unchanged)."""
        shape = dynamic_shape_overrides(tree, self.depth, "draft")
        if shape is None:
            return self
        return replace(self, **shape)

    def to_dict(self) -> dict:
        """The hyper-parameters (the draft model itself is not recorded)."""
        return {name: getattr(self, name) for name in (*_TREE_FIELDS, "sample", "confidence", "adaptive", "siblings")}
