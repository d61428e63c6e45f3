"""How long a draft chain should be: the draft's confidence calibrated against what the target
accepts, and the seconds a draft forward and a verified node cost, both learned while serving.

A chain node is drafted from the draft's distribution at its position; its *confidence* is the
largest probability's share of that distribution's collision mass, ``p1^2 / sum p^2``
(:func:`dominance`), known before the node's token is chosen, so a decision made from it never
looks at the drawn token: sampled chains stay lossless. :class:`ChainCalibration`
holds, per rule mode (greedy or sampled), depth and confidence bin, the running rate at which the
target accepted such a node given that its parent was accepted, seeded from the confidence
(or an adapter's recorded table), and what a node's confidence predicts of its child's. :class:`ChainCosts` holds running means of the seconds of one
draft forward, of a verify step as a line in its node count, and of the tokens a step commits.

The drafter (:mod:`heads.draft.drafter`) keeps a node while its expected gain (the product of the
calibrated acceptances along the chain) pays for one more verified node, and runs one more draft
forward while the expected gain of the next node pays for that forward plus a node, both priced at
the rate the steps currently commit tokens per second.
"""

from __future__ import annotations

from typing import Mapping

import torch

BINS = 10
"""Confidence bins of width 1/BINS."""
DEPTHS = 4
"""Depth buckets: depths 1, 2, 3 and 4 or deeper."""
PRIOR_WEIGHT = 4.0
"""Pseudo-observations behind a table's seed (the confidence itself, or a recorded rate)."""
MODES = ("greedy", "sampled")
CALIBRATION_VERSION = 2
"""Version 2 bins :func:`dominance`; version 1 tables binned the largest probability itself (loaded
as no table: their bins measure another quantity)."""
DECAY = 0.9
"""Running means of costs: the weight the old mean keeps at each new measurement."""
DRAFT_PRIOR = 0.15
"""A draft forward in target steps, until one is measured."""
NODE_PRIOR = 0.04
"""A verified node in target steps, the prior of the fitted slope (held with :data:`SLOPE_WEIGHT`)."""
SLOPE_WEIGHT = 4.0
GAIN_DECAY = 0.7
"""Drafted tokens a step gains: the weight the old mean keeps at each drafted (or replayed) step."""
MAX_PROBE_INTERVAL = 16
"""While drafting does not pay, a step drafts anyway after this many plain steps at most (the
interval doubles after each probe that did not pay, from 1)."""


def dominance(probabilities: torch.Tensor, largest: torch.Tensor | None = None) -> torch.Tensor:
    """``[...]`` of distributions ``[..., V]``: the largest probability's share of the collision
    mass, ``p1^2 / sum_i p_i^2``, in ``[p1, 1]`` (1 for a point mass); ``largest``: ``p1`` where the
    caller has it. It measures how far the top token stands out from its competitors, where ``p1``
    itself also falls with the mass a small draft spreads over a long tail of its vocabulary, so
    bins of ``p1`` lump together tokens the target accepts rarely and almost always
    (docs/draft.md)."""
    if largest is None:
        largest = probabilities.amax(dim=-1)
    return largest.square() / probabilities.square().sum(dim=-1)


def confidence_bins(confidence: torch.Tensor) -> torch.Tensor:
    """Bin index ``[...]`` long of confidences in [0, 1]."""
    return (confidence * BINS).long().clamp(0, BINS - 1)


def confidence_bin(confidence: float) -> int:
    """Bin index of one confidence in [0, 1]."""
    return min(max(int(confidence * BINS), 0), BINS - 1)


def depth_bucket(depth: int) -> int:
    """Bucket index of a depth >= 1."""
    return min(depth, DEPTHS) - 1


def _table(value: float = 0.0) -> list[list[float]]:
    return [[value] * BINS for _ in range(DEPTHS)]


