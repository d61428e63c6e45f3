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

**Trees.** Greedy and typical calls draft a static tree (:func:`block_template`): the
``total_tokens`` best paths over ``min(depth, K)`` depths and ``top_k`` ranks, best first by the
per-depth, per-rank accuracy measured at training time (``tree_accuracy``: the rank-r candidate's
top-1 rate *given the tokens above it*, which is what the sequential head conditions on), so sizes
are nested. Its tokens are filled one depth at a time for every row at once: one head call over the
depth's parent nodes gives each parent's ranked children, with no per-row Python. Under lossless
sampling the drafter grows :class:`EagleDrafter`'s sampled trees instead (children drawn from its
warped distribution, q rows carried), the sequential head answering each level.
"""

from __future__ import annotations

import torch

from dataclasses import replace
from typing import Sequence

from tree_attention.decode import DraftBatch
from tree_attention.dynamic import advance_growth, grow_dynamic_tree
from tree_attention.sampled import grow_sampled_tree
from tree_attention.tree import (
    Tree, TreeBatch, TreeTemplate, best_first_choices, from_choices, prior_accuracy, truncate_batch,
)

from ..backbone import Backbone
from .config import EagleConfig
from .drafter import EagleDrafter
from .modules import EagleHeads
from .parallel import mask_query_forward


def block_template(config: EagleConfig, accuracy: Sequence[Sequence[float]] | None = None) -> TreeTemplate:
    """The static tree of a block drafter's greedy steps: ``min(depth, parallel)`` deep, ranks below
    ``top_k``, the ``total_tokens`` best paths by ``accuracy`` (per depth, per rank; None or a table
    that does not cover every depth: the prior), best first."""
    depths = min(config.depth, config.parallel)
    table = [list(row) for row in accuracy] if accuracy is not None else []
    if len(table) < depths or any(len(row) < config.top_k for row in table[:depths]):
        table = [list(row) for row in prior_accuracy(depths)]
    table = [row[:config.top_k] for row in table[:depths]]
    return from_choices(best_first_choices(table, config.total_tokens), ordered=True)


class BlockDrafter(EagleDrafter):
    """A ``tree_attention.decode.Drafter`` for a ``block`` drafter: :class:`EagleDrafter`'s trees, with
    every level below the first from the sequential head over the step's block features instead of
    a drafter forward (module docstring). ``self.block`` ``[R, K, d]``: the features of depths 1..K
    of the last step's rows."""

    def __init__(self, heads: EagleHeads, target: Backbone, config: EagleConfig,
                 accuracy: Sequence[Sequence[float]] | None = None) -> None:
        if config.parallel < 2 or heads.sequential_head is None:
            raise ValueError(f"BlockDrafter needs a drafter trained with parallel_mode 'block' and parallel >= 2; "
                             f"this one has parallel_mode {config.parallel_mode!r}, parallel {config.parallel}")
        super().__init__(heads, target, config)
        self.parallel = config.parallel
        self.accuracy = accuracy
        self.block: torch.Tensor | None = None
        self._shapes: dict = {}  # (depth, top_k, total_tokens) -> (template, depth-1 indices, deeper levels)
        self._set_template()

    @property
    def nested(self) -> bool:
        """Greedy static trees list their paths best first (a smaller size keeps the first nodes);
        sampled trees do not."""
        return not self.sampling

    def resize(self, tree: int | None) -> None:
        """:meth:`EagleDrafter.resize`, and the static tree rebuilt for the new shape."""
        super().resize(tree)
        self._set_template()

    def _set_template(self) -> None:
        """The greedy steps' static tree for the current shape, and per depth below 1 the indices
        that fill it: each node's parent among the depth's parent nodes, and its rank (built once
        per shape: ``speculate="auto"`` resizes between steps)."""
        shape = (self.depth, self.top_k, self.total_tokens)
        if shape not in self._shapes:
            config = replace(self.configured, depth=self.depth, top_k=self.top_k, total_tokens=self.total_tokens)
            device = next(self.heads.parameters()).device
            template = block_template(config, self.accuracy).to(device)
            parents, depths, ranks = (template.parents.tolist(), template.depths.tolist(), template.ranks.tolist())
            levels = []  # per depth >= 2: (parent nodes [P], its nodes [C], their parent's slot [C], rank [C])
            for depth in range(2, template.max_depth + 1):
                nodes = [node for node in range(template.size) if depths[node] == depth]
                above = sorted({parents[node] for node in nodes})
                levels.append(tuple(torch.tensor(values, device=device) for values in (
                    above, nodes, [above.index(parents[node]) for node in nodes], [ranks[node] for node in nodes])))
            first = [node for node in range(template.size) if depths[node] == 1]
            first_index = (torch.tensor(first, device=device), torch.tensor([ranks[node] for node in first],
                                                                             device=device))
            self._shapes[shape] = (template, first_index, levels)
        self.template, self._first, self._levels = self._shapes[shape]

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

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        """Greedy and typical calls: the static tree (:meth:`_static`); sampled calls: the sampled
        trees of :class:`EagleDrafter`, levels from the sequential head."""
        if self.sampling:
            return super().propose(batch)
        self._commit(batch)
        self.cache.compact()
        return self._static(batch.roots)

    def _static(self, roots: torch.Tensor) -> TreeBatch:
        """Every row's static tree, filled depth by depth from the block features (one head call and
        one top-k per depth for all rows)."""
        template, block = self.template, self.block
        rows, device = block.shape[0], block.device
        tokens = torch.zeros(rows, template.size, dtype=torch.long, device=device)
        tokens[:, 0] = roots.to(device)
        if template.size == 1:  # total_tokens 0: nothing to draft
            return TreeBatch.from_template(template, tokens)
        draft_rows = self.heads.draft_rows(self.target)
        width = template.max_rank + 1
        nodes, ranks = self._first
        candidates = torch.topk(self.target.logits(block[:, 0], draft_rows), width, dim=-1).indices  # (R, k)
        tokens[:, nodes] = self.heads.target_ids(candidates[:, ranks])
        head = self.heads.sequential_head
        parts = head.feature_part(block[:, 1:]) if self._levels else None  # (R, K - 1, d): once per step
        for depth, (above, nodes, slots, ranks) in enumerate(self._levels, start=1):
            embeddings = self.target.input_embeddings(tokens[:, above])  # (R, P, d)
            hidden = head.from_parts(block[:, depth, None], parts[:, depth - 1, None], embeddings)  # (R, P, d)
            candidates = torch.topk(self.target.logits(hidden, draft_rows), width, dim=-1).indices  # (R, P, k)
            tokens[:, nodes] = self.heads.target_ids(candidates[:, slots, ranks])
        trees = TreeBatch.from_template(template, tokens)
        limits = self._row_depths()
        return trees if min(limits) >= template.max_depth else truncate_batch(trees, limits)

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
