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

import time
from typing import Callable

import torch

from tree_attention.capabilities import SizedDrafter, StatelessDrafter
from tree_attention.draft_batch import DraftBatch
from tree_attention.tree import Tree, TreeBatch
from tree_attention.verify import GreedyRule

from .config import LookupConfig
from .drafter import LookupDrafter, LookupMemory
from .gate import LookupGate, match_class, tree_accepted
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


def joined(batches: list[DraftBatch]) -> DraftBatch:
    """The entries of ``batches`` (the same rows, in order) row by row, with the last one's roots
    (one concatenation for a batch of one row, where no entry is padding)."""
    if len(batches) == 1:
        return batches[0]
    if batches[0].rows == 1:
        last = batches[-1]
        dtype = batches[0].features.dtype
        return DraftBatch(torch.cat([batch.features.to(dtype) for batch in batches], dim=1),
                          torch.cat([batch.tokens for batch in batches], dim=1),
                          sum(batch.lengths for batch in batches), last.roots, last.positions, last.batch_rows)
    result = batches[0]
    for batch in batches[1:]:
        result = result.then(batch)
    return result


class HybridDrafter:
    """A trained kind's drafter plus lookup in one verification tree (``tree_attention.decode.Drafter``).

    With a :class:`~heads.lookup.gate.LookupGate` and a greedy rule (``gating``), a step where
    lookup's proposals alone are worth more (see the gate) verifies them without running the trained
    drafter (where lookup found nothing, the roots alone); what that drafter did not see is handed
    to it, row by row in order, at the next step that runs it (``DraftBatch.then``).

    A ``tree_attention.capabilities.ComposedDrafter``: :meth:`bind_parts` sets it up for a rule."""

    def __init__(self, base, lookup: LookupDrafter, gate: LookupGate | None = None) -> None:
        self.base = base
        self.lookup = lookup
        self.gate = gate
        self.gating = gate is not None
        self._unseen: list[DraftBatch] = []  # committed entries the base has not seen yet, step by step
        self._last = None  # the last step: (alone: True, False, or None for the roots alone; keys, proposals, trees)
        self._returned: float | None = None  # when the last propose returned
        self._started: float | None = None  # when the last propose started
        self._forced: str | None = None  # the mode a planner asked for (use_mode), None: the gate's

    @property
    def base(self):
        """The trained kind's drafter."""
        return self._base

    @base.setter
    def base(self, drafter) -> None:
        self._base = drafter
        # a drafter that keeps nothing between steps needs the latest entries only after a skipped step
        self._base_stateless = isinstance(drafter, StatelessDrafter)

    def bind_parts(self, rule, bind: Callable[[object, object], object] | None) -> HybridDrafter:
        """This drafter set up for the serving ``rule``, its trained drafter by ``bind`` (the trained
        kind's ``DrafterKind.bind_rule``; None: nothing to set up). The gate decides only under a
        greedy rule: which tree is verified never changes a greedy output, and a sampled call's
        draws must not depend on timings, so its steps always verify the merged tree."""
        self.gating = self.gate is not None and isinstance(rule, GreedyRule)
        if bind is not None:
            self.base = bind(self.base, rule)
        return self

    modes = ("merged", "lookup")
    """``merged``: the trained drafter's tree with lookup's proposals merged in; ``lookup``: lookup's
    proposals alone (the trained drafter skipped, its entries kept for the next merged step)."""

    fixed_modes = ("lookup",)
    """Modes whose trees :meth:`resize` leaves unchanged: lookup alone keeps its own budget."""

    nested = False
    """The merged tree lists the trained drafter's nodes before lookup's: a smaller size is not its first nodes."""

    def resize(self, tree: int | None) -> None:
        """The trained drafter's part of the merged trees at ``tree`` drafted nodes (None: configured),
        where that drafter can change its size (``tree_attention.capabilities.SizedDrafter``)."""
        if isinstance(self.base, SizedDrafter):
            self.base.resize(tree)

    def use_mode(self, mode: str | None) -> None:
        """Draft the next steps in ``mode`` (``speculate="auto"`` chooses per step); None: the gate's
        choice again (where gating)."""
        if mode is not None and mode not in self.modes:
            raise ValueError(f"mode must be one of {self.modes} or None; got {mode!r}")
        self._forced = mode

    def reset(self, batch_size: int) -> None:
        self.base.reset(batch_size)
        self.lookup.reset(batch_size)
        self._last = self._returned = self._started = None
        self._unseen = []

    def retire(self, keep: torch.Tensor) -> None:
        self.base.retire(keep)
        self.lookup.retire(keep)
        self._last = None
        if self._unseen:
            self._unseen = [unseen.select(keep) for unseen in self._unseen]

    def _learn(self, batch: DraftBatch, host: tuple, started: float) -> None:
        """Give the gate what the last step's trees got on the path the target produced, and its cost
        (``host``: ``batch``'s lengths, tokens and roots as lists, :meth:`LookupDrafter.host`)."""
        last, self._last = self._last, None
        previous, self._started = self._started, started
        counts, tokens, roots = host  # tokens each row committed since the last propose, ...
        if previous is not None:  # ... over all rows, and in what time
            self.gate.step(sum(counts), started - previous)
        if last is None or self._returned is None:
            return
        alone, keys, proposals, trees = last
        self.gate.rest(alone, started - self._returned)
        if trees.rows != batch.rows:
            return
        # what the target produced after each row's entries: its tokens after the first, then the root
        listed = [row[1:length] + [root] for row, length, root in zip(tokens, counts, roots)]
        merged = None if alone is not False else tree_accepted(trees, listed)
        self.gate.observe(keys, proposals, listed, merged)

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        gate = self.gate if self.gating and self._forced is None else None
        started = time.perf_counter()
        host = self.lookup.host(batch)
        if gate is not None:
            self._learn(batch, host, started)
        proposals = self.lookup.proposals(batch, host=host)
        found = any(proposal.tokens for proposal in proposals)
        keys = None
        if gate is not None:
            keys = [match_class(proposal) for proposal in proposals]
            looked = time.perf_counter()
            gate.timed("lookup_seconds", looked - started)
            started = looked
        if self._forced == "lookup" or (gate is not None and gate.lookup_alone(keys)):
            # lookup alone (where it found nothing: the roots alone, a plain step); a drafter that
            # keeps nothing between steps (``StatelessDrafter``) needs the latest entries only
            if self._base_stateless:
                self._unseen = [batch]
            else:
                self._unseen.append(batch)  # (joined once, when the base runs)
            trees = self.lookup.as_trees(batch, proposals)
            if gate is not None:
                gate.lookup_steps += found
                gate.root_steps += not found
                self._last = (True if found else None, keys, proposals, trees)
                self._returned = time.perf_counter()
            return trees
        if self._unseen:
            batch, self._unseen = joined(self._unseen + [batch]), []
        trees = self.base.propose(batch)
        if gate is not None:
            gate.timed("base_seconds", time.perf_counter() - started)
            gate.merged_steps += 1
        if found:
            trees = TreeBatch.from_trees([merge_proposal(tree, proposal) if proposal.tokens else tree
                                          for tree, proposal in zip(trees.trees(), proposals)])
        if gate is not None:
            self._last = (False, keys, proposals, trees)
            self._returned = time.perf_counter()
        return trees


class Hybrid:
    """Lookup added to any other kind's drafter (``SpeculativeModel.set_lookup``; ``KIND.hybrid``):
    the settings, and the memory of earlier requests and the gate that all of one spec's hybrid
    drafters share."""

    def __init__(self, config: LookupConfig) -> None:
        self.config = config
        self.memory = LookupMemory(config)
        self.gate = LookupGate() if config.gate else None

    def wrap(self, drafter) -> HybridDrafter:
        """``drafter``'s trees with lookup's proposals merged in."""
        return HybridDrafter(drafter, LookupDrafter(self.config, self.memory), self.gate)
