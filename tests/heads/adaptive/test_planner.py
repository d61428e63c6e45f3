"""``speculate="auto"`` (heads/adaptive): the cost curve, calibrated acceptance, the per-step
planner, and outputs identical to ``generate`` whatever it decides."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch

import heads
from heads.adapter import recorded_acceptance
from heads.adaptive import AcceptanceModel, Adaptive, CostCurve
from tests.conftest import build_model, left_pad, random_prompt
from tree_attention.decode import PerRowDrafter, SpeculativeDecoder
from tree_attention.tree import TreeBatch, from_choices, prefix_batch


def _bound(model: AcceptanceModel, width: int) -> np.ndarray:
    """The upper confidence bound a choice weighs each prefix of one row's tree by."""
    gain, bonus, _ = model.prefix_estimates(width, 1)
    return gain + bonus


def test_cost_curve_interpolates_optimistically_and_keeps_buckets_apart():
    costs = CostCurve()
    assert costs.verify_seconds(1, 4) is None and costs.draft_seconds(1) == 0.0
    costs.observe_verify(1, 1, 1.0)
    costs.observe_verify(1, 16, 3.0)
    # one sample of width 16: its excess over the plain cost counts half (as if one more had cost 1.0)
    assert costs.verify_seconds(1, 16) == pytest.approx(2.0)
    for _ in range(3):
        costs.observe_verify(1, 16, 3.0)
    assert costs.verify_seconds(1, 16) == pytest.approx(1.0 + 2.0 * 4 / 5)
    assert costs.verify_seconds(1, 4) == pytest.approx(1.0 + 0.2 * 1.6)  # linear in width: the cheaper here
    for _ in range(4):
        costs.observe_verify(1, 64, 5.0)
    wide, narrow = costs.verify_seconds(1, 64), costs.verify_seconds(1, 16)
    assert wide == pytest.approx(1.0 + 4.0 * 4 / 5)
    assert costs.verify_seconds(1, 32) == pytest.approx(narrow + (wide - narrow) / 3)  # linear in the width
    assert costs.verify_seconds(1, 256) == pytest.approx(wide)  # past the widest: its cost
    costs.observe_verify(1, 8, 9.0)  # a noisy narrower width is priced no higher than a wider one
    assert costs.verify_seconds(1, 8) == pytest.approx(costs.verify_seconds(1, 16))
    costs.observe_verify(5, 1, 10.0)  # rows 4..7 share a bucket, apart from batch 1
    assert costs.verify_seconds(4, 1) == pytest.approx(10.0) and costs.verify_seconds(1, 1) == pytest.approx(1.0)
    assert costs.verify_seconds(16, 1) == pytest.approx(10.0)  # an unseen bucket borrows the nearest
    costs.observe_draft(1, 5.0, first=True)  # a request's first propose is kept apart
    costs.observe_draft(1, 0.5, first=False)  # one sample: counted half, beside one free one
    assert costs.draft_seconds(1) == pytest.approx(0.25)


def test_costs_follow_the_machine_speed_and_keep_their_ratios():
    costs = CostCurve()
    for _ in range(32):
        costs.observe_verify(1, 1, 1.0)
        costs.observe_verify(1, 9, 3.0)
    def steady(width):  # its samples unaged
        return float(costs.verify_curve(1, np.array([float(width)]), aged=False)[0])

    before = steady(9)
    for _ in range(16):  # the machine runs at half speed now: plain steps take twice as long
        costs.observe_verify(1, 1, 2.0)
    assert costs.speed == pytest.approx(2.0)
    # every width is priced at the current speed: the tree timed in the fast stretch keeps its cost
    # relative to the plain step, and the plain step's stored cost holds
    assert steady(9) == pytest.approx(2 * before)
    assert steady(1) == pytest.approx(2.0)
    for _ in range(16):  # trees alone do not move the speed (their cost depends on the step before)
        costs.observe_verify(1, 9, 6.0)
    assert costs.speed == pytest.approx(2.0)
    for _ in range(16):
        costs.observe_verify(1, 1, 1.0)
    assert costs.speed == pytest.approx(1.0) and steady(9) < 2 * before
    assert costs.summary()["speed"] == 1.0


def test_fewer_rows_are_never_priced_above_more_rows():
    costs = CostCurve()
    for _ in range(8):
        costs.observe_verify(16, 1, 16.0)
        costs.observe_verify(16, 3, 27.0)
    costs.observe_verify(8, 9, 38.0)
    # no plain step timed over 8 rows yet: priced as 16 rows, no run of plain steps needed first
    assert costs.reference(8) == 16 and costs.reference(32) is None
    assert costs.verify_seconds(8, 1) == pytest.approx(16.0) and costs.verify_seconds(8, 9) == pytest.approx(27.0)
    costs.observe_verify(8, 1, 26.0)  # one noisy plain step over 8 rows, then steady ones
    for _ in range(3):
        costs.observe_verify(8, 1, 12.0)
    assert costs.reference(8) == 8 and costs.reference(4) == 8  # its own table now (4 rows: its next larger)
    assert costs.verify_seconds(8, 1) == pytest.approx(12.0)  # (the median of its timings)
    for _ in range(4):  # noisy plain steps over 4 rows: no higher than over 8
        costs.observe_verify(4, 1, 30.0)
    assert costs.reference(4) == 4 and costs.verify_seconds(4, 1) == pytest.approx(costs.verify_seconds(8, 1))
    assert costs.verify_seconds(16, 9) == pytest.approx(costs.verify_seconds(16, 3))  # (past the widest: its cost)
    assert costs.verify_seconds(8, 9) > costs.verify_seconds(16, 9)  # wider than any timed over 16 rows: not capped


