"""Hybrid trees: a trained drafter's tree and the lookup drafter's continuations verified together.

Per row, the lookup proposal is merged into the trained drafter's tree as a trie: a lookup node
whose path already exists in the tree is the same node, the others are appended below their
(merged) parent. Rows where lookup finds nothing keep the trained tree unchanged, so the verify
forward grows only where the text repeats itself. Trees that carry draft probabilities (sampled
candidates) are left unmerged: a deterministic lookup child among sampled ones would need its own
draft distribution.
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
    return Tree.from_parents(torch.tensor(tokens, dtype=torch.long, device=tree.tokens.device), parents)


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
        if trees.draft_probs is not None or not any(proposal.tokens for proposal in proposals):
            return trees
        return TreeBatch.from_trees([merge_proposal(tree, proposal) if proposal.tokens else tree
                                     for tree, proposal in zip(trees.trees(), proposals)])
