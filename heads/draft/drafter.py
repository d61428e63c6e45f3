"""The draft-model drafter: a separate small causal LM proposes chains or dynamic trees for all
rows of a batch, one draft forward per tree level, with its own ragged KV cache."""

from __future__ import annotations

import torch

from tree_attention import cache as cache_ops
from tree_attention.decode import DraftBatch
from tree_attention.dynamic import advance_growth, grow_dynamic_tree
from tree_attention.mask import causal_visibility
from tree_attention.tree import Tree, TreeBatch, chain_batch

from .config import DraftConfig
from .modules import DraftModel


class DraftModelDrafter:
    """Proposes one tree per row and step (``tree_attention.decode.Drafter``).

    The draft's cache (:class:`~tree_attention.cache.RaggedCache`) holds each row's committed
    tokens, its last root included: ``committed[r]`` of them, at positions ``0 .. committed[r] - 1``
    (the target's positions, left padding removed). A :meth:`propose` crops the previous tree's
    expansion away, appends every row's newly committed tokens and new root in one forward (rows
    right-aligned so the roots share the last column; shorter rows leave holes), whose last logits
    score the roots' children, then grows all rows' chains (``top_k`` 1; a row stops below a node
    its draft is less sure of than ``config.confidence``) or dynamic trees in lockstep, one draft
    forward per level.

    Candidates are the draft's top-k tokens (point masses for the sampling rule) unless
    :meth:`sample_with` set a warp: then chains (``top_k`` 1) draw each token from the draft's
    warped distribution q and carry q in ``draft_probs``.
    """

    def __init__(self, heads: DraftModel, config: DraftConfig) -> None:
        self.heads = heads
        self.draft = heads.backbone
        self.config = config
        self.depth, self.top_k, self.total_tokens = config.depth, config.top_k, config.total_tokens
        self.warp = self.generator = None
        self.reset(1)

    def sample_with(self, warp, generator: torch.Generator | None) -> None:
        """Draw chain tokens from ``softmax(warp(draft logits))`` with ``generator`` (the serving
        rule's warp and draws); ``warp=None``: top-k candidates again."""
        if warp is not None and self.top_k != 1:
            raise ValueError(f"sampled drafts are chains: top_k must be 1, got {self.top_k}")
        self.warp, self.generator = warp, generator

    @property
    def sampling(self) -> bool:
        return self.warp is not None

    def reset(self, batch_size: int) -> None:
        """Forget earlier sequences: an empty cache for ``batch_size`` rows."""
        device = self.draft.device
        self.cache = cache_ops.RaggedCache(batch_size, device)
        self.committed = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.started = False  # after the first propose, each batch's first token is the root already fed

    def retire(self, keep: torch.Tensor) -> None:
        """Drop the cache rows of sequences that left the batch."""
        keep = keep.to(self.committed.device)
        self.cache.select_rows(keep)
        self.committed = self.committed[keep]

    def _commit(self, batch: DraftBatch) -> torch.Tensor:
        """Feed each row's new tokens and its root; the draft's logits at the roots ``[R, V]``."""
        self.cache.crop()
        device = self.committed.device
        tokens = batch.tokens.to(device)
        skip = 1 if self.started else 0  # tokens[:, 0] is the previous root, already in the cache
        counts = batch.lengths.to(device) - skip + 1  # (R,) new tokens and the root
        rows, available = tokens.shape
        width = int(counts.max())
        columns = torch.arange(width, device=device)
        shift = (width - counts)[:, None]  # (R, 1) leading holes
        valid = columns[None, :] >= shift  # (R, W)
        source = (columns[None, :] - shift + skip).clamp(0, available - 1)
        query = tokens.gather(1, source).masked_fill(~valid, 0)
        query[:, -1] = batch.roots.to(device)
        positions = self.committed[:, None] + (columns[None, :] - shift).clamp(min=0)  # (R, W)
        visible = causal_visibility(width, device) & (valid[:, None, :] | torch.eye(width, dtype=torch.bool,
                                                                                     device=device)[None])
        mask = self.cache.mask(positions, visible, self.draft.layout, self.draft.dtype)
        _, logits = self.draft.forward(query, positions, mask, self.cache.cache, "last")
        self.cache.extend(valid, positions)
        self.committed = self.committed + counts
        self.started = True
        return logits[:, -1]

    def _children(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k children tokens and their log-probabilities ``[m, top_k]`` from logits ``[m, V]``."""
        best = torch.topk(torch.log_softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        return best.indices, best.values

    def _next(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A chain's next tokens ``[R]`` from logits ``[R, V]``, the largest probability of each
        row's distribution ``[R]`` and, for sampled chains, the rows of q they were drawn from."""
        if not self.sampling:
            confidence, tokens = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            return tokens, confidence, None
        q = torch.softmax(self.warp(logits.float()), dim=-1)  # (R, V)
        tokens = torch.multinomial(q, 1, generator=self.generator)[:, 0]
        return tokens, q.max(dim=-1).values, q

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        """One chain (``top_k`` 1) or dynamic tree per row of ``batch``."""
        root_logits = self._commit(batch)  # (R, V)
        self.cache.compact()
        if self.top_k == 1:
            return self._chain(batch.roots.to(root_logits.device), root_logits)
        return self._tree(batch.roots.tolist(), root_logits)

    def _chain(self, roots: torch.Tensor, logits: torch.Tensor) -> TreeBatch:
        """Every row's chain, one draft forward per level for all rows; a row stops growing below
        a node whose draft distribution is less confident than ``config.confidence``."""
        rows, device = roots.shape[0], roots.device
        depth = self.depth if self.total_tokens else 0
        tokens, draws = [roots], []
        sizes = torch.ones(rows, dtype=torch.long, device=device)
        growing = torch.ones(rows, dtype=torch.bool, device=device)
        start = self.committed - 1  # (R,) the roots' positions
        for level in range(1, depth + 1):
            token, confidence, q = self._next(logits)
            tokens.append(token)
            draws.append(q)
            sizes = sizes + growing.long()
            growing = growing & (confidence >= self.config.confidence)
            if level == depth or not bool(growing.any()):
                break
            positions = (start + level)[:, None]  # (R, 1)
            keys = start[:, None] + torch.arange(1, level + 1, device=device)[None, :]  # this step's chain slots
            visible = torch.ones(rows, 1, level, dtype=torch.bool, device=device)
            mask = self.cache.mask(positions, visible, self.draft.layout, self.draft.dtype, keys)
            _, logits = self.draft.forward(token[:, None], positions, mask, self.cache.cache, "last")
            logits = logits[:, -1]
        return chain_batch(torch.stack(tokens, dim=1), sizes, draws if self.sampling else None)

    def _tree(self, roots: list[int], root_logits: torch.Tensor) -> TreeBatch:
        """Every row's dynamic tree (EAGLE-2 growth), one draft forward per level for all rows."""
        count, device = len(roots), root_logits.device
        child_tokens, child_scores = self._children(root_logits)
        growths = [grow_dynamic_tree(root, (child_tokens[row], child_scores[row]), self.depth, self.top_k,
                                     self.total_tokens) for row, root in enumerate(roots)]
        trees: list[Tree | None] = [None] * count
        requests = [advance_growth(growth, None, trees, row) for row, growth in enumerate(growths)]
        expansion_positions = torch.zeros(count, 0, dtype=torch.long, device=device)
        columns: list[list[int]] = [[] for _ in range(count)]  # per row: expansion slot of each expanded node
        while any(request is not None for request in requests):
            width = max(request.tokens.numel() if request is not None else 0 for request in requests)
            grown = expansion_positions.shape[1]
            query = torch.zeros(count, width, dtype=torch.long, device=device)
            positions = (self.committed - 1)[:, None].repeat(1, width)  # the root's position
            visible = torch.zeros(count, width, grown + width, dtype=torch.bool, device=device)
            visible[:, :, grown:] = torch.eye(width, dtype=torch.bool, device=device)
            for row, request in enumerate(requests):
                if request is None:
                    continue
                size = request.tokens.numel()
                query[row, :size] = request.tokens
                positions[row, :size] += request.depth
                columns[row] = columns[row] + [grown + i for i in range(size)]
                # request.ancestors[i, j]: expanded node j (expansion order) is node i or its ancestor
                visible[row, :size, torch.tensor(columns[row], device=device)] = request.ancestors
            keys = torch.cat([expansion_positions, positions], dim=1)
            mask = self.cache.mask(positions, visible, self.draft.layout, self.draft.dtype, keys)
            _, logits = self.draft.forward(query, positions, mask, self.cache.cache, "all")  # (R, m, V)
            expansion_positions = keys
            sizes = [request.tokens.numel() if request is not None else 0 for request in requests]
            flat_tokens, flat_scores = self._children(
                torch.cat([logits[row, :size] for row, size in enumerate(sizes) if size]))
            start = 0
            for row, size in enumerate(sizes):
                if not size:
                    continue
                children = (flat_tokens[start:start + size], flat_scores[start:start + size])
                start += size
                requests[row] = advance_growth(growths[row], children, trees, row)
        return TreeBatch.from_trees(trees)