def test_an_option_of_varying_widths_is_priced_from_its_own_steps():
    """A drafter whose trees vary in width verifies widths that are each timed rarely: the width curve
    at its expected width stays optimistic (each width's few samples shrink toward the plain cost)
    however often it drafts. Once the option has a few steps of its own, their median prices it."""
    costs, option = CostCurve(), (None, 8)
    for _ in range(8):
        costs.observe_verify(1, 1, 10.0)
    for width in (2, 3, 4, 5, 6, 7, 8, 9):  # one step each: the option's steady cost is 15 at any width
        costs.observe_verify(1, width, 15.0)
        if width < 5:
            costs.observe_option_verify(1, 15.0, option)
    curve = costs.verify_seconds(1, 6)
    assert float(costs.verify_curve(1, np.array([6.0]), aged=False)[0]) == pytest.approx(12.5)  # half the excess
    assert 10.0 < curve <= 12.5  # (aged: a little less)
    assert costs.step_prices(1, [option], [np.ones(6)], drafting=False)[0, 0] == pytest.approx(curve)  # too few steps of its own yet
    costs.observe_option_verify(1, 15.0, option)
    assert costs.step_prices(1, [option], [np.ones(6)], drafting=False)[0, 0] == pytest.approx(10.0 + 5.0 * 4 / 5)
    assert costs.step_prices(1, [option], [np.ones(6)], drafting=False)[0, 1] == pytest.approx(10.0 + 5.0 * 4 / 5)
    assert costs.step_prices(1, [(None, 4)], [np.ones(6)], drafting=False)[0, 0] == pytest.approx(curve)  # another option: the curve


def test_a_drafter_that_often_proposes_nothing_is_priced_at_its_mean_verify_not_at_its_mean_width():
    """Verify seconds rise most from one node to two. A drafter proposing 9 nodes on half its steps and
    none on the others costs, on average, half a plain and half a 9-wide verify, less than one verify
    of its mean width (5) would; priced at that width it would lose to plain steps it beats."""
    costs, option = CostCurve(), (None, 8)
    for width, seconds in [(1, 1.0), (2, 1.6), (5, 1.7), (9, 1.8)]:
        for _ in range(8):
            costs.observe_verify(1, width, seconds)
    half = np.array([1.0] + [0.5] * 8)  # the chance the padded tree reaches each node (root: 1)
    price = costs.step_prices(1, [option], [half], drafting=False)[0, 1]
    assert price == pytest.approx(0.5 * 1.0 + 0.5 * float(costs.verify_curve(1, np.array([9.0]), aged=False)[0]))
    assert price < float(costs.verify_curve(1, np.array([half.sum()]), aged=False)[0])
    assert costs.step_prices(1, [option], [np.ones(9)], drafting=False)[0, 1] == pytest.approx(
        float(costs.verify_curve(1, np.array([9.0]), aged=False)[0]))  # always 9 wide: the curve's value


def test_an_option_is_timed_over_its_empty_steps_too():
    """The acceptance model counts the steps an option proposed nothing (a node's presence below 1), so
    its verify price is the mean over all its steps, not over the ones that proposed a tree."""
    from tree_attention.planning import StepRecord

    adaptive = Adaptive([0.9] * 4, width=5)
    planner = adaptive.planner("greedy", True)
    roots = (TreeBatch.roots_only(torch.zeros(1, dtype=torch.long)), torch.zeros(1, 1, dtype=torch.long),
             torch.ones(1, dtype=torch.long))
    chain = (_chain_batch(5), torch.arange(5)[None], torch.tensor([5]))
    for _ in range(8):
        planner.observe(StepRecord("plain", 1, 1, 0.0, 1.0, 1), *roots)
    planner._age = 8
    assert planner.draft(1)
    option = planner.choice.option
    planner.observe(StepRecord("drafted", 1, 5, 0.1, 2.0, 5, first_draft=True), *chain)  # switched in: untimed
    for step in range(8):
        record = StepRecord("drafted", 1, 5, 0.1, 2.0, 5) if step % 2 else StepRecord("empty", 1, 1, 0.1, 1.0, 1)
        planner.observe(record, *(chain if step % 2 else roots))
    timed = adaptive.costs.verify_by_option[option][1]
    assert timed.evidence == 8 and timed.value == pytest.approx(1.5)
    assert adaptive.costs.verify[1][1].evidence == 7  # the call's first step untimed; no empty step among them


