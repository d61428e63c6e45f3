"""``speculate="auto"``: each step, the tree size (none: a plain step) and drafting mode with the most
expected tokens per second, from the cost curve (:mod:`.cost`) and calibrated acceptance (:mod:`.acceptance`).

For the rows still decoding, each option the drafter offers (a ``SizedDrafter``'s sizes in each of a
``ModalDrafter``'s modes) is priced at drafting plus verify seconds against the tokens it is expected to
commit, and compared with a plain step. Nested sizes share one acceptance model per mode. The size is
chosen before drafting, so outputs are those of any fixed choice. Rows with no plain steps timed over as
many rows or more first plan a run of plain steps (the reference); then each model drafts until it has seen :data:`REPLAN_EVERY` rows. A plan
priced from an untimed cost, or paying only by optimism, serves one step (out of plain steps it pays both switches
in full); one ahead only by a cost aged toward 0 is timed in one step, the best at unaged costs the rest. Untimed: a
call's first step, the first after rows finished or a switch; an empty step counts toward its option's verify mean alone."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from tree_attention.capabilities import SizedDrafter
from tree_attention.planning import ModalDrafter, StepRecord
from tree_attention.tree import TreeBatch

from .acceptance import HALF_LIFE, AcceptanceModel
from .cost import CostCurve

REPLAN_EVERY = 8
"""Steps a plan serves before it is made again (sooner when the rows change): its estimates move over
:data:`~heads.adaptive.acceptance.HALF_LIFE` steps, and a plan costs a share of a small model's step. A
plan repeating the last one (same option and rows) serves twice as long as that one, up to half the
half-life (estimates move < 30% in that many steps). Also the rows an option is first drafted on."""

_LONGEST_PLAN = max(REPLAN_EVERY, HALF_LIFE // 2)  # steps a repeated plan serves at most

Option = tuple  # (drafting mode or None, size or None): one way to draft a step


@dataclass
class Choice:
    """What the planner chose for one step, and the figures it chose from (per row and step)."""

    draft: bool
    mode: str | None = None  # a ModalDrafter's drafting mode (None: other drafters)
    size: int | None = None  # drafted nodes per row the drafter is resized to (None: as configured)
    nodes: int = 1  # nodes a row is expected to verify, root included (1: a plain step)
    expected_tokens: float = 1.0
    seconds: float | None = None
    plain_seconds: float | None = None
    reason: str = ""
    tentative: bool = False  # untimed costs, or paying over plain only by optimism: one step, then a new plan
    then: "Choice | None" = None  # ahead by cost optimism alone: after its one step, the rest of the plan

    @property
    def option(self) -> Option:
        return (self.mode, self.size)


def _label(option: Option) -> str:
    return "/".join(str(part) for part in option if part is not None) or "configured"


@dataclass
class CallSummary:
    """What ``auto`` did in one call (``last_stats.speculation``)."""

    steps: dict[str, int] = field(default_factory=lambda: {"plain": 0, "empty": 0, "drafted": 0})
    cuts: Counter = field(default_factory=Counter)  # verified width -> drafted steps
    options: Counter = field(default_factory=Counter)  # option -> steps that drafted with it
    reasons: Counter = field(default_factory=Counter)
    last: Choice | None = None
    request_prior_rows: float | None = None  # earlier requests' evidence, in rows (None: not cut)

    def as_dict(self, adaptive: "Adaptive", key: str) -> dict:
        models, last = {_label(option): model for (rule, *option), model in adaptive.models.items() if rule == key}, self.last
        return {"auto": True, "rule": key, "steps": dict(self.steps), "verified_widths": dict(sorted(self.cuts.items())),
                "options": {_label(option): steps for option, steps in self.options.items()}, "reasons": dict(self.reasons),
                "request_prior_rows": None if self.request_prior_rows is None else round(self.request_prior_rows, 1),
                "last_choice": None if last is None else {
                    "draft": last.draft, "mode": last.mode, "size": last.size, "nodes": last.nodes, "reason": last.reason,
                    "expected_tokens": round(last.expected_tokens, 3), "predicted_speedup":  # tokens per second over a plain step's
                        last.seconds and last.plain_seconds and round(last.expected_tokens * last.plain_seconds / last.seconds, 3)},
                "acceptance": {label: model.summary() for label, model in models.items()},
                "costs": adaptive.costs.summary()}


class Adaptive:
    """What ``auto`` keeps for one spec across calls: one cost curve, and one acceptance model per rule key
    (greedy, each sampling setting) and drafting option, seeded with the adapter's recorded acceptance."""

    def __init__(self, prior_by_depth: Sequence[float] | None = None, width: int = 1,
                 sizes: Sequence[int] = (), extra: int = 0, sampled_prior: Sequence[float] | None = None) -> None:
        """``prior_by_depth`` (``sampled_prior``): acceptance by depth recorded greedy (at a temperature); ``width``:
        the widest tree (root included); ``sizes``: a SizedDrafter's; ``extra``: a hybrid's lookup budget."""
        self.costs, self.models = CostCurve(), {}  # models: per (rule key, mode, size), an AcceptanceModel
        # the priors of greedy and of sampling rules (recorded sampled)
        self.prior_by_depth, self.sampled_prior = list(prior_by_depth or ()), list(sampled_prior or ())
        self._sampled: set[str] = set()  # rule keys of sampling rules (planner: not deterministic)
        self.plans: dict[str, tuple[Choice, int, int, int]] = {}  # per rule key: the last call's (plan, rows, age, steps it serves)
        self.width, self.sizes, self.extra = width, tuple(sorted(set(sizes))), extra

    def model(self, key: str, option: Option = (None, None)) -> AcceptanceModel:
        """The acceptance model of rule ``key`` and drafting ``option`` (mode, size)."""
        model = self.models.get((key, *option))
        if model is None:
            width = self.width if option[1] is None else min(self.width, 1 + option[1] + self.extra)
            prior = self.sampled_prior if key in self._sampled else self.prior_by_depth
            model = self.models[(key, *option)] = AcceptanceModel(prior, width)
        return model

    def planner(self, key: str, deterministic: bool, drafter=None) -> "CallPlanner":
        """The planner of one call under the rule ``key`` (``deterministic``: any node-order cut is lossless)
        for ``drafter`` (a ModalDrafter gets its mode, a SizedDrafter its size, chosen per step)."""
        if not deterministic:
            self._sampled.add(key)
        return CallPlanner(self, key, deterministic, drafter)


