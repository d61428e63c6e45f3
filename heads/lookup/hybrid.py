"""Hybrid trees: a trained drafter's tree and the lookup drafter's continuations verified together.

Per row, the lookup proposal is merged into the trained drafter's tree as a trie: a lookup node
whose path already exists in the tree is the same node, the others are appended below their
(merged) parent. Rows where lookup finds nothing keep the trained tree unchanged, so the verify
forward grows only where the text repeats itself.

Trees of sampled candidates (``draft_probs``) are merged too: a lookup node is a point mass, its
row one-hot at its token. Appended after every drafted sibling, it is tried last, and whether it
is there (its token not drawn already) depends only on those earlier siblings, never on its own
draw: the sampling rule (accept with ``r(x)``, remove ``x`` from the residual) stays exact.
"""

from __future__ import annotations

import torch

from tree_attention.decode import DraftBatch
from tree_attention.tree import Tree, TreeBatch

from .drafter import LookupDrafter
from .index import Proposal


def merge_proposal(tree: Tree, proposal: Proposal) -> Tree:
    """``tree`` with ``proposal``'s nodes (parents ``-1`` = the root) merged in as a trie."""
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens)) if node}
    mapping: list[int] = []
    for token, parent in zip(proposal.tokens, proposal.parents):
        anchor = 0 if parent < 0 else mapping[parent]
        node = children.get((anchor, token))
        if node is None:
            node = len(tokens)
            tokens.append(token)
            parents.append(anchor)
            children[(anchor, token)] = node
        mapping.append(node)
    if len(tokens) == tree.size:
        return tree
    merged = Tree.from_parents(torch.tensor(tokens, dtype=torch.long, device=tree.tokens.device), parents)
    if tree.draft_probs is None:
        return merged
    points = torch.nn.functional.one_hot(merged.tokens[tree.size:], tree.draft_probs.shape[-1])
    probs = torch.cat([tree.draft_probs, points.to(tree.draft_probs.dtype)])  # (N', V) lookup nodes: point masses
    return Tree(merged.tokens, merged.parents, merged.depths, merged.ancestors, probs)


class HybridDrafter:
    """A trained kind's drafter plus lookup in one verification tree (``tree_attention.decode.Drafter``)."""

    def __init__(self, base, lookup: LookupDrafter) -> None:
        self.base = base
        self.lookup = lookup

    def reset(self, batch_size: int) -> None:
        self.base.reset(batch_size)
        self.lookup.reset(batch_size)

    def retire(self, keep: torch.Tensor) -> None:
        self.base.retire(keep)
        self.lookup.retire(keep)

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        trees = self.base.propose(batch)
        proposals = self.lookup.proposals(batch)
        if not any(proposal.tokens for proposal in proposals):
            return trees
        return TreeBatch.from_trees([merge_proposal(tree, proposal) if proposal.tokens else tree
                                     for tree, proposal in zip(trees.trees(), proposals)])