def test_drafting_is_priced_at_its_mean_and_a_verify_width_at_its_median():
    """A verify of one width does the same work every step: its spread is the machine's noise, and
    one slow step must not price it. A drafter's work varies (chains stop by confidence): most steps
    stop early, a few run deep, and the median of such steps understates what drafting costs."""
    costs, option = CostCurve(), (None, 8)
    for seconds in (1.0, 1.0, 1.0, 9.0):
        costs.observe_verify(1, 1, seconds)
        costs.observe_draft(1, seconds, first=False, mode=option)
        costs.observe_option_verify(1, 10.0 + seconds, option)
    assert costs.verify_seconds(1, 1) == pytest.approx(1.0)
    assert costs.draft_seconds(1, option, aged=False) == pytest.approx(3.0 * 4 / 5)  # the mean, shrunk
    price = costs.step_prices(1, [option], [np.ones(3)], drafting=False)[0, 1]
    assert price == pytest.approx(1.0 + (13.0 - 1.0) * 4 / 5)  # the option's own steps: their mean
    assert costs.summary()["draft_ms"][str(option)][1] == pytest.approx(3000.0)


def _request(model: AcceptanceModel, outcomes: list[int]) -> None:
    """One request's drafted steps on a chain of 4: ``outcomes`` drafted tokens accepted per step."""
    for accepted in outcomes:
        model.observe(_chain_batch(5), torch.arange(accepted + 1)[None], torch.tensor([accepted + 1]))


def test_a_new_request_weighs_earlier_ones_by_how_much_requests_differ():
    """Acceptance varies between requests (repetitive code, fresh prose): where earlier requests'
    first-node acceptance spread widely, a new request gets their evidence as a prior of a few rows
    (the rates kept) and its own steps take over; where they were alike, their evidence stands."""
    def trained(rates: list[float]) -> tuple[AcceptanceModel, float | None]:
        model = AcceptanceModel(width=5)
        for rate in rates:
            model.new_request()  # (each request's start, as a call's)
            hits = int(round(40 * rate))
            _request(model, [1] * hits + [0] * (40 - hits))
        before = model._estimates()[1].copy()
        weight = model.new_request()
        if weight is not None:
            assert np.allclose(model._estimates()[1], before)  # the rates stand
            assert model._estimates()[2][1] == pytest.approx(weight)  # their evidence: the weight's rows
        _request(model, [4] * 8)  # this request: every drafted node accepted
        return model, weight

    differ, weight = trained([0.2, 0.95, 0.3, 0.9, 0.25])
    alike, none = trained([0.5, 0.55, 0.45, 0.5, 0.5])
    assert none is None and 1.0 <= weight < 8.0, (none, weight)
    assert differ.prefix_estimates(5, 1)[0][-1] > 2.0 > 1.0 > alike.prefix_estimates(5, 1)[0][-1]
    assert AcceptanceModel(width=5).new_request() is None  # no earlier requests: nothing to cut


def test_steps_that_also_compact_the_cache_are_not_timed_and_untimed_prices_plan_one_step():
    from tree_attention.planning import StepRecord

    adaptive = Adaptive(width=3)
    planner = adaptive.planner("greedy", True)
    roots = (TreeBatch.roots_only(torch.zeros(4, dtype=torch.long)), torch.zeros(4, 1, dtype=torch.long),
             torch.ones(4, dtype=torch.long))
    for rows, seconds in [(4, 9.0), (4, 1.0), (4, 1.0), (2, 7.0), (2, 0.5)]:
        planner.observe(StepRecord("plain", rows, 1, 0.0, seconds, rows), *roots)
    # the call's first step (9.0) and the first after rows finished (7.0) are dropped
    assert adaptive.costs.verify_seconds(4, 1) == pytest.approx(1.0)
    assert adaptive.costs.verify_seconds(2, 1) == pytest.approx(0.5)
    assert adaptive.costs.known(4, 1) and not adaptive.costs.known(4, 3)
    adaptive.costs.observe_draft(4, 0.1, False, (None, None))
    assert adaptive.costs.known(4, 1, (None, None)) and not adaptive.costs.known(2, 1, (None, None))


def test_rows_that_finish_keep_drafting_priced_from_more_rows_instead_of_timing_plain_steps_again():
    from tree_attention.planning import StepRecord

    adaptive = Adaptive([0.9] * 4, width=5)
    planner = adaptive.planner("greedy", True)
    roots = (TreeBatch.roots_only(torch.zeros(4, dtype=torch.long)), torch.zeros(4, 1, dtype=torch.long),
             torch.ones(4, dtype=torch.long))
    for _ in range(6):
        assert not planner.draft(4) and planner.choice.reason == "time plain steps"
        planner.observe(StepRecord("plain", 4, 1, 0.0, 1.0, 4), *roots)
    assert adaptive.costs.reference(2) == 4 and adaptive.costs.reference(8) is None
    assert planner.draft(2) and planner.choice.reason == "measure an option never drafted"  # (as over 4 rows)
    assert adaptive.planner("greedy", True)._plan(8).reason == "time plain steps"  # more rows: timed first


