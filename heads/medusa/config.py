"""Hyper-parameters of Medusa heads."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from tree_attention.tree import check_tree_size

from ..kind import SAMPLE_MODES


@dataclass
class MedusaConfig:
    """Hyper-parameters of a set of Medusa heads."""

    num_heads: int = 4
    """Number of heads K; head k predicts the token k + 2 positions ahead."""
    num_layers: int = 1
    """Residual blocks per head."""
    share_lm_head: bool = False
    """Use the backbone's frozen output head instead of one trainable projection per head."""
    draft_vocab_size: int | None = None
    """Heads score only this many tokens, the most frequent of the training data (``token_map`` in the
    adapter; :mod:`heads.draft_vocab`); None: the whole vocabulary. Not with ``share_lm_head``."""
    tree: Sequence[Sequence[int]] | int | None = None
    """Verification tree: a choice list of rank paths, or a node count for a default tree (None: 16)."""
    sample: str = "auto"
    """Candidates under lossless sampling (``do_sample=True``): ``auto`` (and ``always``, the same
    here: every tree can be sampled) draws each node's children without replacement from the
    head's distribution warped like the target's (temperature, top-k, top-p), accepted with
    min(1, p/q) and the residual; ``never`` keeps each head's top-k tokens (point masses, accepted
    with p(x)). The tree's shape is the same either way. Greedy decoding and typical acceptance
    always draft the top-k tokens."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MedusaConfig.{name} must be a positive int; got {value!r}")
        if self.draft_vocab_size is not None:
            if not isinstance(self.draft_vocab_size, int) or isinstance(self.draft_vocab_size, bool) \
                    or self.draft_vocab_size < 1:
                raise ValueError(f"MedusaConfig.draft_vocab_size must be a positive int or None; got "
                                 f"{self.draft_vocab_size!r}")
            if self.share_lm_head:
                raise ValueError("MedusaConfig.draft_vocab_size needs the heads' own projections; it cannot be "
                                 "combined with share_lm_head=True")
        if self.sample not in SAMPLE_MODES:
            raise ValueError(f"MedusaConfig.sample must be one of {SAMPLE_MODES}; got {self.sample!r}")
        if isinstance(self.tree, int):
            check_tree_size(int(self.tree), "MedusaConfig.tree")
        elif self.tree is not None:
            self.tree = [list(path) for path in self.tree]
            check_tree_size(len(self.tree), "MedusaConfig.tree (a choice list of paths)")

    def to_dict(self) -> dict:
        return asdict(self)
