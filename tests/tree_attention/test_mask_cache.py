"""Tree mask, position ids and the kept cache against plain sequential forwards (logits compared)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heads.backbone import inspect_backbone
from tests.conftest import ARCHITECTURES, VOCAB, build_model, random_prompt
from tree_attention import cache as cache_ops
from tree_attention.mask import (
    additive_mask, layout_masks, prefill_attention_mask, tree_attention_mask, tree_position_ids, tree_visibility,
)
from tree_attention.tree import Tree, from_choices
from tree_attention.verify import Acceptance

CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)]
IMPLEMENTATIONS = ("sdpa", "eager")


def _prefill(target, prompt):
    cache = cache_ops.new_cache()
    length = prompt.shape[1]
    mask = prefill_attention_mask(length, target.layout, target.dtype, prompt.device)
    target.forward(prompt, torch.arange(length)[None], mask, cache, "last")
    return cache


def _random_tree(seed: int) -> Tree:
    template = from_choices(CHOICES)
    generator = torch.Generator().manual_seed(seed)
    return template.with_tokens(torch.randint(3, VOCAB, (template.size,), generator=generator))


def _path_tokens(tree: Tree, node: int) -> list[int]:
    nodes = torch.nonzero(tree.ancestors[node]).flatten()
    return tree.tokens[nodes].tolist()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_tree_logits_equal_per_branch_sequential_logits(name, implementation):
    """Every node's logits in the tree forward equal a plain causal forward over prefix + its path."""
    model = build_model(name, attn_implementation=implementation)
    target = inspect_backbone(model)
    prompt = random_prompt(15, seed=4)  # longer than the sliding windows of the tiny Mistral/Gemma-2
    cache = _prefill(target, prompt)
    tree = _random_tree(seed=5)
    mask = tree_attention_mask(15, tree.ancestors, tree.depths, target.layout, target.dtype)
    _, logits = target.forward(tree.tokens[None], tree_position_ids(15, tree.depths), mask, cache, "all")
    for node in range(tree.size):
        sequence = torch.cat([prompt[0], torch.tensor(_path_tokens(tree, node))])[None]
        with torch.no_grad():
            expected = model(sequence).logits[0, -1]
        torch.testing.assert_close(logits[0, node], expected, rtol=1e-4, atol=1e-4, msg=f"{name} node {node}")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_kept_cache_equals_sequential_cache(name):
    """After keeping a non-contiguous path, the cache equals the cache of feeding that path in order,
    and the next forward on it gives the logits of a full sequential forward."""
    model = build_model(name)
    target = inspect_backbone(model)
    prompt = random_prompt(13, seed=6)
    cache = _prefill(target, prompt)
    tree = _random_tree(seed=7)
    mask = tree_attention_mask(13, tree.ancestors, tree.depths, target.layout, target.dtype)
    target.forward(tree.tokens[None], tree_position_ids(13, tree.depths), mask, cache, "all")
    node = tree.size - 3  # a deep node not at the end of the node order
    path = torch.nonzero(tree.ancestors[node]).flatten()
    assert not torch.equal(path, torch.arange(path.numel()))
    cache_ops.keep_path(cache, 13, path)
    kept = path.numel()
    assert int(cache.get_seq_length()) == 13 + kept

    sequence = torch.cat([prompt[0], tree.tokens[path]])[None]
    reference_cache = _prefill(target, sequence)
    for layer, reference_layer in zip(cache.layers, reference_cache.layers):
        torch.testing.assert_close(layer.keys, reference_layer.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.values, reference_layer.values, rtol=1e-4, atol=1e-5)

    next_token = torch.tensor([[5]])
    position = 13 + kept
    step_mask = tree_attention_mask(position, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                                    target.layout, target.dtype)
    _, logits = target.forward(next_token, torch.tensor([[position]]), step_mask, cache, "all")
    with torch.no_grad():
        expected = model(torch.cat([sequence, next_token], dim=1)).logits[0, -1]
    torch.testing.assert_close(logits[0, 0], expected, rtol=1e-4, atol=1e-4)