def test_the_plain_reference_is_timed_in_a_plan_of_plain_steps_and_not_from_empty_steps():
    """Nor from the first plain step after drafting ones (a switch costs more on a CPU)."""
    from tree_attention.planning import StepRecord

    adaptive = Adaptive([0.9] * 4, width=5)
    planner = adaptive.planner("greedy", True)
    roots = (TreeBatch.roots_only(torch.zeros(1, dtype=torch.long)), torch.zeros(1, 1, dtype=torch.long),
             torch.ones(1, dtype=torch.long))
    assert not planner.draft(1) and planner.choice.reason == "time plain steps"
    for _ in range(6):  # a width-1 forward amid drafted ones (the drafter proposed nothing): not timed
        planner.observe(StepRecord("empty", 1, 1, 0.001, 3.0, 1), *roots)
    assert 1 not in adaptive.costs.verify.get(1, {})
    assert not planner.draft(1)  # the first plain step after drafting ones (a switch): not timed
    planner.observe(StepRecord("plain", 1, 1, 0.0, 2.0, 1), *roots)
    assert 1 not in adaptive.costs.verify.get(1, {})
    for step in range(5):  # the plan serves plain steps until the reference rests on a few of them
        assert not planner.draft(1)
        planner.observe(StepRecord("plain", 1, 1, 0.0, 1.0, 1), *roots)
    assert adaptive.costs.verify[1][1].evidence == 5 and adaptive.costs.verify_seconds(1, 1) == pytest.approx(1.0)
    planner._age = 8  # the plain plan is over: the next one measures the drafter
    assert planner.draft(1) and planner.choice.reason == "measure an option never drafted"


def test_a_plan_priced_from_an_untimed_width_serves_one_step():
    adaptive = Adaptive([0.9] * 4, width=5)
    planner = adaptive.planner("greedy", True)
    for _ in range(8):  # a chain of 4, accepted whole, on 8 rows: measured
        planner.models[0].observe(_chain_batch(5), torch.arange(5)[None], torch.tensor([5]))
    for _ in range(4):  # a plain plan's timings
        adaptive.costs.observe_verify(1, 1, 1.0)
    adaptive.costs.observe_draft(1, 0.1, False, (None, None))
    choice = planner._plan(1)  # width 5 never timed: priced as the widest timed (optimistic)
    assert choice.draft and choice.tentative
    assert planner.draft(1) and planner._age == 1
    planner.draft(1)  # planned again at once
    assert planner.summary.reasons["drafting pays"] == 2
    adaptive.costs.observe_verify(1, 5, 1.5)
    assert not planner._plan(1).tentative


def test_a_plan_that_repeats_the_last_one_serves_twice_as_long():
    """Planning costs a share of a small model's step: a plan choosing what the last one chose serves
    8, 16, then 32 steps; a different choice, or other rows, starts again at 8."""
    adaptive = Adaptive([0.9] * 4, width=5)
    planner = adaptive.planner("greedy", True)
    for _ in range(8):  # a chain of 4, accepted whole, on 8 rows: measured
        planner.models[0].observe(_chain_batch(5), torch.arange(5)[None], torch.tensor([5]))
    for width in (1, 5):
        for _ in range(8):
            adaptive.costs.observe_verify(1, width, 1.0 if width == 1 else 1.2)
    adaptive.costs.observe_draft(1, 0.1, False, (None, None))
    plans = []
    for _ in range(8 + 16 + 32 + 32):
        before = sum(planner.summary.reasons.values())
        planner.draft(1)
        if sum(planner.summary.reasons.values()) > before:
            plans.append(planner._serves)
    assert plans == [8, 16, 32, 32]
    planner.draft(2)  # other rows: planned again, and served 8 steps
    assert planner._serves == 8


def test_an_option_ahead_only_by_an_aged_cost_is_timed_in_one_step_then_the_best_at_unaged_costs_serves():
    """A cost timed long ago is priced toward 0 (so that it is timed again), which may choose an
    option that at its unaged costs loses to another drafting option though it beats a plain step:
    one step times it again (a two-mode drafter drafted its slow mode for 8 steps at a time), and the
    best at unaged costs serves the rest of the plan without planning again."""
    adaptive = Adaptive([0.9] * 8, width=9, sizes=(2, 8))
    planner = adaptive.planner("greedy", True, _Sized(nested=False))
    for model, width in zip(planner.models, (3, 9)):  # both sizes accepted whole on 8 rows
        for _ in range(8):
            model.observe(_chain_batch(width), torch.arange(width)[None], torch.tensor([width]), width)
    adaptive.costs.observe_draft(1, 10.0, False, (None, 8))  # size 8 drafts slowly, timed long ago
    for width in (1, 3, 9) * 300:  # ... 900 verify forwards ago (its timing's weight halves every 64)
        adaptive.costs.observe_verify(1, width, 1.0)
    adaptive.costs.observe_draft(1, 0.1, False, (None, 2))  # size 2: cheap, timed now
    assert planner.draft(1)  # point estimates: size 2 at 3 / 1.1 s, size 8 at 9 / 11 s, plain at 1 / 1 s
    choice = planner.choice
    assert choice.option == (None, 8) and choice.reason == "timed again" and not choice.tentative
    assert choice.then.draft and choice.then.option == (None, 2) and choice.then.then is None
    assert planner.draft(1) and planner.choice is choice.then and planner._age == 2
    for _ in range(6):
        assert planner.draft(1) and planner.choice is choice.then
    assert dict(planner.summary.reasons) == {"timed again": 1}  # one plan: 8 steps
    adaptive.costs.observe_draft(1, 10.0, False, (None, 8))  # timed again: its price is its cost
    choice = planner._plan(1)
    assert choice.option == (None, 2) and not choice.tentative and choice.reason == "drafting pays"


