"""Tree-attention verification: token trees, 4D masks, acceptance rules, cache surgery and the
decode loop. Pure tensor logic on top of ``transformers`` ``Cache``; it knows nothing about how
drafts are made."""

from .decode import DecodeStats, Drafter, PerRowDrafter, RowDrafter, Target, speculative_generate
from .draft_batch import DraftBatch
from .tree import InvalidTreeError, Tree, TreeBatch, TreeTemplate, chain, default_tree, from_choices

__all__ = [
    "DecodeStats", "DraftBatch", "TreeBatch", "Drafter", "PerRowDrafter", "RowDrafter", "Target", "speculative_generate", "InvalidTreeError", "Tree", "TreeTemplate",
    "chain", "default_tree", "from_choices",
]
