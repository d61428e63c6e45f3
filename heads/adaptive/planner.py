"""``speculate="auto"``: each step, the cut of the drafter's trees (none at all: a plain step) with
the most expected tokens per second, from the cost curve (:mod:`.cost`) and calibrated acceptance
(:mod:`.acceptance`).

Before a step the planner compares, for the rows still decoding, a plain step (one token a row at
the cost of a width-1 verify) with drafting: the drafter's steady cost plus the verify cost of each
cut, against the tokens each cut is expected to commit. After the drafter proposed, a deterministic
rule (greedy) picks the node-order prefix of the actual trees worth verifying, the drafting cost
now spent; a sampling rule verifies the depth cut chosen before drafting (a cut that does not
depend on what was sampled keeps the rule lossless). Which nodes are verified never changes a greedy
output, and a sampled output follows the target's distribution whatever the cut.

The first time a rows bucket is served the planner takes one plain step to time a width-1 forward,
the reference every cut is judged against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tree_attention.planning import ModalDrafter, StepRecord
from tree_attention.tree import TreeBatch, prefix_batch, truncate_batch

from .acceptance import AcceptanceModel
from .cost import CostCurve

REPLAN_EVERY = 4
"""Steps a plan serves before it is made again (sooner when the rows change or it was an
exploring step): the estimates it rests on fade over :data:`~heads.adaptive.acceptance.HALF_LIFE`
steps, and a plan costs tens of microseconds, a share of a small model's step."""

CUTS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
"""Node-prefix widths (root included) a greedy step compares, besides the whole tree."""


@dataclass
class Choice:
    """What the planner chose for one step, and the figures it chose from (per row and step)."""

    draft: bool
    nodes: int = 1
    """Nodes verified per row, root included (1: a plain step); for a depth cut, its expected width."""
    depth: int | None = None
    """The depth cut (sampling rules), None for a node-prefix cut."""
    expected_tokens: float = 1.0
    seconds: float | None = None
    plain_seconds: float | None = None
    reason: str = ""
    mode: str | None = None
    """The drafting mode (a :class:`~tree_attention.decode.ModalDrafter`'s), None for other drafters."""

    @property
    def speedup(self) -> float | None:
        """Predicted tokens per second over a plain step's."""
        if self.seconds is None or self.plain_seconds is None or self.seconds <= 0:
            return None
        return self.expected_tokens * self.plain_seconds / self.seconds


@dataclass
class CallSummary:
    """What ``auto`` did in one call (``last_stats.speculation``)."""

    steps: dict[str, int] = field(default_factory=lambda: {"plain": 0, "empty": 0, "drafted": 0})
    cuts: dict[int, int] = field(default_factory=dict)  # verified width -> drafted steps
    modes: dict[str, int] = field(default_factory=dict)  # drafting mode -> steps that drafted in it
    reasons: dict[str, int] = field(default_factory=dict)
    last: Choice | None = None

    def as_dict(self, adaptive: "Adaptive", key: str) -> dict:
        models = {mode or "": model for (rule, mode), model in adaptive.models.items() if rule == key}
        return {"auto": True, "rule": key, "steps": dict(self.steps), "verified_widths": dict(sorted(self.cuts.items())),
                "modes": dict(self.modes), "reasons": dict(self.reasons),
                "last_choice": None if self.last is None else {
                    "draft": self.last.draft, "nodes": self.last.nodes, "depth": self.last.depth,
                    "expected_tokens": round(self.last.expected_tokens, 3),
                    "predicted_speedup": None if self.last.speedup is None else round(self.last.speedup, 3),
                    "mode": self.last.mode, "reason": self.last.reason},
                "acceptance": {mode: model.summary() for mode, model in models.items()},
                "costs": adaptive.costs.summary()}