def _chain_batch(width: int) -> TreeBatch:
    template = from_choices([(0,) * depth for depth in range(1, width)])
    return TreeBatch.from_template(template, torch.zeros(1, width, dtype=torch.long))


def test_acceptance_counts_what_each_prefix_would_have_accepted():
    model = AcceptanceModel()
    trees = _chain_batch(5)  # root + 4 drafted nodes in a chain
    for accepted in [3, 3, 1, 3]:  # accepted path lengths (drafted nodes)
        model.observe(trees, torch.arange(accepted + 1)[None], torch.tensor([accepted + 1]))
    exists, rate, seen, *_ = model._estimates()
    assert list(exists[1:5]) == [1, 1, 1, 1] and list(seen[1:5]) == [8, 8, 8, 8]  # 4 rows + the prior's 4
    # the chain's prior (uninformed): depth d reached with 0.5 ** d, weighted as 4 steps
    assert rate[1] == pytest.approx((4 + 4 * 0.5) / 8) and rate[4] == pytest.approx((0 + 4 * 0.5 ** 4) / 8)
    assert rate[1] > rate[2] > rate[4]  # node 1 always accepted, node 4 never
    gains = _bound(model, 5)
    assert np.all(np.diff(gains) >= 0) and gains[0] == 0.0
    # rows that held fewer nodes (lookup's ragged trees) count only the nodes they held
    ragged = TreeBatch.from_trees([prefix_batch(trees, 3).row(0), trees.row(0)])
    model.observe(ragged, torch.tensor([[0, 1, 2, 2], [0, 1, 1, 1]]), torch.tensor([3, 2]))
    exists, _, seen, *_ = model._estimates()
    assert list(seen[1:5]) == [10, 10, 9, 9] and exists[4] == pytest.approx((4 + 1 + 4) / (6 + 4))


def test_the_rows_left_after_rows_finish_are_predicted_from_their_own_steps():
    """Rows finish at their token budget, those that accept most first: the rows left accept less. Over
    fewer rows than the model has seen, a rows bucket's own steps move the prediction; over as many rows as
    ever seen (batch-1 traffic alone included), the pooled estimate stands."""
    model, single = AcceptanceModel(width=5), AcceptanceModel(width=5)
    chain = _chain_batch(5)
    four = TreeBatch.from_trees([chain.row(0)] * 4)
    for _ in range(8):  # four rows accepting every node
        model.observe(four, torch.arange(5)[None].expand(4, 5), torch.full((4,), 5))
        single.observe(chain, torch.arange(5)[None], torch.tensor([5]))
    pooled = model.prefix_estimates(5, 4)[0].copy()
    assert model.prefix_estimates(5, 2)[0] == pytest.approx(pooled)  # no step over 2 rows yet
    assert single.prefix_estimates(5, 1)[0] == pytest.approx(single._estimates()[3])  # batch-1 traffic: pooled
    two = TreeBatch.from_trees([chain.row(0)] * 2)
    for _ in range(4):  # the two rows left accept the first node alone
        model.observe(two, torch.tensor([[0, 1, 1, 1, 1]] * 2), torch.full((2,), 2))
    left, all_rows = model.prefix_estimates(5, 2)[0], model.prefix_estimates(5, 4)[0]
    assert left[1] == pytest.approx(all_rows[1], abs=0.05)  # the first node: as before
    assert left[-1] < all_rows[-1] - 1.0  # deeper ones: their own steps pull them down
    assert all_rows[-1] == pytest.approx(model.prefix_estimates(5, 7)[0][-1])  # (4..7 rows: one bucket)


def test_a_smaller_size_does_not_count_as_missing_nodes_of_a_larger_one():
    model = AcceptanceModel(width=5)  # one model serves nested sizes 1..4 (greedy)
    root_and_one = (torch.arange(2)[None], torch.tensor([2]))
    for _ in range(4):
        model.observe(_chain_batch(5), *root_and_one)  # size 4: every node proposed
    for _ in range(40):
        model.observe(_chain_batch(2), *root_and_one, capacity=2)  # size 1: nodes 2-4 never asked for
    exists, rate, seen, *_ = model._estimates()
    assert exists[1] == 1 and exists[4] == 1  # not diluted to 8 / 48 by the size-1 steps
    assert seen[1] == 48 and seen[4] == 8 and rate[1] > 0.9


