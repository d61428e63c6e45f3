"""Token trees verified in one target forward.

A tree has ``N`` nodes in topological order: node 0 is the root (the token the target already
committed and that is not in the cache yet), and every other node's parent has a smaller index.
Nodes at depth ``d`` sit at position ``prefix_length + d``.

Two layers of description:

* :class:`TreeTemplate` — the shape only (parents, depths) plus, for static trees built from
  choice lists, which candidate rank at which depth each node takes. Drafters that propose a
  fixed set of ranked candidates per depth (Medusa heads) fill it with tokens by gathering.
* :class:`Tree` — a template's shape together with one token per node, what verification reads.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Sequence

import torch

Path = tuple[int, ...]


class InvalidTreeError(ValueError):
    """A tree description that cannot be verified (cycle, bad parent, rank beyond top-k...)."""


def _check_parents(parents: Sequence[int]) -> None:
    if len(parents) == 0:
        raise InvalidTreeError("a tree needs at least the root node; got parents=[]")
    if parents[0] != -1:
        raise InvalidTreeError(f"node 0 must be the root (parent -1); got parent {parents[0]}")
    for index, parent in enumerate(parents[1:], start=1):
        if not isinstance(parent, int):
            raise InvalidTreeError(f"parent of node {index} must be an int; got {type(parent).__name__}")
        if parent < 0 or parent >= index:
            raise InvalidTreeError(
                f"parent of node {index} is {parent}: every non-root node needs a parent with a smaller "
                "index (topological order), which also rules out cycles"
            )


def _depths_from_parents(parents: Sequence[int]) -> list[int]:
    depths = [0] * len(parents)
    for index in range(1, len(parents)):
        depths[index] = depths[parents[index]] + 1
    return depths


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """``[N, N]`` bool: entry ``(i, j)`` is True when node ``j`` is ``i`` or an ancestor of ``i``.

    ``parents`` is ``[N]`` long with ``-1`` at the root; nodes are in topological order.
    """
    count = parents.numel()
    ancestors = torch.eye(count, dtype=torch.bool, device=parents.device)
    for index in range(1, count):
        ancestors[index] |= ancestors[int(parents[index])]
    return ancestors


@dataclass(frozen=True)
class TreeTemplate:
    """Shape of a tree, independent of its tokens.

    Attributes:
        parents: ``[N]`` long, ``-1`` for the root.
        depths: ``[N]`` long, 0 for the root.
        ranks: ``[N]`` long, the candidate rank each node takes at its depth (root: 0).
        ancestors: ``[N, N]`` bool, see :func:`ancestor_matrix`.
        paths: the choice list this template was built from (root excluded), in node order.
    """

    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    ancestors: torch.Tensor
    paths: tuple[Path, ...] = field(default=())

    @property
    def size(self) -> int:
        return int(self.parents.numel())

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @property
    def max_rank(self) -> int:
        """Highest candidate rank used at any depth (top-k needed is ``max_rank + 1``)."""
        return int(self.ranks.max())

    def to(self, device: torch.device | str) -> "TreeTemplate":
        return TreeTemplate(
            self.parents.to(device), self.depths.to(device), self.ranks.to(device),
            self.ancestors.to(device), self.paths,
        )

    def with_tokens(self, tokens: torch.Tensor) -> "Tree":
        """Attach one token per node (``[N]`` long) to this shape."""
        return Tree(tokens=tokens, parents=self.parents, depths=self.depths, ancestors=self.ancestors)


@dataclass(frozen=True)
class Tree:
    """A token tree ready for verification. All tensors share one device.

    Attributes:
        tokens: ``[N]`` long, node 0 is the root token.
        parents: ``[N]`` long, ``-1`` at the root, parents before children.
        depths: ``[N]`` long.
        ancestors: ``[N, N]`` bool (self included).
        draft_probs: optional ``[N, V]``: row ``c`` is the draft distribution node ``c`` was
            *sampled* from (lossless sampling needs it); None when children are chosen
            deterministically (top-k ranks).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    draft_probs: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: Sequence[int]) -> "Tree":
        """Build and validate a tree from tokens ``[N]`` and a parent list (``-1`` for the root)."""
        parents = [int(p) for p in parents]
        _check_parents(parents)
        if tokens.dim() != 1 or tokens.numel() != len(parents):
            raise InvalidTreeError(
                f"tokens must be 1-D with one entry per node ({len(parents)}); got shape {tuple(tokens.shape)}"
            )
        parent_tensor = torch.tensor(parents, dtype=torch.long, device=tokens.device)
        depths = torch.tensor(_depths_from_parents(parents), dtype=torch.long, device=tokens.device)
        return cls(tokens.long(), parent_tensor, depths, ancestor_matrix(parent_tensor))


