"""Token trees verified in one target forward.

A tree has ``N`` nodes in topological order: node 0 is the root (the token the target already
committed and that is not in the cache yet), and every other node's parent has a smaller index.
Nodes at depth ``d`` sit at position ``prefix_length + d``.

Two layers of description:

* :class:`TreeTemplate` — the shape only (parents, depths) plus, for static trees built from
  choice lists, which candidate rank at which depth each node takes. Drafters that propose a
  fixed set of ranked candidates per depth (Medusa heads) fill it with tokens by gathering.
* :class:`Tree` — a template's shape together with one token per node, what verification reads.
* :class:`TreeBatch` — one tree per row of a batch, padded to the largest: what drafters return.

Dynamic trees (grown from a drafter's scores) are in :mod:`tree_attention.dynamic`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Generator, Iterable, Sequence

import torch

from .limits import MAX_TREE_NODES, InvalidTreeError, check_tree_size  # noqa: F401 - re-exported

Path = tuple[int, ...]


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

    @cached_property
    def max_depth(self) -> int:
        return int(self.depths.max())  # read once: a template never changes

    @cached_property
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


@dataclass(frozen=True)
class TreeBatch:
    """One draft tree per live row, padded to the largest (what ``Drafter.propose`` returns).

    Node 0 of every row is its root; row ``r``'s real nodes are ``0 .. sizes[r] - 1`` (parents
    before children), the rest is padding that sees only itself and that no real node sees.

    Attributes:
        tokens: ``[R, N]`` long (padding 0).
        parents: ``[R, N]`` long, ``-1`` at roots and padding.
        depths: ``[R, N]`` long (padding 0).
        visibility: ``[R, N, N]`` bool, ``[r, i, j]``: node ``j`` is node ``i`` or its ancestor.
        sizes: ``[R]`` long, real nodes per row.
        draft_probs: optional ``[R, N, V]``: row ``c`` is the distribution node ``c`` was sampled
            from (see :class:`Tree`); None when every candidate was chosen deterministically.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    visibility: torch.Tensor
    sizes: torch.Tensor
    draft_probs: torch.Tensor | None = None
    uniform: bool = False
    """True when every row has all ``N`` nodes (no padding): the batch-1 and static-tree fast path."""
    depth: int | None = None
    """The deepest node's depth when the drafter knows it without reading the tensors (lets the
    loop skip a host synchronisation); None: read from ``depths``."""

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.depth is None else self.depth

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def row(self, index: int, size: int | None = None) -> Tree:
        """Row ``index`` as a :class:`Tree` (its real nodes only; ``size`` when already known)."""
        size = int(self.sizes[index]) if size is None else size
        probs = None if self.draft_probs is None else self.draft_probs[index, :size]
        return Tree(self.tokens[index, :size], self.parents[index, :size], self.depths[index, :size],
                    self.visibility[index, :size, :size], probs)

    def trees(self) -> list[Tree]:
        """Every row as a :class:`Tree`."""
        sizes = [self.width] * self.rows if self.uniform else self.sizes.tolist()
        return [self.row(index, size) for index, size in enumerate(sizes)]

    @classmethod
    def from_template(cls, template: "TreeTemplate", tokens: torch.Tensor) -> "TreeBatch":
        """Every row the shape of ``template``, with tokens ``[R, N]``."""
        rows = tokens.shape[0]
        return cls(tokens, template.parents.expand(rows, -1), template.depths.expand(rows, -1),
                   template.ancestors.expand(rows, -1, -1),
                   torch.full((rows,), template.size, dtype=torch.long, device=tokens.device), uniform=True,
                   depth=template.max_depth)

    @classmethod
    def roots_only(cls, roots: torch.Tensor) -> "TreeBatch":
        """One node per row, its root ``roots`` ``[R]``: a step that drafts nothing (plain decoding)."""
        rows, device = int(roots.shape[0]), roots.device
        zeros = torch.zeros(rows, 1, dtype=torch.long, device=device)
        return cls(roots[:, None], torch.full((rows, 1), -1, dtype=torch.long, device=device), zeros,
                   torch.ones(rows, 1, 1, dtype=torch.bool, device=device),
                   torch.ones(rows, dtype=torch.long, device=device), uniform=True, depth=0)

    @classmethod
    def from_trees(cls, trees: Sequence[Tree]) -> "TreeBatch":
        """Trees padded to the largest (stacked without padding when all have one size)."""
        size = max(tree.size for tree in trees)
        device = trees[0].tokens.device
        sizes = torch.tensor([tree.size for tree in trees], dtype=torch.long, device=device)
        with_probs = [tree.draft_probs is not None for tree in trees]
        if any(with_probs) and not all(with_probs):
            raise InvalidTreeError("either every tree of a batch carries draft_probs or none does")
        if all(tree.size == size for tree in trees):
            probs = torch.stack([tree.draft_probs for tree in trees]) if all(with_probs) else None
            return cls(torch.stack([tree.tokens for tree in trees]), torch.stack([tree.parents for tree in trees]),
                       torch.stack([tree.depths for tree in trees]), torch.stack([tree.ancestors for tree in trees]),
                       sizes, probs, uniform=True)
        rows = len(trees)
        tokens = torch.zeros(rows, size, dtype=torch.long, device=device)
        parents = torch.full((rows, size), -1, dtype=torch.long, device=device)
        depths = torch.zeros(rows, size, dtype=torch.long, device=device)
        visibility = torch.eye(size, dtype=torch.bool, device=device).repeat(rows, 1, 1)
        probs = None
        if all(with_probs):
            probs = trees[0].draft_probs.new_zeros(rows, size, trees[0].draft_probs.shape[-1])
        for index, tree in enumerate(trees):
            tokens[index, :tree.size] = tree.tokens
            parents[index, :tree.size] = tree.parents
            depths[index, :tree.size] = tree.depths
            visibility[index, :tree.size, :tree.size] = tree.ancestors
            if probs is not None:
                probs[index, :tree.size] = tree.draft_probs
        return cls(tokens, parents, depths, visibility, sizes, probs)


