"""Parallel drafting for EAGLE (``EagleConfig.parallel = K > 1``; P-EAGLE / PARD style).

Sequential EAGLE runs one drafter forward per tree level; on small targets each forward costs
about as much as a fraction of the whole verification forward, so drafting, not verification,
bounds the speed. Here one drafter forward per step gives the distributions of depths 1..K.

``heads`` mode (``EagleConfig.parallel_mode``, the default): the forward that commits each row's new
(feature, next token) pairs is the sequential drafter's, and its prediction at the root gives depth 1;
depths 2..K come from ``K - 1`` Medusa-style heads, each with its own output rows, on that prediction
(``EagleConfig.head_input`` ``prediction``, the default: it has attended over the row's cache and
seen the root token) or on the root's input feature (``feature``: the backbone's feature at the
position before the root, as Medusa's heads read it). Trained with their input's gradient stopped,
the heads leave the drafter's layer to the sequential chain.

``mask`` mode: the forward that commits each row's new (feature, next token) pairs also
runs ``K - 1`` mask queries after the row's last pair: query ``j`` sits at position
``last + j``, reads the learned ``mask_feature`` and ``mask_embedding`` and attends to the row's
committed entries and its earlier mask queries. The last pair's output gives the depth-1
distribution, mask query ``j``'s output the depth-``j + 1`` one; a static top-k tree over those
depths (as Medusa's) is filled from them. One drafter forward per step, whatever the depth.

Tree shape (:func:`parallel_template`): ``min(depth, K)`` deep, ranks below ``top_k`` at every
depth, the ``total_tokens`` best nodes best-first by per-depth, per-rank accuracy (measured on
held-out data at training time and kept in the adapter as ``tree_accuracy``; before that, the
prior of :func:`tree_attention.tree.prior_accuracy`). The defaults (``top_k`` 1) give a chain.

The mask queries' cache entries lie past the drafter cache's bookkeeping width, like the last tree
expansion of the sequential drafter, and the next step's :meth:`RaggedCache.crop` drops them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tree_attention import cache as cache_ops
from tree_attention.draft_batch import DraftBatch
from tree_attention.mask import causal_visibility
from tree_attention.tree import (
    TreeBatch, TreeTemplate, best_first_choices, from_choices, prior_accuracy, truncate_batch,
)

from ..backbone import Backbone
from ..families import position_limit
from .config import EagleConfig
from .drafter import commit_forward, committed_pairs, dense_forward, dense_ok
from .modules import EagleHeads, check_against_target


def parallel_template(config: EagleConfig, accuracy: Sequence[Sequence[float]] | None = None) -> TreeTemplate:
    """The static tree of a parallel drafter: ``min(depth, parallel)`` deep, ranks ``< top_k``, the
    ``total_tokens`` best nodes best-first over ``accuracy`` (per depth, per rank; None or a table
    that does not cover every depth: the prior)."""
    depths = min(config.depth, config.parallel)
    table = [list(row) for row in accuracy] if accuracy is not None else []
    if len(table) < depths or any(len(row) < 1 for row in table[:depths]):
        table = [list(row) for row in prior_accuracy(depths)]
    table = [row[:config.top_k] for row in table[:depths]]
    return from_choices(best_first_choices(table, config.total_tokens))


def mask_query_forward(heads: EagleHeads, target: Backbone, cache: cache_ops.RaggedCache, committed: torch.Tensor,
                       batch: DraftBatch, parallel: int, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter forward that appends each row's pairs (features[i], tokens[i + 1]) and (features[-1],
    root) to ``cache`` and runs ``parallel - 1`` mask queries behind them (``mask`` and ``block``
    modes). Returns the predicted features of depths 1..``parallel`` ``[R, K, d]`` (the last pair's
    output, then the mask queries') and the new committed counts ``[R]``. The mask queries' entries
    stay past the cache's bookkeeping width (the next step's ``crop`` drops them); ``limit`` (a hard
    position limit, or None) clamps their positions."""
    cache.crop()
    rows, width = batch.tokens.shape
    masks = parallel - 1
    if limit is None and dense_ok(heads, batch, cache):
        predicted, committed = dense_forward(heads, target, cache, committed, batch, heads.mask_inputs(rows, masks))
        return predicted[:, width - 1:], committed  # (R, K, d): the last pair's output, then the mask queries'
    counts, next_tokens, valid = committed_pairs(batch, committed.device)
    device, dtype = committed.device, target.dtype
    last, row_index, columns = counts - 1, torch.arange(rows, device=device), torch.arange(width, device=device)
    visible = torch.zeros(rows, width + masks, width + masks, dtype=torch.bool, device=device)
    visible[:, :width, :width] = causal_visibility(width, device) & (
        valid[:, None, :] | torch.eye(width, dtype=torch.bool, device=device)[None])
    visible[:, width:, :width] = valid[:, None, :]  # mask queries see the row's committed pairs
    visible[:, width:, width:] = causal_visibility(masks, device)  # and the row's earlier mask queries
    pair_positions = committed[:, None] + columns[None, :]  # (R, n)
    mask_positions = (committed + last)[:, None] + torch.arange(1, masks + 1, device=device)[None, :]
    if limit is not None:  # depths beyond the limit are cut from the tree by the drafter
        mask_positions = mask_positions.clamp(max=limit - 1)
    positions = torch.cat([pair_positions, mask_positions], dim=1)  # (R, n + K - 1)
    attention = cache.mask(positions, visible, heads.layout, dtype)
    mask_features, mask_embeddings = heads.mask_inputs(rows, masks)
    features = torch.cat([heads.fuse(batch.features.to(device=device, dtype=dtype)), mask_features], dim=1)
    embeddings = torch.cat([target.input_embeddings(next_tokens), mask_embeddings.to(dtype)], dim=1)
    predicted = heads.step(features, embeddings, positions, attention, cache.cache)  # (R, n + K - 1, d)
    cache.extend(valid, pair_positions)
    return torch.cat([predicted[row_index, last][:, None], predicted[:, width:]], dim=1), committed + counts


