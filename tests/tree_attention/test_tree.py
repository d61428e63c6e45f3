from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tree_attention.dynamic import check_dynamic_size
from tree_attention.tree import (
    DEFAULT_TREE_SIZES, MAX_TREE_NODES, PRIOR_ACCURACY, InvalidTreeError, Tree, best_first_choices, chain, default_tree,
    from_choices, truncate_depth, chain_with_siblings,
)
from tree_attention.tree import TreeBatch
from tree_attention.verify import greedy_accept, greedy_accept_batch


def test_from_choices_orders_by_depth_and_links_parents():
    template = from_choices([(1,), (0, 0), (0,), (1, 0)])
    assert template.paths == ((0,), (1,), (0, 0), (1, 0))
    assert template.parents.tolist() == [-1, 0, 0, 1, 2]
    assert template.depths.tolist() == [0, 1, 1, 2, 2]
    assert template.ranks.tolist() == [0, 0, 1, 0, 0]


def test_chain():
    template = chain(3)
    assert template.parents.tolist() == [-1, 0, 1, 2]
    assert chain(0).size == 1


@pytest.mark.parametrize("choices, message", [
    ([(0, 1)], "no parent"),
    ([(0,), (0,)], "duplicate"),
    ([()], "empty path"),
    ([(-1,)], "non-negative"),
    ([(0,), (0, 5)], "beyond top_k"),
    ([(0,), (0, 0), (0, 0, 0)], "depth 3"),
])
def test_invalid_choices(choices, message):
    with pytest.raises(InvalidTreeError, match=message):
        from_choices(choices, top_k=4, max_depth=2)


@pytest.mark.parametrize("parents, message", [
    ([], "at least the root"),
    ([0, 0], "root"),
    ([-1, 1], "smaller index"),  # self-loop
    ([-1, 2, 1], "smaller index"),  # cycle 1 -> 2 -> 1
    ([-1, -1], "smaller index"),  # second root
])
def test_invalid_parents(parents, message):
    with pytest.raises(InvalidTreeError, match=message):
        Tree.from_parents(torch.zeros(len(parents), dtype=torch.long), parents)


def test_tokens_must_match_parents():
    with pytest.raises(InvalidTreeError, match="one entry per node"):
        Tree.from_parents(torch.zeros(3, dtype=torch.long), [-1, 0])


@pytest.mark.parametrize("size", DEFAULT_TREE_SIZES)
def test_default_trees_have_the_requested_size(size):
    template = default_tree(size, 4)
    assert template.size == size + 1
    assert template.max_depth <= 4


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=4), min_size=4, max_size=4),
       st.integers(1, 40))
def test_default_trees_are_nested_in_node_order(accuracy, size):
    """The default tree of ``n`` nodes is the first ``n`` nodes of a larger one (``speculate="auto"``
    counts what every smaller size would have accepted from one drafted step)."""
    accuracy = [sorted(level, reverse=True) for level in accuracy]
    large = default_tree(size, 4, accuracy)
    for smaller in range(0, large.size - 1):
        assert list(default_tree(smaller, 4, accuracy).paths) == list(large.paths)[:smaller]
    parents = large.parents.tolist()
    assert all(0 <= parent < node for node, parent in enumerate(parents) if node)  # parents first


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=5), min_size=1, max_size=5),
       st.integers(0, 60))
def test_best_first_choices_are_closed_and_best(accuracy, size):
    accuracy = [sorted(level, reverse=True) for level in accuracy]
    choices = best_first_choices(accuracy, size)
    known = set(choices)
    assert len(known) == len(choices) <= size
    assert all(len(path) == 1 or path[:-1] in known for path in choices)
    from_choices(choices)  # valid tree

    def value(path):
        result = 1.0
        for depth, rank in enumerate(path):
            result *= accuracy[depth][rank]
        return result

    values = [value(p) for p in choices]
    assert values == sorted(values, reverse=True) or all(abs(a - b) < 1e-9 for a, b in zip(values, sorted(values, reverse=True)))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=0, max_size=30), st.integers(0, 4))
