"""Dynamic (EAGLE-2) trees on crafted draft distributions, against a naive reference that expands
level by level without pruning and ranks every generated node by its path probability."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from tree_attention.dynamic import Expansion, best_nodes, dynamic_tree
from tree_attention.tree import InvalidTreeError
from tree_attention.verify import greedy_accept

VOCAB = 23
ROOT = 5


def _children(path: tuple[int, ...], top_k: int, peak: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Crafted draft distribution after ``path``: seeded by the path, its top_k tokens and log-probs."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(path).encode()))
    log_probs = torch.log_softmax(peak * 3 * torch.randn(VOCAB, generator=generator, dtype=torch.float64), -1)
    best = torch.topk(log_probs, top_k)
    return best.indices, best.values.float()


class CraftedDrafter:
    """Answers expansion requests from :func:`_children` and checks what it is asked."""

    def __init__(self, top_k: int, peak: float = 1.0) -> None:
        self.top_k, self.peak = top_k, peak
        self.expanded: list[tuple[int, ...]] = []  # paths (root excluded) in expansion order
        self.calls = 0

    def root_children(self):
        return _children((ROOT,), self.top_k, self.peak)

    def __call__(self, request: Expansion):
        self.calls += 1
        count, grown = request.tokens.numel(), len(self.expanded)
        assert request.ancestors.shape == (count, grown + count)
        new_paths = []
        for node in range(count):
            parent = int(request.parents[node])
            prefix = self.expanded[parent] if parent >= 0 else ()
            path = prefix + (int(request.tokens[node]),)
            assert len(path) == request.depth
            new_paths.append(path)
        for node, path in enumerate(new_paths):
            everyone = self.expanded + new_paths
            expected = [other == path[:len(other)] and (other in self.expanded or other == path) for other in everyone]
            assert request.ancestors[node].tolist() == expected
        self.expanded += new_paths
        children = [_children((ROOT,) + path, self.top_k, self.peak) for path in new_paths]
        return torch.stack([c[0] for c in children]), torch.stack([c[1] for c in children])


def _path_score(path: tuple[int, ...]) -> float:
    score = 0.0
    for depth in range(1, len(path) + 1):
        tokens, log_probs = _children((ROOT,) + path[:depth - 1], VOCAB)
        score += float(log_probs[tokens.tolist().index(path[depth - 1])])
    return score


def reference_candidates(depth: int, top_k: int, peak: float = 1.0) -> dict[tuple[int, ...], float]:
    """Every node naive EAGLE-2 generates (no pruning), with its path log-probability."""
    tokens, log_probs = _children((ROOT,), top_k, peak)
    level = {(int(t),): float(s) for t, s in zip(tokens, log_probs)}
    generated = dict(level)
    for _ in range(depth - 1):
        frontier = sorted(level.items(), key=lambda item: -item[1])[:top_k]
        level = {}
        for path, score in frontier:
            tokens, log_probs = _children((ROOT,) + path, top_k, peak)
            level.update({path + (int(t),): score + float(s) for t, s in zip(tokens, log_probs)})
        generated.update(level)
    return generated


def _tree_paths(tree) -> list[tuple[int, ...]]:
    paths = []
    for node in range(tree.size):
        nodes = torch.nonzero(tree.ancestors[node]).flatten().tolist()
        paths.append(tuple(int(tree.tokens[i]) for i in nodes[1:]))
    return paths


SHAPES = [(1, 1, 1), (1, 4, 2), (2, 3, 4), (3, 2, 5), (4, 3, 10), (5, 4, 12), (6, 8, 40), (3, 3, 100), (5, 1, 3)]


@pytest.mark.parametrize("depth, top_k, total_tokens", SHAPES)
@pytest.mark.parametrize("peak", [0.3, 1.0, 3.0])
def test_matches_naive_reference(depth, top_k, total_tokens, peak):
    drafter = CraftedDrafter(top_k, peak)
    tree = dynamic_tree(ROOT, drafter.root_children(), drafter, depth, top_k, total_tokens)
    generated = reference_candidates(depth, top_k, peak)
    ranked = sorted(generated, key=lambda path: (-generated[path], len(path)))
    expected = set(ranked[:total_tokens])
    paths = _tree_paths(tree)
    assert paths[0] == () and int(tree.tokens[0]) == ROOT
    assert set(paths[1:]) == expected and len(paths) == len(set(paths))
    assert tree.size == min(total_tokens, len(generated)) + 1
    assert int(tree.depths.max()) <= depth
    assert drafter.calls <= depth - 1


@pytest.mark.parametrize("depth, top_k, total_tokens", SHAPES)
def test_closed_topological_and_best_scores(depth, top_k, total_tokens):
    drafter = CraftedDrafter(top_k)
    tree = dynamic_tree(ROOT, drafter.root_children(), drafter, depth, top_k, total_tokens)
    parents = tree.parents.tolist()
    assert parents[0] == -1 and all(0 <= parent < node for node, parent in enumerate(parents) if node)
    paths = _tree_paths(tree)
    for node in range(1, tree.size):
        assert paths[parents[node]] == paths[node][:-1]  # closed under ancestors
        assert int(tree.depths[node]) == len(paths[node])
    # scores: every kept node is at least as probable as every generated node left out
    generated = reference_candidates(depth, top_k)
    kept = [_path_score(path) for path in paths[1:]]
    left_out = [score for path, score in generated.items() if path not in set(paths)]
    if kept and left_out:
        assert min(kept) >= max(left_out) - 1e-6
    for path in paths[1:]:
        assert math.isclose(_path_score(path), generated[path], rel_tol=1e-5, abs_tol=1e-5)
    assert all(a >= b - 1e-6 for a, b in zip(kept, kept[1:]))  # best first


@pytest.mark.parametrize("depth, top_k, total_tokens", SHAPES)
def test_a_smaller_tree_is_the_first_nodes_of_a_larger_one(depth, top_k, total_tokens):
    """Sizes are nested in node order (what ``speculate="auto"`` counts on): the tree grown with
    ``n`` drafted nodes (depth at most ``n``) is the first ``n`` nodes of the larger one."""
    large = dynamic_tree(ROOT, CraftedDrafter(top_k).root_children(), CraftedDrafter(top_k), depth, top_k,
                         total_tokens)
    for size in range(1, total_tokens):
        drafter = CraftedDrafter(top_k)
        small = dynamic_tree(ROOT, drafter.root_children(), drafter, min(depth, size), top_k, size)
        assert _tree_paths(small) == _tree_paths(large)[:small.size]
        assert small.size == min(size, large.size - 1) + 1


def test_pruning_skips_hopeless_levels_but_keeps_the_result():
    # peaked distributions, a budget of 2: once two nodes beat every frontier node, expansion stops
    drafter = CraftedDrafter(top_k=4, peak=3.0)
    tree = dynamic_tree(ROOT, drafter.root_children(), drafter, 8, 4, 2)
    generated = reference_candidates(8, 4, peak=3.0)
    ranked = sorted(generated, key=lambda path: (-generated[path], len(path)))
    assert set(_tree_paths(tree)[1:]) == set(ranked[:2])
    assert drafter.calls < 7
    assert sum(len(path) for path in drafter.expanded) < 4 * sum(range(1, 8))


def test_zero_total_tokens_is_the_root_alone():
    drafter = CraftedDrafter(top_k=3)
    tree = dynamic_tree(ROOT, drafter.root_children(), drafter, 5, 3, 0)
    assert tree.size == 1 and tree.tokens.tolist() == [ROOT] and drafter.calls == 0


def test_best_nodes_breaks_ties_by_depth_then_index():
    scores = torch.tensor([-1.0, -1.0, -0.5, -1.0, -2.0])
    depths = torch.tensor([2, 1, 1, 1, 3])
    assert best_nodes(scores, depths, 3).tolist() == [1, 2, 3]
    assert best_nodes(scores, depths, 4).tolist() == [0, 1, 2, 3]
    assert best_nodes(scores, depths, 0).tolist() == []


def test_a_dynamic_tree_verifies_like_any_tree():
    drafter = CraftedDrafter(top_k=2)
    tree = dynamic_tree(ROOT, drafter.root_children(), drafter, 3, 2, 5)
    logits = torch.full((tree.size, VOCAB), -10.0)
    deepest = int(torch.argmax(tree.depths))
    path = torch.nonzero(tree.ancestors[deepest]).flatten()
    for parent, child in zip(path[:-1].tolist(), path[1:].tolist()):
        logits[parent, int(tree.tokens[child])] = 10.0  # the target agrees along the deepest path
    logits[deepest, 7] = 10.0
    acceptance = greedy_accept(tree, logits)
    assert acceptance.path.tolist() == path.tolist() and acceptance.next_token == 7


@pytest.mark.parametrize("depth, top_k, total_tokens, name", [
    (0, 2, 4, "depth"), (2, 0, 4, "top_k"), (2, 2, -1, "total_tokens"), (2.0, 2, 4, "depth"), (True, 2, 4, "depth"),
])
def test_bad_shape(depth, top_k, total_tokens, name):
    drafter = CraftedDrafter(top_k=2)
    with pytest.raises(InvalidTreeError, match=f"dynamic tree {name} must be an int"):
        dynamic_tree(ROOT, drafter.root_children(), drafter, depth, top_k, total_tokens)


def test_expand_with_wrong_shape_is_named():
    drafter = CraftedDrafter(top_k=2)

    def wrong(request):
        return torch.zeros(request.tokens.numel(), 3, dtype=torch.long), torch.zeros(request.tokens.numel(), 3)

    with pytest.raises(ValueError, match=r"expand must return tokens and log_probs of shape \[2, 2\]"):
        dynamic_tree(ROOT, drafter.root_children(), wrong, 3, 2, 4)