def test_fading_reopens_a_question_after_plain_steps():
    model = AcceptanceModel()
    trees = _chain_batch(3)
    for _ in range(8):  # node 1 rejected 8 times
        model.observe(trees, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    low = _bound(model, 3)[1]  # the bound on what node 1 alone would accept
    rate = model._estimates()[1][1]
    for _ in range(200):  # plain steps: no evidence, old evidence fades
        model.fade()
    assert _bound(model, 3)[1] > low + 0.1  # the bound widened: the question is open
    # the estimate itself stays where the evidence put it: the prior (0.5) fades with the evidence
    assert model._estimates()[1][1] == pytest.approx(rate)


def test_a_high_prior_does_not_come_back_after_plain_steps():
    model = AcceptanceModel(prior_by_depth=[0.9, 0.8])
    trees = _chain_batch(3)
    for _ in range(32):  # node 1 rejected on every step
        model.observe(trees, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    for _ in range(400):  # long after: the prior's 0.9 outweighed the faded evidence before
        model.fade()
    assert model._estimates()[1][1] < 0.2


def test_a_drafter_that_proposed_nothing_is_asked_again_after_plain_steps():
    model = AcceptanceModel()
    empty = _chain_batch(1)
    root = (torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    model.observe(_chain_batch(4), *root)
    for _ in range(30):  # lookup before the text repeats: roots alone
        model.observe(empty, *root)
    low = _bound(model, 4)[-1]
    for _ in range(300):
        model.fade()
    assert _bound(model, 4)[-1] > 2 * low


def test_recorded_acceptance_is_the_mean_over_mixes():
    assert recorded_acceptance({"a": {"acceptance_by_position": [0.8, 0.4]},
                                "b": {"acceptance_by_position": [0.6]}}) == pytest.approx([0.7, 0.4])
    assert recorded_acceptance({}) == []
    mixed = {"greedy": {"acceptance_by_position": [0.9]}, "warm": {"acceptance_by_position": [0.4], "temperature": 0.7}}
    assert recorded_acceptance(mixed) == pytest.approx([0.9])  # each rule its own prior
    assert recorded_acceptance(mixed, sampled=True) == pytest.approx([0.4])
    # an adapter trained for every temperature records a list per mix, an entry per temperature
    both = {"prose": [{"acceptance_by_position": [0.8], "tau": 1.8},
                      {"acceptance_by_position": [0.5], "tau": 1.5, "temperature": 0.7}]}
    assert recorded_acceptance(both) == pytest.approx([0.8])
    assert recorded_acceptance(both, sampled=True) == pytest.approx([0.5])
    adaptive = Adaptive([0.9], 3, sampled_prior=[0.4])
    adaptive.planner("sampled key", False)
    assert adaptive.model("sampled key").prior_by_depth == [0.4] and adaptive.model("greedy").prior_by_depth == [0.9]


class SlowStarter:
    """Knows the greedy continuation. The first propose of every request sleeps ``first_seconds``
    and its first ``bad_steps`` proposals are wrong; then it proposes the true continuation, a
    chain of ``depth``: the drafter that once locked ``auto`` into plain decoding for good."""

    def __init__(self, continuation: list[int], depth: int, first_seconds: float, bad_steps: int,
                 prompt_length: int) -> None:
        self.continuation, self.depth = continuation, depth
        self.first_seconds, self.bad_steps = first_seconds, bad_steps
        self.prompt_length = prompt_length
        self.template = from_choices([(0,) * level for level in range(1, depth + 1)])

    def reset(self):
        self.seen, self.calls = 0, 0

    def propose(self, features, tokens, root):
        # tokens: the entries committed since the last propose (the prompt, and plain steps' roots)
        self.seen += tokens.shape[1]
        self.position = self.seen - self.prompt_length  # the root's index in the continuation
        if self.calls == 0:
            time.sleep(self.first_seconds)
        wrong = self.calls < self.bad_steps
        self.calls += 1
        nodes = [root] + [(self.continuation[index] + wrong) % 97 if index < len(self.continuation) else 0
                          for index in range(self.position + 1, self.position + 1 + self.depth)]
        return self.template.with_tokens(torch.tensor(nodes))


def timed_as_modelled(planner):
    """``planner`` observing steps timed by a fixed model instead of the clock (a loaded test
    machine must not decide the test): a request's first propose 50 ms, a steady one 0.2 ms; a
    verify forward 1 ms plus 0.2 ms per node beyond the root."""
    observe = planner.observe

    def modelled(record, trees, paths, lengths):
        draft = 0.0 if record.kind == "plain" else 0.05 if record.first_draft else 0.0002
        observe(dataclasses.replace(record, draft_seconds=draft, verify_seconds=0.001 + 0.0002 * (record.width - 1)),
                trees, paths, lengths)

    planner.observe = modelled
    return planner


def test_a_slow_and_poor_start_of_every_request_does_not_lock_auto_into_plain():
    model = build_model("llama", seed=3)
    spec = heads.attach_heads(model, kind="medusa")  # only for its target view
    adaptive = Adaptive()
    taus = []
    for call in range(6):
        prompt = random_prompt(8, seed=call)
        expected = model.generate(prompt, max_new_tokens=60, do_sample=False)
        continuation = expected[0, prompt.shape[1]:].tolist()
        drafter = PerRowDrafter([SlowStarter(continuation, depth=4, first_seconds=0.0, bad_steps=3,
                                             prompt_length=prompt.shape[1])])
        planner = timed_as_modelled(adaptive.planner("greedy", True, drafter))
        with torch.no_grad():
            output, stats = SpeculativeDecoder(spec.target, drafter, prompt, 60, planner=planner).run()
        assert torch.equal(output, expected)
        taus.append(stats.tau)
    kinds = [step.kind for step in stats.steps]
    assert kinds.count("drafted") > 0.7 * len(kinds), kinds
    assert min(taus[1:]) > 2.5, taus


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("kind", ["medusa", "eagle", "lookup", "hybrid"])
def test_auto_is_token_identical_on_batches(name, kind):
    model = build_model(name, seed=5)
    spec = heads.attach_heads(model, kind="medusa" if kind == "hybrid" else kind)
    if kind == "hybrid":
        spec.set_lookup(True)
    ids, mask = left_pad([random_prompt(length, seed=length) for length in (4, 9, 6)])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    for _ in range(3):  # the planner learns across calls; any cut it takes is lossless
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=24, speculate="auto"), expected)
    speculation = spec.last_stats.speculation
    assert speculation["auto"] and sum(speculation["steps"].values()) == len(spec.last_stats.steps)
    # the report is built when first read, once; the plan's own seconds are a phase of their own
    assert spec.last_stats.speculation is speculation and json.dumps(spec.last_stats.as_dict())
    assert spec.last_stats.phases["plan"] > 0 and all(step.plan_seconds >= 0 for step in spec.last_stats.steps)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", ["medusa", "eagle", "draft", "lookup", "hybrid"])
def test_every_size_and_mode_mixed_per_step_is_token_identical(name, kind, monkeypatch):
    """A planner that takes a plain step or drafts with a random option (mode and size) every step:
    each resize keeps the drafter's state, so the output is ``generate``'s whatever it picks."""
    from heads.adaptive import CallPlanner, Choice

    model = build_model(name, seed=11)
    # (the draft kind's adaptive chain offers one size: its fixed chain, several)
    options = dict(draft_model=build_model(name, seed=12), adaptive=False) if kind == "draft" else {}
    spec = heads.attach_heads(model, kind="medusa" if kind == "hybrid" else kind, **options)
    if kind == "hybrid":
        spec.set_lookup(True)
    picks = torch.Generator().manual_seed(3)
    drafted = set()

    def random_plan(self, rows):
        pick = int(torch.randint(len(self.options) + 1, (1,), generator=picks))
        if pick == 0:
            return Choice(False, reason="test")
        drafted.add(self.options[pick - 1])
        return Choice(True, *self.options[pick - 1], nodes=2, reason="test")

    monkeypatch.setattr(CallPlanner, "_plan", random_plan)
    monkeypatch.setattr("heads.adaptive.planner.REPLAN_EVERY", 1)
    ids, mask = left_pad([random_prompt(length, seed=length) for length in (5, 8)])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for _ in range(3):
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20, speculate="auto"), expected)
    assert len({size for _, size in drafted}) >= 3, drafted  # several sizes were drafted