def test_ancestors_and_truncation_on_random_trees(raw_parents, max_depth):
    parents = [-1] + [value % (index + 1) for index, value in enumerate(raw_parents)]
    tree = Tree.from_parents(torch.arange(len(parents)), parents)
    for node in range(tree.size):  # ancestors = walking up the parent chain
        walk, current = {node}, node
        while parents[current] >= 0:
            current = parents[current]
            walk.add(current)
        assert set(torch.nonzero(tree.ancestors[node]).flatten().tolist()) == walk
    small = truncate_depth(tree, max_depth)
    assert int(small.depths.max()) <= max_depth
    rebuilt = Tree.from_parents(small.tokens, small.parents.tolist())
    assert torch.equal(rebuilt.ancestors, small.ancestors)
    # tokens double as original indices: each kept node keeps its original parent
    for node in range(1, small.size):
        assert parents[int(small.tokens[node])] == int(small.tokens[small.parents[node]])


def test_greedy_accept_crafted_logits():
    template = from_choices([(0,), (1,), (0, 0), (1, 0), (1, 0, 0)])
    # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (1,0), 5 (1,0,0)
    tokens = torch.tensor([7, 3, 4, 5, 6, 8])
    tree = template.with_tokens(tokens)
    logits = torch.full((6, 10), -5.0)
    argmax = {0: 4, 1: 5, 2: 6, 3: 1, 4: 9, 5: 2}  # root→4 (node 2), node 2→6 (node 4), node 4→9 (≠8)
    for node, token in argmax.items():
        logits[node, token] = 5.0
    acceptance = greedy_accept(tree, logits)
    assert acceptance.path.tolist() == [0, 2, 4]
    assert acceptance.next_token == 9
    assert acceptance.accepted_drafts == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=0, max_size=20), min_size=1, max_size=3),
       st.integers(0, 2**31 - 1))