def from_choices(choices: Iterable[Sequence[int]], top_k: int | None = None,
                 max_depth: int | None = None, ordered: bool = False) -> TreeTemplate:
    """Static tree from a Medusa-style choice list.

    Each choice is a path of candidate ranks, one per depth: ``(0, 1)`` means "the top-1 candidate
    at depth 1, then the second candidate at depth 2 below it". Every prefix of a path must be in
    the list too. The root is implicit. Nodes are ordered by depth, then by the path; ``ordered``:
    in the list's own order, which must list every path after its parent (a best-first list, whose
    first ``n`` paths are then the tree's first ``n`` drafted nodes).

    Raises:
        InvalidTreeError: empty or duplicate paths, negative ranks, a rank ``>= top_k``, a path deeper
            than ``max_depth``, or a path whose parent path is missing.
    """
    choices = list(choices)
    check_tree_size(len(choices), "a choice list of paths")
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
    if not ordered:
        paths.sort(key=lambda p: (len(p), p))
    elif any(len(path) > 1 and paths.index(path[:-1]) > index for index, path in enumerate(paths)):
        raise InvalidTreeError("ordered choices must list every path after its parent")
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
    check_tree_size(length, "chain length")
    return from_choices([(0,) * depth for depth in range(1, length + 1)])


def best_first_choices(accuracy: Sequence[Sequence[float]], size: int) -> list[Path]:
    """The ``size`` paths with the highest expected acceptance, as a choice list.

    ``accuracy[d][r]`` is the probability that the rank-``r`` candidate at depth ``d + 1`` is the
    target's token (given its parent was). A path's value is the product along it; since extending
    a path never raises its value, taking the best ``size`` paths best-first always yields a closed
    tree (every prefix present). This is the tree construction of the Medusa paper; it maximises
    the expected number of accepted tokens for a node budget under the independence assumption.
    """
    if size < 0:
        raise InvalidTreeError(f"tree size must be >= 0; got {size}")
    check_tree_size(size, "tree")
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
PRIOR_TOP1 = (0.6, 0.4, 0.3, 0.25, 0.2)
PRIOR_DEPTH_DECAY = 0.8
"""Beyond the five depths of :data:`PRIOR_TOP1`, each depth's top-1 prior is the previous one's
times this (0.2, 0.16, 0.128, ...), continuing the table's own decay from depth 3 to 5."""
PRIOR_RANK_DECAY = 0.45
PRIOR_RANKS = 10


