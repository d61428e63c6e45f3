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
    assert math.isclose(stats.draft_seconds + stats.verify_seconds + stats.phases["prefill"] + stats.phases["result"],
                        stats.total_seconds, rel_tol=1e-9, abs_tol=1e-9)


def test_phases_in_a_batch_and_as_dict():
    model = build_model("qwen2", seed=3)
    spec = heads.attach_heads(model, kind="lookup", tree=4)
    ids, mask = left_pad([random_prompt(6, seed=4)[0], random_prompt(11, seed=5)[0]])
    spec.generate(ids, attention_mask=mask, max_new_tokens=16)
    record = spec.last_stats.as_dict()
    assert math.isclose(sum(record["phases"].values()), record["total_seconds"], rel_tol=1e-9, abs_tol=1e-9)
