"""Sampled candidates (tree_attention/sampled.py): draws without replacement follow the sequential
law, the rows they carry are what they were drawn from, and trees of them, best-first pruned to a
budget and mixed with point masses, keep the sampling rule exact (chi-square against hand-computed
laws, false alarm 1e-3); wrong rows or a pruning that looks at the drawn tokens are caught."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import tree_attention.sampled as sampled
from tests.stats import FALSE_ALARM, chi_square_pvalue
from tree_attention.sampled import depleted, draw_without_replacement, drawn_from, grow_sampled_tree
from tree_attention.tree import Tree
from tree_attention.verify import sample_accept


def sequential_law(q: list[float], count: int) -> dict:
    """P(x_1..x_count) of drawing one token at a time from the renormalised rest of ``q``."""
    law = {}
    for tokens in itertools.permutations(range(len(q)), count):
        chance, rest = 1.0, 1.0
        for token in tokens:
            chance *= q[token] / rest
            rest -= q[token]
        law[tokens] = chance
    return law


@pytest.fixture(params=["host", "race"])
def drawing(request, monkeypatch):
    """Both ways of drawing: per row on the host (large draws) and the Gumbel race (small ones)."""
    monkeypatch.setattr(sampled, "RACE_ELEMENTS", 0 if request.param == "host" else 1 << 40)
    return request.param


def test_draws_without_replacement_follow_the_sequential_law(drawing):
    q = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    generator = torch.Generator().manual_seed(0)
    tokens = draw_without_replacement(q.log().expand(6000, -1), q.expand(6000, -1), 3, generator)
    pvalue = chi_square_pvalue([tuple(row) for row in tokens.tolist()], sequential_law(q.tolist(), 3))
    assert pvalue > FALSE_ALARM, pvalue


def test_a_concentrated_row_still_gives_distinct_draws_in_the_sequential_law(drawing):
    q = torch.tensor([0.94, 0.03, 0.02, 0.01, 0.0])  # repeats of the first token are drawn often
    tokens = draw_without_replacement(q.log().expand(6000, -1), q.expand(6000, -1), 4, torch.Generator().manual_seed(2))
    assert all(len(set(row)) == 4 for row in tokens.tolist())
    pvalue = chi_square_pvalue([tuple(row) for row in tokens[:, :3].tolist()], sequential_law(q.tolist(), 3))
    assert pvalue > FALSE_ALARM, pvalue
    assert not (tokens == 4).any()  # four tokens have probability: the one without is never drawn


def test_rows_are_what_each_draw_came_from_and_point_masses_past_the_support(drawing):
    q = torch.tensor([[0.0, 0.6, 0.0, 0.4, 0.0]])
    logits = torch.tensor([[5.0, 1.0, 3.0, 0.0, -1.0]])
    tokens = draw_without_replacement(logits, q, 4, torch.Generator().manual_seed(1))
    assert sorted(tokens[0, :2].tolist()) == [1, 3]  # the support first, in a random order
    assert tokens[0, 2:].tolist() == [0, 2]  # then the best of the rest by logits
    rows = drawn_from(q, tokens)  # (1, 4, V)
    assert torch.allclose(rows[0, 0], q[0])
    second = torch.zeros(5)
    second[tokens[0, 1]] = 1.0  # q without the first draw, renormalised: all on the other token
    assert torch.allclose(rows[0, 1], second)
    assert torch.equal(rows[0, 2:], torch.nn.functional.one_hot(tokens[0, 2:], 5).float())
    used = torch.tensor([True, False])  # only the first of the listed tokens was drawn before
    row = depleted(torch.tensor([0.5, 0.3, 0.2]), torch.tensor(2), torch.tensor([0, 1]), used)
    assert torch.allclose(row, torch.tensor([0.0, 0.6, 0.4]))


P_ROOT = torch.tensor([0.05, 0.3, 0.25, 0.2, 0.15, 0.05])
Q_ROOT = torch.tensor([0.45, 0.3, 0.05, 0.1, 0.1, 0.0])


def emitted_first_tokens(trials: int, deplete: bool = True, seed: int = 0) -> list[int]:
    """The token the rule emits at a root with three children drawn without replacement from
    ``Q_ROOT`` and a lookup-like point mass (token 5) appended when not drawn already."""
    generator = torch.Generator().manual_seed(seed)
    draws = draw_without_replacement(Q_ROOT.log().expand(trials, -1), Q_ROOT.expand(trials, -1), 3, generator)
    rows = drawn_from(Q_ROOT.expand(trials, -1), draws) if deplete else Q_ROOT.expand(trials, 3, -1)
    probs = torch.cat([P_ROOT[None], torch.full((4, 6), 1 / 6)])  # the children's own distributions: unused
    emitted = []
    for draw, row in zip(draws.tolist(), rows):
        tokens, parents, draft = [0] + draw, [-1, 0, 0, 0], [torch.zeros(6), *row]
        if 5 not in draw:
            tokens, parents, draft = tokens + [5], parents + [0], draft + [torch.nn.functional.one_hot(
                torch.tensor(5), 6).float()]
        tree = Tree.from_parents(torch.tensor(tokens), parents)
        tree = Tree(tree.tokens, tree.parents, tree.depths, tree.ancestors, torch.stack(draft))
        acceptance = sample_accept(tree, probs[:tree.size], generator, tree.draft_probs)
        path = acceptance.path.tolist()
        emitted.append(tokens[path[1]] if len(path) > 1 else acceptance.next_token)
    return emitted


def test_sampled_siblings_and_a_point_mass_keep_the_target_law():
    pvalue = chi_square_pvalue(emitted_first_tokens(1500), dict(enumerate(P_ROOT.tolist())))
    assert pvalue > FALSE_ALARM, pvalue


def test_rows_that_ignore_earlier_siblings_are_caught():
    pvalue = chi_square_pvalue(emitted_first_tokens(1500, deplete=False), dict(enumerate(P_ROOT.tolist())))
    assert pvalue < FALSE_ALARM, pvalue


# A Markov target and draft over 5 tokens: p(. | last token) and q(. | last token).
TARGET = torch.softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 2.0, 1.5, 0.5, 0.0],
                                     [1.0, 0.0, 2.0, 0.0, 1.0], [0.5, 0.5, 0.5, 2.0, 0.0],
                                     [0.0, 1.0, 0.0, 1.0, 2.0]]), dim=-1)
DRAFT = torch.softmax(torch.tensor([[3.0, 0.0, 1.0, 0.0, -2.0], [0.0, 0.5, 2.5, 0.0, 1.0],
                                    [2.0, 0.0, 0.5, 0.0, 2.0], [0.0, 1.5, 0.0, 1.0, 0.0],
                                    [1.0, 0.0, 0.0, 2.5, 1.0]]), dim=-1)


def grow(root: int, generator: torch.Generator, depth: int = 3, top_k: int = 2, total_tokens: int = 3) -> Tree:
    """A sampled tree below ``root`` from the Markov draft (``DRAFT[last token]`` at each node)."""

    def children(last: torch.Tensor):
        q = DRAFT[last]  # (m, V)
        tokens = draw_without_replacement(q.log(), q, top_k, generator)
        return tokens, drawn_from(q, tokens)

    growth = grow_sampled_tree(root, tuple(part[0] for part in children(torch.tensor([root]))), depth, top_k,
                               total_tokens)
    try:
        request = next(growth)
        while True:
            request = growth.send(children(request.tokens))
    except StopIteration as finished:
        return finished.value


def speculative_pairs(trials: int, seed: int = 0) -> list[tuple[int, int]]:
    """The first two tokens after root 0, decoded by sampled trees and the rule."""
    generator = torch.Generator().manual_seed(seed)
    pairs, sizes = [], set()
    for _ in range(trials):
        emitted, root = [], 0
        while len(emitted) < 2:
            tree = grow(root, generator)
            sizes.add(tree.size)
            acceptance = sample_accept(tree, TARGET[tree.tokens], generator, tree.draft_probs)
            emitted += tree.tokens[acceptance.path[1:]].tolist() + [acceptance.next_token]
            root = emitted[-1]
        pairs.append(tuple(emitted[:2]))
    assert sizes == {4}, sizes  # the budget pruned every tree (2 + 4 + 8 candidates grown at most)
    return pairs


def markov_pairs() -> dict:
    return {(a, b): float(TARGET[0, a] * TARGET[a, b]) for a, b in itertools.product(range(5), repeat=2)}


def test_a_best_first_sampled_tree_keeps_the_target_law():
    pvalue = chi_square_pvalue(speculative_pairs(600), markov_pairs())
    assert pvalue > FALSE_ALARM, pvalue


def test_pruning_by_the_drawn_tokens_own_probability_is_caught(monkeypatch):
    """EAGLE-2's pruning applied to sampled children (a node's key includes its own q(x)) is not
    lossless: a candidate is kept more often when its token was likely under q."""

    def own_score_keys(parent_key, parent_score, values):
        return [(parent_score + math.log(value), parent_score + math.log(value)) if value > 0 else
                (-math.inf, -math.inf) for value in values]

    monkeypatch.setattr(sampled, "_slots", own_score_keys)
    pvalue = chi_square_pvalue(speculative_pairs(600), markov_pairs())
    assert pvalue < FALSE_ALARM, pvalue


def test_the_grown_tree_carries_its_rows_and_respects_the_budget():
    generator = torch.Generator().manual_seed(5)
    tree = grow(1, generator, depth=4, top_k=3, total_tokens=6)
    assert tree.size == 7 and tree.draft_probs.shape == (7, 5)
    for node in range(1, tree.size):
        row = tree.draft_probs[node]
        assert math.isclose(float(row.sum()), 1.0, rel_tol=1e-5) and row[tree.tokens[node]] > 0
        siblings = [other for other in range(1, node) if tree.parents[other] == tree.parents[node]]
        assert all(row[tree.tokens[other]] == 0 for other in siblings)  # drawn without replacement
    empty = grow(1, generator, total_tokens=0)
    assert empty.size == 1 and empty.draft_probs.shape == (1, 5)
    with pytest.raises(ValueError, match="expand must return"):
        growth = grow_sampled_tree(1, (torch.tensor([0, 1]), drawn_from(DRAFT[1], torch.tensor([0, 1]))), 3, 2, 4)
        next(growth)
        growth.send((torch.zeros(5, 2, dtype=torch.long), torch.zeros(5, 2, 5)))
