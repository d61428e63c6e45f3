"""``speculate="auto"``: how much to draft for a batch, from costs measured on this machine.

Speculation pays when ``tau(n) x t_plain(B) > t_step(B, n)``: the tokens a row commits per step
with ``n`` drafted nodes, times the cost of one plain decoding step at batch size ``B``, must beat
the cost of one speculative step (drafting, verifying ``n + 1`` nodes per row, accepting). At
batch 1 a small model's forward is overhead-bound and extra nodes are nearly free; as ``B`` grows
the verify forward becomes compute-bound, ``t_step`` grows with ``B x (n + 1)`` and the win
shrinks, then turns into a loss.

The policy measures both costs the first time it sees a (batch size, prompt length) bucket (a
bucket within a factor 4 of a measured prompt length at the same batch size starts from that one's
costs instead): a few real speculative steps per candidate tree size on the caller's prompts, and a
few plain steps of the backbone's own ``generate``; every later run in the bucket refines the
estimate of the setting it used. ``tau(n)`` comes from every speculative step seen with that tree
size under the same acceptance rule and sampling settings (acceptance falls with temperature),
calibration steps included, so it follows the traffic actually served. It picks the size with the
best predicted speedup, and no speculation at all (the backbone's own ``generate``) unless that
prediction beats plain decoding by ``margin``.

Two safeguards keep one unlucky measurement from deciding for good. Step costs are the median of
the last :data:`COST_SAMPLES` measurements of a setting, not a running mean that one stalled step
drags. And a size seen for only a few steps is given the benefit of the doubt: its predicted
speedup is scaled by ``1 + EXPLORE / sqrt(row steps seen)`` when choosing (an upper confidence
bound), so a size whose calibration happened to fall on text it could not draft (prompt lookup at
the start of a reply, before anything repeats) is tried on real traffic until its estimate is
backed by evidence, instead of plain decoding being chosen forever. A size predicted clearly slower
than plain decoding is never tried this way (after the 6 calibration steps the bound is 1.2x the
prediction, so below 0.92x nothing is tried; it shrinks to the prediction within a call or two),
and ``tau`` is non-decreasing in the tree size for nested trees, so a larger size is credited with
at least the tau of any smaller one.

Calibration runs stay inside what the call may generate: at most ``max_new_tokens`` new tokens
per row and never past a hard position limit (GPT-2's ``n_positions``). A call with room for fewer
than :data:`MIN_CALIBRATION_TOKENS` new tokens in a bucket not yet measured runs plain decoding
instead of calibrating on one or two steps (whose costs and tau are noise that later calls would
inherit); a later, longer call calibrates the bucket.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from tree_attention.decode import SpeculativeDecoder

CALIBRATION_STEPS = 6
MIN_CALIBRATION_TOKENS = CALIBRATION_STEPS + 2  # a shorter call runs plain rather than calibrate on noise
COST_SAMPLES = 8  # a step cost is the median of the last this many measurements of its setting
BORROW_LENGTHS = 4  # a new prompt-length bucket starts from costs measured within this factor
EXPLORE = 0.5  # upper-confidence bonus: predicted x (1 + EXPLORE / sqrt(row steps seen))


def step_seconds(stats) -> float:
    """Seconds a speculative call spent in its steps: every phase of the loop but the prefill and
    the output's assembly (acceptance, cache and bookkeeping included, which grow with the batch),
    or drafting plus verifying where no phases were recorded."""
    if stats.phases:
        return max(0.0, stats.total_seconds - stats.phases.get("prefill", 0.0) - stats.phases.get("result", 0.0))
    return stats.draft_seconds + stats.verify_seconds


def _bucket(value: int) -> int:
    """The next power of two (cost changes slowly with batch size and prompt length)."""
    return 1 << max(0, int(value) - 1).bit_length()


@dataclass
class Observed:
    """Tokens committed per row and step with one tree size, summed over all steps seen."""

    tokens: int = 0
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
    observed: dict = field(default_factory=dict)  # (n, rule key) -> Observed

    def __post_init__(self) -> None:
        if not self.sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.sizes):
            raise ValueError(f"SpeculationPolicy.sizes must be positive node counts; got {self.sizes!r}")
        if not self.margin >= 1.0:
            raise ValueError(f"SpeculationPolicy.margin must be >= 1; got {self.margin!r}")

    @staticmethod
    def key(input_ids: torch.Tensor) -> tuple[int, int]:
        return _bucket(input_ids.shape[0]), _bucket(input_ids.shape[1])

    def observe(self, size: int, rule_key: str, stats, key: tuple[int, int] | None = None) -> None:
        """Record a speculative run with ``size`` drafted nodes: its tokens per row-step and, with
        the bucket ``key``, its cost per step (the plain cost stays the calibrated one: a plain
        run's time includes its prefill)."""
        steps = stats.target_forwards - 1  # the prefill is not a step
        if not size:
            return
        record = self.observed.setdefault((size, rule_key), Observed())
        record.tokens += stats.new_tokens - stats.batch_size  # the prefill's token is not a step's
        record.row_steps += stats.row_forwards - stats.batch_size
        if key is not None and steps > 0 and (key, size) in self.step_costs:
            self.record_cost(key, size, step_seconds(stats) / steps)

    def record_cost(self, key: tuple[int, int], size: int, seconds: float) -> None:
        """A measured cost per step of ``size`` drafted nodes (0: plain) in bucket ``key``; the
        estimate is the median of the last :data:`COST_SAMPLES`."""
        samples = self.cost_samples.setdefault((key, size), [])
        samples.append(seconds)
        del samples[:-COST_SAMPLES]
        self.step_costs[(key, size)] = statistics.median(samples)

    def _borrow_costs(self, key: tuple[int, int]) -> None:
        """Start a new bucket from the measured costs of the nearest one with the same batch bucket
        and a prompt length within a factor of :data:`BORROW_LENGTHS` (refined by every later run),
        rather than calibrating again: costs change slowly with the prompt length."""
        if (key, 0) in self.step_costs:
            return
        near = [other for other, size in self.cost_samples if size == 0 and other[0] == key[0]
                and max(other[1], key[1]) <= BORROW_LENGTHS * min(other[1], key[1])]
        if not near:
            return
        source = min(near, key=lambda other: abs(other[1].bit_length() - key[1].bit_length()))
        for (other, size), samples in list(self.cost_samples.items()):
            if other == source:
                self.cost_samples[(key, size)] = list(samples)
                self.step_costs[(key, size)] = self.step_costs[(other, size)]

    def taus(self, rule_key: str) -> dict[int, float]:
        """Tokens per row-step by size: the observed ones, each at least any smaller size's (nested
        trees accept at least as much), 1.0 for sizes never seen."""
        taus, best = {}, 1.0
        for size in sorted(self.sizes):
            record = self.observed.get((size, rule_key))
            best = max(best, (record.tau if record is not None else None) or 1.0)
            taus[size] = best
        return taus

    def evidence(self, rule_key: str) -> dict[int, int]:
        """Row-steps seen per size under ``rule_key``."""
        return {size: getattr(self.observed.get((size, rule_key)), "row_steps", 0) for size in self.sizes}

    def _plain_step(self, spec, input_ids, attention_mask, budget: int) -> float:
        """Seconds per token of the backbone's own ``generate`` at this batch (best of two), from
        runs of at most ``budget`` new tokens."""
        def timed(count: int) -> float:
            start = time.perf_counter()
            spec.backbone.generate(input_ids, attention_mask=attention_mask, max_new_tokens=count, min_new_tokens=count,
                                   do_sample=False, pad_token_id=spec.pad_token_id)
            return time.perf_counter() - start

        steps = min(CALIBRATION_STEPS, budget - 1)
        timed(min(2, budget))  # warm-up
        return max(1e-9, min((timed(steps + 1) - timed(1)) / steps for _ in range(2)))

    def _spec_step(self, spec, size: int, input_ids, attention_mask, rule, budget: int) -> float:
        """Median seconds per speculative step with ``size`` drafted nodes (the first step excluded
        when there are more), from a run of at most ``budget`` new tokens per row."""
        drafter = spec._bind(spec.drafter_for(size), rule)  # the candidates generate will draft (sampled or top-k)
        decoder = SpeculativeDecoder(spec.target, drafter, input_ids, budget, (), rule, attention_mask)
        decoder.prefill()
        times = []
        for _ in range(CALIBRATION_STEPS + 1):
            if not decoder.rows:
                break
            start = time.perf_counter()
            decoder.step()
            times.append(time.perf_counter() - start)
        decoder.stats.new_tokens = sum(len(output) for output in decoder.outputs)
        self.observe(size, rule.key, decoder.stats)
        return statistics.median(times[1:] or times)

    @staticmethod
    def budget(spec, attention_mask: torch.Tensor, max_new_tokens: int | None) -> int:
        """New tokens a calibration run may generate: ``max_new_tokens`` (None: unbounded), and no
        more than the positions the longest row has left under a hard position limit (GPT-2's
        ``n_positions``)."""
        from .families import position_limit

        budget = 1 << 30 if max_new_tokens is None else int(max_new_tokens)
        limit = position_limit(spec.target)
        if limit is not None:
            budget = min(budget, limit - int(attention_mask.long().sum(dim=1).max()))
        return budget

    def choose(self, spec, input_ids: torch.Tensor, attention_mask: torch.Tensor, rule,
               max_new_tokens: int | None = None) -> dict:
        """The setting for this batch: ``{"tree": n or 0, "predicted_speedup": {...}, ...}``.

        Calibration generates at most ``max_new_tokens`` tokens per row and stays inside the
        model's position limit; with room for one new token at most there is nothing to speculate
        on: plain decoding, nothing measured (``"reason"`` says so)."""
        key = self.key(input_ids)
        budget = self.budget(spec, attention_mask, max_new_tokens)
        if budget <= 1:
            return {"policy": "auto", "tree": 0, "rule": rule.key, "batch_bucket": key[0], "length_bucket": key[1],
                    "reason": f"room for {max(budget, 0)} new token(s) (max_new_tokens or the position limit): "
                              "nothing to speculate on"}
        self._borrow_costs(key)
        calibrated = (key, 0) in self.step_costs and all((key, size) in self.step_costs for size in self.sizes)
        if not calibrated and budget < MIN_CALIBRATION_TOKENS:
            return {"policy": "auto", "tree": 0, "rule": rule.key, "batch_bucket": key[0], "length_bucket": key[1],
                    "reason": f"room for {budget} new tokens: too few to calibrate this batch size and prompt length "
                              f"on (at least {MIN_CALIBRATION_TOKENS}); plain decoding until a longer call does"}
        if (key, 0) not in self.step_costs:
            self.record_cost(key, 0, self._plain_step(spec, input_ids, attention_mask, budget))
        for size in self.sizes:
            if (key, size) not in self.step_costs or (size, rule.key) not in self.observed:
                cost = self._spec_step(spec, size, input_ids, attention_mask, rule, budget)
                if (key, size) not in self.step_costs:
                    self.record_cost(key, size, cost)
        plain = self.step_costs[(key, 0)]
        taus, evidence = self.taus(rule.key), self.evidence(rule.key)
        predicted = {size: taus[size] * plain / self.step_costs[(key, size)] for size in self.sizes}
        bound = {size: predicted[size] * (1 + EXPLORE / max(1, evidence[size]) ** 0.5) for size in self.sizes}
        best = max(bound, key=bound.get)
        chosen = best if bound[best] >= self.margin else 0
        return {
            "policy": "auto", "tree": chosen, "rule": rule.key, "batch_bucket": key[0], "length_bucket": key[1],
            "plain_step_ms": 1000 * plain,
            "step_ms": {size: 1000 * self.step_costs[(key, size)] for size in self.sizes},
            "tau": taus, "row_steps": evidence, "predicted_speedup": predicted, "upper_bound": bound,
            "exploring": bool(chosen) and predicted[chosen] < self.margin, "margin": self.margin,
        }
