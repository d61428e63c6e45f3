"""The Medusa drafter: a static tree filled with the heads' ranked candidates, or under lossless
sampling with candidates drawn from the heads' warped distributions."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tree_attention.draft_batch import DraftBatch
from tree_attention.gumbel import COUPLED_POOL
from tree_attention.sampled import depleted, draw_without_replacement
from tree_attention.tree import (
    InvalidTreeError, TreeBatch, TreeTemplate, default_tree, from_choices,
)

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
    """Fills a static tree with the heads' candidates (``tree_attention.decode.Drafter``).

    The node at depth ``d`` with rank ``r`` takes head ``d - 1``'s ``r``-th most likely token
    (point masses for the sampling rule), unless :meth:`sample_with` set a warp: then the ``k``
    children of each node are ``k`` draws without replacement from head ``d - 1``'s warped
    distribution q (in rank order; draws of different nodes independent), each carrying in
    ``draft_probs`` the distribution it was drawn from (q without its earlier siblings, renormalised).
    The tree's shape is fixed, so which nodes exist never depends on the drawn tokens. ``sample`` is
    the config's mode (:data:`heads.medusa.config.SAMPLE_MODES`), read by the kind's ``bind_rule``.
    """

    stateless = True
    """Keeps nothing between steps (it reads each row's last feature): a step it skipped need not be
    replayed to it (``HybridDrafter``)."""

    def __init__(self, heads: MedusaHeads, template: TreeTemplate,
                 shared_logits: Callable[[torch.Tensor], torch.Tensor] | None = None, sample: str = "auto") -> None:
        self.heads = heads
        self.shared_logits = shared_logits
        self.sample = sample
        self.warp = self.generator = None
        self.coupled = None  # a seeded (Gumbel) rule whose noise ranks the candidates, see couple_with
        self.shapes: Callable[[int], TreeTemplate] | None = None
        """Builds the default template of a number of drafted nodes (:meth:`resize`)."""
        self.set_template(template)

    def sample_with(self, warp, generator: torch.Generator | None) -> None:
        """Draw candidates from ``softmax(warp(head logits))`` with ``generator`` (the serving rule's
        warp and draws); ``warp=None``: the top-k candidates again."""
        self.warp, self.generator = warp, generator

    @property
    def sampling(self) -> bool:
        return self.warp is not None

    def couple_with(self, rule) -> None:
        """Rank each head's candidates by its warped logits plus the noise ``rule`` (a bound
        :class:`~tree_attention.gumbel.GumbelRule`) draws the target's token with at that node's
        position (:meth:`~tree_attention.gumbel.GumbelRule.coupled_pool`, among the head's
        :data:`~tree_attention.gumbel.COUPLED_POOL` best tokens), instead of by the logits alone:
        the target's seeded draw is then a candidate whenever a head ranks it high enough, where
        top-k candidates hold it with its probability alone. None: top-k candidates. The output
        never depends on it."""
        self.coupled = rule

    def set_template(self, template: TreeTemplate) -> None:
        """Use ``template`` (also what :meth:`resize` ``(None)`` returns to); InvalidTreeError when a
        node's rank needs more candidates than the vocabulary has (rank ``r`` is the ``r + 1``-th
        most likely token)."""
        self._derive(template)
        self._shapes: dict[int | None, dict] = {None: self._shape()}  # per size (resize): what _derive set

    def _derive(self, template: TreeTemplate) -> None:
        """Set ``template`` and the indices derived from it."""
        vocab = self.heads.draft_vocab_size
        scored = "the vocabulary" if self.heads.token_map is None else "the draft vocabulary"
        if template.size > 1 and template.max_rank >= vocab:
            raise InvalidTreeError(f"tree rank {template.max_rank} needs the top {template.max_rank + 1} candidates "
                                   f"of a head, but {scored} has {vocab} tokens")
        device = next(self.heads.parameters()).device
        self.template = template.to(device)
        self.top_k = template.max_rank + 1
        # flat index into the (K, top_k) candidate table for every non-root node
        nodes = self.template.depths[1:]
        self._candidate_index = (nodes - 1) * self.top_k + self.template.ranks[1:]
        # sampled candidates: the nodes with children ("families"), each non-root node's family and
        # its place among its siblings (node order), and the siblings drawn before it
        parents = template.parents[1:].tolist()
        families = sorted(set(parents))
        family = [families.index(parent) for parent in parents]
        sibling = [parents[:node].count(parent) for node, parent in enumerate(parents)]
        self._families = torch.tensor(families, dtype=torch.long, device=device)  # (P,) parent nodes
        self._family = torch.tensor(family, dtype=torch.long, device=device)  # (N - 1,)
        self._sibling = torch.tensor(sibling, dtype=torch.long, device=device)  # (N - 1,)
        self._children = max(sibling, default=-1) + 1  # the most children of one node
        if self._children > vocab:
            raise InvalidTreeError(f"a tree node has {self._children} children, but {scored} has {vocab} tokens")

    def _shape(self) -> dict:
        return {name: getattr(self, name) for name in (
            "template", "top_k", "_candidate_index", "_families", "_family", "_sibling", "_children")}

    nested = True
    """Default trees are built best-first, each node after the ones chosen before it: the tree of a
    smaller size is the first nodes of a larger one (``tree_attention.tree.default_tree``). Sampled,
    the same static tree is filled with draws taken in sibling order, so a smaller size's tree is
    the first nodes of a larger one's in distribution, and a node's acceptance depends only on the
    nodes before it (its ancestors and earlier siblings)."""

    def resize(self, tree: int | None) -> None:
        """Fill the default tree of ``tree`` drafted nodes from the next step on (None: the template
        last given to :meth:`set_template`); ``shapes`` (set by the kind) builds it from the heads'
        measured accuracies (``tree_attention.capabilities.SizedDrafter``)."""
        shape = self._shapes.get(tree)
        if shape is None:
            if self.shapes is None:
                raise ValueError("this MedusaDrafter was built without `shapes`: it cannot resize")
            self._derive(self.shapes(tree))
            shape = self._shapes[tree] = self._shape()
        self.__dict__.update(shape)

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
        logits = self.heads(last, self.shared_logits, count=template.max_depth)  # (depth, R, V')
        if self.sampling:
            return self._sampled(roots, logits)
        if self.coupled is not None and batch.positions is not None and batch.batch_rows is not None:
            depths = torch.arange(1, logits.shape[0] + 1, device=logits.device)  # each head's drafted depth
            positions = batch.positions.to(logits.device)[:, None] + depths[None, :]  # (R, depth)
            columns = self.coupled.coupled_pool(logits.transpose(0, 1), batch.batch_rows, positions, self.top_k,
                                                COUPLED_POOL, self.heads.token_map)  # (R, depth, top_k)
            candidates = self.heads.target_ids(columns)
        else:
            best = torch.topk(logits, self.top_k, dim=-1).indices
            candidates = self.heads.target_ids(best).transpose(0, 1)  # (R, depth, top_k) target ids
        drafted = candidates.reshape(batch.rows, -1)[:, self._candidate_index]  # (R, N - 1)
        return TreeBatch.from_template(template, torch.cat([roots.to(drafted.device), drafted], dim=1))

    def _sampled(self, roots: torch.Tensor, logits: torch.Tensor) -> TreeBatch:
        """Every node's children drawn without replacement from its depth's head (``logits``
        ``[depth, R, V']``), with the rows they were drawn from as ``draft_probs`` (no probability
        outside a draft vocabulary)."""
        family_logits = self.heads.full_logits(logits[self.template.depths[self._families]].transpose(0, 1).float())
        count, vocab = family_logits.shape[0], family_logits.shape[-1]  # (R, P, V)
        q = torch.softmax(self.warp(family_logits.reshape(-1, vocab)), dim=-1).view_as(family_logits)
        drawn = draw_without_replacement(family_logits, q, self._children, self.generator)  # (R, P, children)
        tokens = drawn[:, self._family, self._sibling]  # (R, N - 1)
        siblings = drawn[:, self._family]  # (R, N - 1, children) every node's family's draws
        before = torch.arange(self._children, device=tokens.device)[None, :] < self._sibling[:, None]
        probs = depleted(q[:, self._family], tokens, siblings, before)  # (R, N - 1, V)
        probs = torch.cat([probs.new_zeros(count, 1, vocab), probs], dim=1)  # the roots' rows are unused
        tree = TreeBatch.from_template(self.template, torch.cat([roots.to(tokens.device), tokens], dim=1))
        return TreeBatch(tree.tokens, tree.parents, tree.depths, tree.visibility, tree.sizes, probs,
                         uniform=True, depth=tree.depth)
