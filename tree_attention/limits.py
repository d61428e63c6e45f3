"""Bounds on what one speculative step may verify."""

from __future__ import annotations


class InvalidTreeError(ValueError):
    """A tree description that cannot be verified (cycle, bad parent, rank beyond top-k, too many nodes...)."""


MAX_TREE_NODES = 1024
"""The most drafted nodes (root excluded) one row's tree may have, wherever a size is given (a
node count, a choice list, a dynamic tree's ``total_tokens``/``top_k``, a lookup budget). A verify
forward holds an ``[N, N]`` mask and ``N`` cache positions per row, and a static template's
construction is ``O(N^2)``: 1024 is 16x the largest shipped default (a 64-node Medusa tree; EAGLE-2
uses 60)."""


def check_tree_size(nodes: int, name: str) -> None:
    """Refuse ``nodes`` drafted nodes beyond :data:`MAX_TREE_NODES`, naming the setting ``name``."""
    if nodes > MAX_TREE_NODES:
        raise InvalidTreeError(f"{name}={nodes} asks for more drafted nodes than MAX_TREE_NODES={MAX_TREE_NODES} "
                               f"(tree_attention.tree) allows in one step's tree")