class Adaptive:
    """The state ``auto`` keeps for one spec across calls: one cost curve, one acceptance model per
    rule key (greedy, each sampling setting), seeded from the adapter's recorded acceptance."""

    def __init__(self, prior_by_depth: list[float] | None = None, width: int = 1) -> None:
        """``prior_by_depth``: the acceptance by depth recorded at save time; ``width``: the widest
        tree the drafter is configured to propose (root included)."""
        self.costs = CostCurve()
        self.models: dict[tuple[str, str | None], AcceptanceModel] = {}
        self.prior_by_depth = list(prior_by_depth or ())
        self.width = width

    def model(self, key: str, mode: str | None = None) -> AcceptanceModel:
        """The acceptance model of rule ``key`` and drafting ``mode``."""
        if (key, mode) not in self.models:
            self.models[(key, mode)] = AcceptanceModel(self.prior_by_depth, self.width)
        return self.models[(key, mode)]

    def planner(self, key: str, deterministic: bool, drafter=None) -> "CallPlanner":
        """The planner of one call under the rule ``key`` (``deterministic``: any cut is lossless)
        for ``drafter`` (a :class:`~tree_attention.decode.ModalDrafter` gets its mode chosen per step)."""
        return CallPlanner(self, key, deterministic, drafter)


class CallPlanner:
    """The :class:`tree_attention.decode.Planner` of one ``generate`` call."""

    def __init__(self, adaptive: Adaptive, key: str, deterministic: bool, drafter=None) -> None:
        self.adaptive, self.key, self.deterministic = adaptive, key, deterministic
        self.costs = adaptive.costs
        self.modal = drafter if isinstance(drafter, ModalDrafter) else None
        self.modes: tuple[str | None, ...] = (None,) if self.modal is None else tuple(self.modal.modes)
        self.acceptance = adaptive.model(key, self.modes[0])
        self.summary = CallSummary()
        self.choice: Choice | None = None
        self.planned_width = 0  # the proposed width the last plan assumed
        self._cuts: dict[int, np.ndarray] = {}  # per proposed width: the node-prefix cuts compared
        self._rows, self._age = 0, 0  # the rows the current plan was made for, and the steps it served

    def _options(self, acceptance: AcceptanceModel, rows: int) -> tuple[np.ndarray, list, np.ndarray, np.ndarray] | None:
        """The cuts a step may take before drafting: (nodes ``[C]``, depth cut or None per option,
        expected drafted tokens a row accepts ``[C]``, expected padded width ``[C]``)."""
        if self.deterministic:
            width = max(2, acceptance.width)
            nodes = self._cuts.get(width)
            if nodes is None:
                nodes = self._cuts[width] = np.array([cut for cut in (*CUTS, width) if cut <= width])
            gains, padded = acceptance.prefix_gains(width, rows)
            return nodes, [None] * nodes.size, gains[nodes - 1], padded[nodes - 1]
        cuts = acceptance.depth_cuts()
        if not cuts:
            return None
        widths = np.array([width for _, _, width in cuts])
        return widths, [depth for depth, _, _ in cuts], np.array([gain for _, gain, _ in cuts]), widths

    def _plan(self, rows: int) -> Choice:
        models = [(mode, self.adaptive.model(self.key, mode)) for mode in self.modes]
        for mode, model in models:
            if not model.known:
                return Choice(True, nodes=0, reason="drafter not measured yet: draft and measure", mode=mode)
        if not self.costs.knows_plain(rows):
            return Choice(False, nodes=0, reason="time a plain step")  # (nodes=0: planned again next step)
        plain = self.costs.verify_seconds(rows, 1)
        best, best_rate = Choice(False, seconds=plain, plain_seconds=plain, reason="plain is fastest"), 1.0 / plain
        for mode, model in models:
            options = self._options(model, rows)
            if options is None:
                return Choice(True, nodes=0, reason="no tree seen yet under this rule: draft and measure", mode=mode)
            nodes, depths, gains, padded = options
            seconds = self.costs.draft_seconds(rows, mode) + self.costs.verify_curve(rows, np.rint(padded))
            rates = (1.0 + gains) / np.maximum(seconds, 1e-9)
            index = int(rates.argmax())
            if rates[index] > best_rate:
                best_rate = float(rates[index])
                best = Choice(True, int(nodes[index]), depths[index], 1.0 + float(gains[index]), float(seconds[index]),
                              plain, "drafting pays", mode)
                self.planned_width = max(2, model.width)
        return best

    def release(self) -> None:
        """The call is over: a modal drafter chooses its own mode again (``speculate=None`` calls)."""
        if self.modal is not None:
            self.modal.use_mode(None)

    # -- the Planner protocol -----------------------------------------------------------------

    def draft(self, rows: int) -> bool:
        choice = self.choice
        if choice is not None and choice.nodes and rows == self._rows and self._age < REPLAN_EVERY:
            self._age += 1  # the plan still stands: the estimates it rests on move over tens of steps
            return choice.draft
        self.choice, self._rows, self._age = self._plan(rows), rows, 1
        if self.choice.draft:
            self.acceptance = self.adaptive.model(self.key, self.choice.mode)
            if self.modal is not None:
                self.modal.use_mode(self.choice.mode)
        self.summary.reasons[self.choice.reason] = self.summary.reasons.get(self.choice.reason, 0) + 1
        self.summary.last = self.choice
        return self.choice.draft

    def trim(self, trees: TreeBatch) -> TreeBatch:
        self.acceptance.proposed(trees)
        choice = self.choice
        if choice is None or not choice.nodes:  # nothing measured yet: verify the whole trees
            return trees
        if not self.deterministic:
            return trees if choice.depth is None else truncate_batch(trees, [choice.depth] * trees.rows)
        if trees.width <= choice.nodes:  # nothing beyond the planned cut
            return trees
        if self._age > 1 or (trees.uniform and trees.scores is None and trees.width == self.planned_width):
            return prefix_batch(trees, choice.nodes)  # within a plan's life, or the very shape it planned for
        self.choice.nodes = self._best_prefix(trees)
        return prefix_batch(trees, self.choice.nodes)

    def _best_prefix(self, trees: TreeBatch) -> int:
        """The node-order prefix of ``trees`` (its node count) with the most expected tokens per
        second, drafting spent; it stands for the rest of the plan's life."""
        rows, width = trees.rows, trees.width
        sizes = np.full(rows, width) if trees.uniform else trees.sizes.cpu().numpy()
        cuts = np.array([1, *(cut for cut in CUTS if cut < width), width])
        seconds = self.costs.verify_curve(rows, cuts)
        if trees.scores is not None:  # the drafter scored its nodes: calibrated scores, this very tree
            gains = self.acceptance.score_gains(trees.scores.numpy(), sizes, cuts)
        else:
            gains = self.acceptance.tree_gains(sizes, cuts)
        rates = (rows + gains) / np.maximum(seconds, 1e-9)
        return int(cuts[int(np.argmax(rates))])

    def observe(self, record: StepRecord, trees: TreeBatch | None, paths: torch.Tensor,
                lengths: torch.Tensor) -> None:
        if not record.first_draft:  # (the call's first tree step also builds the cache's deferred bookkeeping)
            self.costs.observe_verify(record.rows, record.width, record.verify_seconds)
        mode = self.choice.mode if self.choice is not None else None
        if record.kind != "plain":
            self.costs.observe_draft(record.rows, record.draft_seconds, record.first_draft, mode)
        for other in self.modes:
            self.adaptive.model(self.key, other).fade()
        if record.kind == "drafted" and trees is not None:
            self.acceptance.observe(trees, paths, lengths)
        if record.kind == "drafted" and mode is not None:
            self.summary.modes[mode] = self.summary.modes.get(mode, 0) + 1
        self.summary.steps[record.kind] += 1
        if record.kind == "drafted":
            self.summary.cuts[record.width] = self.summary.cuts.get(record.width, 0) + 1
