"""The Medusa drafter: a static tree filled with the heads' ranked candidates."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tree_attention.decode import DraftBatch
from tree_attention.tree import InvalidTreeError, TreeBatch, TreeTemplate, default_tree, from_choices

from .modules import MedusaHeads


def resolve_tree(tree: Sequence[Sequence[int]] | int | None, num_heads: int,
                 accuracy: Sequence[Sequence[float]] | None = None) -> TreeTemplate:
    """A tree template from a choice list, or a default tree of ``tree`` drafted nodes."""
    if tree is None:
        tree = 16
    if isinstance(tree, bool) or not isinstance(tree, (int, list, tuple)):
        raise ValueError(f"tree must be a node count or a list of rank paths; got {tree!r}")
    if isinstance(tree, int):
        if tree < 0:
            raise ValueError(f"tree size must be >= 0; got {tree}")
        return default_tree(tree, num_heads, accuracy)
    return from_choices(tree, max_depth=num_heads)


class MedusaDrafter:
    """Fills a static tree with the heads' ranked candidates (``tree_attention.decode.Drafter``).

    The node at depth ``d`` with rank ``r`` takes head ``d - 1``'s ``r``-th most likely token.
    """

    def __init__(self, heads: MedusaHeads, template: TreeTemplate,
                 shared_logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.heads = heads
        self.shared_logits = shared_logits
        self.set_template(template)

    def set_template(self, template: TreeTemplate) -> None:
        """Use ``template``; InvalidTreeError when a node's rank needs more candidates than the
        vocabulary has (rank ``r`` is the ``r + 1``-th most likely token)."""
        if template.size > 1 and template.max_rank >= self.heads.vocab_size:
            raise InvalidTreeError(f"tree rank {template.max_rank} needs the top {template.max_rank + 1} candidates "
                                   f"of a head, but the vocabulary has {self.heads.vocab_size} tokens")
        device = next(self.heads.parameters()).device
        self.template = template.to(device)
        self.top_k = template.max_rank + 1
        # flat index into the (K, top_k) candidate table for every non-root node
        nodes = self.template.depths[1:]
        self._candidate_index = (nodes - 1) * self.top_k + self.template.ranks[1:]

    def reset(self, batch_size: int) -> None:
        """Medusa heads keep no state between steps."""

    def retire(self, keep: torch.Tensor) -> None:
        """No per-row state to drop."""

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        """One tree per row from the heads applied to each row's last feature (one batched pass)."""
        template = self.template
        roots = batch.roots[:, None]  # (R, 1)
        if template.size == 1:
            return TreeBatch.from_template(template, roots)
        rows = torch.arange(batch.rows, device=batch.features.device)
        last = batch.features[rows, batch.lengths - 1]  # (R, d)
        logits = self.heads(last, self.shared_logits, count=template.max_depth)  # (depth, R, V)
        candidates = torch.topk(logits, self.top_k, dim=-1).indices.transpose(0, 1)  # (R, depth, top_k)
        drafted = candidates.reshape(batch.rows, -1)[:, self._candidate_index]  # (R, N - 1)
        return TreeBatch.from_template(template, torch.cat([roots.to(drafted.device), drafted], dim=1))
