"""Acceptance by position both ways, from hand-built accepted lengths: prefix survival
``P(accepted >= k)`` and conditional ``P(accept at k | accepted k - 1)``, in ``DecodeStats``,
in the report ``measure`` aggregates over calls (``selfdraft bench``/``check``/``train``), and
printed by ``selfdraft bench``."""

from __future__ import annotations

import pytest
import torch

from training import evaluate
from tree_attention.decode import DecodeStats


def _stats(lengths: list[int], depth: int) -> DecodeStats:
    stats = DecodeStats(accepted_lengths=list(lengths))
    stats.finish(depth)
    return stats


def test_decode_stats_survival_and_conditional_by_hand():
    # 8 steps: accepted 0, 1, 1, 2, 3, 3, 3, 0 drafted tokens of a depth-4 tree
    stats = _stats([0, 1, 1, 2, 3, 3, 3, 0], 4)
    # >= 1: 6 of 8; >= 2: 4 of 8; >= 3: 3 of 8; >= 4: none
    assert stats.prefix_survival == pytest.approx([6 / 8, 4 / 8, 3 / 8, 0.0])
    assert stats.prefix_survival == stats.acceptance_by_position
    # of the 6 that accepted 1, 4 accepted a 2nd; of those 4, 3 a 3rd; of those 3, none a 4th
    assert stats.conditional_acceptance == pytest.approx([6 / 8, 4 / 6, 3 / 4, 0.0])
    as_dict = stats.as_dict()
    assert as_dict["prefix_survival"] == as_dict["acceptance_by_position"]
    assert as_dict["conditional_acceptance"] == pytest.approx([6 / 8, 4 / 6, 3 / 4, 0.0])


def test_conditional_is_undefined_past_the_deepest_accepted_depth():
    stats = _stats([1, 0, 1, 1], 4)  # nothing reaches depth 2
    assert stats.prefix_survival == pytest.approx([3 / 4, 0.0, 0.0, 0.0])
    assert stats.conditional_acceptance == [pytest.approx(3 / 4), 0.0, None, None]
    assert DecodeStats.conditional_rates([]) == []
    assert DecodeStats.conditional_rates([1.0, 1.0, 0.5]) == [1.0, 1.0, 0.5]


class _Spec:
    """A stand-in speculative model whose ``generate`` reports given accepted lengths per call."""

    def __init__(self, calls: list[tuple[list[int], int]]) -> None:
        self.calls = iter(calls)
        self.backbone = None

    def generate(self, ids, attention_mask=None, max_new_tokens=1, **settings):
        lengths, depth = next(self.calls)
        self.last_stats = _stats(lengths, depth)
        self.last_stats.new_tokens = sum(lengths) + len(lengths)
        self.last_stats.target_forwards = self.last_stats.row_forwards = len(lengths) + 1
        return torch.cat([ids, torch.zeros(1, max_new_tokens, dtype=ids.dtype)], dim=1)


def test_measure_aggregates_both_ways_over_calls():
    """Two calls, the second with a shallower tree: its steps count as rejections past its depth.
    Over the 6 steps [2, 0, 3 | 1, 2, 2]: >= 1: 5, >= 2: 4, >= 3: 1."""
    spec = _Spec([([2, 0, 3], 3), ([1, 2, 2], 2)])
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]])]
    report = evaluate.measure(spec, prompts, 4, plain=False, warmup=False)
    assert report.prefix_survival == pytest.approx([5 / 6, 4 / 6, 1 / 6])
    assert report.acceptance_by_position == report.prefix_survival
    assert report.conditional_acceptance == pytest.approx([5 / 6, 4 / 5, 1 / 4])
    keys = report.to_dict()
    assert {"acceptance_by_position", "prefix_survival", "conditional_acceptance", "tau"} <= set(keys)


def test_bench_prints_both_ways():
    from training.commands.bench import format_rates

    assert format_rates([0.75, 2 / 3, None]) == "0.75 0.67 -"
    assert format_rates([]) == "-"
