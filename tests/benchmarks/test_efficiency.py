"""The efficiency's bare bound (benchmarks.common.bare_call_seconds) on a real call's statistics."""

import pytest
import torch

import heads
from benchmarks.common import bare_call_seconds, interpolate
from tests.conftest import build_model


def test_the_bare_bound_prices_each_step_at_its_own_width():
    model = build_model("llama", seed=3)
    spec = heads.attach_heads(model, kind="lookup", tree=10, history_tokens=0)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9]])
    spec.generate(prompt, max_new_tokens=24)
    stats = spec.last_stats
    widths = [step.width for step in stats.steps]
    assert len(widths) == stats.target_forwards - 1 and sum(widths) == stats.verified_nodes
    assert len(set(widths)) > 1  # lookup's trees vary: a bound at the mean width would differ
    verify = {1: 2.0, 4: 2.5, 16: 5.0}  # ms by width: concave, as measured
    bare = bare_call_seconds(stats, verify, prefill_seconds=0.010)
    expected = 0.010 + stats.phases["draft"] + sum(interpolate(verify, w) for w in widths) / 1000
    assert bare == pytest.approx(expected)
    mean = len(widths) * interpolate(verify, sum(widths) / len(widths)) / 1000
    assert bare - 0.010 - stats.phases["draft"] != pytest.approx(mean)


def test_a_call_handed_to_generate_has_no_bound():
    class Delegated:  # statistics of a call decoded by the backbone's own generate
        steps: list = []
        phases: dict = {}

    assert bare_call_seconds(Delegated(), {1: 1.0}, 0.0) is None