def test_a_resized_drafter_keeps_its_state(monkeypatch):
    """The target as its own draft model accepts every drafted token, as long as the draft's cache
    stays in step with the text: resized every step at random, it still does."""
    from heads.adaptive import CallPlanner, Choice

    model = build_model("llama", seed=11)
    spec = heads.attach_heads(model, kind="draft", draft_model=model, depth=8, top_k=1, total_tokens=8,
                              adaptive=False)
    picks = torch.Generator().manual_seed(4)

    def random_plan(self, rows):
        pick = int(torch.randint(len(self.options) + 1, (1,), generator=picks))
        return Choice(False, reason="test") if pick == 0 else Choice(True, *self.options[pick - 1], nodes=2, reason="test")

    monkeypatch.setattr(CallPlanner, "_plan", random_plan)
    monkeypatch.setattr("heads.adaptive.planner.REPLAN_EVERY", 1)
    prompt = random_prompt(6, seed=2)
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
    assert torch.equal(spec.generate(prompt, max_new_tokens=40, speculate="auto"), expected)
    drafted = [step for step in spec.last_stats.steps if step.kind == "drafted"]
    assert len({step.width for step in drafted}) >= 3  # several sizes
    assert all(step.tokens == step.width for step in drafted[:-1]), [(s.width, s.tokens) for s in drafted]


def test_a_modal_drafter_gets_its_mode_per_step_and_back_after_the_call():
    model = build_model("llama", seed=7)
    spec = heads.attach_heads(model, kind="medusa")
    spec.set_lookup(True)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    for _ in range(4):
        assert torch.equal(spec.generate(prompt, max_new_tokens=30, speculate="auto"), expected)
    speculation = spec.last_stats.speculation
    sizes = spec.adaptive.sizes
    # one acceptance model per option: lookup alone (its own budget), the merged trees at each size
    assert set(speculation["acceptance"]) == {"lookup", *(f"merged/{size}" for size in sizes)}
    assert spec.drafter._forced is None  # a speculate=None call drafts as the drafter itself chooses
    assert spec.drafter.base.template.size == spec.drafter_for(None).base.template.size  # and at its own size


