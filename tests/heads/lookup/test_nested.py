"""Nested lookup trees and what ``speculate="auto"`` learns from them.

A lookup proposal with a smaller budget is the first nodes of a larger budget's (best-first
selection with a unique order), so every drafted greedy step also says what each smaller tree would
have committed on the same text (``DecodeStats.nested``). The policy compares sizes on those shared
steps (``SpeculationPolicy.nested_taus``) instead of on whichever prompts each size happened to be
drafted on.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import heads
from heads.lookup import LookupConfig, LookupDrafter
from heads.lookup.index import SuffixIndex, propose
from heads.policy import Observed, SpeculationPolicy
from tests.conftest import build_model, greedy_reference, random_prompt
from tree_attention.decode import DecodeStats, DraftBatch


@settings(deadline=None, max_examples=150)
@given(text=st.lists(st.integers(0, 4), min_size=2, max_size=80),
       history=st.lists(st.integers(0, 4), max_size=40),
       root=st.integers(0, 4), max_depth=st.sampled_from([2, 5, 10]))
def test_a_smaller_budget_proposes_the_first_nodes_of_a_larger_one(text, history, root, max_depth):
    own, other = SuffixIndex(4, 1, 64), SuffixIndex(4, 1, 64)
    own.extend(own.add_stream(), text)
    other.extend(other.add_stream(), history)
    sources, context = [(own, 1.0), (other, 0.8)], text[-4:] + [root]
    large = propose(context, sources, 16, max_depth)
    for budget in (1, 2, 3, 4, 8, 10):
        small = propose(context, sources, budget, max_depth)
        count = min(budget, len(large.tokens))
        assert small.tokens == large.tokens[:count] and small.parents == large.parents[:count]


def test_nested_counts_are_what_a_smaller_drafter_proposes_at_the_same_step():
    """Two drafters (budgets 10 and 4, adaptive) fed the same committed text: the larger one's
    ``nested_counts([4])`` leading nodes are exactly the smaller one's tree, step after step,
    while the adaptive budget shrinks and grows. (Given the same adaptive state: each drafter starts
    from its own budget, so the counts describe the smaller size at the larger one's state.)"""
    torch.manual_seed(0)
    text = torch.randint(0, 6, (2, 60))
    large, small = LookupDrafter(LookupConfig(budget=10, history_tokens=0)), LookupDrafter(LookupConfig(budget=4, history_tokens=0))
    for drafter in (large, small):
        drafter.reset(2)
    small.expected = list(large.expected)
    position, scales = 0, set()
    for step, accepted in enumerate([1, 1, 3, 1, 1, 1, 5, 2, 1, 4, 1, 1]):
        lengths = torch.tensor([accepted, max(1, accepted - 1)])
        tokens = torch.stack([row[position:position + accepted] for row in text])
        batch = DraftBatch(torch.zeros(2, accepted, 1), tokens, lengths, text[:, position + accepted])
        position += accepted
        big, little = large.proposals(batch), small.proposals(batch)
        counts = large.nested_counts([4, 10])
        scales.update(large.scales)
        for row in range(2):
            count = counts[row][0]
            assert big[row].tokens[:count] == little[row].tokens, (step, row)
            assert big[row].parents[:count] == little[row].parents
            assert counts[row][1] == len(big[row].tokens)
    assert len(scales) > 1  # the adaptive budget did move


@pytest.mark.parametrize("name, seed, length", [("llama", 1, 9), ("qwen2", 0, 9), ("gpt2", 0, 6)])
def test_the_decoder_counts_what_each_nested_tree_would_have_committed(name, seed, length):
    """Recorded per step and checked against the final greedy output: a tree of the first ``k``
    nodes commits one token more than the longest path of those nodes that spells the output's
    continuation. The drafted size's own count equals what the loop committed."""
    model = build_model(name)
    prompt = random_prompt(length, seed)
    prompt = torch.cat([prompt, prompt, prompt[:, :4]], dim=1)
    spec = heads.attach_heads(model, kind="lookup", tree=10, history_tokens=0)
    drafter = spec.drafter_for(10)
    seen = []
    original = drafter.propose

    def recording(batch):
        trees = original(batch)
        seen.append((trees, drafter.nested_counts([2, 4, 10])))
        return trees

    drafter.propose = recording
    from tree_attention.decode import SpeculativeDecoder

    decoder = SpeculativeDecoder(spec.target, drafter, prompt, 40, nested_sizes=[2, 4, 10])
    output, stats = decoder.run()
    assert torch.equal(output, greedy_reference(model, prompt, 40))
    generated = output[0, prompt.shape[1]:].tolist()
    expected, committed = [0, 0, 0, 0], 1  # [steps, size 2, size 4, size 10]
    for trees, counts in seen:
        tokens, parents = trees.tokens[0].tolist(), trees.parents[0].tolist()
        size = int(trees.sizes[0])
        if size == 1:  # nothing proposed: a plain step, not counted
            committed += 1
            continue
        limit = 40 - committed
        if max(trees.depths[0].tolist()) > limit - 1:  # cut to the token budget: not counted
            best = _longest(tokens, parents, size, generated[committed:])
            committed += best + 1
            continue
        expected[0] += 1
        for index, count in enumerate(counts[0], start=1):
            expected[index] += _longest(tokens, parents, 1 + count, generated[committed:]) + 1
        committed += _longest(tokens, parents, size, generated[committed:]) + 1
    assert stats.nested[0] == expected
    assert expected[3] > expected[2] > expected[1] > expected[0]  # drafts were accepted, and size mattered
    assert expected[3] >= expected[0] + 10


def _longest(tokens, parents, size, continuation) -> int:
    """Drafted nodes accepted among nodes ``1..size - 1`` (lookup: selection order is node order)."""
    return _longest_ranked(tokens[:size], parents[:size], list(range(-1, size - 1)), size, continuation)


def test_sampling_counts_nothing():
    model = build_model("llama")
    spec = heads.attach_heads(model, kind="lookup", tree=10, history_tokens=0)
    prompt = random_prompt(8, 1)
    spec.generate(torch.cat([prompt, prompt], dim=1), max_new_tokens=20, speculate="auto", do_sample=True,
                  generator=torch.Generator().manual_seed(0))
    assert spec.last_stats.nested == [] and not spec.policy.paired


def _nested_call(policy, ids, tree, steps, tokens_by_size):
    """Feed ``policy`` one finished greedy call that drafted ``tree`` nodes for ``steps`` steps."""
    choice = policy.choose(ids, SimpleNamespace(key="greedy"), 96)
    choice.update(tree=tree, nested_sizes=[size for size in sorted(policy.sizes) if size <= tree])
    row = [steps] + [tokens_by_size[size] for size in choice["nested_sizes"]]
    stats = DecodeStats(steps=[(True, 1.0, 1, 1)] * steps, row_drafted=[[tokens_by_size[tree], steps]], nested=[row])
    policy.observe(choice, stats)


def test_sizes_are_compared_on_the_same_steps():
    """Size 10 drafted on a hard prompt (tau 3, size 4 would have had 2 there), then size 4 on an
    easy one (tau 6): the observed taus say 4 > 10, the shared steps say 10 is 1.5x size 4."""
    ids = torch.ones(1, 16, dtype=torch.long)
    policy = SpeculationPolicy((4, 10))
    _nested_call(policy, ids, 10, 30, {4: 60, 10: 90})
    _nested_call(policy, ids, 4, 10, {4: 60})
    assert policy.observed[(4, "greedy", 1)].tau == 6.0 and policy.observed[(10, "greedy", 1)].tau == 3.0
    nested = policy.nested_taus("greedy", 1)
    assert nested[4] == (60 + 60) / 40 and abs(nested[10] - nested[4] * 90 / 60) < 1e-9
    assert policy.taus("greedy", 1) == nested
    key = policy.key(ids)
    policy.record_cost(key, 0, 0.5)
    policy.record_cost(key, 4, 1.0)
    policy.record_cost(key, 10, 1.1)
    choice = policy.choose(ids, SimpleNamespace(key="greedy"), 96)
    assert choice["tree"] == 10, choice  # 4.5 x 0.5 / 1.1 beats 3 x 0.5 / 1.0
    # the same history without nested counts: size 4 wins on its easy prompt
    plain = SpeculationPolicy((4, 10))
    plain.observed = {size_key: Observed(record.tokens, record.row_steps) for size_key, record in policy.observed.items()}
    for size, cost in ((0, 0.5), (4, 1.0), (10, 1.1)):
        plain.record_cost(key, size, cost)
    assert plain.choose(ids, SimpleNamespace(key="greedy"), 96)["tree"] == 4


def test_a_smaller_size_counted_on_larger_steps_is_not_explored_blindly():
    """Without nested counts an unmeasured smaller size is credited with the larger one's tau; with
    them, with its own: a size that accepts far less on the same steps is not tried."""
    ids = torch.ones(1, 16, dtype=torch.long)
    policy = SpeculationPolicy((2, 10))
    key = policy.key(ids)
    policy.record_cost(key, 0, 1.0)
    policy.record_cost(key, 10, 1.2)
    policy.observed[(10, "greedy", 1)] = Observed(3.0 * 40, 40)
    assert policy.choose(ids, SimpleNamespace(key="greedy"), 96)["tree"] == 2  # could be 3 x 1.0 / ~1.05
    policy.paired = {(2, 10, "greedy", 1): Observed(1.3 * 40, 40), (10, 10, "greedy", 1): Observed(3.0 * 40, 40)}
    choice = policy.choose(ids, SimpleNamespace(key="greedy"), 96)
    assert choice["tree"] == 10 and not choice["exploring"]


def test_auto_with_lookup_learns_nested_taus_and_stays_identical():
    model = build_model("qwen2")
    spec = heads.attach_heads(model, kind="lookup", tree=8, history_tokens=0)
    for seed in range(3):
        prompt = random_prompt(10, seed)
        prompt = torch.cat([prompt, prompt], dim=1)
        assert torch.equal(spec.generate(prompt, max_new_tokens=48, speculate="auto"),
                           greedy_reference(model, prompt, 48))
    nested = spec.policy.nested_taus("greedy", 1)
    assert nested and all(nested[a] <= nested[b] for a, b in zip(sorted(nested), sorted(nested)[1:]))
    assert min(nested) == min(spec.policy.sizes)


def test_a_step_that_proposed_nothing_is_marked_and_left_out_of_the_sizes_tau():
    """Lookup before the text repeats verifies the roots alone: such steps are marked None. The
    call's verdict on drafting counts them (row_drafted: what drafting gives on this text); the
    policy's tau for the size and its step costs leave them out (row_empty), and so does the plain
    cost."""
    model = build_model("llama")
    fresh = random_prompt(12, 5)
    spec = heads.attach_heads(model, kind="lookup", tree=8, history_tokens=0)
    spec.generate(fresh, max_new_tokens=30)
    stats = spec.last_stats
    flags = [step[0] for step in stats.steps]
    assert None in flags and True in flags, flags
    asked = [step for step in stats.steps if step[0] is not False]
    assert stats.row_drafted[0] == [sum(step[2] for step in asked), len(asked)]
    assert stats.row_empty[0] == flags.count(None) and all(step[2] == 1 for step in asked if step[0] is None)
    proposed = sum(step[2] for step in stats.steps if step[0]) / flags.count(True)
    assert abs(stats.slowest_row_tau(proposed=True) - proposed) < 1e-9
    assert stats.slowest_row_tau() < proposed
    policy = SpeculationPolicy((8,))
    choice = policy.choose(fresh, SimpleNamespace(key="greedy"), 30)
    choice["tree"], choice["learns"] = 8, True
    policy.observe(choice, stats)
    assert choice["plain_steps"] == flags.count(False) and choice["drafted_steps"] == flags.count(True)
    assert abs(policy.observed[(8, "greedy", 1)].tau - proposed) < 1e-9
    from heads.controller import mean_cost  # the steps that proposed, the first left out (one row: their median)

    assert policy.step_costs[(policy.key(fresh), 8)] == mean_cost([step for step in stats.steps if step[0]], True)


def test_medusa_default_trees_are_nested_by_their_selection_order():
    """A default Medusa tree of ``m`` nodes is the ``m`` first of a larger one's best-first selection
    (``selection_ranks``), prior table or measured."""
    from heads.medusa.drafter import resolve_tree, selection_ranks

    for accuracy in (None, [[0.7, 0.2, 0.05], [0.5, 0.3, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]):
        large = resolve_tree(16, 4, accuracy)
        ranks = selection_ranks(large, 4, accuracy)
        assert sorted(ranks[1:]) == list(range(15 + 1)) and ranks[0] == -1
        for size in (1, 2, 4, 8):
            small = resolve_tree(size, 4, accuracy)
            assert {large.paths[node - 1] for node in range(1, large.size) if ranks[node] < size} == set(small.paths)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_decoder_counts_nested_medusa_trees(name, toy_target):
    """As for lookup, against the final greedy output: a default tree of ``m`` nodes holds the nodes
    ranked below ``m`` in the selection order; a custom tree is not counted."""
    model = toy_target if name == "llama" else build_model(name)
    spec = heads.attach_heads(model, kind="medusa", tree=16, share_lm_head=True)
    drafter = spec.drafter_for(16)
    assert drafter.nests
    seen = []
    original = drafter.propose

    def recording(batch):
        trees = original(batch)
        seen.append((trees, drafter.nested_ranks[0], drafter.nested_counts([2, 4, 16])[0]))
        return trees

    drafter.propose = recording
    from tree_attention.decode import SpeculativeDecoder

    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]) if name == "llama" else random_prompt(8, 2)
    output, stats = SpeculativeDecoder(spec.target, drafter, prompt, 40, nested_sizes=[2, 4, 16]).run()
    assert torch.equal(output, greedy_reference(model, prompt, 40))
    generated = output[0, prompt.shape[1]:].tolist()
    expected, committed = [0, 0, 0, 0], 1
    for trees, ranks, counts in seen:
        tokens, parents = trees.tokens[0].tolist(), trees.parents[0].tolist()
        continuation = generated[committed:]
        full = _longest_ranked(tokens, parents, ranks, 16, continuation)
        if max(trees.depths[0].tolist()) > 40 - committed - 1:
            committed += full + 1
            continue
        expected[0] += 1
        for index, count in enumerate(counts, start=1):
            expected[index] += _longest_ranked(tokens, parents, ranks, count, continuation) + 1
        committed += full + 1
    assert stats.nested[0] == expected
    if name == "llama":  # the toy target's progressions: drafts accepted, and size mattered
        assert expected[3] > expected[1] > expected[0]
    custom = spec.drafter_for([[0], [0, 0]])
    assert not custom.nests
    _, stats = SpeculativeDecoder(spec.target, custom, prompt, 10, nested_sizes=[2]).run()
    assert stats.nested == []


def _longest_ranked(tokens, parents, ranks, count, continuation) -> int:
    """Drafted nodes accepted among the nodes ranked below ``count``."""
    depth = {0: 0}
    best = 0
    for node in range(1, len(tokens)):
        parent = parents[node]
        if ranks[node] < count and parent in depth and depth[parent] < len(continuation) \
                and tokens[node] == continuation[depth[parent]]:
            depth[node] = depth[parent] + 1
            best = max(best, depth[node])
    return best


@pytest.mark.parametrize("sizes", [[0], [-2], [2.5], [True], ["4"]])
def test_bad_nested_sizes_are_refused(sizes):
    from tree_attention.decode import SpeculativeDecoder

    model = build_model("llama")
    spec = heads.attach_heads(model, kind="lookup", tree=4, history_tokens=0)
    with pytest.raises(ValueError, match="nested_sizes must be positive tree sizes"):
        SpeculativeDecoder(spec.target, spec.drafter_for(4), random_prompt(6, 0), 8, nested_sizes=sizes)
