"""One ``speculate="auto"`` call's per-step schedule (:class:`CallController`) and how it judges
its own drafting: what the rest of the call would cost drafting against plain steps, with rows
leaving the batch as they finish (:func:`drain_seconds`).

A batch call lasts until its last row is done, and the loop drops each row when it finishes, so
its steps get cheaper towards the end. Drafting spreads the rows out (each advances by its own
acceptance), so after the first rows finish the rest run in smaller, cheaper steps; plain steps
keep the rows together until the end. Judging a batch call by its first drafted steps (every row
still decoding, the dearest steps of the call) against its slowest row's tokens per step misjudged
it: on demo-llama at batch 4 those steps cost 9.2-9.8 ms where the steps with 1-2 rows left cost
5.6-7.2 ms; Medusa's size 2 stopped at a verdict of 0.96x in a call like one that ran to 1.22x. The
verdict now projects both remainders: each row's remaining tokens at its own rate (its tokens per
drafted step so far, blended with the policy's estimate), every step costed by how many rows it
still holds, from this call's steps and the policy's costs at fewer rows
(:attr:`heads.policy.SpeculationPolicy.row_costs`), linear in between.
"""

from __future__ import annotations

import statistics
from typing import Callable

PLAIN_STEPS = 3  # plain steps that open a call in a bucket whose plain cost is unknown
SWITCH_STEPS = 6  # drafted steps of a call before it may give up drafting
SWITCH_BELOW = 0.97  # ... when drafting realised less than this times plain decoding's speed
EXPLORE_BELOW = (0.5, 0.8)  # ... or, for a greedy call with lookup (not steady),
# below the first after SWITCH_STEPS drafted steps (a clear loss: batch 16) or below the second after
# twice as many: acceptance often grows through a reply (prompt lookup finds repeats only once there
# is text to repeat, then accepts ten tokens a step), so a first call that drafts at 0.6x early may pay
# later, and stopping it would keep the policy from ever seeing that (every reply starts without
# repeats, so this holds for every greedy lookup call, not only a size's first; the policy itself
# sends calls to plain decoding where lookup does not pay on the whole).
PRIOR_STEPS = 2  # the policy's tau for the size counts as this many of the call's drafted steps
REFRESH_STEPS = range(1, 3)  # the steps of a drafting call that refresh the plain cost (see the policy)


def costs_by_rows(steps: list[tuple], skip_first: bool = False) -> dict[int, float]:
    """Median seconds of ``steps`` (``DecodeStats.steps`` entries) per number of rows they decoded;
    the first left out with ``skip_first`` when there are others (a call's first drafted step also
    feeds the drafter the prompt, and its first step costs more than later ones)."""
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    grouped: dict[int, list[float]] = {}
    for step in steps:
        grouped.setdefault(step[3], []).append(step[1])
    return {rows: statistics.median(seconds) for rows, seconds in grouped.items()}


def mean_cost(steps: list[tuple], skip_first: bool = False) -> float:
    """Seconds per step of ``steps`` robustly: each row count's median (:func:`costs_by_rows`)
    weighted by its steps (the first left out with ``skip_first`` when there are others)."""
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    costs = costs_by_rows(steps)
    return max(1e-12, sum(costs[step[3]] for step in steps) / max(len(steps), 1))


def rows_cost(anchors: dict[int, float], rows: int) -> float:
    """Seconds of a step decoding ``rows`` rows from the measured ``anchors`` (rows -> seconds):
    linear between the nearest measured counts around it, the nearest one's beyond them."""
    if rows in anchors:
        return anchors[rows]
    below = [count for count in anchors if count < rows]
    above = [count for count in anchors if count > rows]
    if not below or not above:
        return anchors[max(below) if below else min(above)]
    low, high = max(below), min(above)
    return anchors[low] + (anchors[high] - anchors[low]) * (rows - low) / (high - low)


def drain_seconds(finish: list[float], cost: Callable[[int], float]) -> float:
    """Seconds until every row is done, when row ``i`` needs ``finish[i]`` more steps and a step
    that still decodes ``a`` rows costs ``cost(a)`` (a row leaves the batch once it is done)."""
    total, done = 0.0, 0.0
    ordered = sorted(max(0.0, steps) for steps in finish)
    for index, steps in enumerate(ordered):
        total += (steps - done) * cost(len(ordered) - index)
        done = steps
    return total