def prior_accuracy(depths: int) -> tuple[tuple[float, ...], ...]:
    """The prior table for ``depths`` depths: :data:`PRIOR_TOP1`, then geometric decay by
    :data:`PRIOR_DEPTH_DECAY`; rank ``r`` of a depth is its top-1 times ``PRIOR_RANK_DECAY ** r``."""
    top1 = list(PRIOR_TOP1[:depths])
    while len(top1) < depths:
        top1.append(top1[-1] * PRIOR_DEPTH_DECAY)
    return tuple(tuple(value * PRIOR_RANK_DECAY ** rank for rank in range(PRIOR_RANKS)) for value in top1)


PRIOR_ACCURACY: tuple[tuple[float, ...], ...] = prior_accuracy(len(PRIOR_TOP1))

DEFAULT_TREE_SIZES = (1, 4, 8, 16, 32, 64)


def default_tree(size: int, num_depths: int,
                 accuracy: Sequence[Sequence[float]] | None = None) -> TreeTemplate:
    """Default static tree with ``size`` drafted nodes (root excluded) over ``num_depths`` depths.

    Built best-first from ``accuracy`` (per depth, per rank; measured tables must cover every
    depth), else from :func:`prior_accuracy` (any number of depths). Nodes are in the order they were
    chosen, so the default tree of ``n`` nodes is the first ``n`` nodes of any larger one (nested).
    """
    table = list(accuracy if accuracy is not None else prior_accuracy(num_depths))[:num_depths]
    if len(table) < num_depths:
        raise InvalidTreeError(f"accuracy table covers {len(table)} depths, {num_depths} needed")
    return from_choices(best_first_choices(table, size), ordered=True)


def truncate_batch(trees: TreeBatch, limits: list[int]) -> TreeBatch:
    """Each row cut to its nodes at depth ``<= limits[r]``; unchanged (no copy) when no row is
    deeper than its limit."""
    if trees.max_depth <= min(limits):
        return trees
    if not bool((trees.depths > torch.tensor(limits, device=trees.depths.device)[:, None]).any()):
        return trees
    return TreeBatch.from_trees([truncate_depth(tree, limit) for tree, limit in zip(trees.trees(), limits)])


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


_CHAIN_TEMPLATES: dict[tuple[int, torch.device], TreeTemplate] = {}


def chain_template(size: int, device: torch.device | str) -> TreeTemplate:
    """The chain of ``size`` nodes (the root included), cached per size and device."""
    key = (size, torch.device(device))
    template = _CHAIN_TEMPLATES.get(key)
    if template is None:
        template = from_choices([(0,) * depth for depth in range(1, size)]).to(device)
        template = _CHAIN_TEMPLATES.setdefault(key, template)
    return template


def chain_batch(tokens: torch.Tensor, sizes: torch.Tensor, draws: list[torch.Tensor] | None) -> TreeBatch:
    """Chains as a :class:`TreeBatch`: ``tokens`` ``[R, N]`` (roots first), ``sizes`` ``[R]`` real
    nodes per row; ``draws[d - 1]`` ``[R, V]`` the distribution node ``d`` was drawn from (sampled
    chains; the roots' rows of ``draft_probs`` are unused and zero)."""
    rows, width = tokens.shape
    if not draws and bool((sizes == width).all()):  # every row a whole chain: the cached template's shape
        return TreeBatch.from_template(chain_template(width, tokens.device), tokens)
    columns = torch.arange(width, device=tokens.device)
    real = columns[None, :] < sizes[:, None]  # (R, N)
    parents = torch.where(real & (columns[None, :] > 0), columns[None, :] - 1, -1)
    depths = torch.where(real, columns[None, :], 0)
    lower = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=tokens.device)
    visibility = (lower[None] & real[:, None, :] & real[:, :, None]) | eye  # padding sees itself only
    probs = None
    if draws:
        drawn = torch.stack(draws, dim=1)  # (R, N - 1, V)
        probs = torch.cat([drawn.new_zeros(rows, 1, drawn.shape[-1]), drawn], dim=1) * real[..., None]
    return TreeBatch(tokens.masked_fill(~real, 0), parents, depths, visibility, sizes, probs,
                     uniform=bool((sizes == width).all()))


