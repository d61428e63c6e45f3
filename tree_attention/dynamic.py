"""Dynamic draft trees (EAGLE-2 style): grown level by level from a drafter's scores."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Generator, Mapping

import torch

from .tree import InvalidTreeError, Tree, check_tree_size

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


DYNAMIC_FIELDS = ("depth", "top_k", "total_tokens")
"""The fields of a dynamic tree's shape."""


def dynamic_shape_overrides(tree, depth: int, label: str) -> dict | None:
    """The field overrides a ``with_tree(tree)`` asks of a config whose tree is ``depth`` deep: a
    node count (``total_tokens``) or a mapping of :data:`DYNAMIC_FIELDS` (None: no change). A node
    count (>= 1) without ``depth`` lowers the depth to fit it, never widening the tree; ``label``
    names the kind in errors (e.g. ``"EAGLE"``)."""
    if tree is None:
        return None
    if isinstance(tree, Mapping):
        unknown = set(tree) - set(DYNAMIC_FIELDS)
        if unknown:
            raise ValueError(f"{label} tree options are {DYNAMIC_FIELDS}; got unknown {sorted(unknown)}")
        shape = dict(tree)
    elif isinstance(tree, bool) or not isinstance(tree, int):
        raise ValueError(f"a{'n' if label[:1] in 'AEIOU' else ''} {label} tree is a node count (total_tokens) or a "
                         f"mapping of {DYNAMIC_FIELDS}; got {tree!r}")
    else:
        shape = {"total_tokens": tree}
    total = shape.get("total_tokens")
    if "depth" not in shape and isinstance(total, int) and not isinstance(total, bool) and total >= 1:
        shape["depth"] = min(depth, total)
    return shape


def check_dynamic_size(depth: int, top_k: int, total_tokens: int, label: str) -> None:
    """Refuse a dynamic tree shape beyond :data:`~tree_attention.tree.MAX_TREE_NODES` in any of its
    fields (ints), naming ``label.field``: drafted nodes, children per expanded node, levels."""
    for name, value in (("total_tokens", total_tokens), ("top_k", top_k), ("depth", depth)):
        check_tree_size(value, f"{label}.{name}")


def _check_dynamic_shape(depth: int, top_k: int, total_tokens: int) -> None:
    for name, value, low in (("depth", depth, 1), ("top_k", top_k, 1), ("total_tokens", total_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidTreeError(f"dynamic tree {name} must be an int >= {low}; got {value!r}")
    check_dynamic_size(depth, top_k, total_tokens, "dynamic tree")


def best_nodes(scores: torch.Tensor, depths: torch.Tensor, count: int, ranked: bool = False) -> torch.Tensor:
    """Indices of the best ``count`` nodes by score, increasing (``ranked``: best first); ties go
    to the shallower, then the earlier node.

    ``scores`` and ``depths`` are ``[C]``. When every child scores at most its parent and parents
    come before children, the result is closed under ancestors: a parent ranks ahead of each of
    its children (so best-first order lists parents first too, and the best ``n < count`` are
    its first ``n``).
    """
    order = torch.arange(scores.numel(), device=scores.device)
    order = order[torch.sort(depths[order], stable=True).indices]
    order = order[torch.sort(-scores[order], stable=True).indices]
    return order[:count] if ranked else torch.sort(order[:count]).values


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
    """The tree of the kept candidates (closed under ancestors, each after its parent) below ``root``,
    in the order of ``keep``."""
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
    Returns the tree best node first (parents before children), so the tree grown with a smaller
    ``total_tokens`` (and ``depth`` at most that) is its first nodes: sizes are nested. The
    bookkeeping runs on Python lists (a few dozen candidates): one host transfer per level.
    """
    growth = grow_dynamic_tree(root, root_children, depth, top_k, total_tokens)
    try:
        request = next(growth)
        while True:
            request = growth.send(expand(request))
    except StopIteration as finished:
        return finished.value


def expansion_request(frontier: list[int], tokens: list[int], parents: list[int], slot: dict[int, int],
                      chains: list[list[int]], level: int, device) -> tuple[Expansion, list[list[int]]]:
    """The :class:`Expansion` asking for the children of candidates ``frontier`` (all at depth
    ``level``), given each candidate's token and parent candidate, the expansion slot of every
    candidate expanded so far and their chains of expanded ancestors; also the new nodes' chains."""
    grown, parent_slots = len(chains), [slot.get(parents[candidate], -1) for candidate in frontier]
    new_chains = [(chains[p] if p >= 0 else []) + [grown + i] for i, p in enumerate(parent_slots)]
    request = Expansion(torch.tensor([tokens[c] for c in frontier], dtype=torch.long, device=device),
                        torch.tensor(parent_slots, dtype=torch.long, device=device), level,
                        _bool_rows(new_chains, grown + len(frontier), device))
    return request, new_chains


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
        grown = len(chains)
        request, new_chains = expansion_request(frontier, tokens, parents, slot, chains, level, device)
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
    keep = best_nodes(torch.tensor(scores, dtype=torch.float64), torch.tensor(depths), total_tokens, ranked=True).tolist()
    return _tree_from_candidates(root, tokens, parents, depths, keep, device)


def advance_growth(growth: Generator, children, trees: list, row: int):
    """Send ``children`` to row ``row``'s growing tree (:func:`grow_dynamic_tree`; None: start it);
    its next :class:`Expansion` request, or None once it is done, its tree then in ``trees[row]``."""
    try:
        return next(growth) if children is None else growth.send(children)
    except StopIteration as finished:
        trees[row] = finished.value
        return None