def test_cache_does_not_grow_across_steps():
    model = build_model("llama")
    target = inspect_backbone(model)
    cache = _prefill(target, random_prompt(4, seed=1))
    for step in range(5):
        tree = _random_tree(seed=step)
        prefix = int(cache.get_seq_length())
        mask = tree_attention_mask(prefix, tree.ancestors, tree.depths, target.layout, target.dtype)
        target.forward(tree.tokens[None], tree_position_ids(prefix, tree.depths), mask, cache, "all")
        cache_ops.keep_path(cache, prefix, torch.tensor([0, 2]))
        assert all(layer.keys.shape[-2] == prefix + 2 for layer in cache.layers)


def test_tree_visibility_and_positions():
    tree = from_choices([(0,), (1,), (0, 0)])  # nodes: root, (0,), (1,), (0,0)
    visible = tree_visibility(2, tree.ancestors)[0].int().tolist()
    assert visible == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ]
    assert tree_position_ids(2, tree.depths).tolist() == [[2, 3, 3, 4]]


def test_sliding_window_in_the_mask():
    mask = tree_attention_mask(4, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                               3, torch.float32)
    # query at position 4 sees keys 2, 3, 4 (q - k < 3)
    assert (mask[0, 0, 0] == 0).tolist() == [False, False, True, True, True]
    layered = tree_attention_mask(4, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                                  {"full_attention": None, "sliding_attention": 3}, torch.float32)
    assert (layered["full_attention"] == 0).all()
    torch.testing.assert_close(layered["sliding_attention"], mask)


def test_additive_mask_values():
    mask = additive_mask(torch.tensor([[[True, False]]]), torch.float16)
    assert mask.dtype == torch.float16 and mask.shape == (1, 1, 1, 2)
    assert mask[0, 0, 0, 0] == 0 and mask[0, 0, 0, 1] == torch.finfo(torch.float16).min


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), queries=st.integers(1, 6), width=st.integers(0, 9), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_mask_of_a_cache_without_holes_equals_the_general_mask(rows, queries, width, seed, dtype):
    """The ragged cache's dense fast path (layout None, every cached slot visible) builds exactly the
    mask of the general path, for any new-slot visibility; with a hole or a sliding window the
    general path runs (the fast one would let a query see the hole, or keys outside its window)."""
    generator = torch.Generator().manual_seed(seed)
    cache = cache_ops.RaggedCache(rows, "cpu")
    cache.extend(None, torch.arange(width).expand(rows, width).clone())
    positions = width + torch.randint(0, 4, (rows, queries), generator=generator)
    new_visible = torch.rand(rows, queries, queries, generator=generator) < 0.5
    expected = layout_masks(torch.cat([torch.ones(rows, queries, width, dtype=torch.bool), new_visible], dim=2),
                            positions, torch.cat([cache.positions, positions], dim=1), None, dtype)
    fast = cache.mask(positions, new_visible, None, dtype)
    assert fast.dtype == dtype and torch.equal(fast, expected)
    if width:
        cache.visible = cache.visible.clone()
        cache.visible[0, 0] = False  # a hole: the general path, which hides it
        assert (cache.mask(positions, new_visible, None, dtype)[0, 0, :, 0] == torch.finfo(dtype).min).all()
        cache.visible[0, 0] = True
        windowed = cache.mask(positions, new_visible, 2, dtype)
        assert torch.equal(windowed, layout_masks(
            torch.cat([torch.ones(rows, queries, width, dtype=torch.bool), new_visible], dim=2),
            positions, torch.cat([cache.positions, positions], dim=1), 2, dtype))