class ParallelEagleDrafter:
    """Proposes one static-shape tree per row and step (``tree_attention.decode.Drafter``) from one
    drafter forward over all rows: the newly committed pairs plus ``K - 1`` mask queries per row.

    The cache bookkeeping is the sequential :class:`~heads.eagle.drafter.EagleDrafter`'s: a row's
    live entries are its committed pairs (entry ``i``: target feature at ``i``, token at ``i + 1``),
    ragged rows leave holes, and everything a forward appends past the committed pairs (here the
    mask queries) is cropped at the next step.
    """

    def __init__(self, heads: EagleHeads, target: Backbone, config: EagleConfig,
                 accuracy: Sequence[Sequence[float]] | None = None) -> None:
        check_against_target(config, target)
        if config.parallel < 2 or (heads.mask_feature is None and heads.parallel_heads is None):
            raise ValueError(f"ParallelEagleDrafter needs a drafter trained for parallel drafting (parallel >= 2); "
                             f"config.parallel is {config.parallel}")
        self.heads = heads
        self.target = target
        self.parallel = config.parallel
        self.position_limit = position_limit(target)  # GPT-2's n_positions; None: no hard limit
        device = next(heads.parameters()).device
        self.template = parallel_template(config, accuracy).to(device)
        self.top_k = self.template.max_rank + 1
        # flat index into the (depth, top_k) candidate table for every non-root node
        self._candidate_index = (self.template.depths[1:] - 1) * self.top_k + self.template.ranks[1:]
        self.reset(1)

    def reset(self, batch_size: int) -> None:
        """Forget earlier sequences: an empty cache for ``batch_size`` rows."""
        device = next(self.heads.parameters()).device
        self.cache = cache_ops.RaggedCache(batch_size, device)
        self.committed = torch.zeros(batch_size, dtype=torch.long, device=device)  # pairs per row

    def retire(self, keep: torch.Tensor) -> None:
        """Drop the cache rows of sequences that left the batch."""
        self.cache.select_rows(keep)
        self.committed = self.committed[keep]

    def _draft(self, batch: DraftBatch) -> torch.Tensor:
        """The predicted features of depths 1..K ``[R, K, d]`` (:func:`mask_query_forward`)."""
        predicted, self.committed = mask_query_forward(self.heads, self.target, self.cache, self.committed, batch,
                                                       self.parallel, self.position_limit)
        return predicted

    def _logits(self, batch: DraftBatch, depths: int) -> torch.Tensor:
        """The drafter's logits ``[R, depths, V']`` of depths ``1..depths`` for every row: the commit
        forward's prediction (depth 1) and the heads (``heads`` mode), or the forward's prediction
        and its mask queries' (``mask`` mode)."""
        rows = self.heads.draft_rows(self.target)
        if self.heads.parallel_heads is None:
            return self.target.logits(self._draft(batch)[:, :depths], rows)
        self.cache.crop()
        first, self.committed = commit_forward(self.heads, self.target, self.cache, self.committed, batch)
        logits = self.target.logits(first, rows)[:, None]  # (R, 1, V')
        if depths == 1:
            return logits
        root = None
        if self.heads.config.head_input == "feature":  # the root's backbone feature: each row's last one
            device = first.device
            last = (batch.lengths.to(device) - 1)[:, None, None].expand(-1, 1, batch.features.shape[-1])
            root = batch.features.to(device=device, dtype=first.dtype).gather(1, last)[:, 0]  # (R, F)
        deeper = self.heads.served_depth_logits(self.target, self.heads.head_inputs(first, root), depths - 1)
        return torch.cat([logits, deeper.to(logits.dtype)], dim=1)  # (R, depths, V')

    def _depth_limits(self) -> list[int] | None:
        """Each row's deepest verifiable node near a hard position limit (its root sits at position
        ``committed``); None when no row is near one."""
        if self.position_limit is None:
            return None
        room = (self.position_limit - 1 - self.committed).clamp(min=0)
        if bool((room >= self.template.max_depth).all()):
            return None
        return room.tolist()

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        """One tree per row of ``batch``, all from one drafter forward."""
        template = self.template
        roots = batch.roots[:, None]  # (R, 1)
        if template.size == 1:  # total_tokens 0: nothing to draft (the cache is reset by every generate)
            return TreeBatch.from_template(template, roots)
        logits = self._logits(batch, template.max_depth)  # (R, depth, V')
        self.cache.compact()
        candidates = self.heads.target_ids(torch.topk(logits, self.top_k, dim=-1).indices)  # (R, depth, top_k)
        drafted = candidates.reshape(batch.rows, -1)[:, self._candidate_index]  # (R, N - 1)
        trees = TreeBatch.from_template(template, torch.cat([roots.to(drafted.device), drafted], dim=1))
        limits = self._depth_limits()
        return trees if limits is None else truncate_batch(trees, limits)