def test_greedy_accept_batch_against_row_by_row(raw_rows, seed):
    """Both batch forms (one row: a walk in Python; several: no per-row Python) keep exactly the path
    and bonus token of the per-row rule, padded rows and ties included (the one-row form's host
    chunks too)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = 3  # a small vocabulary: many drafted tokens match, so paths run deep and tie
    trees = []
    for raw in raw_rows:
        parents = [-1] + [value % (index + 1) for index, value in enumerate(raw)]
        trees.append(Tree.from_parents(torch.randint(0, vocab, (len(parents),), generator=generator), parents))
    batch = TreeBatch.from_trees(trees)
    logits = torch.randn(len(trees), batch.width, vocab, generator=generator)
    for rows in ([0], list(range(len(trees)))):  # each first row alone, then the whole batch
        sub = TreeBatch.from_trees([trees[row] for row in rows])
        accepted = greedy_accept_batch(sub, logits[rows, :sub.width])
        for index, row in enumerate(rows):
            expected = greedy_accept(trees[row], logits[row, :trees[row].size])
            length = int(accepted.lengths[index])
            assert accepted.paths[index, :length].tolist() == expected.path.tolist()
            assert int(accepted.next_tokens[index]) == expected.next_token
            if accepted.chunks is not None:  # the one-row walk's host copy: path tokens, then the bonus
                path_tokens = trees[row].tokens[expected.path].tolist()
                assert accepted.chunks[index] == path_tokens + [expected.next_token]
        assert accepted.chunks is not None or len(rows) > 1 or sub.width == 1


def test_greedy_accept_nothing():
    tree = from_choices([(0,), (1,)]).with_tokens(torch.tensor([1, 2, 3]))
    logits = torch.zeros(3, 5)
    logits[0, 4] = 1.0
    acceptance = greedy_accept(tree, logits)
    assert acceptance.path.tolist() == [0] and acceptance.next_token == 4


def test_prior_accuracy_is_decreasing():
    for level in PRIOR_ACCURACY:
        assert list(level) == sorted(level, reverse=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(2, 7), st.integers(1, 3), st.integers(0, 2 ** 31 - 1))
def test_chain_with_siblings_against_trees_built_node_by_node(rows, width, side, seed):
    """Each row: its chain (``sizes`` nodes), then the real siblings in level order (a sibling of level
    d is a child of chain node d - 1, only where the chain has a node at level d), then padding."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (rows, width), generator=generator)
    sizes = torch.randint(1, width + 1, (rows,), generator=generator)
    siblings = torch.randint(50, 100, (rows, (width - 1) * side), generator=generator)
    levels = torch.arange(1, width).repeat_interleave(side)
    real = (torch.rand(rows, (width - 1) * side, generator=generator) < 0.6) & (levels[None, :] < sizes[:, None])
    batch = chain_with_siblings(tokens, sizes, siblings, real)
    for row in range(rows):
        size = int(sizes[row])
        node_tokens, parents = tokens[row, :size].tolist(), list(range(-1, size - 1))
        for column in torch.nonzero(real[row]).flatten().tolist():
            node_tokens.append(int(siblings[row, column]))
            parents.append(int(levels[column]) - 1)
        expected = Tree.from_parents(torch.tensor(node_tokens), parents)
        got = batch.row(row)
        assert int(batch.sizes[row]) == expected.size
        assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.parents, expected.parents)
        assert torch.equal(got.depths, expected.depths) and torch.equal(got.ancestors, expected.ancestors)
        padding = batch.visibility[row, expected.size:]
        assert torch.equal(padding, torch.eye(batch.width, dtype=torch.bool)[expected.size:])  # padding sees itself
        assert not batch.visibility[row, :expected.size, expected.size:].any()
    assert batch.width == int(batch.sizes.max()) and batch.uniform == bool((batch.sizes == batch.width).all())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 1.0, 2.0, -1.5, float("inf"), -float("inf"), float("nan")]),
                         min_size=1, max_size=9), min_size=1, max_size=5),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.booleans())
def test_last_axis_argmax_is_torchs_argmax(rows, dtype, strided):
    """The acceptance's argmax (NumPy for float32/float64 on the CPU) returns torch's indices: the
    first maximum, a NaN counting as the maximum, ties and infinities included, on strided views and
    in inference mode too."""
    from tree_attention.verify import last_axis_argmax

    width = max(len(row) for row in rows)
    logits = torch.tensor([row + [-float("inf")] * (width - len(row)) for row in rows], dtype=dtype)
    if strided:  # a non-contiguous view: every other column of a wider tensor
        logits = torch.stack([logits, logits], dim=-1).flatten(-2)[..., ::2]
    assert torch.equal(last_axis_argmax(logits), logits.argmax(dim=-1))
    with torch.inference_mode():
        inference = logits.clone()
        assert torch.equal(last_axis_argmax(inference[None]), inference[None].argmax(dim=-1))


def test_tree_sizes_beyond_the_bound_are_refused_before_building():
    """issue 36 item 10: a size of 10**6 built an 11,111-node template (15 s); every way a size
    enters the tree module is refused by name, at once."""
    start = time.perf_counter()
    for build in (lambda: default_tree(10 ** 9, 4), lambda: chain(10 ** 9),
                  lambda: from_choices([(rank,) for rank in range(MAX_TREE_NODES + 1)]),
                  lambda: check_dynamic_size(8, 1, 10 ** 9, "EagleConfig")):
        with pytest.raises(InvalidTreeError, match="MAX_TREE_NODES=1024"):
            build()
    assert time.perf_counter() - start < 1.0
    assert default_tree(MAX_TREE_NODES, 4).size == MAX_TREE_NODES + 1
    assert chain(MAX_TREE_NODES).size == MAX_TREE_NODES + 1