def from_choices(choices: Iterable[Sequence[int]], top_k: int | None = None,
                 max_depth: int | None = None) -> TreeTemplate:
    """Static tree from a Medusa-style choice list.

    Each choice is a path of candidate ranks, one per depth: ``(0, 1)`` means "the top-1 candidate
    at depth 1, then the second candidate at depth 2 below it". Every prefix of a path must be in
    the list too. The root is implicit. Nodes are ordered by depth, then by the path.

    Raises:
        InvalidTreeError: empty or duplicate paths, negative ranks, a rank ``>= top_k``, a path deeper
            than ``max_depth``, or a path whose parent path is missing.
    """
    paths: list[Path] = []
    for choice in choices:
        path = tuple(choice)
        if len(path) == 0:
            raise InvalidTreeError("empty path in choices: the root is implicit, list only its descendants")
        for rank in path:
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise InvalidTreeError(f"path {path}: ranks must be non-negative ints")
            if top_k is not None and rank >= top_k:
                raise InvalidTreeError(f"path {path}: rank {rank} is beyond top_k={top_k}")
        if max_depth is not None and len(path) > max_depth:
            raise InvalidTreeError(f"path {path} has depth {len(path)} but at most {max_depth} is possible")
        paths.append(path)
    if len(set(paths)) != len(paths):
        raise InvalidTreeError("choices contain duplicate paths")
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise InvalidTreeError(f"path {path} has no parent: {path[:-1]} is missing from choices")
    paths.sort(key=lambda p: (len(p), p))
    index_of = {path: index + 1 for index, path in enumerate(paths)}
    parents = [-1] + [index_of.get(path[:-1], 0) for path in paths]
    ranks = [0] + [path[-1] for path in paths]
    parent_tensor = torch.tensor(parents, dtype=torch.long)
    return TreeTemplate(
        parents=parent_tensor,
        depths=torch.tensor(_depths_from_parents(parents), dtype=torch.long),
        ranks=torch.tensor(ranks, dtype=torch.long),
        ancestors=ancestor_matrix(parent_tensor),
        paths=tuple(paths),
    )


def chain(length: int) -> TreeTemplate:
    """A single path of ``length`` drafted nodes below the root (``length=0``: no speculation)."""
    if not isinstance(length, int) or length < 0:
        raise InvalidTreeError(f"chain length must be a non-negative int; got {length!r}")
    return from_choices([(0,) * depth for depth in range(1, length + 1)])


def best_first_choices(accuracy: Sequence[Sequence[float]], size: int) -> list[Path]:
    """The ``size`` paths with the highest expected acceptance, as a choice list.

    ``accuracy[d][r]`` is the probability that the rank-``r`` candidate at depth ``d + 1`` is the
    target's token (given its parent was). A path's value is the product along it; since extending
    a path never raises its value, taking the best ``size`` paths best-first always yields a closed
    tree (every prefix present). This is the tree construction of the Medusa paper; it maximises
    the expected number of accepted tokens for a node budget under the independence assumption.
    """
    import heapq

    if size < 0:
        raise InvalidTreeError(f"tree size must be >= 0; got {size}")
    depth_count = len(accuracy)
    chosen: list[Path] = []
    frontier: list[tuple[float, Path]] = []
    if depth_count and len(accuracy[0]):
        frontier.append((-float(accuracy[0][0]), (0,)))
    while frontier and len(chosen) < size:
        negative_value, path = heapq.heappop(frontier)
        chosen.append(path)
        value = -negative_value
        depth = len(path)
        rank = path[-1]
        level = accuracy[depth - 1]
        if rank + 1 < len(level):  # next sibling
            sibling_value = value / max(float(level[rank]), 1e-12) * float(level[rank + 1])
            heapq.heappush(frontier, (-sibling_value, path[:-1] + (rank + 1,)))
        if depth < depth_count and len(accuracy[depth]):  # first child
            heapq.heappush(frontier, (-value * float(accuracy[depth][0]), path + (0,)))
    return chosen


# Prior per-depth, per-rank top-k accuracies for untrained trees. Shape follows what distilled
# Medusa heads reach (Medusa paper, Vicuna-7B: top-1 0.56/0.32/0.20/0.15 for heads 0-3) with
# rank-r accuracy decaying geometrically; a trained adapter replaces this with measured values.
PRIOR_ACCURACY: tuple[tuple[float, ...], ...] = tuple(
    tuple(top1 * (0.45 ** rank) for rank in range(10)) for top1 in (0.6, 0.4, 0.3, 0.25, 0.2)
)

DEFAULT_TREE_SIZES = (1, 4, 8, 16, 32, 64)