class ChainCalibration:
    """Acceptance given the parent accepted, per mode, depth bucket and confidence bin; and per
    mode, depth bucket and the *parent's* confidence bin, the expected calibrated acceptance of a
    node (what one more draft forward is expected to buy, known before it runs): the current rates
    averaged over the bins children of such parents were seen in.

    Counts are kept without their prior, as host floats ``[DEPTHS][BINS]`` per mode (a few
    additions per step: cheaper than tensor operations); :attr:`accepted`, :attr:`seen` and
    :meth:`rates` give tensors. A rate's prior (:data:`PRIOR_WEIGHT` pseudo-observations) is the
    recorded table when there is one, else halfway between the confidence and 1 at depth 1
    (optimistic, so that a bin gets nodes verified before its rate decides) and the rate one depth
    up below it; the expected next acceptance's prior is the rate of a node of the parent's bin at
    the child's depth."""

    def __init__(self, prior: Mapping | None = None) -> None:
        self.counts = {mode: {"accepted": _table(), "seen": _table(),
                              "children": [[[0.0] * BINS for _ in range(BINS)] for _ in range(DEPTHS)]}
                       for mode in MODES}  # children[depth bucket][parent bin][child bin]
        # a chain node's alternatives (greedy), per depth bucket: how many were observed, how many
        # were the target's token, and the sum of their draft probabilities (what a calibrated
        # draft would expect)
        self.alternatives = {"seen": [0.0] * DEPTHS, "accepted": [0.0] * DEPTHS, "mass": [0.0] * DEPTHS}
        self.prior = {}
        if prior is not None and prior.get("version") != CALIBRATION_VERSION:
            prior = None  # (an older table's bins measure another quantity)
        for mode in MODES:
            recorded = prior.get("modes", {}).get(mode) if prior is not None else None
            self.prior[mode] = None if recorded is None else (recorded["acceptance"], recorded["following"])

    @property
    def accepted(self) -> dict[str, torch.Tensor]:
        return {mode: torch.tensor(self.counts[mode]["accepted"], dtype=torch.float64) for mode in MODES}

    @property
    def seen(self) -> dict[str, torch.Tensor]:
        return {mode: torch.tensor(self.counts[mode]["seen"], dtype=torch.float64) for mode in MODES}

    def rate_lists(self, mode: str) -> tuple[list[list[float]], list[list[float]]]:
        """``(acceptance, following)`` ``[DEPTHS][BINS]``: the calibrated acceptance given the parent
        accepted, and at [bucket of a child's depth, its parent's bin] the child's expected one."""
        counts, prior = self.counts[mode], self.prior[mode]
        rates, above = [], [0.5 + (b + 0.5) / BINS / 2 for b in range(BINS)]
        for depth in range(DEPTHS):
            base = above if prior is None else prior[0][depth]
            above = [(a + PRIOR_WEIGHT * p) / (n + PRIOR_WEIGHT)
                     for a, n, p in zip(counts["accepted"][depth], counts["seen"][depth], base)]
            rates.append(above)
        bases = rates if prior is None else prior[1]
        following = []
        for depth in range(DEPTHS):
            row = []
            for parent in range(BINS):
                children = counts["children"][depth][parent]
                expected = sum(n * rate for n, rate in zip(children, rates[depth]))
                row.append((expected + PRIOR_WEIGHT * bases[depth][parent]) / (sum(children) + PRIOR_WEIGHT))
            following.append(row)
        return rates, following

    def alternative_scales(self) -> list[float]:
        """Per depth bucket, the factor that turns the draft probability ``p`` of one of its
        next-best tokens at a level into the chance, under greedy decoding, that the target picks
        it there given the parent accepted: ``min(1, scale * p)``, the ratio of the alternatives
        the target picked to the probability the draft gave them. Most such tokens have a small
        ``p``, so a ratio over all of them resolves small probabilities that confidence bins
        would lump together. Learned while serving only (an adapter records none); seeded with
        the draft taken at its word (1, :data:`PRIOR_WEIGHT` tokens' worth) at depth 1 and the
        factor one depth up below it."""
        counts, scales, above = self.alternatives, [], 1.0
        for depth in range(DEPTHS):
            above = (counts["accepted"][depth] + PRIOR_WEIGHT * above) / (counts["mass"][depth] + PRIOR_WEIGHT)
            scales.append(above)
        return scales

    def observe_alternative(self, depth: int, probability: float, accepted: bool) -> None:
        """An alternative of draft probability ``probability`` at ``depth`` whose parent the target
        accepted, and whether the target picked it (greedy: known whether or not it was verified)."""
        self.alternatives["seen"][depth_bucket(depth)] += 1
        self.alternatives["mass"][depth_bucket(depth)] += probability
        self.alternatives["accepted"][depth_bucket(depth)] += float(accepted)

    def rates(self, mode: str) -> torch.Tensor:
        """``[DEPTHS, BINS]`` calibrated acceptance given the parent accepted."""
        return torch.tensor(self.rate_lists(mode)[0], dtype=torch.float64)

    def next_rates(self, mode: str) -> torch.Tensor:
        """``[DEPTHS, BINS]``: at [bucket of a child's depth, its parent's bin], the child's
        expected calibrated acceptance."""
        return torch.tensor(self.rate_lists(mode)[1], dtype=torch.float64)

    def observe(self, mode: str, depth: int, bin_index: int, accepted: bool) -> None:
        """A verified node at ``depth`` whose parent was accepted."""
        counts = self.counts[mode]
        counts["seen"][depth_bucket(depth)][bin_index] += 1
        counts["accepted"][depth_bucket(depth)][bin_index] += float(accepted)

    def observe_following(self, mode: str, depth: int, parent_bin: int, child_bin: int) -> None:
        """A node drafted at ``depth`` (>= 2): its parent's confidence bin and its own."""
        self.counts[mode]["children"][depth_bucket(depth)][parent_bin][child_bin] += 1

    def to_dict(self) -> dict:
        """The calibrated rates as JSON (what an adapter records, the prior when it is loaded)."""
        def table(values: list[list[float]]) -> list:
            return [[round(float(v), 4) for v in row] for row in values]

        modes = {}
        for mode in MODES:
            rates, following = self.rate_lists(mode)
            modes[mode] = {"acceptance": table(rates), "following": table(following),
                           "observed": int(sum(map(sum, self.counts[mode]["seen"])))}
        return {"version": CALIBRATION_VERSION, "bins": BINS, "depths": DEPTHS, "modes": modes}