def test_growing_layer_matches_concatenation_through_crops_gathers_and_row_selection():
    """The loop's cache layer appends into spare room; whatever the loop does to it (crop, gather a
    path, select rows, reset) it holds exactly what a concatenating DynamicCache holds, and appending
    does not move the history while there is room."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(0)
    growing, reference = cache_ops.new_cache(), DynamicCache()
    assert isinstance(growing, cache_ops.GrowingCache)

    def both(operation):
        operation(growing)
        operation(reference)
        for ours, theirs in zip(growing.layers, reference.layers):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)

    def append(count, rows=3):
        keys = torch.randn(rows, 2, count, 4, generator=generator)
        values = torch.randn(rows, 2, count, 4, generator=generator)
        return lambda cache: [cache.update(keys + layer, values - layer, layer) for layer in range(2)]

    both(append(5))
    assert growing.pooled() is None  # the first forward: layers appear one by one, each with its own buffers
    both(append(3))  # the second: every layer moved into one pool
    assert growing.pooled() is not None
    start = growing.layers[0].keys.data_ptr()
    for count in (1, 7):
        both(append(count))
    assert growing.layers[0].keys.data_ptr() == start  # appended in place, no reallocation
    both(lambda cache: cache_ops.crop(cache, 12))
    both(append(6))
    path = torch.tensor([[0, 2, 5], [1, 3, 3], [4, 4, 4]])
    assert growing.pooled() is not None  # this gather moves every layer's entries at once
    both(lambda cache: cache_ops.gather(cache, 12, path))
    both(append(3))
    both(lambda cache: cache_ops.gather(cache, 15, torch.tensor([2, 0])))  # one path for every row
    both(append(2))
    both(lambda cache: cache_ops.select_rows(cache, torch.tensor([2, 0])))
    assert growing.pooled() is None  # a row selection leaves new tensors: gathers go layer by layer
    both(lambda cache: cache_ops.gather(cache, 14, torch.tensor([[1, 0], [0, 1]])))
    both(append(40, rows=2))  # pooled again, with room for the 40
    assert growing.pooled() is not None
    both(lambda cache: cache_ops.crop(cache, 3))
    both(append(1, rows=2))
    both(append(100, rows=2))  # past the pool's room: moved once into a larger pool
    assert growing.pooled() is not None
    both(lambda cache: cache_ops.gather(cache, 4, torch.tensor([[0, 50, 99], [3, 3, 3]])))
    for layer in growing.layers:
        layer.reset()
    for layer in reference.layers:
        layer.reset()
    both(append(2, rows=1))


def test_layers_of_different_shapes_keep_their_own_buffers():
    """A model whose layers' keys differ in shape (here the head width, and values wider than keys)
    is never pooled; gathers and appends still hold exactly what a concatenating cache holds."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(1)
    growing, reference = cache_ops.new_cache(), DynamicCache()

    def append(count):
        for cache in (growing, reference):
            state = torch.Generator().manual_seed(count)
            for layer, width in enumerate((4, 8)):  # values wider than keys, as some attention variants have
                cache.update(torch.randn(1, 2, count, width, generator=state),
                             torch.randn(1, 2, count, width + 2, generator=state), layer)

    for count in (5, 3, 4):
        append(count)
    assert growing.pooled() is None
    path = torch.randint(0, 4, (1, 3), generator=generator)
    for cache in (growing, reference):
        cache_ops.gather(cache, 8, path)
    append(2)
    for ours, theirs in zip(growing.layers, reference.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=6), st.integers(1, 5))
def test_one_row_bookkeeping_read_late_equals_the_eager_one(steps, prompt):
    """A one-row cache without holes defers ``visible`` and ``positions`` (``keep(full=True)``); read at
    any point, they equal the eager bookkeeping of the same slots (a slot kept per path node)."""
    lazy = cache_ops.RaggedCache(1, "cpu")
    eager = cache_ops.RaggedCache(1, "cpu")
    positions = torch.arange(prompt)[None, :]
    for ragged in (lazy, eager):
        ragged.extend(torch.ones(1, prompt, dtype=torch.bool), positions)
    length = prompt
    for width, extra in steps:
        depth = min(extra, width - 1)
        query_positions = length + torch.arange(width)[None, :].clamp(max=depth)  # a chain, then siblings
        path = torch.arange(depth + 1)[None, :]
        lazy.keep(path, None, query_positions, full=True)
        eager.keep(path, torch.ones(path.shape, dtype=torch.bool), query_positions)
        length += depth + 1
        assert lazy.width == eager.width == length
        assert lazy.dense()
    assert torch.equal(lazy.positions, eager.positions)
    assert torch.equal(lazy.visible, eager.visible)
    assert lazy.positions.tolist() == [list(range(length))]
    lazy.crop(prompt + 1)  # a crop after the late read keeps both aligned
    assert lazy.width == prompt + 1 and lazy.positions.shape == (1, prompt + 1) and lazy.dense()