class CallController:
    """The per-step schedule of one ``auto`` call (``SpeculativeDecoder(schedule=...)``): plain steps
    while the bucket's plain cost is being measured, then drafting with the chosen size until the
    call has shown that drafting loses (see the policy's module docstring). ``prior_tau`` (the policy's
    estimate for this size and batch size, if any) is blended into each row's own evidence with the
    weight of :data:`PRIOR_STEPS` steps: a little inertia against a few unlucky steps, no more
    (acceptance differs a lot from prompt to prompt, and a call that drafts badly should stop soon).
    ``fewer_rows`` (rows -> (plain seconds, drafted seconds) with this size, either None where not
    measured) are the policy's step costs at fewer rows than the call has, which price the call's
    later steps once rows have left (:func:`drain_seconds`)."""

    def __init__(self, plain_cost: float | None, size: int, prior_tau: float | None = None,
                 refresh: bool = False, steady: bool = False,
                 fewer_rows: dict[int, tuple[float | None, float | None]] | None = None) -> None:
        self.plain_cost, self.size, self.prior_tau = plain_cost, size, prior_tau
        self.steady = steady  # acceptance does not grow through a reply: the strict threshold from the start
        self.plain_first = PLAIN_STEPS if plain_cost is None else 0
        # a refresh measures plain steps 1 and 2: a call's first step costs ~10% more than later ones
        # (measured on stories260K), which made drafting look better than the backbone's generate
        self.refresh_steps = REFRESH_STEPS if refresh and plain_cost is not None else range(0)
        self.fewer_rows = dict(fewer_rows or {})
        self.switched_at: int | None = None  # drafted steps when drafting stopped
        self.realized: float | None = None  # the last verdict: plain over drafting seconds, for the rest of the call
        self._effective: float | None = None  # see :attr:`effective`
        self._projected: tuple | None = None  # (rows' steps to finish, steps that proposed) at the last verdict
        self.drafted = 0  # this call's drafted steps so far

    def __call__(self, decoder) -> bool:
        stats = decoder.stats
        if not self.size:
            decoder.drafting = False
            return False
        if stats.steps and stats.steps[-1][0] is not False:  # drafted (None: asked, proposed nothing)
            self.drafted += 1
        if len(stats.steps) < self.plain_first or len(stats.steps) in self.refresh_steps:
            return False
        if self.plain_cost is None:  # the call's opening plain steps (the first left out) are this bucket's first measure
            self.plain_cost = statistics.median(step[1] for step in stats.steps[1:] or stats.steps)
        if self.drafted >= SWITCH_STEPS:
            self.realized = self.project(decoder)
            if self.steady:
                below = SWITCH_BELOW
            else:
                below = EXPLORE_BELOW[1] if self.drafted >= 2 * SWITCH_STEPS else EXPLORE_BELOW[0]
            if self.realized < below:
                self.switched_at = self.drafted
                decoder.drafting = False
                return False
        return True

    def project(self, decoder) -> float:
        """Plain steps' seconds over drafting's for the rest of the call (above 1: drafting pays).
        Each active row needs its remaining tokens' worth of plain steps, or that many over its own
        rate of drafted steps (tokens per drafted step so far, the policy's tau blended in); steps are
        costed by the rows they still decode. Keeps what :attr:`effective` needs."""
        stats = decoder.stats
        prior, weight = (0.0, 0.0) if self.prior_tau is None else (self.prior_tau, PRIOR_STEPS)
        remaining, finish = [], []
        for row in decoder.rows:
            tokens, steps = stats.row_drafted[row]
            remaining.append(float(max(0, decoder.max_new_tokens - len(decoder.outputs[row]))))
            finish.append(remaining[-1] / max(1e-12, (tokens + prior * weight) / max(steps + weight, 1e-12)))
        asked = [step for step in stats.steps if step[0] is not False]
        proposed = [step for step in asked if step[0]]
        plain_steps = [step for step in stats.steps if step[0] is False]
        plain = self._with_fewer_rows(costs_by_rows(plain_steps, stats.steps[0][0] is False), 0,
                                      {stats.batch_size: self.plain_cost})
        drafted = self._with_fewer_rows(costs_by_rows(asked, skip_first=True), 1)
        plain_seconds = drain_seconds(remaining, lambda rows: rows_cost(plain, rows))
        draft_seconds = drain_seconds(finish, lambda rows: rows_cost(drafted, rows))
        if proposed:
            self._projected, self._effective = (finish, proposed), None
        return plain_seconds / max(draft_seconds, 1e-12)

    @property
    def effective(self) -> float | None:
        """The call's projected seconds per step that proposed nodes, over the steps its last row
        takes, as of the last verdict (what the policy records for a call that stopped drafting);
        computed when read, not at every verdict."""
        if self._effective is None and self._projected is not None:
            finish, proposed = self._projected
            counted = proposed[1:] or proposed  # the first drafted step also fed the drafter the prompt
            costs = costs_by_rows(counted)
            anchors = self._with_fewer_rows(costs, 1)
            done = sum(costs[step[3]] for step in counted)
            self._effective = (done + drain_seconds(finish, lambda rows: rows_cost(anchors, rows))) / \
                max(len(counted) + max(finish, default=0.0), 1e-12)
        return self._effective

    @effective.setter
    def effective(self, seconds: float | None) -> None:
        self._effective, self._projected = seconds, None

    def _with_fewer_rows(self, anchors: dict[int, float], which: int, override: dict | None = None) -> dict[int, float]:
        """``anchors`` (rows -> seconds, this call's), ``override`` on top, plus the policy's costs at
        fewer rows than any of them (``which``: 0 plain, 1 drafted), each at most the smallest
        measured count's (a step over fewer rows costs no more)."""
        anchors = {**anchors, **(override or {})}
        smallest = min(anchors)
        for rows, pair in self.fewer_rows.items():
            if pair[which] is not None and rows < smallest:
                anchors[rows] = min(pair[which], anchors[smallest])
        return anchors
