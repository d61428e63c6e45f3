"""The block drafter (``EagleConfig.parallel_mode="block"``): one drafter forward for every depth, a
sequential head for each node's children (DSpark style).

**Why.** Sequential EAGLE pays one drafter forward (a decoder layer attending over the drafter's
cache) per tree level; parallel drafting with mask queries pays one per step, but a mask query for
depth ``j + 1`` does not know which token was drafted at depth ``j``, so later depths accept little
wherever the continuation has more than one likely token. The block drafter keeps the one forward:
the forward that commits a row's new pairs also runs ``K - 1`` mask queries (:func:`mask_query_forward`),
giving a feature ``h_j`` per depth ``j = 1..K``. Depth 1's logits come from ``h_1`` (which has seen
the root token); a node at depth ``j`` with token ``x`` gets its children from ``refine(h_{j+1}, e(x))``
(:class:`~heads.eagle.modules.SequentialHead`, a two-layer MLP over the feature and the token's
embedding) through the frozen output head: its children depend on its own token, at the cost of a
small MLP and an output-head product per level, not a drafter forward.

**Trees.** Everything else is the sequential drafter's (:class:`EagleDrafter`): chains (``top_k``
1) whose length follows the calibrated acceptance (``min_acceptance``) with siblings at unsure
levels, EAGLE-2 dynamic trees (best first by path probability, so sizes are nested), and under
lossless sampling children drawn from the drafter's warped distribution with their q rows carried
in the tree. Trees are at most ``min(depth, K)`` deep.
"""

from __future__ import annotations

import torch

from tree_attention.decode import DraftBatch
from tree_attention.dynamic import advance_growth, grow_dynamic_tree
from tree_attention.sampled import grow_sampled_tree
from tree_attention.tree import Tree, TreeBatch

from ..backbone import Backbone
from .config import EagleConfig
from .drafter import EagleDrafter
from .modules import EagleHeads
from .parallel import mask_query_forward


class BlockDrafter(EagleDrafter):
    """A ``tree_attention.decode.Drafter`` for a ``block`` drafter: :class:`EagleDrafter`'s trees, with
    every level below the first from the sequential head over the step's block features instead of
    a drafter forward (module docstring). ``self.block`` ``[R, K, d]``: the features of depths 1..K
    of the last step's rows."""

    def __init__(self, heads: EagleHeads, target: Backbone, config: EagleConfig) -> None:
        if config.parallel < 2 or heads.sequential_head is None:
            raise ValueError(f"BlockDrafter needs a drafter trained with parallel_mode 'block' and parallel >= 2; "
                             f"this one has parallel_mode {config.parallel_mode!r}, parallel {config.parallel}")
        super().__init__(heads, target, config)
        self.parallel = config.parallel
        self.block: torch.Tensor | None = None

    def _row_depths(self) -> list[int]:
        """:meth:`EagleDrafter._row_depths`, at most ``K`` (the depths one block forward predicts)."""
        return [min(depth, self.parallel) for depth in super()._row_depths()]

    def _commit(self, batch: DraftBatch) -> torch.Tensor:
        """Append each row's pairs and run the mask queries behind them; keep the block's features and
        return depth 1's ``[R, d]``."""
        if self.min_acceptance > 0:
            self._learn(batch)
        self.block, self.committed = mask_query_forward(self.heads, self.target, self.cache, self.committed, batch,
                                                        self.parallel, self.position_limit)
        return self.block[:, 0]

    def _next_level(self, features: torch.Tensor, token: torch.Tensor, level: int, start: torch.Tensor,
                    unmasked: bool) -> torch.Tensor:
        """Depth ``level + 1``'s features ``[R, d]``: the block's, refined with the tokens ``[R]``
        drafted at ``level``."""
        return self.heads.refine(self.block[:, level], self.target.input_embeddings(token))

    def _tree(self, roots: list[int], root_features: torch.Tensor, draft_rows) -> TreeBatch:
        """One dynamic tree per row (EAGLE-2 growth, or sampled children); every expansion request of
        every row answered by one sequential-head call over all requested nodes."""
        child_tokens, child_log_probs = self._children(root_features, draft_rows)
        count = len(roots)
        depths = self._row_depths()
        grow = grow_sampled_tree if self.sampling else grow_dynamic_tree
        growths = [grow(root, (child_tokens[row], child_log_probs[row]), depths[row], self.top_k, self.total_tokens)
                   for row, root in enumerate(roots)]
        trees: list[Tree | None] = [None] * count
        requests = [advance_growth(growth, None, trees, row) for row, growth in enumerate(growths)]
        while any(request is not None for request in requests):
            live = [row for row, request in enumerate(requests) if request is not None]
            sizes = [requests[row].tokens.numel() for row in live]
            rows = torch.tensor([row for row, size in zip(live, sizes) for _ in range(size)],
                                device=root_features.device)  # (m,) each requested node's row
            levels = torch.tensor([requests[row].depth for row, size in zip(live, sizes) for _ in range(size)],
                                  device=root_features.device)  # (m,) each node's depth: its children's block index
            tokens = torch.cat([requests[row].tokens for row in live]).to(root_features.device)  # (m,)
            predicted = self.heads.refine(self.block[rows, levels], self.target.input_embeddings(tokens))  # (m, d)
            flat_tokens, flat_log_probs = self._children(predicted, draft_rows)
            start = 0
            for row, size in zip(live, sizes):
                children = (flat_tokens[start:start + size], flat_log_probs[start:start + size])
                start += size
                requests[row] = advance_growth(growths[row], children, trees, row)
        return TreeBatch.from_trees(trees)
