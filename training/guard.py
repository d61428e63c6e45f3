"""The online learner's guard (:mod:`training.online`): the acceptance proxy an update must not lower
on held-back traffic, and whether a fall of it lies beyond the measurement's noise."""

from __future__ import annotations

import math

from tree_attention.tree import best_first_choices

GUARD_TREE = 16
"""Drafted nodes of the default tree whose expected acceptance the guard compares (the default tree size)."""
GUARD_RANKS = 10
"""Ranks per depth the guard measures (what the offline trainer's accuracy table holds)."""
GUARD_GROUPS = 4
"""Parts of the held-back pool the guard measures apart: the spread of the update's effect over them is
the noise its fall is judged against."""
GUARD_SIGNIFICANCE = 2.0
"""A fall of the proxy counts as beyond noise when the mean fall over the parts exceeds this many
standard errors of that mean."""


def significant_fall(before: list[float], after: list[float]) -> bool:
    """Whether the proxy fell beyond noise between two measurements of the same parts of the pool: the
    parts' mean fall exceeds :data:`GUARD_SIGNIFICANCE` standard errors of that mean (paired by part).
    With fewer than two parts there is no noise to judge by: any fall counts."""
    if len(before) != len(after) or len(before) < 2:
        return True
    falls = [b - a for b, a in zip(before, after)]
    mean = sum(falls) / len(falls)
    error = math.sqrt(sum((fall - mean) ** 2 for fall in falls) / (len(falls) - 1) / len(falls))
    return mean > GUARD_SIGNIFICANCE * error


def expected_acceptance(accuracy: list[list[float]], size: int = GUARD_TREE) -> float:
    """Drafted tokens a step accepts on average with the default tree of ``size`` nodes built from
    ``accuracy`` (per depth, per rank: the share of positions whose target token is that rank), if
    depths were independent: the sum over the tree's nodes of the product of their path's accuracies."""
    if not accuracy:
        return 0.0
    total = 0.0
    for path in best_first_choices(accuracy, size):
        total += math.prod(accuracy[depth][rank] for depth, rank in enumerate(path))
    return total