def default_tree(size: int, num_depths: int,
                 accuracy: Sequence[Sequence[float]] | None = None) -> TreeTemplate:
    """Default static tree with ``size`` drafted nodes (root excluded) over ``num_depths`` depths.

    Built best-first from ``accuracy`` (per depth, per rank; defaults to :data:`PRIOR_ACCURACY`).
    """
    table = list(accuracy if accuracy is not None else PRIOR_ACCURACY)[:num_depths]
    if len(table) < num_depths:
        raise InvalidTreeError(f"accuracy table covers {len(table)} depths, {num_depths} needed")
    return from_choices(best_first_choices(table, size))


def truncate_depth(tree: Tree, max_depth: int) -> Tree:
    """The subtree of nodes at depth ``<= max_depth`` (node order and root kept)."""
    if int(tree.depths.max()) <= max_depth:
        return tree
    keep = torch.nonzero(tree.depths <= max_depth, as_tuple=False).flatten()
    new_index = torch.full((tree.size,), -1, dtype=torch.long, device=tree.tokens.device)
    new_index[keep] = torch.arange(keep.numel(), device=keep.device)
    parents = tree.parents[keep]
    parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
    draft_probs = tree.draft_probs[keep] if tree.draft_probs is not None else None
    return Tree(tree.tokens[keep], parents, tree.depths[keep], tree.ancestors[keep][:, keep], draft_probs)


# --- Dynamic trees (EAGLE-2 style) ------------------------------------------------------------
#
# A drafter that scores children autoregressively grows the tree level by level: the root's
# children first, then, for ``depth - 1`` levels, the ``top_k`` most promising nodes of the newest
# level ask the drafter for their ``top_k`` children. A node's score is the sum of the drafter's
# log-probabilities along its path (the log of their product). Of all nodes generated, the best
# ``total_tokens`` become the tree to verify. This module only does the bookkeeping; the drafter
# answers :class:`Expansion` requests through a callback.


@dataclass(frozen=True)
class Expansion:
    """Nodes of a growing dynamic tree whose children the drafter is asked for.

    Nodes are numbered in *expansion order*: the ``E`` nodes expanded in earlier requests, then
    the ``m`` nodes of this one (the root is never expanded; its children come with the call).

    Attributes:
        tokens: ``[m]`` long, the nodes' tokens.
        parents: ``[m]`` long, each node's parent in expansion order (``-1``: the root).
        depth: depth of all ``m`` nodes (>= 1; the root has depth 0).
        ancestors: ``[m, E + m]`` bool, which expanded nodes are each node itself or its
            ancestors (the root excluded). Row ``i`` is what node ``i`` may attend to.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: int
    ancestors: torch.Tensor


ExpandChildren = Callable[[Expansion], tuple[torch.Tensor, torch.Tensor]]
"""Callback of :func:`dynamic_tree`: children ``(tokens [m, top_k] long, log_probs [m, top_k])``
of each requested node, the drafter's ``top_k`` most likely next tokens and their log-probabilities."""


