"""The loop's time split (``DecodeStats.phases``) covers the whole call: its phases sum to the total."""

from __future__ import annotations

import math

import pytest

import heads
from conftest import build_model, left_pad, random_prompt
from tree_attention.decode import PHASES


@pytest.mark.parametrize("kind, options", [("medusa", {"num_heads": 2, "tree": 6}), ("lookup", {"tree": 8}),
                                           ("eagle", {"total_tokens": 4})])
def test_phases_sum_to_the_total(kind, options):
    model = build_model("llama", seed=1)
    spec = heads.attach_heads(model, kind=kind, **options)
    prompt = random_prompt(10, seed=2).repeat(1, 2)
    spec.generate(prompt, max_new_tokens=24)
    stats = spec.last_stats
    assert set(stats.phases) == set(PHASES)
    assert all(value >= 0.0 for value in stats.phases.values())
    assert math.isclose(sum(stats.phases.values()), stats.total_seconds, rel_tol=1e-9, abs_tol=1e-9)
    assert stats.phases["forward"] > 0 and stats.phases["prefill"] > 0
    assert math.isclose(stats.draft_seconds + stats.verify_seconds + stats.phases["prefill"] + stats.phases["result"]
                        + stats.phases["plan"], stats.total_seconds, rel_tol=1e-9, abs_tol=1e-9)


def test_phases_in_a_batch_and_as_dict():
    model = build_model("qwen2", seed=3)
    spec = heads.attach_heads(model, kind="lookup", tree=4)
    ids, mask = left_pad([random_prompt(6, seed=4)[0], random_prompt(11, seed=5)[0]])
    spec.generate(ids, attention_mask=mask, max_new_tokens=16)
    record = spec.last_stats.as_dict()
    assert math.isclose(sum(record["phases"].values()), record["total_seconds"], rel_tol=1e-9, abs_tol=1e-9)


def test_draft_batches_chain_row_by_row_even_when_padded_wider():
    import torch

    from tree_attention.draft_batch import DraftBatch

    # the first batch is padded wider than its longest row (its longest row left the batch)
    first = DraftBatch(torch.arange(2 * 5 * 2, dtype=torch.float32).view(2, 5, 2),
                       torch.tensor([[1, 2, 0, 0, 0], [3, 0, 0, 0, 0]]), torch.tensor([2, 1]), torch.tensor([9, 9]))
    later = DraftBatch(-torch.ones(2, 2, 2), torch.tensor([[4, 5], [6, 0]]), torch.tensor([2, 1]), torch.tensor([7, 8]))
    both = first.then(later)
    assert both.lengths.tolist() == [4, 2] and both.roots.tolist() == [7, 8]
    assert both.tokens[0, :4].tolist() == [1, 2, 4, 5] and both.tokens[1, :2].tolist() == [3, 6]
    assert torch.equal(both.features[0, :2], first.features[0, :2])
    assert torch.equal(both.features[0, 2:4], later.features[0]) and torch.equal(both.features[1, 1], later.features[1, 0])