_SIBLING_SHAPES: dict[tuple[int, int, torch.device], tuple[torch.Tensor, ...]] = {}


def _sibling_shape(width: int, side: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Parents, depths and ancestry ``[T, T]`` of a chain of ``width`` nodes (the root included)
    followed by ``side`` leaves below each of its first ``width - 1`` nodes, cached."""
    key = (width, side, torch.device(device))
    shape = _SIBLING_SHAPES.get(key)
    if shape is None:
        columns = torch.arange(width, device=device)
        levels = torch.arange(1, width, device=device).repeat_interleave(side)  # the leaves' depths
        parents = torch.cat([columns - 1, levels - 1])
        depths = torch.cat([columns, levels])
        shape = _SIBLING_SHAPES.setdefault(key, (parents, depths, ancestor_matrix(parents)))
    return shape


def chain_with_siblings(tokens: torch.Tensor, sizes: torch.Tensor, siblings: torch.Tensor,
                        real_siblings: torch.Tensor) -> TreeBatch:
    """Chains with alternative leaves as a :class:`TreeBatch`.

    ``tokens`` ``[R, N]`` (roots first) and ``sizes`` ``[R]`` are the chains as for
    :func:`chain_batch`; ``siblings`` ``[R, (N - 1) * s]`` holds ``s`` alternatives per level, those
    of level ``d`` (columns ``(d - 1) * s ..``) children of chain node ``d - 1``; ``real_siblings``
    (same shape, bool) says which exist (only where the chain has a node at that level). Each row
    is its chain, then its real alternatives in level order, then padding."""
    rows, width = tokens.shape
    side = siblings.shape[1] // max(1, width - 1)
    parents, depths, ancestry = _sibling_shape(width, side, tokens.device)
    columns = torch.arange(width, device=tokens.device)
    real = torch.cat([columns[None, :] < sizes[:, None], real_siblings], dim=1)  # (R, T)
    full_order = torch.sort((~real).to(torch.uint8), dim=1, stable=True).indices  # real nodes first, in order
    inverse = torch.argsort(full_order, dim=1)  # old index -> new index
    new_sizes = real.sum(dim=1)
    keep = int(new_sizes.max())
    order = full_order[:, :keep]
    kept = torch.gather(real, 1, order)  # (R, keep)
    old_parents = parents[order]
    new_parents = torch.where(kept & (old_parents >= 0), torch.gather(inverse, 1, old_parents.clamp(min=0)), -1)
    visibility = ancestry[order[:, :, None], order[:, None, :]] & kept[:, :, None] & kept[:, None, :]
    visibility |= torch.eye(keep, dtype=torch.bool, device=tokens.device)
    all_tokens = torch.cat([tokens, siblings], dim=1)
    return TreeBatch(torch.where(kept, torch.gather(all_tokens, 1, order), 0), new_parents,
                     torch.where(kept, depths[order], 0), visibility, new_sizes,
                     uniform=bool((new_sizes == keep).all()))


def prefix_batch(trees: TreeBatch, nodes: int) -> TreeBatch:
    """Every row cut to its first ``nodes`` nodes in node order (root included; parents come
    before children, so each row stays a tree). Unchanged (no copy) when no row is longer."""
    if nodes < 1:
        raise ValueError(f"a cut keeps at least the root; got nodes={nodes}")
    if nodes >= trees.width:
        return trees
    probs = None if trees.draft_probs is None else trees.draft_probs[:, :nodes]
    return TreeBatch(trees.tokens[:, :nodes], trees.parents[:, :nodes], trees.depths[:, :nodes],
                     trees.visibility[:, :nodes, :nodes], trees.sizes.clamp(max=nodes), probs,
                     uniform=trees.uniform, depth=None)
