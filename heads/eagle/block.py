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
sampling (``sample="auto"``) the same tree is filled with draws: each parent's children are drawn
without replacement from the drafter's warped distribution q at that parent (in rank order), and
each node carries the q it was drawn from (without its earlier siblings, renormalised) for the
sampling rule; which nodes exist never depends on the drawn tokens. ``sample="never"`` keeps the
top-k tokens (point masses).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from tree_attention.draft_batch import DraftBatch
from tree_attention.sampled import depleted, draw_without_replacement
from tree_attention.tree import (
    TreeBatch, TreeTemplate, best_first_choices, from_choices, prior_accuracy, truncate_batch,
)

from ..backbone import Backbone
from ..draft_vocab import full_vocabulary_logits
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
    """A ``tree_attention.decode.Drafter`` for a ``block`` drafter: per step one drafter forward (the
    new pairs and the mask queries) and the static tree filled depth by depth by the sequential head
    (module docstring). It keeps :class:`EagleDrafter`'s cache bookkeeping, sampling binding
    (:meth:`EagleDrafter.sample_with`) and position limits. ``self.block`` ``[R, K, d]``: the
    features of depths 1..K of the last step's rows."""

    def __init__(self, heads: EagleHeads, target: Backbone, config: EagleConfig,
                 accuracy: Sequence[Sequence[float]] | None = None) -> None:
        if config.parallel < 2 or heads.sequential_head is None:
            raise ValueError(f"BlockDrafter needs a drafter trained with parallel_mode 'block' and parallel >= 2; "
                             f"this one has parallel_mode {config.parallel_mode!r}, parallel {config.parallel}")
        super().__init__(heads, target, config)
        self.parallel = config.parallel
        self.accuracy = accuracy
        self.block: torch.Tensor | None = None
        self._shapes: dict = {}  # (depth, top_k, total_tokens) -> (template, depth 1's fill indices, deeper levels)
        self._set_template()

    nested = True
    """Static trees list their paths best first: a smaller size's tree is the first nodes of a larger
    one's (sampled: in distribution, each node's draw depending only on its ancestors and earlier
    siblings)."""

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
            first = [node for node in range(template.size) if depths[node] == 1]  # all children of the root
            first_index = tuple(torch.tensor(values, device=device) for values in (
                first, [0] * len(first), [ranks[node] for node in first]))
            self._shapes[shape] = (template, first_index, levels)
        self.template, self._first, self._levels = self._shapes[shape]

    def _row_depths(self) -> list[int]:
        """:meth:`EagleDrafter._row_depths`, at most ``K`` (the depths one block forward predicts)."""
        return [min(depth, self.parallel) for depth in super()._row_depths()]

    def _commit(self, batch: DraftBatch) -> torch.Tensor:
        """Append each row's pairs and run the mask queries behind them; keep the block's features and
        return depth 1's ``[R, d]``."""
        self.block, self.committed = mask_query_forward(self.heads, self.target, self.cache, self.committed, batch,
                                                        self.parallel, self.position_limit)
        return self.block[:, 0]

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        """One static tree per row of ``batch`` (top-k candidates, or draws when sampling)."""
        self._commit(batch)
        self.cache.compact()
        return self._static(batch.roots)

    def _static(self, roots: torch.Tensor) -> TreeBatch:
        """Every row's static tree, filled depth by depth from the block features (one head call and
        one top-k or one draw per depth for all rows); under sampling with the q rows it was drawn from."""
        template, block = self.template, self.block
        rows, device = block.shape[0], block.device
        tokens = torch.zeros(rows, template.size, dtype=torch.long, device=device)
        tokens[:, 0] = roots.to(device)
        if template.size == 1:  # total_tokens 0: nothing to draft
            return TreeBatch.from_template(template, tokens)
        draft_rows = self.heads.draft_rows(self.target)
        width = template.max_rank + 1
        probs = None
        if self.sampling:  # (R, N, V) the q each node was drawn from (the root's row unused)
            probs = block.new_zeros(rows, template.size, self.target.vocab_size, dtype=torch.float32)
        self._fill(tokens, probs, self.target.logits(block[:, :1], draft_rows), *self._first, width)
        head = self.heads.sequential_head
        parts = head.feature_part(block[:, 1:]) if self._levels else None  # (R, K - 1, d): once per step
        for depth, (above, nodes, slots, ranks) in enumerate(self._levels, start=1):
            embeddings = self.target.input_embeddings(tokens[:, above])  # (R, P, d)
            hidden = head.from_parts(block[:, depth, None], parts[:, depth - 1, None], embeddings)  # (R, P, d)
            self._fill(tokens, probs, self.target.logits(hidden, draft_rows), nodes, slots, ranks, width)
        trees = TreeBatch.from_template(template, tokens)
        if probs is not None:
            trees = TreeBatch(trees.tokens, trees.parents, trees.depths, trees.visibility, trees.sizes, probs,
                              uniform=True, depth=trees.depth)
        limits = self._row_depths()
        return trees if min(limits) >= template.max_depth else truncate_batch(trees, limits)

    def _fill(self, tokens: torch.Tensor, probs: torch.Tensor | None, logits: torch.Tensor, nodes: torch.Tensor,
              slots: torch.Tensor, ranks: torch.Tensor, width: int) -> None:
        """Set ``tokens[:, nodes]`` (and ``probs[:, nodes]`` when sampling) from the drafter's logits
        ``[R, P, V']`` at the ``P`` parent nodes of one depth: node ``i`` is child ``ranks[i]`` of parent
        ``slots[i]``, the parent's top-``width`` candidates, or its draws without replacement from q."""
        if probs is None:
            candidates = torch.topk(logits, width, dim=-1).indices  # (R, P, k)
            tokens[:, nodes] = self.heads.target_ids(candidates[:, slots, ranks])
            return
        logits = full_vocabulary_logits(logits.float(), self.heads.token_map, self.target.vocab_size)  # (R, P, V)
        q = torch.softmax(self.warp(logits.reshape(-1, logits.shape[-1])), dim=-1).view_as(logits)
        drawn = draw_without_replacement(logits, q, width, self.generator)  # (R, P, k) in draw order
        chosen = drawn[:, slots, ranks]  # (R, C)
        tokens[:, nodes] = chosen
        before = torch.arange(width, device=ranks.device)[None, :] < ranks[:, None]  # (C, k) earlier siblings
        probs[:, nodes] = depleted(q[:, slots], chosen, drawn[:, slots], before).to(probs.dtype)