def test_a_switch_between_plain_and_drafting_is_timed_apart_and_paid_once_a_plan():
    """The first step after a switch costs more on a CPU (a drafter catches up): it moves neither the
    steady tables nor the speed, its extra seconds are kept per direction, and a plan that switches
    pays them once over its steps, so neither side is priced at the switch's cost."""
    from heads.adaptive import Choice
    from heads.adaptive.planner import REPLAN_EVERY
    from tree_attention.planning import StepRecord

    adaptive = Adaptive([0.9] * 4, width=3)
    planner = adaptive.planner("greedy", True)
    roots = (TreeBatch.roots_only(torch.zeros(1, dtype=torch.long)), torch.zeros(1, 1, dtype=torch.long),
             torch.ones(1, dtype=torch.long))
    chain = (_chain_batch(3), torch.arange(3)[None], torch.tensor([3]))
    planner.draft(1)
    for _ in range(6):
        planner.observe(StepRecord("plain", 1, 1, 0.0, 1.0, 1), *roots)
    planner.choice = Choice(True, None, None, nodes=3, reason="test")
    planner.observe(StepRecord("drafted", 1, 3, 0.9, 1.5, 3), *chain)  # switched in: catching up, untimed
    assert adaptive.costs.draft_seconds(1, (None, None)) == 0.0 and 3 not in adaptive.costs.verify[1]
    for _ in range(4):
        planner.observe(StepRecord("drafted", 1, 3, 0.3, 1.5, 3), *chain)
    assert adaptive.costs.draft_seconds(1, (None, None), aged=False) == pytest.approx(0.3 * 4 / 5)
    planner.choice = Choice(False, reason="test")
    planner.observe(StepRecord("plain", 1, 1, 0.0, 1.8, 1), *roots)  # switched out: 0.8 s more than steady
    assert adaptive.costs.verify_seconds(1, 1) == pytest.approx(1.0)
    assert adaptive.costs.switch_seconds(False) == pytest.approx(0.8)
    assert adaptive.costs.switch_seconds(True) == 0.0  # (no steady drafting timed then to compare with)
    planner.choice = Choice(True, None, None, nodes=3, reason="test")
    planner.observe(StepRecord("drafted", 1, 3, 0.9, 1.5, 3), *chain)  # switched in again: now measured
    assert adaptive.costs.switch_seconds(True) == pytest.approx(0.9 - 0.3 * 4 / 5)
    planner._last_plain = False  # a plan made after drafted steps: plain pays the switch once
    for _ in range(8):
        planner.models[0].observe(*chain)
    choice = planner._plan(1)
    assert choice.plain_seconds == pytest.approx(1.0 + 0.8 / REPLAN_EVERY)


def test_an_exploring_step_out_of_plain_steps_pays_both_switches_in_full():
    """A step that drafts only because the bound says it may pay serves one step: out of a plain
    stretch it pays the switch into drafting and back in full, not a plan's share of them (here the
    bound pays at a share and not in full); once drafting, it pays no switch and is explored."""
    from heads.adaptive import Choice
    from tree_attention.planning import StepRecord

    def plan(switch_in: float, last_plain: bool) -> str:
        adaptive = Adaptive([0.5] * 4, width=3)
        planner = adaptive.planner("greedy", True)
        roots = (TreeBatch.roots_only(torch.zeros(1, dtype=torch.long)), torch.zeros(1, 1, dtype=torch.long),
                 torch.ones(1, dtype=torch.long))
        planner.draft(1)
        for _ in range(6):
            planner.observe(StepRecord("plain", 1, 1, 0.0, 1.0, 1), *roots)
        planner.choice = Choice(True, None, None, nodes=3, reason="test")
        for step in range(8):  # node 1 accepted on every other step: half a token against 1.8 s
            planner.observe(StepRecord("drafted", 1, 3, 0.5, 1.3, 2), _chain_batch(3), torch.arange(3)[None],
                            torch.tensor([1 + step % 2]))
        adaptive.costs.observe_switch(True, switch_in)
        planner._last_plain = last_plain
        return planner._plan(1).reason

    assert plan(0.0, True) == "it may pay"
    assert plan(0.4, True) == "plain is fastest"  # (a plan's share, 0.05 s, would still explore)
    assert plan(0.4, False) == "it may pay"


class _Sized:
    """A SizedDrafter stub: records the sizes it is set to."""

    def __init__(self, nested: bool) -> None:
        self.nested, self.sizes = nested, []

    def resize(self, tree):
        self.sizes.append(tree)


@pytest.mark.parametrize("nested", [True, False])
def test_options_are_first_measured_at_their_largest_size(nested):
    """Nested sizes share one acceptance model, which a step at the largest size fills for every
    smaller size: exploring starts there (one model to fill, not one step at each size). Sizes that
    are not nested each get their own steps, the largest first."""
    adaptive = Adaptive([0.9] * 8, width=9, sizes=(2, 4, 8))
    drafter = _Sized(nested)
    planner = adaptive.planner("greedy", True, drafter)
    for _ in range(4):  # the plain reference
        adaptive.costs.observe_verify(1, 1, 1.0)
    assert planner.draft(1) and planner.choice.reason == "measure an option never drafted"
    assert drafter.sizes == [8]
    for _ in range(8):  # a plan's worth of rows drafted at size 8
        planner.acceptance.observe(_chain_batch(9), torch.arange(3)[None], torch.tensor([3]), 9)
    planner._age = 1
    planner.draft(1)
    if nested:
        assert planner.choice.reason != "measure an option never drafted"
    else:
        assert planner.choice.reason == "measure an option never drafted" and drafter.sizes[-1] == 4
