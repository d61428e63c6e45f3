"""The EAGLE drafter: all rows' dynamic trees grown in lockstep, one drafter forward per level;
top-k candidates (EAGLE-2), or under lossless sampling candidates drawn from the drafter's own
warped distribution."""

from __future__ import annotations

import torch

from tree_attention import cache as cache_ops
from tree_attention.draft_batch import DraftBatch
from tree_attention.mask import causal_extension_mask, causal_visibility
from tree_attention.dynamic import advance_growth, grow_dynamic_tree
from tree_attention.gumbel import COUPLED_POOL
from tree_attention.sampled import draw_without_replacement, drawn_from, grow_sampled_tree
from tree_attention.tree import Tree, TreeBatch, chain_batch, chain_with_siblings

from ..backbone import Backbone
from ..draft_vocab import full_vocabulary_logits
from ..families import position_limit
from .config import EagleConfig
from .calibration import ChainCalibration
from .modules import EagleHeads, check_against_target


def committed_pairs(batch: DraftBatch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a step appends to an EAGLE drafter's cache: per row the pairs (features[i], tokens[i + 1])
    and (features[-1], root). Returns ``(counts [R], next_tokens [R, n], valid [R, n])``: the pairs per
    row, the token of each pair (the root after the row's last feature), and which columns are real."""
    counts = batch.lengths.to(device)
    width = batch.tokens.shape[1]
    next_tokens = batch.next_tokens().to(device)
    valid = torch.arange(width, device=device)[None, :] < counts[:, None]
    return counts, next_tokens, valid


def dense_ok(heads: EagleHeads, batch: DraftBatch, cache: cache_ops.RaggedCache) -> bool:
    """Whether a step can take :func:`dense_forward`: every row commits its whole batch (no padding),
    the drafter cache has no holes and the drafter has no sliding window."""
    return heads.layout is None and batch.full() and cache.dense()


def dense_forward(heads: EagleHeads, target, cache: cache_ops.RaggedCache, committed: torch.Tensor,
                  batch: DraftBatch, extra: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The drafter forward that commits each row's pairs when :func:`dense_ok`: every query sees the
    whole cache and the queries before it, so the mask is the causal extension of the cache and
    positions run on from ``committed``. ``extra`` (features, embeddings ``[R, E, d]``) are queried
    after the pairs in the same forward and left past the bookkeeping (cropped at the next step).
    Returns the predicted features ``[R, n + E, d]`` and the new committed counts."""
    rows, width = batch.tokens.shape
    device, dtype = committed.device, target.dtype
    features = heads.fuse(batch.features.to(device=device, dtype=dtype))
    embeddings = target.input_embeddings(batch.next_tokens().to(device))  # (R, n, d)
    if extra is not None:
        features = torch.cat([features, extra[0]], dim=1)
        embeddings = torch.cat([embeddings, extra[1].to(dtype)], dim=1)
    queries = features.shape[1]
    positions = committed[:, None] + torch.arange(queries, device=device)[None, :]
    mask = causal_extension_mask(cache.width, queries, dtype, device).expand(rows, -1, -1, -1)
    predicted = heads.step(features, embeddings, positions, mask, cache.cache)
    cache.extend(None, positions[:, :width])  # every pair stays visible
    return predicted, committed + width


def commit_forward(heads: EagleHeads, target, cache: cache_ops.RaggedCache, committed: torch.Tensor,
                   batch: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter forward that appends each row's pairs (features[i], tokens[i + 1]) and
    (features[-1], root) to ``cache`` (already cropped); ragged rows leave holes. Returns the
    predicted features at the roots' positions ``[R, d]`` (depth 1) and the new committed counts."""
    if dense_ok(heads, batch, cache):
        predicted, committed = dense_forward(heads, target, cache, committed, batch)
        return predicted[:, -1], committed  # (R, d)
    rows, width = batch.tokens.shape
    device, dtype = committed.device, target.dtype
    counts, next_tokens, valid = committed_pairs(batch, device)
    last, row_index, columns = counts - 1, torch.arange(rows, device=device), torch.arange(width, device=device)
    visible = causal_visibility(width, device) & (valid[:, None, :] | torch.eye(width, dtype=torch.bool,
                                                                                device=device)[None])
    positions = committed[:, None] + columns[None, :]
    mask = cache.mask(positions, visible, heads.layout, dtype)
    embeddings = target.input_embeddings(next_tokens)  # (R, n, d)
    features = heads.fuse(batch.features.to(device=device, dtype=dtype))
    predicted = heads.step(features, embeddings, positions, mask, cache.cache)
    cache.extend(valid, positions)
    return predicted[row_index, last], committed + counts  # (R, d)


SIBLING_GAIN = 0.125
"""A chain level gets its ``siblings`` when the estimated chance that the chain reaches the level and
its node there is rejected exceeds this (then a sibling is accepted about half the time on the
demo target: an expected 0.06 tokens a step for a verified node that costs about 1-2% of a step)."""


SAMPLED_PRIOR_RATE = 0.6
"""The acceptance a sampled call's fresh calibration assumes of a chain node before evidence (greedy
calls share one calibration across calls and start optimistic, at 1). A sampled call learns within
its own few dozen steps, so an optimistic start would spend its first steps on full-depth chains that
sampling rarely accepts in full; at 0.6 a chain under ``min_acceptance`` 0.5 starts 2 deep and grows
where this call's evidence shows it is accepted."""


class EagleDrafter:
    """Proposes one dynamic tree per row and step (``tree_attention.decode.Drafter``), all rows
    of a batch in one drafter forward per tree level.

    Keeps its own batch cache (:class:`~tree_attention.cache.RaggedCache`) in step with each
    row's accepted path: a row's live entries are its committed pairs, entry ``i`` written by
    (target feature at ``i``, token at ``i + 1``); the last tree expansion sits past the
    bookkeeping's width. Each :meth:`propose` crops the expansion away, appends every row's newly
    committed pairs (ragged: shorter rows leave holes) and grows all rows' trees in lockstep
    (:func:`tree_attention.tree.grow_dynamic_tree`).

    Candidates are the drafter's top-k tokens (point masses for the sampling rule) unless
    :meth:`sample_with` set a warp: then every expanded node's children are drawn without
    replacement from the drafter's warped distribution q and the tree is grown by
    :func:`tree_attention.sampled.grow_sampled_tree`, carrying q rows in ``draft_probs``.
    ``sample`` is the config's mode, read by the kind's ``bind_rule``.
    """

    def __init__(self, heads: EagleHeads, target: Backbone, config: EagleConfig) -> None:
        check_against_target(config, target)
        self.heads = heads
        self.target = target
        self.configured = config
        self.depth, self.top_k, self.total_tokens = config.depth, config.top_k, config.total_tokens
        self.confidence, self.min_acceptance = config.confidence, config.min_acceptance
        self.sample = config.sample
        self.siblings = config.siblings
        self.warp = self.generator = None
        self.coupled = None  # a seeded (Gumbel) rule whose noise ranks candidates, see couple_with
        self.position_limit = position_limit(target)  # GPT-2's n_positions; None: no hard limit
        self.reset(1)

    @property
    def nested(self) -> bool:
        """Greedy dynamic trees list their nodes best first: a smaller ``total_tokens`` keeps the
        first nodes (``tree_attention.dynamic.grow_dynamic_tree``); sampled trees are grown in
        expansion order, which a smaller size does not keep."""
        return not self.sampling

    def resize(self, tree: int | None) -> None:
        """Grow the next steps' trees to ``tree`` drafted nodes, depth lowered to fit
        (:meth:`EagleConfig.with_tree`; None: the configured tree); the cache is kept
        (``tree_attention.capabilities.SizedDrafter``)."""
        config = self.configured.with_tree(tree)
        self.depth, self.top_k, self.total_tokens = config.depth, config.top_k, config.total_tokens

    def sample_with(self, warp, generator: torch.Generator | None) -> None:
        """Draw candidates from ``softmax(warp(drafter logits))`` with ``generator`` (the serving
        rule's warp and draws); ``warp=None``: top-k candidates again."""
        self.warp, self.generator = warp, generator

    def couple_with(self, rule) -> None:
        """Rank each expanded node's children by the drafter's warped logits plus the noise ``rule``
        (a bound :class:`~tree_attention.gumbel.GumbelRule`) draws the target's token with at the
        children's position (among the drafter's :data:`~tree_attention.gumbel.COUPLED_POOL` best),
        scored by their own log-probabilities for the tree's growth; None: top-k children. The
        output never depends on it."""
        self.coupled = rule

    @property
    def sampling(self) -> bool:
        return self.warp is not None

    def _row_depths(self) -> list[int]:
        """Each row's tree depth: the configured one, lowered near a hard position limit so that no
        drafter expansion (positions up to ``committed + depth - 2``) and no verified node (the
        root's position + depth) lies beyond it; deeper nodes could not be verified anyway."""
        if self.position_limit is None:
            return [self.depth] * int(self.committed.numel())
        room = (self.position_limit - 1 - self.committed).tolist()
        return [max(1, min(self.depth, int(value))) for value in room]

    def reset(self, batch_size: int) -> None:
        """Forget earlier sequences: an empty cache for ``batch_size`` rows."""
        device = next(self.heads.parameters()).device
        self.cache = cache_ops.RaggedCache(batch_size, device)
        self.committed = torch.zeros(batch_size, dtype=torch.long, device=device)  # pairs per row
        self._pending = None  # the last chains (tokens, sizes, bins), until the next batch shows what was accepted
        # greedy outputs do not depend on where chains stop, so greedy calls share what they learn; a
        # sampled call learns afresh, so that its draws (and a seeded call's output) depend on it alone
        self.calibration = (ChainCalibration(SAMPLED_PRIOR_RATE) if self.sampling
                            else self.heads.chain_calibration)

    def _children(self, hidden: torch.Tensor, rows, count: int | None = None, positions: torch.Tensor | None = None,
                  batch_rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k next tokens (target ids) and their log-probabilities ``[m, count]`` (None: ``top_k``)
        from predicted features ``[m, d]``; when sampling, ``top_k`` draws without replacement
        (target ids) and the rows of the target vocabulary ``[m, top_k, V]`` they were drawn from.
        Coupled to a seeded rule (:meth:`couple_with`) where the children's position ids
        ``positions`` ``[m]`` and batch rows are given: the candidates its noise ranks first, with
        their own log-probabilities."""
        logits = self.target.logits(hidden, rows).float()  # (m, V')
        if self.coupled is not None and positions is not None and batch_rows is not None and not self.sampling:
            columns = self.coupled.coupled_pool(logits[:, None], batch_rows, positions[:, None], count or self.top_k,
                                                COUPLED_POOL, self.heads.token_map)[:, 0]  # (m, count)
            return self.heads.target_ids(columns), torch.log_softmax(logits, dim=-1).gather(1, columns)
        if self.sampling:
            logits = full_vocabulary_logits(logits, self.heads.token_map, self.target.vocab_size)
            q = torch.softmax(self.warp(logits), dim=-1)  # (m, V)
            tokens = draw_without_replacement(logits, q, self.top_k, self.generator)
            return tokens, drawn_from(q, tokens)
        log_probs = torch.log_softmax(logits, dim=-1)  # (m, V')
        best = torch.topk(log_probs, count or self.top_k, dim=-1)
        return self.heads.target_ids(best.indices), best.values

    def retire(self, keep: torch.Tensor) -> None:
        """Drop the cache rows of sequences that left the batch."""
        self.cache.select_rows(keep)
        self.committed = self.committed[keep]
        if self._pending is not None:
            tokens, sizes, bins = self._pending
            self._pending = (tokens[keep.to(tokens.device)], sizes[keep.to(sizes.device)], bins[keep.cpu()])

    def _learn(self, batch: DraftBatch) -> None:
        """Feed the calibration what the target produced after the last chains' roots."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        tokens, sizes, bins = pending
        rows = batch.tokens.shape[0]
        if tokens.shape[0] != rows:
            return
        chains = [row[1:size] for row, size in zip(tokens.tolist(), sizes.tolist())]
        produced = [row[:length] for row, length in zip(batch.next_tokens().tolist(), batch.lengths.tolist())]
        self.calibration.observe(chains, bins.tolist(), produced)

    def _commit(self, batch: DraftBatch) -> torch.Tensor:
        """Append each row's pairs (features[i], tokens[i + 1]) and (features[-1], root); return
        the predicted features at the roots' positions ``[R, d]``."""
        if self.min_acceptance > 0:
            self._learn(batch)
        self.cache.crop()
        root_features, self.committed = commit_forward(self.heads, self.target, self.cache, self.committed, batch)
        return root_features

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        """One chain (``top_k`` 1) or dynamic tree per row of ``batch``."""
        root_features = self._commit(batch)  # (R, d)
        self.cache.compact()
        draft_rows = self.heads.draft_rows(self.target)
        if self.top_k == 1:
            return self._chain(batch.roots.to(root_features.device), root_features, draft_rows, batch)
        return self._tree(batch.roots.tolist(), root_features, draft_rows, batch)

    def _chain(self, roots: torch.Tensor, features: torch.Tensor, draft_rows, batch: DraftBatch | None = None
               ) -> TreeBatch:
        """Every row's chain, one drafter forward per level for all rows, with no tree bookkeeping:
        the same tokens as the dynamic tree of ``top_k`` 1 (its candidates, its draws), and a row
        stops growing below a node whose drafter distribution is less sure than ``confidence``.
        Unsure levels of top-k chains also get the next ``siblings`` candidates as leaves."""
        rows, device = roots.shape[0], roots.device
        limits = torch.tensor(self._row_depths(), device=device) if self.total_tokens else roots.new_zeros(rows)
        depth = int(limits.max()) if rows else 0
        tokens, draws, bins = [roots], [], []
        sizes = torch.ones(rows, dtype=torch.long, device=device)
        growing = limits > 0
        reach = torch.ones(rows, dtype=torch.float64)  # estimated chance that every node so far is accepted
        start = self.committed - 1  # (R,) the roots' positions
        # a chain node sees every committed slot and the chain above it: with no holes (and no
        # sliding window) that is every key, and no mask is needed
        unmasked = self.heads.layout is None and self.cache.dense()
        side = 0 if self.sampling else self.siblings
        siblings, real_siblings = [], []
        for level in range(1, depth + 1):
            children, scores = self._children(features, draft_rows, 1 + side, *self._where(batch, level))
            # (R, 1 + s), or (R, 1), (R, 1, V)
            token = children[:, 0]
            present = growing  # rows with a node at this level
            if self.sampling:
                draws.append(scores[:, 0])
                sure = scores[:, 0].max(dim=-1).values
            else:
                sure = scores[:, 0].exp()
            tokens.append(token)
            sizes = sizes + growing.long()
            growing = growing & (sure >= self.confidence) & (limits > level)
            before = reach
            if self.min_acceptance > 0:
                bins.append(self.calibration.bins(sure))
                rate = self.calibration.rates(bins[-1])
                reach = reach * rate
                growing = growing & (reach >= self.min_acceptance).to(growing.device)
            elif side:  # no calibration: the drafter's own probability stands for the acceptance rate
                rate = sure.to("cpu", torch.float64)
                reach = reach * rate
            if side:  # alternatives where the chain reaches this level and may well be rejected there
                wanted = (before * (1.0 - rate) > SIBLING_GAIN).to(present.device)
                siblings.append(children[:, 1:])
                real_siblings.append((present & wanted)[:, None].expand(-1, side))
            if level == depth or not bool(growing.any()):
                break
            features = self._next_level(features, token, level, start, unmasked)
        chains = torch.stack(tokens, dim=1)
        if self.min_acceptance > 0:
            self._pending = (chains, sizes, torch.stack(bins, dim=1) if bins else torch.zeros(rows, 0, dtype=torch.long))
        if siblings:
            real = torch.cat(real_siblings, dim=1)
            room = self.total_tokens - (sizes - 1)  # the budget counts siblings too, shallower ones first
            real = real & (real.long().cumsum(dim=1) <= room[:, None])
            if bool(real.any()):
                return chain_with_siblings(chains, sizes, torch.cat(siblings, dim=1), real)
        return chain_batch(chains, sizes, draws if self.sampling else None)

    def _next_level(self, features: torch.Tensor, token: torch.Tensor, level: int, start: torch.Tensor,
                    unmasked: bool) -> torch.Tensor:
        """A chain's features ``[R, d]`` at depth ``level + 1`` from those at ``level`` and the tokens
        drafted there ``[R]``: one drafter forward over every row's chain node (``start`` ``[R]``: the
        roots' positions; ``unmasked``: every key is visible, no mask needed)."""
        rows, device = token.shape[0], token.device
        positions = (start + level)[:, None]  # (R, 1)
        mask = None
        if not unmasked:
            keys = start[:, None] + torch.arange(1, level + 1, device=device)[None, :]  # this step's chain slots
            visible = torch.ones(rows, 1, level, dtype=torch.bool, device=device)
            mask = self.cache.mask(positions, visible, self.heads.layout, features.dtype, keys)
        embeddings = self.target.input_embeddings(token[:, None])  # (R, 1, d)
        return self.heads.step(features[:, None], embeddings, positions, mask, self.cache.cache)[:, 0]

    def _where(self, batch: DraftBatch | None, depth, rows: list[int] | None = None) -> tuple:
        """``(positions [m], batch rows)`` of children at ``depth`` (an int, or ``[m]`` per child)
        below the roots of ``rows`` (None: every row once), for a coupled rule; ``(None, None)``
        when not coupled or the batch does not say."""
        if self.coupled is None or batch is None or batch.positions is None or batch.batch_rows is None:
            return None, None
        rows = list(range(len(batch.batch_rows))) if rows is None else rows
        index = torch.tensor(rows, dtype=torch.long, device=batch.positions.device)
        depth = torch.as_tensor(depth, device=batch.positions.device)
        return batch.positions[index] + depth, [batch.batch_rows[row] for row in rows]

    def _tree(self, roots: list[int], root_features: torch.Tensor, draft_rows, batch: DraftBatch | None = None
              ) -> TreeBatch:
        """One dynamic tree per row (EAGLE-2 growth, or sampled children), all rows in lockstep."""
        child_tokens, child_log_probs = self._children(root_features, draft_rows, None, *self._where(batch, 1))
        count, device = len(roots), root_features.device
        depths = self._row_depths()
        grow = grow_sampled_tree if self.sampling else grow_dynamic_tree
        growths = [grow(root, (child_tokens[row], child_log_probs[row]), depths[row], self.top_k, self.total_tokens)
                   for row, root in enumerate(roots)]
        trees: list[Tree | None] = [None] * count
        requests = [advance_growth(growth, None, trees, row) for row, growth in enumerate(growths)]
        outputs = [root_features[row:row + 1] for row in range(count)]  # per row: the root's, then each expanded node's
        columns: list[list[int]] = [[] for _ in range(count)]  # per row: expansion slot of each expanded node
        expansion_positions = torch.zeros(count, 0, dtype=torch.long, device=device)
        while any(request is not None for request in requests):
            width = max(request.tokens.numel() if request is not None else 0 for request in requests) or 1
            grown = expansion_positions.shape[1]
            parents = torch.zeros(count, width, root_features.shape[-1], dtype=root_features.dtype, device=device)
            query_tokens = torch.zeros(count, width, dtype=torch.long, device=device)
            query_positions = (self.committed - 1)[:, None].repeat(1, width)
            visible = torch.zeros(count, width, grown + width, dtype=torch.bool, device=device)
            visible[:, :, grown:] = torch.eye(width, dtype=torch.bool, device=device)
            for row, request in enumerate(requests):
                if request is None:
                    continue
                size = request.tokens.numel()
                parents[row, :size] = outputs[row][request.parents + 1]
                query_tokens[row, :size] = request.tokens
                query_positions[row, :size] += request.depth
                columns[row] = columns[row] + [grown + i for i in range(size)]
                # request.ancestors[i, j]: expanded node j (expansion order) is node i or its ancestor
                visible[row, :size, torch.tensor(columns[row], device=device)] = request.ancestors
            keys = torch.cat([expansion_positions, query_positions], dim=1)
            mask = self.cache.mask(query_positions, visible, self.heads.layout, parents.dtype, keys)
            embeddings = self.target.input_embeddings(query_tokens)  # (R, m, d)
            predicted = self.heads.step(parents, embeddings, query_positions, mask, self.cache.cache)  # (R, m, d)
            expansion_positions = keys
            sizes = [request.tokens.numel() if request is not None else 0 for request in requests]
            flat = torch.cat([predicted[row, :size] for row, size in enumerate(sizes) if size])
            owners = [row for row, size in enumerate(sizes) for _ in range(size)]
            below = [requests[row].depth + 1 for row in owners]  # the children's depth
            flat_tokens, flat_log_probs = self._children(flat, draft_rows, None, *self._where(batch, below, owners))
            start = 0
            for row, size in enumerate(sizes):
                if not size:
                    continue
                outputs[row] = torch.cat([outputs[row], predicted[row, :size]])
                children = (flat_tokens[start:start + size], flat_log_probs[start:start + size])
                start += size
                requests[row] = advance_growth(growths[row], children, trees, row)
        return TreeBatch.from_trees(trees)
