"""``speculate="auto"``: how much to draft for a batch, from costs measured on this machine while serving.

Speculation pays when ``tau(n) x t_plain(B) > t_step(B, n)``: the tokens a row commits per step
with ``n`` drafted nodes, times the cost of one plain decoding step at batch size ``B``, must beat
the cost of one speculative step (drafting, verifying ``n + 1`` nodes per row, accepting). At
batch 1 a small model's forward is overhead-bound and extra nodes are nearly free; as ``B`` grows
the verify forward becomes compute-bound, ``t_step`` grows with ``B x (n + 1)`` and the win
shrinks, then turns into a loss.

Every ``auto`` call that may draft runs in the speculative loop, which decides before each step
whether to draft (:class:`CallController`); a step that drafts nothing verifies each row's root
alone, a plain decoding step, token for token the same as the backbone's own ``generate``. So
nothing is measured off to the side and no token is thrown away. A call chosen to draft nothing at
all (``"delegate"``) runs the backbone's own ``generate`` (:attr:`SpeculationPolicy.delegate_plain`;
the loop's plain steps, which measure plain costs and follow a stop, cost 0.99x-1.01x of its steps):

- **Costs** are kept per (batch size, prompt length) bucket (powers of two): the plain step cost
  from plain steps over every row (the backbone's ``generate`` keeps every row to the end), each
  tree size's step cost as seconds per drafted step of the call's last row (rows leave the loop as
  they finish, so a batch call's later steps are cheaper: each row count's median, weighted by its
  steps; for a call that stopped drafting, its controller's projection), each the median of the last
  :data:`COST_SAMPLES` calls' figures; and per number of rows a step decoded (:attr:`row_costs`),
  which price a batch call's later steps (:mod:`heads.controller`). A bucket never served starts from the costs of one at the
  same batch bucket and a prompt length within a factor :data:`BORROW_LENGTHS`, if any.
- **Calibration inside the call** (a size that lost at a smaller batch bucket, or could not pay there
  even on its optimistic estimate, is not explored at a larger one, where it can only lose more): in a bucket whose plain cost is unknown the call starts with
  :data:`PLAIN_STEPS` plain steps, and a drafting call takes its second and third steps plain while
  the plain cost has few samples or none recent (:data:`REFRESH_PLAIN`), since every size is judged
  against it (a call's first step costs more than later ones and is left out of plain costs); a tree
  size whose cost is unknown in the bucket is tried (the largest that could pay first) on the call's
  own traffic.
- **tau(n)** is the tokens per drafted step of each call's *slowest* row (a batch call lasts until
  its slowest row is done, so at batch 16 the mean row's tau overstates what drafting buys), kept
  per tree size, batch bucket, acceptance rule and sampling settings (acceptance falls with
  temperature) over every call served; it is non-decreasing in the tree size for nested trees,
  so a larger size is credited with at least the tau of any smaller one. Where the drafter's trees
  are nested (prompt lookup, Medusa's default trees; ``nested_counts``), each greedy drafted step also counts
  what every smaller size would have committed on it, and sizes are compared on those shared steps
  (:meth:`SpeculationPolicy.nested_taus`), not on whichever calls each size happened to draft.
- **Choosing** (per call): the size with the best predicted speedup ``tau(n) x t_plain / t_step(n)``,
  scaled by ``1 + EXPLORE / sqrt(row steps seen)`` (an upper confidence bound: a size seen for only
  a few steps, e.g. prompt lookup measured at the start of a reply before anything repeats, is
  tried again until its estimate is backed by evidence); plain decoding unless that beats 1 by
  ``margin``. The size seen drafting for the most steps keeps its place (if it pays) unless another
  is :data:`IMPROVE` faster (unless it has been seen for fewer than :data:`SWITCH_STEPS` steps, not
  yet judged at all): each size's tau comes from the calls it ran, so sizes explored on other
  text are not comparable within a few percent (on demo code, lookup sizes 4 and 2 measured on easy
  prompts at tau 4.2 and 2.9 displaced size 10 measured on a hard one at 2.7, and auto then ran at
  1.9x where size 10 alone ran at 3.9x). After :data:`RETRY_AFTER` plain choices in a row at one
  batch bucket and rule, whatever the prompts' lengths (then twice as many, and so on), a call measures the best size again, judged as a first measurement
  (the lenient thresholds below, no prior tau): one call's few drafted steps can misjudge a size badly (the first steps of a reply accept
  less and cost more), and plain calls would never correct it.
- **Choosing again within the call**: once the call has drafted :data:`SWITCH_STEPS` steps, it
  compares what drafting would cost for the rest of the call with plain steps (each row's own rate
  so far, blended with the policy's tau; each step priced by the rows it still decodes, as rows
  leave when they finish: :meth:`heads.controller.CallController.project`), and stops
  drafting for the rest of the call when that falls below :data:`SWITCH_BELOW`. A greedy call with
  lookup (alone or in a hybrid) stops only on a clear loss, :data:`EXPLORE_BELOW`: lookup's
  acceptance grows through a reply, from nothing while the reply has not repeated anything yet to
  ten tokens a step later (a demo prose reply opened with ten steps where lookup matched nothing,
  then ran at 2x; judged by the strict threshold after eight steps it had stopped at 0.92x). A
  trained drafter without lookup, whose acceptance does not grow, is judged by :data:`SWITCH_BELOW`
  (``SpeculationPolicy.steady``), and so is every sampled call: sampled text repeats itself far
  less. The call's drafted steps include those where the drafter proposed nothing (what drafting
  gives on this text); the policy's tau and step costs leave them out. A wrong choice (a size explored at batch 16, an estimate from other
  traffic) so costs a few steps, not a call.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from .controller import (EXPLORE_BELOW, PLAIN_STEPS, PRIOR_STEPS, REFRESH_STEPS, SWITCH_BELOW,  # noqa: F401
                         SWITCH_STEPS, CallController, costs_by_rows, mean_cost)

MIN_LEARN_TOKENS = PLAIN_STEPS + 2 * SWITCH_STEPS + 1  # a shorter call neither explores nor teaches:
# its trees are cut to its few remaining tokens, so its tau says nothing about the size (a 4-token
# warm-up call once set prompt lookup's tau to 1.1 and kept auto on plain decoding for good)
GROWING_LEARN_TOKENS = 48  # the same for a greedy call with lookup (alone or in a hybrid), whose acceptance
# grows through a reply: a 16-token warm-up call of lookup 10 on demo prose measured tau 1.6 where whole
# replies run at 3.7, and nested at size 2's tau that estimate kept size 10 out for good (2 -> 1.8x, 10: 2.3x)
COST_SAMPLES = 8  # a step cost is the median of the last this many calls' measurements
REFRESH_PLAIN = 4  # a drafting call takes plain steps REFRESH_STEPS when the plain cost has fewer samples
# than REFRESH_SAMPLES or none from the last this many calls (a stale or noisy plain cost misjudges every size)
REFRESH_SAMPLES = 3  # (with COST_SAMPLES, every call of the first eight took two plain steps: on demo code,
# where lookup commits ~7.7 tokens a step, that cost ~7% of each call)
BORROW_LENGTHS = 4  # a new prompt-length bucket starts from costs measured within this factor
RETRY_AFTER = 2  # consecutive plain choices before the best measured size is measured again (then doubling)
EXPLORE = 0.5  # upper-confidence bonus: predicted x (1 + EXPLORE / sqrt(row steps seen))
IMPROVE = 0.1  # a size not yet measured is tried, once a measured one beats plain decoding, only if it
# could beat that one by this much: each try costs a call's drafted steps, and at T=0.7 on stories260K
# trying sizes 4 and 2 after 8 had won (1.37x, 1.57x) cost three of six calls (0.84x-0.97x)


def _bucket(value: int) -> int:
    """The next power of two (cost changes slowly with batch size and prompt length)."""
    return 1 << max(0, int(value) - 1).bit_length()


@dataclass
class Observed:
    """Tokens per drafted step of each call's slowest row with one tree size, summed over the
    drafted steps seen (``row_steps``)."""

    tokens: float = 0.0
    row_steps: int = 0

    @property
    def tau(self) -> float | None:
        return self.tokens / self.row_steps if self.row_steps else None


@dataclass
class SpeculationPolicy:
    """Chooses a tree size per batch; see the module docstring. ``sizes`` are the candidate
    numbers of drafted nodes (0, plain decoding, is always a candidate)."""

    sizes: tuple[int, ...]
    margin: float = 1.1
    step_costs: dict = field(default_factory=dict)  # ((B bucket, T bucket), n) -> seconds per step
    cost_samples: dict = field(default_factory=dict)  # same keys -> the last COST_SAMPLES measurements
    draft_costs: dict = field(default_factory=dict)  # same keys (n > 0) -> drafting seconds per drafted step
    draft_samples: dict = field(default_factory=dict)  # same keys -> the last COST_SAMPLES measurements
    observed: dict = field(default_factory=dict)  # (n, rule key, B bucket) -> Observed (slowest row's)
    since_plain: dict = field(default_factory=dict)  # bucket -> calls since its last plain-cost sample
    delegate_plain: bool = True  # a call that drafts nothing runs the backbone's own generate
    plain_streak: dict = field(default_factory=dict)  # (B bucket, rule key) -> plain choices in a row (as tau)
    retry_interval: dict = field(default_factory=dict)  # same keys -> plain choices before the next retry
    paired: dict = field(default_factory=dict)  # (size, drafted size, rule key, B bucket) -> Observed: what a tree
    # of `size` would have committed (slowest row) on the steps drafted with `drafted` nodes (nested trees, greedy)
    row_costs: dict = field(default_factory=dict)  # (T bucket, n, rows) -> seconds of a step decoding that many
    row_samples: dict = field(default_factory=dict)  # rows (n = 0: plain); same keys -> the last COST_SAMPLES measurements
    steady: bool = False  # acceptance does not grow through a reply (a trained drafter without lookup): an
    # exploring call is judged by the strict SWITCH_BELOW after SWITCH_STEPS drafted steps, not the lenient
    # EXPLORE_BELOW, which exists for lookup (on demo-llama at batch 8, where EAGLE's fixed tree ran at
    # 0.90x, its exploring calls drafted to their end at about 0.9x under the lenient rule)

    def __post_init__(self) -> None:
        if not self.sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.sizes):
            raise ValueError(f"SpeculationPolicy.sizes must be positive node counts; got {self.sizes!r}")
        if not self.margin >= 1.0:
            raise ValueError(f"SpeculationPolicy.margin must be >= 1; got {self.margin!r}")

    @staticmethod
    def key(input_ids: torch.Tensor) -> tuple[int, int]:
        return _bucket(input_ids.shape[0]), _bucket(input_ids.shape[1])

    @staticmethod
    def _record(samples: dict, estimates: dict, entry: tuple, seconds: float) -> None:
        """Add ``seconds`` to ``samples[entry]``; ``estimates[entry]`` is the median of its last
        :data:`COST_SAMPLES`."""
        kept = samples.setdefault(entry, [])
        kept.append(seconds)
        del kept[:-COST_SAMPLES]
        estimates[entry] = statistics.median(kept)

    def record_cost(self, key: tuple[int, int], size: int, seconds: float) -> None:
        """A measured cost per step of ``size`` drafted nodes (0: plain) in bucket ``key``."""
        self._record(self.cost_samples, self.step_costs, (key, size), seconds)

    def record_draft_cost(self, key: tuple[int, int], size: int, seconds: float) -> None:
        """The drafting part (propose and tree handling) of a drafted step of ``size`` nodes in bucket
        ``key``."""
        self._record(self.draft_samples, self.draft_costs, (key, size), seconds)

    def _borrow_costs(self, key: tuple[int, int]) -> None:
        """Start a new bucket from the measured costs of the nearest one with the same batch bucket
        and a prompt length within a factor of :data:`BORROW_LENGTHS` (refined by every later call)."""
        if (key, 0) in self.step_costs:
            return
        near = [other for other, size in self.cost_samples if size == 0 and other[0] == key[0]
                and max(other[1], key[1]) <= BORROW_LENGTHS * min(other[1], key[1])]
        if not near:
            return
        source = min(near, key=lambda other: abs(other[1].bit_length() - key[1].bit_length()))
        for samples, estimates in ((self.cost_samples, self.step_costs), (self.draft_samples, self.draft_costs)):
            for (other, size), kept in list(samples.items()):
                if other == source:
                    samples[(key, size)] = list(kept)
                    estimates[(key, size)] = estimates[(other, size)]

    def taus(self, rule_key: str, batch: int, nested: dict[int, float] | None = None) -> dict[int, float]:
        """Tokens per drafted step of a call's slowest row, by size, at batch bucket ``batch``: from
        nested counts where there are some (:meth:`nested_taus`, or ``nested`` if already computed),
        else the observed ones; each at least any smaller size's (nested trees accept at least as
        much), 1.0 for sizes never seen."""
        nested = self.nested_taus(rule_key, batch) if nested is None else nested
        taus, best = {}, 1.0
        for size in sorted(self.sizes):
            record = self.observed.get((size, rule_key, batch))
            best = max(best, nested.get(size) or (record.tau if record is not None else None) or 1.0)
            taus[size] = best
        return taus

    def nested_taus(self, rule_key: str, batch: int) -> dict[int, float]:
        """Sizes' taus compared on the same steps, for drafters whose trees are nested (greedy): every
        drafted step of size ``s`` also counts what each size ``m <= s`` would have committed
        (:attr:`paired`). The smallest size's tau pools every such step; each larger size ``n`` is
        the next smaller one's times their ratio on the steps drafted at ``n`` or more, where both
        are known. So a size explored on an easy prompt is not credited with that prompt's ease (on
        demo code, lookup size 4 measured at tau 4.2 on an easy prompt displaced size 10 measured at
        2.7 on a hard one; on the same steps 10 accepts more). Sizes above every drafted one are absent."""
        pairs = {(size, drafted): record for (size, drafted, key, bucket), record in self.paired.items()
                 if key == rule_key and bucket == batch}

        def pooled(size: int, floor: int) -> tuple[float, int]:
            records = [record for (other, drafted), record in pairs.items() if other == size and drafted >= floor]
            return sum(record.tokens for record in records), sum(record.row_steps for record in records)

        taus: dict[int, float] = {}
        previous = None
        for size in sorted(self.sizes):
            tokens, steps = pooled(size, size)
            if not steps:
                break
            if previous is None:
                taus[size] = tokens / steps
            else:
                smaller, _ = pooled(previous, size)
                taus[size] = taus[previous] * tokens / max(smaller, 1e-12)
            previous = size
        return taus

    def evidence(self, rule_key: str, batch: int) -> dict[int, int]:
        """Drafted steps seen per size under ``rule_key`` at batch bucket ``batch``."""
        return {size: getattr(self.observed.get((size, rule_key, batch)), "row_steps", 0) for size in self.sizes}

    def choose(self, input_ids: torch.Tensor, rule, max_new_tokens: int | None = None) -> dict:
        """The setting for this call: ``{"tree": n or 0, "predicted_speedup": {...}, ...}`` (plus the
        :class:`CallController` under ``"controller"``, which the call's loop consults per step).

        With room for one new token at most there is nothing to speculate on (``"reason"``)."""
        key, batch = self.key(input_ids), input_ids.shape[0]
        # sampled text repeats itself far less than greedy text (prompt lookup commits 1.1-1.3 tokens a
        # step at T=0.7 on both shipped targets), so the lenient thresholds that let a first greedy call
        # see lookup's acceptance grow would only let a sampled exploring call run at a loss
        steady = self.steady or not str(rule.key).startswith("greedy")
        base = {"policy": "auto", "rule": rule.key, "batch_bucket": key[0], "length_bucket": key[1]}
        refresh = (len(self.cost_samples.get((key, 0), ())) < REFRESH_SAMPLES
                   or self.since_plain.get(key, 0) >= REFRESH_PLAIN)
        self._borrow_costs(key)
        plain = self.step_costs.get((key, 0))

        def plain_steps(reason: str | None = None, measure: bool = False, **extra) -> dict:
            """No drafting in this call: the backbone's own ``generate`` (``"delegate"``), or plain
            steps in the loop when they are to measure the bucket's plain cost (``measure``)."""
            return {**base, "tree": 0, "controller": CallController(plain, 0), "exploring": False,
                    "delegate": self.delegate_plain and not measure,
                    "plain_step_ms": None if plain is None else 1000 * plain,
                    **({} if reason is None else {"reason": reason}), **extra}

        if max_new_tokens is not None and max_new_tokens <= 1:
            return plain_steps(f"room for {max(max_new_tokens, 0)} new token(s): nothing to speculate on",
                               measure=True)
        nested = self.nested_taus(rule.key, key[0])
        taus, evidence = self.taus(rule.key, key[0], nested), self.evidence(rule.key, key[0])
        measured = [size for size in self.sizes if (key, size) in self.step_costs and evidence[size]]
        ruled_out = {size for size in self.sizes
                     if size not in measured and self._loses_at_smaller_batch(key, size, rule.key)}
        explore = self._worth_measuring(key, plain, taus, measured, ruled_out, nested)
        if plain is None and explore is None:  # no plain step yet: this call measures one (and a size, if any may pay)
            hopeful = [size for size in self.sizes if size not in ruled_out]
            explore = max(hopeful) if hopeful else None
            if explore is None:
                return plain_steps("every size loses, or cannot pay, at a smaller batch size already: plain steps")
        least = MIN_LEARN_TOKENS if steady else GROWING_LEARN_TOKENS
        short = max_new_tokens is not None and max_new_tokens < least
        base["learns"] = not short
        if explore is not None and short:  # too short to judge a size on: plain steps (which measure plain)
            if plain is None or not measured:
                return plain_steps(f"{max_new_tokens} new tokens: too few to measure a tree size on "
                                   f"(at least {least}); plain steps", measure=plain is None)
            explore = None
        if explore is not None:  # measured on this call's own steps (the mid-call switch bounds the cost)
            prior = (self.observed.get((explore, rule.key, key[0])) or Observed()).tau
            larger = [size for size in measured if size > explore]
            if explore in nested:  # counted on the same steps as larger sizes: judged strictly by that
                prior = taus[explore]
            elif prior is None and larger:  # a larger nested tree's tau bounds this one's: judge it strictly
                prior = taus[min(larger)]
            return {**base, "tree": explore, "controller": self.controller(key, plain, explore, batch, prior, refresh,
                                                                             steady),
                    "exploring": True, "nested_sizes": self._nested_sizes(explore),
                    "plain_step_ms": None if plain is None else 1000 * plain,
                    "reason": f"{explore} drafted nodes not measured yet at this batch size, prompt length and "
                              "sampling setting: measured on this call"}
        if not measured:  # every size ruled out without measuring it: plain decoding
            return plain_steps(predicted_speedup={}, upper_bound={}, margin=self.margin)
        predicted = {size: taus[size] * plain / self.step_costs[(key, size)] for size in measured}
        bound = {size: predicted[size] * (1 + EXPLORE / max(1, evidence[size]) ** 0.5) for size in measured}
        best = max(bound, key=bound.get)
        incumbent = max(measured, key=lambda size: evidence[size])  # the size seen drafting most
        if evidence[incumbent] > evidence[best] >= SWITCH_STEPS and bound[incumbent] >= self.margin and \
                bound[best] < bound[incumbent] * (1 + IMPROVE):
            best = incumbent  # sizes measured on different calls saw different text: a small lead is not enough
            # (a size seen for fewer steps than a call's verdict needs has not been judged at all: on demo
            # prose, lookup size 10 seen for 5 steps of a 16-token call stayed behind size 4 for good, the
            # cell at 0.9x of the fixed size-10 tree)
        chosen = best if bound[best] >= self.margin else 0
        retry = self._retry((key[0], rule.key), chosen, short)
        if retry:
            chosen = best
        return {
            **base, "tree": chosen, "nested_sizes": self._nested_sizes(chosen),
            # a retry judges the size afresh, as a first measurement (lenient thresholds, no prior)
            "controller": self.controller(key, plain, chosen, batch, None if retry else taus.get(chosen), refresh,
                                          steady),
            "delegate": self.delegate_plain and not chosen,
            "plain_step_ms": 1000 * plain,
            "step_ms": {size: 1000 * self.step_costs[(key, size)] for size in measured},
            "tau": taus, "row_steps": evidence, "predicted_speedup": predicted, "upper_bound": bound,
            "exploring": retry or (bool(chosen) and predicted[chosen] < self.margin), "margin": self.margin,
            **({"reason": f"plain decoding chosen {RETRY_AFTER}+ calls running: the best size measured "
                          "again (its estimate may come from a few unlucky steps)"} if retry else {}),
        }

    def _nested_sizes(self, tree: int) -> list[int]:
        """The sizes whose acceptance a call drafting ``tree`` nodes counts on its own steps (where
        the drafter nests its trees): every candidate size up to ``tree``."""
        return [size for size in sorted(self.sizes) if size <= tree] if tree else []

    def _fewer_rows(self, key, size: int, batch: int) -> dict[int, tuple[float | None, float | None]]:
        """Measured seconds of a plain step and of a step drafting ``size`` nodes per row, by number of
        rows below ``batch`` (prompt-length bucket of ``key``): what the call's steps cost once rows
        have left (:class:`CallController`)."""
        costs = {rows: (self.row_costs.get((key[1], 0, rows)), self.row_costs.get((key[1], size, rows)))
                 for rows in range(1, batch)}
        return {rows: pair for rows, pair in costs.items() if pair != (None, None)}

    def controller(self, key, plain: float | None, size: int, batch: int, prior: float | None = None,
                   refresh: bool = False, steady: bool = False) -> CallController:
        """The :class:`CallController` of a call drafting ``size`` nodes per row over ``batch`` rows."""
        return CallController(plain, size, prior, refresh, steady, self._fewer_rows(key, size, batch) if size else None)

    def _retry(self, key, chosen: int, short: bool) -> bool:
        """Whether a call that would decode plainly measures the best size again instead: after
        :data:`RETRY_AFTER` consecutive plain choices in this bucket and rule, then after twice as
        many, and so on (an estimate from one call's few drafted steps can be far off, and a plain
        call teaches nothing; a setting where drafting really loses pays one short stopped call per
        doubling interval). Calls too short to learn from (``short``) neither count nor retry."""
        if chosen or short:
            if chosen:
                self.plain_streak[key] = 0
                self.retry_interval.pop(key, None)
            return False
        streak = self.plain_streak.get(key, 0) + 1
        interval = self.retry_interval.get(key, RETRY_AFTER)
        if streak < interval:
            self.plain_streak[key] = streak
            return False
        self.plain_streak[key] = 0
        self.retry_interval[key] = 2 * interval
        return True

    def _loses_at_smaller_batch(self, key, size: int, rule_key: str) -> bool:
        """True when ``size`` did not pay at a smaller batch bucket (prompt length within
        :data:`BORROW_LENGTHS`, same rule): measured there (:data:`SWITCH_STEPS` drafted steps or
        more) and predicted below ``margin`` as :meth:`choose` predicts it (its tau as :meth:`taus`
        gives it), or else below ``margin`` on its optimistic estimate there
        (:meth:`_optimistic_speedup`). A larger batch only makes drafted nodes dearer and the slowest
        row slower, so it is not explored (on demo-llama at batch 8, EAGLE sizes that could not pay at
        batch 4 were explored at 0.6x-0.8x, the cell at 0.91x-0.95x)."""
        for (other, other_size), plain in self.step_costs.items():
            if other_size != 0 or other[0] >= key[0]:
                continue
            if max(other[1], key[1]) > BORROW_LENGTHS * min(other[1], key[1]):
                continue
            evidence = self.evidence(rule_key, other[0])
            measured = [n for n in self.sizes if (other, n) in self.step_costs and evidence[n] >= SWITCH_STEPS]
            if not measured:
                continue
            nested = self.nested_taus(rule_key, other[0])
            taus = self.taus(rule_key, other[0], nested)
            if size in measured:
                estimate = taus[size] * plain / max(self.step_costs[(other, size)], 1e-12)
            else:
                estimate = self._optimistic_speedup(other, size, plain, taus, measured, nested)
            if estimate is not None and estimate < self.margin:
                return True
        return False

    def _worth_measuring(self, key, plain: float | None, taus: dict, measured: list[int],
                         ruled_out: set = frozenset(), nested: dict | None = None) -> int | None:
        """The largest size not yet ``measured`` (a step cost in bucket ``key`` and tau seen under
        this rule and batch bucket) that could beat plain decoding by ``margin`` on its optimistic
        estimate (:meth:`_optimistic_speedup`; a size with nothing to judge it by is worth trying),
        or None; without a plain cost, the largest size. Once a measured size beats plain decoding by
        ``margin``, another is tried only if it could beat that size's predicted speedup by
        :data:`IMPROVE` as well."""
        need = self.margin
        for size in measured:
            if plain is not None:
                predicted = taus[size] * plain / max(self.step_costs[(key, size)], 1e-12)
                if predicted >= self.margin:
                    need = max(need, predicted * (1 + IMPROVE))
        for size in sorted(self.sizes, reverse=True):
            if size in measured or size in ruled_out:
                continue
            if plain is None:
                return size
            optimistic = self._optimistic_speedup(key, size, plain, taus, measured, nested)
            if optimistic is None or optimistic >= need:
                return size
        return None

    def _optimistic_speedup(self, key, size: int, plain: float, taus: dict, measured: list[int],
                            nested: dict | None = None) -> float | None:
        """An upper estimate of ``size``'s speedup in bucket ``key``: its tau as counted on larger
        sizes' steps where the drafter nests its trees (:meth:`nested_taus`), else the next larger
        measured size's (a nested smaller tree accepts no more) but at most ``size + 1``; its cost as
        measured, else interpolated between plain decoding and the next larger costed size, where
        only the verification part shrinks with ``n`` and the drafting part (Medusa's heads, EAGLE's
        levels, a lookup) is kept whole. None when neither it nor a larger size has a cost there."""
        larger = [other for other in measured if other > size]
        costed = [other for other in self.sizes if other > size and (key, other) in self.step_costs]
        cost = self.step_costs.get((key, size))
        if cost is None and not costed:
            return None
        if cost is None:
            other = min(costed)
            total = self.step_costs[(key, other)]
            drafting = min(self.draft_costs.get((key, other), 0.0), max(0.0, total - plain))
            cost = plain + drafting + (total - plain - drafting) * size / other
        if nested and size in nested:
            tau = taus[size]
        else:
            tau = min(taus[min(larger)], size + 1) if larger else size + 1  # n nodes commit at most n + 1
        return tau * plain / max(cost, 1e-12)

    def _observe_nested(self, choice: dict, stats, batch: int) -> None:
        """Add a call's nested counts (:attr:`DecodeStats.nested`) to :attr:`paired`: per size, the
        slowest row's tokens per counted step, weighted by the steps counted."""
        sizes, rows = choice.get("nested_sizes") or [], [row for row in stats.nested if row and row[0]]
        if not sizes or not rows or len(rows[0]) != len(sizes) + 1:
            return
        steps = max(row[0] for row in rows)
        for index, size in enumerate(sizes, start=1):
            rate = min(row[index] / row[0] for row in rows)
            record = self.paired.setdefault((size, choice["tree"], choice["rule"], batch), Observed())
            record.tokens += rate * steps
            record.row_steps += steps

    def observe(self, choice: dict, stats) -> None:
        """Learn from a finished ``auto`` call: its plain and drafted step costs (medians over the
        call, into the bucket's estimates), its slowest row's tokens per drafted step (weighted by
        the drafted steps), and what the call's controller did (into ``choice``)."""
        key, size = (choice["batch_bucket"], choice["length_bucket"]), choice["tree"]
        controller = choice.pop("controller", None)
        plain_steps = [step for step in stats.steps if step[0] is False]  # (None: proposed nothing, not timed as plain)
        plain_first = bool(stats.steps) and stats.steps[0][0] is False  # the call's first step costs more than later ones
        plain = [step for step in plain_steps[plain_first and len(plain_steps) > 1:] if step[3] == stats.batch_size]
        drafted = [step for step in stats.steps if step[0]]
        if plain:  # a step of every row, as the backbone's generate takes (rows leave the loop as they finish)
            self.record_cost(key, 0, statistics.median(step[1] for step in plain))
        self.since_plain[key] = 0 if plain else self.since_plain.get(key, 0) + 1
        tau = stats.slowest_row_tau(proposed=True)
        learns = choice.get("learns", True)
        for steps, tree, skip in ((plain_steps, 0, plain_first), (drafted, size, True)):
            for rows, seconds in (costs_by_rows(steps, skip) if learns or not tree else {}).items():
                self._record(self.row_samples, self.row_costs, (key[1], tree, rows), seconds)
        if drafted and size and tau is not None and learns:
            # per drafted step of the slowest row, rows leaving as they finish: measured to the end of
            # the call, or as its controller projected it where it stopped drafting
            stopped = controller is not None and controller.switched_at is not None and controller.effective
            self.record_cost(key, size, controller.effective if stopped else mean_cost(drafted, skip_first=True))
            self.record_draft_cost(key, size, stats.draft_seconds / len(drafted))  # plain steps' few us included
            record = self.observed.setdefault((size, choice["rule"], key[0]), Observed())
            record.tokens += tau * len(drafted)
            record.row_steps += len(drafted)
            self._observe_nested(choice, stats, key[0])
        choice.update({"plain_steps": len(plain_steps), "drafted_steps": len(drafted), "slowest_row_tau": tau})
        if controller is not None and size:
            choice.update({"stopped_drafting_after": controller.switched_at, "realized_speedup": controller.realized})