class CallPlanner:
    """The :class:`tree_attention.planning.Planner` of one ``generate`` call."""

    def __init__(self, adaptive: Adaptive, key: str, deterministic: bool, drafter=None) -> None:
        self.adaptive, self.key, self.deterministic, self.costs = adaptive, key, deterministic, adaptive.costs
        self.modal = drafter if isinstance(drafter, ModalDrafter) else None
        self.sized = drafter if isinstance(drafter, SizedDrafter) and adaptive.sizes else None
        modes = (None,) if self.modal is None else tuple(self.modal.modes)
        fixed = () if self.modal is None else tuple(self.modal.fixed_modes)
        sizes = (None,) if self.sized is None else adaptive.sizes
        self.options: list[Option] = [(mode, size) for mode in modes for size in ((None,) if mode in fixed else sizes)]
        # nested sizes share one model per mode: a step shows what every smaller size would accept
        nested = self.sized is not None and self.sized.nested
        self.models = [adaptive.model(key, (mode, None if nested else size)) for mode, size in self.options]
        # per option: the nodes of its trees in its model's node order (None: all the model has seen)
        self._nodes = [1 + size if nested and size is not None else None for _, size in self.options]
        self.acceptance = self.models[-1]
        self._distinct = list({id(model): model for model in self.models}.values())
        self.summary = CallSummary()
        # a call is a request: earlier ones' evidence is cut as they differ; else the last plan serves on
        weights = [model.new_request() for model in self._distinct]
        self.summary.request_prior_rows = min((weight for weight in weights if weight is not None), default=None)
        self.choice, self._rows, self._age, self._serves = adaptive.plans.get(key, (None, 0, 0, REPLAN_EVERY))
        if self.choice is not None and (self.summary.request_prior_rows is not None
                                        or self.choice.draft and self.choice.option not in self.options):
            self.choice = None  # (replanned now; or the drafter offers other options now)
        self.summary.last = self.choice
        self._applied, self._capacity = None, None  # the drafter's option (None: as configured), nodes asked for
        self._last_rows, self._last_plain = 0, True  # this call's previous step: its rows (0: none yet), plain

    def _plan(self, rows: int) -> Choice:
        if self.costs.reference(rows) is None:  # plain steps: the reference every option is judged against
            return Choice(False, reason="time plain steps")
        # largest sizes first: where sizes are nested, the largest shows what every smaller one accepts
        for (mode, size), model in reversed(list(zip(self.options, self.models))):
            if model.rows_seen < REPLAN_EVERY:  # a plan's worth of rows of every model (a step at a time)
                return Choice(True, mode, size, nodes=model.width, reason="measure an option never drafted", tentative=True)
        # a plan that switches between plain and drafting steps pays the switch once over its steps
        plain = self.costs.verify_seconds(rows, 1) + (0.0 if self._last_plain else self.costs.switch_seconds(False) / REPLAN_EVERY)
        (expected, bonuses, widths), reaches = (np.zeros(len(self.options)) for _ in range(3)), []
        for index, (model, nodes) in enumerate(zip(self.models, self._nodes)):
            gain, bonus, reach = model.prefix_estimates(model.width, rows)
            last = model.width - 1 if nodes is None else min(nodes, model.width) - 1
            reaches.append(reach[:last + 1])
            expected[index], bonuses[index], widths[index] = gain[last], bonus[last], reaches[-1].sum()
        prices = self.costs.step_prices(rows, self.options, reaches)
        seconds = prices[:, 0] + (self.costs.switch_seconds(True) / REPLAN_EVERY if self._last_plain else 0.0)
        rates = (1.0 + (gains := expected + bonuses)) / np.maximum(seconds, 1e-9)
        best, steady = int(rates.argmax()), prices[:, 1]
        # paying by the bound alone: one exploring step, which out of plain steps pays both switches in full
        explores = (1.0 + expected[best]) / max(steady[best], 1e-9) <= 1.0 / plain
        extra = (self.costs.switch_seconds(True) * (1 - 1 / REPLAN_EVERY) + self.costs.switch_seconds(False)
                 if explores and self._last_plain and self._last_rows else 0.0)  # (a call's first step: no switch)
        if (1.0 + gains[best]) / max(seconds[best] + extra, 1e-9) <= 1.0 / plain:
            return Choice(False, seconds=plain, plain_seconds=plain, reason="plain is fastest")
        top = int(((1.0 + gains) / np.maximum(steady, 1e-9)).argmax())  # ahead by an aged cost alone: timed in one step
        def planned(index: int, reason: str, then: Choice | None = None, exploring: bool = False) -> Choice:
            return Choice(True, *self.options[index], int(round(widths[index])), 1.0 + float(gains[index]), float(seconds[index]),
                          plain, reason, exploring or not self.costs.known(rows, widths[index], self.options[index]), then)
        if explores:
            return planned(best, "it may pay", exploring=True)
        return planned(best, "drafting pays") if top == best else planned(best, "timed again", planned(top, "drafting pays"))

    def release(self) -> None:
        """The call is over: the drafter drafts as configured again (``speculate=None`` calls)."""
        if self.choice is not None:  # (the next call starts from this plan)
            self.adaptive.plans[self.key] = (self.choice, self._rows, self._age, self._serves)
        if self.modal is not None:
            self.modal.use_mode(None)
        if self.sized is not None:
            self.sized.resize(None)

    def draft(self, rows: int) -> bool:
        choice = self.choice
        if choice is not None and choice.then is not None and self._age >= 1 and not choice.tentative:
            choice = self.choice = choice.then  # (the plan's exploring step is done)
        if (choice is None or not choice.nodes or rows != self._rows
                or self._age >= (1 if choice.tentative else self._serves)):
            again = self._plan(rows)
            repeated = (choice is not None and rows == self._rows and not (choice.tentative or again.tentative)
                        and again.then is None and (again.draft, again.option) == (choice.draft, choice.option))
            self._serves = min(2 * self._serves, _LONGEST_PLAN) if repeated else REPLAN_EVERY
            choice = self.choice = again
            self._rows, self._age = rows, 0
            self.summary.reasons[choice.reason] += 1
            self.summary.last = choice
        self._age += 1
        if choice.draft and choice.option != self._applied:
            self._applied, index = choice.option, self.options.index(choice.option)
            self.acceptance, self._capacity = self.models[index], self._nodes[index]
            if self.modal is not None:
                self.modal.use_mode(choice.mode)
            if self.sized is not None:
                self.sized.resize(choice.size)
        return choice.draft

    def observe(self, record: StepRecord, trees: TreeBatch | None, paths: torch.Tensor,
                lengths: torch.Tensor) -> None:
        # steady costs only: a step after a switch costs more, and would price the other side too high
        steady = self._last_plain == (record.kind == "plain")
        option = self.choice.option if self.choice is not None else (None, None)
        timed = record.rows == self._last_rows and not record.first_draft
        if timed and steady:
            if record.kind != "empty":
                self.costs.observe_verify(record.rows, record.width, record.verify_seconds)
            if record.kind != "plain" and self.choice is not None and self.choice.draft:
                # an option's price is its mean step, the steps where it proposed nothing included
                self.costs.observe_option_verify(record.rows, record.verify_seconds, option)
        elif timed and record.kind != "empty":
            usual = (self.costs.verify_seconds(record.rows, 1) if record.kind == "plain"
                     else self.costs.draft_seconds(record.rows, option, aged=False) or None)
            if usual is not None:  # (the extra seconds of a switch: what each plan pays once)
                seconds = record.verify_seconds if record.kind == "plain" else record.draft_seconds
                self.costs.observe_switch(record.kind != "plain", seconds - usual)
        self._last_rows, self._last_plain = record.rows, record.kind == "plain"
        if record.kind != "plain":
            self.costs.observe_draft(record.rows, record.draft_seconds, record.first_draft or not steady, option)
        for model in self._distinct:
            model.fade()
        summary = self.summary
        summary.steps[record.kind] += 1
        if record.kind != "plain" and trees is not None:  # (an empty step: the drafter proposed nothing)
            self.acceptance.observe(trees, paths, lengths, self._capacity)
        if record.kind == "drafted":
            summary.options[option] += 1
            summary.cuts[record.width] += 1