def check_calibration(table: object) -> None:
    """ValueError unless ``table`` is what :meth:`ChainCalibration.to_dict` writes."""
    if not isinstance(table, Mapping):
        raise ValueError(f"calibration must be an object; got {type(table).__name__}")
    if (table.get("version") not in (1, CALIBRATION_VERSION) or table.get("bins") != BINS
            or table.get("depths") != DEPTHS):
        raise ValueError(f"calibration must have version {CALIBRATION_VERSION} (or 1), {BINS} bins and {DEPTHS} depth "
                         f"buckets; got version {table.get('version')!r}, bins {table.get('bins')!r}, depths "
                         f"{table.get('depths')!r}")
    modes = table.get("modes")
    if not isinstance(modes, Mapping) or not set(modes) <= set(MODES):
        raise ValueError(f"calibration.modes must map some of {MODES} to tables; got {modes!r}")
    for mode, block in modes.items():
        rows = block.get("acceptance") if isinstance(block, Mapping) else None
        following = block.get("following") if isinstance(block, Mapping) else None
        shaped = all(isinstance(rows, list) and len(rows) == DEPTHS and
                     all(isinstance(row, list) and len(row) == BINS for row in rows) for rows in (rows, following))
        values = [v for row in rows + following for v in row] if shaped else []
        if not shaped or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0
                                 for v in values):
            raise ValueError(f"calibration.modes.{mode} must hold 'acceptance' and 'following' tables "
                             f"[{DEPTHS}][{BINS}] of rates in [0, 1]")