def _check_dynamic_shape(depth: int, top_k: int, total_tokens: int) -> None:
    for name, value, low in (("depth", depth, 1), ("top_k", top_k, 1), ("total_tokens", total_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidTreeError(f"dynamic tree {name} must be an int >= {low}; got {value!r}")


def best_nodes(scores: torch.Tensor, depths: torch.Tensor, count: int) -> torch.Tensor:
    """Indices (increasing) of the best ``count`` nodes by score; ties go to the shallower, then
    the earlier node.

    ``scores`` and ``depths`` are ``[C]``. When every child scores at most its parent and parents
    come before children, the result is closed under ancestors: a parent ranks ahead of each of
    its children.
    """
    order = torch.arange(scores.numel(), device=scores.device)
    order = order[torch.sort(depths[order], stable=True).indices]
    order = order[torch.sort(-scores[order], stable=True).indices]
    return torch.sort(order[:count]).values


def _checked_children(children: tuple[torch.Tensor, torch.Tensor], rows: int, top_k: int):
    tokens, log_probs = children
    if tokens.shape != (rows, top_k) or log_probs.shape != (rows, top_k):
        raise ValueError(
            f"expand must return tokens and log_probs of shape [{rows}, {top_k}]; got "
            f"{tuple(tokens.shape)} and {tuple(log_probs.shape)}"
        )
    return tokens.long(), log_probs.float()


def _bool_rows(chains: list[list[int]], width: int, device) -> torch.Tensor:
    """``[len(chains), width]`` bool with row ``i`` True at the columns listed in ``chains[i]``."""
    rows = torch.zeros(len(chains), width, dtype=torch.bool)
    row_index = [row for row, chain in enumerate(chains) for _ in chain]
    rows[row_index, [column for chain in chains for column in chain]] = True
    return rows.to(device)


def _tree_from_candidates(root: int, tokens: list[int], parents: list[int], depths: list[int],
                          keep: list[int], device) -> Tree:
    """The tree of the kept candidates (increasing indices, closed under ancestors) below ``root``."""
    new_index = {candidate: node for node, candidate in enumerate(keep, start=1)}
    tree_parents = [-1] + [new_index.get(parents[candidate], 0) for candidate in keep]
    chains: list[list[int]] = [[0]]
    for node in range(1, len(tree_parents)):
        chains.append(chains[tree_parents[node]] + [node])
    return Tree(
        tokens=torch.tensor([root] + [tokens[c] for c in keep], dtype=torch.long, device=device),
        parents=torch.tensor(tree_parents, dtype=torch.long, device=device),
        depths=torch.tensor([0] + [depths[c] for c in keep], dtype=torch.long, device=device),
        ancestors=_bool_rows(chains, len(chains), device),
    )


def dynamic_tree(root: int, root_children: tuple[torch.Tensor, torch.Tensor], expand: ExpandChildren,
                 depth: int, top_k: int, total_tokens: int) -> Tree:
    """Grow a tree best-first (EAGLE-2) and keep its best ``total_tokens`` drafted nodes.

    Args:
        root: the committed token at node 0.
        root_children: ``(tokens [top_k], log_probs [top_k])``, the root's most likely children.
        expand: asked once per level below the first for the children of the newest level's
            ``top_k`` best nodes (see :class:`Expansion`, :data:`ExpandChildren`).
        depth: deepest level drafted (1: the root's children only, no ``expand`` call).
        top_k: children per expanded node, and nodes expanded per level.
        total_tokens: drafted nodes kept (the tree has ``total_tokens + 1`` nodes at most).

    Nodes whose score cannot beat the current ``total_tokens``-th best are not expanded: their
    children would score no higher and rank after it, so the result equals that of expanding them.
    Returns the tree in topological order (nodes by level, parents before children). The
    bookkeeping runs on Python lists (a few dozen candidates): one host transfer per level.
    """
    growth = grow_dynamic_tree(root, root_children, depth, top_k, total_tokens)
    try:
        request = next(growth)
        while True:
            request = growth.send(expand(request))
    except StopIteration as finished:
        return finished.value


def grow_dynamic_tree(root: int, root_children: tuple[torch.Tensor, torch.Tensor], depth: int, top_k: int,
                      total_tokens: int) -> Generator[Expansion, tuple[torch.Tensor, torch.Tensor], Tree]:
    """:func:`dynamic_tree` as a generator: yields each :class:`Expansion` request, takes the
    children back through ``send`` and returns the tree, so that a drafter can grow the trees of
    a whole batch in lockstep (one drafter forward per level for all rows)."""
    _check_dynamic_shape(depth, top_k, total_tokens)
    first_tokens, first_scores = _checked_children((root_children[0][None], root_children[1][None]), 1, top_k)
    device = first_tokens.device
    tokens, scores = first_tokens[0].tolist(), first_scores[0].tolist()  # per candidate
    parents, depths = [-1] * top_k, [1] * top_k  # parent candidate (-1: root), depth
    slot: dict[int, int] = {}  # candidate -> position in expansion order
    chains: list[list[int]] = []  # per expanded node: expansion positions of its expanded ancestors and itself
    frontier = list(range(top_k))  # the newest level's best candidates
    for level in range(1, depth if total_tokens else 1):
        if len(scores) >= total_tokens:
            threshold = heapq.nlargest(total_tokens, scores)[-1]
            frontier = [candidate for candidate in frontier if scores[candidate] > threshold]
        if not frontier:
            break
        grown, parent_slots = len(chains), [slot.get(parents[candidate], -1) for candidate in frontier]
        new_chains = [(chains[p] if p >= 0 else []) + [grown + i] for i, p in enumerate(parent_slots)]
        request = Expansion(torch.tensor([tokens[c] for c in frontier], dtype=torch.long, device=device),
                            torch.tensor(parent_slots, dtype=torch.long, device=device), level,
                            _bool_rows(new_chains, grown + len(frontier), device))
        child_tokens, child_scores = _checked_children((yield request), len(frontier), top_k)
        slot.update({candidate: grown + i for i, candidate in enumerate(frontier)})
        chains += new_chains
        first = len(scores)
        for candidate, row_tokens, row_scores in zip(frontier, child_tokens.tolist(), child_scores.tolist()):
            tokens += row_tokens
            scores += [scores[candidate] + value for value in row_scores]
            parents += [candidate] * top_k
            depths += [level + 1] * top_k
        newest = sorted(range(first, len(scores)), key=lambda candidate: -scores[candidate])[:top_k]  # stable
        frontier = sorted(newest)
    keep = best_nodes(torch.tensor(scores, dtype=torch.float64), torch.tensor(depths), total_tokens).tolist()
    return _tree_from_candidates(root, tokens, parents, depths, keep, device)
