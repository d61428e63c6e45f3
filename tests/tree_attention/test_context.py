"""Every tree node's sequence, built at once by ``ContextTracker.nodes``, equals the one written out
by walking the node's parents: the row's prompt (padding included), its committed tokens, then the
path from the root's child down to the node."""

from __future__ import annotations

import torch

from tree_attention.context import FILL, ContextTracker
from tree_attention.tree import Tree, TreeBatch


def _random_tree(generator: torch.Generator, size: int, root: int) -> Tree:
    parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, size)]
    tokens = torch.randint(3, 50, (size,), generator=generator)
    tokens[0] = root
    return Tree.from_parents(tokens, parents)


def _path(tree: Tree, node: int) -> list[int]:
    tokens = []
    while node > 0:
        tokens.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return tokens[::-1]


def test_node_sequences_are_prompt_committed_tokens_and_path():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (3, 6), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    ids[mask == 0] = 0
    tracker = ContextTracker(ids, mask, max_new_tokens=20)
    committed = {0: [7, 8, 9, 10], 1: [11], 2: [12, 13]}
    for row, tokens in committed.items():  # in chunks, as the loop commits them
        for start in range(0, len(tokens), 3):
            tracker.append(row, tokens[start:start + 3])
    rows = [0, 2]  # row 1 finished
    trees = [_random_tree(generator, 9, committed[0][-1]), _random_tree(generator, 5, committed[2][-1])]
    batch = TreeBatch.from_trees(trees)
    contexts = tracker.nodes(rows, batch)
    width = batch.width
    assert contexts.ids.shape[0] == len(rows) * width and contexts.prompt_width == 6
    for index, (row, tree) in enumerate(zip(rows, trees)):
        for node in range(width):
            path = _path(tree, node) if node < tree.size else []  # padding nodes: the committed text
            expected = ids[row].tolist() + committed[row] + path
            m = index * width + node
            length = int(contexts.lengths[m])
            assert length == len(expected)
            assert contexts.ids[m, contexts.ids.shape[1] - length:].tolist() == expected
            assert (contexts.ids[m, :contexts.ids.shape[1] - length] == FILL).all()
            padding = int((mask[row] == 0).sum())
            assert int(contexts.starts[m]) == contexts.ids.shape[1] - length + padding


def test_prompt_contexts_are_the_padded_prompts():
    ids = torch.tensor([[0, 0, 5, 6], [4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    contexts = ContextTracker(ids, mask, 4).prompts()
    assert torch.equal(contexts.ids, ids)
    assert contexts.lengths.tolist() == [4, 4] and contexts.starts.tolist() == [2, 0]
