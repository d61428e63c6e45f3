"""Nested lookup trees: a lookup proposal with a smaller budget is the first nodes of a larger
budget's (best-first selection with a unique order), so a node-order prefix of a lookup tree, which
``speculate="auto"`` verifies when the whole tree would not pay, is the smaller budget's tree.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import heads
from heads.lookup import LookupConfig, LookupDrafter
from heads.lookup.index import SuffixIndex, propose
from tests.conftest import build_model, greedy_reference, random_prompt
from tree_attention.decode import DecodeStats
from tree_attention.draft_batch import DraftBatch


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


def test_a_resized_drafter_proposes_the_first_nodes_of_the_configured_one():
    """Two drafters (budget 10, adaptive budget scale) fed the same committed text, one resized to 4
    and back: its trees are the configured one's first nodes, step after step, while the adaptive
    budget shrinks and grows, and the same trees once resized back (its rows' state was kept).
    (Without ``extend``: a row that drafts deeper after a fully accepted step does so at its own
    depth limit, which a smaller budget lowers.)"""
    torch.manual_seed(0)
    text = torch.randint(0, 6, (2, 60))
    large, small = (LookupDrafter(LookupConfig(budget=10, history_tokens=0, extend=1)) for _ in range(2))
    for drafter in (large, small):
        drafter.reset(2)
    position, scales = 0, set()
    for step, accepted in enumerate([1, 1, 3, 1, 1, 1, 5, 2, 1, 4, 1, 1]):
        small.resize(None if step >= 10 else 4)
        lengths = torch.tensor([accepted, max(1, accepted - 1)])
        tokens = torch.stack([row[position:position + accepted] for row in text])
        batch = DraftBatch(torch.zeros(2, accepted, 1), tokens, lengths, text[:, position + accepted])
        position += accepted
        big, little = large.proposals(batch), small.proposals(batch)
        scales.update(large.scales)
        for row in range(2):
            assert len(little[row].tokens) <= (4 if step < 10 else 10)
            assert big[row].tokens[:len(little[row].tokens)] == little[row].tokens, (step, row)
            assert big[row].parents[:len(little[row].tokens)] == little[row].parents
            if step >= 10:
                assert little[row].tokens == big[row].tokens
    assert len(scales) > 1  # the adaptive budget did move