class ChainCosts:
    """Running means, in seconds, of one chain level (a draft forward of all rows, one token each,
    and the host arithmetic that decides on its logits), of a steady
    step's feeding forward, of a plain verify step (one node a row), of a drafted verify step as
    ``intercept + slope * (nodes - 1)``, and of the tokens a row commits per step; the slope is a
    weighted least-squares fit over steps of two or more nodes, held towards :data:`NODE_PRIOR` of
    their mean (chains of one length alone cannot tell it apart). Plain steps stay out of the line:
    on a CPU the second query of a forward costs far more than each one after it (matrix products
    of one row take another kernel than those of several), so a line through both would charge that
    jump to every node and leave it out of what drafting at all costs. Whether drafting pays
    compares the running means of the drafted tokens a step kept and of its seconds beyond a plain
    step (its proposal, and its verify step on the line against the plain step's mean), both over
    the drafted steps and the replayed plain steps (one-token chains); a call's first drafted step,
    which catches up on the prompt, counts in the gain only."""

    def __init__(self) -> None:
        self.draft: float | None = None
        self.weight = self.nodes = self.seconds = self.nodes2 = self.cross = 0.0  # decayed sums of (nodes - 1, s)
        self.step_seconds: float | None = None
        self.plain: float | None = None  # seconds of a verify step of one node a row
        self.tokens = 1.0
        self.gain = 1.0  # drafted tokens a row kept per drafted step (optimistic until measured)
        self.propose: float | None = None  # seconds of a steady drafted step's proposal
        self.drafted_nodes = 0.0  # verified nodes of a drafted step beyond the root
        self.feed: float | None = None  # seconds of a steady step's feeding forward
        self.interval, self.waited = 1, 0

    def add_draft(self, seconds: float) -> None:
        self.draft = seconds if self.draft is None else DECAY * self.draft + (1 - DECAY) * seconds

    def add_step(self, nodes: int, verify_seconds: float, step_seconds: float, tokens: float) -> None:
        """One step: its widest row's node count (root included), the seconds from the end of its
        proposal to the next one, its whole seconds and the tokens a row committed on average."""
        if nodes <= 1:
            self.plain = verify_seconds if self.plain is None else DECAY * self.plain + (1 - DECAY) * verify_seconds
        else:
            x = float(nodes - 1)
            self.weight = DECAY * self.weight + 1
            self.nodes = DECAY * self.nodes + x
            self.seconds = DECAY * self.seconds + verify_seconds
            self.nodes2 = DECAY * self.nodes2 + x * x
            self.cross = DECAY * self.cross + x * verify_seconds
        self.step_seconds = step_seconds if self.step_seconds is None else \
            DECAY * self.step_seconds + (1 - DECAY) * step_seconds
        self.tokens = DECAY * self.tokens + (1 - DECAY) * tokens

    def add_drafted(self, gain: float, propose_seconds: float, nodes: int, *, feed_seconds: float | None = None,
                    caught_up: bool = False, first: bool = False) -> None:
        """A drafted step: the drafted tokens a row kept, the seconds of the proposal and the
        widest row's node count (root included). ``feed_seconds``: the part of the proposal spent in
        the draft forward that fed it the step's committed tokens and root (None: not timed apart).

        The mean seconds of a drafted step price what drafting costs at a steady step, so that a
        plain step is chosen from what drafting costs now, not from what the draft once spent
        catching up. ``first``: a call's first proposal (its feeding forward reads the whole prompt,
        and the first call's also warms the draft up) stays out of that mean, like the first
        drafting of a call in :class:`heads.adaptive.cost.CostCurve`. ``caught_up``: the feeding
        forward also read the tokens of plain steps before it (a probe): the step counts, its
        feeding forward priced as a steady one (:meth:`steady_feed`); having read more tokens than
        a steady one, it also bounds a steady one (counted when below the mean)."""
        self.gain = GAIN_DECAY * self.gain + (1 - GAIN_DECAY) * gain
        if not first:
            steady = self.steady_feed()
            if feed_seconds is not None and (not caught_up or (steady is not None and feed_seconds < steady)):
                self.feed = feed_seconds if self.feed is None else DECAY * self.feed + (1 - DECAY) * feed_seconds
            elif feed_seconds is not None and steady is not None:  # the plain steps' deferred feeding left out
                propose_seconds -= feed_seconds - steady
            self._add_drafted_seconds(propose_seconds, nodes)
        if self.pays():
            self.interval = 1
        elif self.waited >= self.interval:  # a probe that did not pay: wait longer before the next
            self.interval = min(2 * self.interval, MAX_PROBE_INTERVAL)
        self.waited = 0

    def add_replayed(self, gain: float) -> None:
        """A plain step replayed: the drafted tokens a row would have kept with a chain of one, a
        drafted step of one node whose proposal is a steady feeding forward (the gain and the
        seconds of a drafted step are means over the same steps: a one-token chain's gain is not
        weighed against a longer chain's seconds)."""
        self.gain = GAIN_DECAY * self.gain + (1 - GAIN_DECAY) * gain
        steady = self.steady_feed()
        if steady is not None and self.propose is not None:
            self._add_drafted_seconds(steady, 2)
        if self.pays():
            self.interval = 1

    def steady_feed(self) -> float | None:
        """Seconds of a steady step's feeding forward (a few tokens per row): the running mean of
        those timed, else of a draft forward (one token per row); None before either."""
        return self.feed if self.feed is not None else self.draft

    def _add_drafted_seconds(self, propose_seconds: float, nodes: int) -> None:
        """One drafted step's proposal seconds and its widest row's node count (root included)."""
        if self.propose is None:
            self.propose, self.drafted_nodes = propose_seconds, float(nodes - 1)
        else:
            self.propose = DECAY * self.propose + (1 - DECAY) * propose_seconds
            self.drafted_nodes = DECAY * self.drafted_nodes + (1 - DECAY) * (nodes - 1)

    @property
    def draft_step(self) -> float | None:
        """Seconds of a drafted step beyond a plain one: its mean proposal, and the verify line at
        its mean verified nodes beyond the root less a plain step's seconds (priced when asked,
        from the line and the plain mean as they are now); None before any drafted step was
        counted."""
        if self.propose is None:
            return None
        line, plain = self.verify_line(), self.plain_seconds()
        if line is None or plain is None:
            return self.propose
        return self.propose + max(0.0, line[0] + line[1] * self.drafted_nodes - plain)

    def plain_seconds(self) -> float | None:
        """Seconds of a plain verify step: the running mean of those timed, else the verify line's
        intercept; None before any step was timed."""
        if self.plain is not None:
            return self.plain
        line = self.verify_line()
        return None if line is None else line[0]

    def pays(self) -> bool:
        """Whether a drafted step is expected to commit tokens faster than a plain step: the
        tokens it gains exceed its extra seconds in plain steps (True until measured)."""
        plain, extra = self.plain_seconds(), self.draft_step
        if plain is None or extra is None:
            return True
        return self.gain > extra / max(plain, 1e-9)

    def draft_now(self) -> bool:
        """Draft at this step: it pays, or the plain steps since the last draft reached the probe interval."""
        if self.pays() or self.waited >= self.interval:
            return True
        self.waited += 1
        return False

    def verify_line(self) -> tuple[float, float] | None:
        """``(intercept, slope)`` seconds of a drafted verify step; before one was timed, through a
        plain step's seconds at the prior slope; None before any step was timed."""
        if self.weight == 0:
            return None if self.plain is None else (self.plain, NODE_PRIOR * self.plain)
        mean_x, mean_y = self.nodes / self.weight, self.seconds / self.weight
        intercept0 = max(mean_y, 1e-9)
        slope = ((self.cross - self.weight * mean_x * mean_y) + SLOPE_WEIGHT * NODE_PRIOR * intercept0) / \
            ((self.nodes2 - self.weight * mean_x * mean_x) + SLOPE_WEIGHT)
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 1e-9), slope

    def jump_price(self) -> float:
        """Tokens: what a drafted verify step costs over a plain one beyond its nodes' slope (the
        second query's jump, module docstring of :class:`ChainCosts`) at the rate the steps commit
        tokens; 0 until plain and drafted steps were both timed."""
        if self.plain is None or self.weight == 0 or self.step_seconds is None:
            return 0.0
        return max(0.0, self.verify_line()[0] - self.plain) * self.tokens / self.step_seconds

    def prices(self) -> tuple[float, float]:
        """``(draft forward, verified node)`` in tokens: their seconds at the tokens per second the
        steps commit (priors in target steps until measured)."""
        line = self.verify_line()
        if line is None or self.step_seconds is None:
            return DRAFT_PRIOR, NODE_PRIOR
        slope = line[1]
        rate = self.tokens / self.step_seconds  # tokens a row commits per second
        draft = self.draft if self.draft is not None else DRAFT_PRIOR * self.plain_seconds()
        return draft * rate, slope * rate
