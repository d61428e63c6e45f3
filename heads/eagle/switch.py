"""``drafting="auto"``: a drafter trained for parallel drafting drafts each step in whichever mode
commits more tokens per second on this machine.

Sequential EAGLE spends one drafter forward per tree level; parallel drafting one forward per step,
with a static tree that accepts less per node. Which wins depends on what a drafter forward costs
next to the verification forward: on stories260K (5 layers of width 64, where every forward is
Python overhead) a drafter level costs about a seventh of a verification and the parallel tree wins;
on demo-llama (whose verification grows by about 0.5 ms per node) the sequential chain does. A
drafter trained with ``parallel = K`` serves both: its teacher-forced pairs are trained exactly as a
sequential drafter's first step, and its parallel heads (or mask queries) give the parallel depths.

:class:`SwitchingEagleDrafter` holds one drafter of each mode over one shared drafter cache (both
append a step's committed pairs the same way and crop whatever they drafted past them at the next
step), so a step of either mode may follow a step of the other. :class:`DraftingChoice` measures,
in exploration windows where the modes alternate every two steps, the tokens each mode's steps
commit and their wall-clock seconds from one ``propose`` to the next (drafting, verification and
the rest of the loop), then drafts with the faster mode for a stretch that grows with the gap, and
measures again. Alternating within a window compares the modes on the same stretch of text: how
many tokens a step commits swings far more with the text than between the modes.

Which tree is verified never changes a greedy output, so greedy calls choose per step. A sampled
call drafts in one mode throughout, so that its draws never depend on timings within it:
:class:`CallModeChoice` measures whole calls of each mode per sampling setting (sequential candidates
drawn from the drafter's distribution; parallel ones its top-k tokens, point masses to the rule) and
gives each call the mode that committed more tokens per second, trying the other every
:data:`RETRY_CALLS` calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from tree_attention.draft_batch import DraftBatch
from tree_attention.tree import PRIOR_RANKS, TreeBatch

from ..backbone import Backbone
from .config import EagleConfig
from .drafter import EagleDrafter
from .modules import EagleHeads
from .parallel import ParallelEagleDrafter

MODES = ("sequential", "parallel")
WARMUP = 4
"""Unmeasured sequential steps before the first exploration (its chains start long, till their
calibration has seen a few outcomes)."""
EXPLORE = 16
FIRST_EXPLORE = 32
"""Steps of an exploration window (the first one: :data:`FIRST_EXPLORE`, with no earlier windows to
weigh against): the modes alternate every :data:`BLOCK` steps, so both are measured on the same
stretch of text (how many tokens a step commits varies far more between stretches of text than
between the modes). Later windows are short: on easy text a 96-token reply is a dozen steps, and a
32-step window on demo code spanned three replies, half of them in the slower mode."""
BLOCK = 2
EARLY = 8
EARLY_GAP = 0.4
"""A window closes after :data:`EARLY` steps (each mode measured over half of them, on the same text)
when one mode's rate already beats the other's by more than this: on stories260K the parallel tree
wins its windows by 25-80%, and each step of the slower mode costs about 1.6x one of the faster."""
EXPLOIT = 192
"""Steps of the faster mode after a window whose two rates were 10% apart; the stretch is shorter for
a closer call (down to a quarter) and longer for a wider gap (up to 4x). Then the next window
measures both again. A window whose cycles split (a block of each mode, on the same text; the loser
won at least half as many cycles as the winner) counts as a close call whatever the gap of its sums:
on demo-llama prose, where the modes tie, one unlucky 16-step window put the parallel tree ahead by
43% and kept it for 513 steps."""
SATURATION_STEPS = 8
SATURATION = 0.85
"""A stretch of the shallower mode also ends once its last :data:`SATURATION_STEPS` steps committed
at least this fraction of the most its tree can per row and step (see ``DraftingChoice._saturated``):
on demo-llama code a window on a hard prompt chose the 3-deep parallel tree, which then ran at tau
3.84 on easy prompts where the sequential chain commits 8 tokens a step."""
CHECK = 32
DRIFT = 0.2
"""A stretch is measured too: once it has :data:`CHECK` measured steps, a rate more than
:data:`DRIFT` away from what its mode did in the window (the text got harder or easier, or a
passing load misled the window) ends it, and a window measures both modes on the new text. Which
mode is faster changes with the text: on demo-llama the modes tie on a hard prompt and the chain
commits twice as much per second on an easy one."""
WINDOW_DECAY = 0.25
"""A window chooses on its own measurements plus the earlier windows', each window's weighted by this
factor per later window (together a third of the newest's at most): on a hard prompt the modes tie
within the noise, and a short window there should not undo what windows on other text showed, while
a clear reversal still switches within one window."""
PATIENCE = 16
"""A window that a drift or saturation check opened and that chose the same mode again doubles the
steps the next stretch runs before either check may end it (up to this factor; a window that
changes the mode resets it): on stories260K the parallel tree saturates on easy text and wins every
window by 25-80%, and re-measuring the 1.6x slower chain every few dozen steps cost about 7%."""


class DraftingChoice:
    """The choice of each step's mode: exploration windows of :data:`EXPLORE` steps in which the
    modes alternate, each followed by a stretch of the faster mode (per window: committed tokens
    over wall-clock seconds of each mode's steps). Kept on the drafter's heads across ``generate``
    calls, per drafting configuration (serving statistics, never saved)."""

    def __init__(self, ceilings: dict[str, float] | None = None) -> None:
        # per mode, the tokens per row and step it commits at most (its tree's depth + 1), where the
        # other mode drafts deeper: a stretch of it that nears this ends (see SATURATION)
        self.ceilings = dict(ceilings or {})
        self._recent: list[float] = []  # the stretch's last SATURATION_STEPS steps' tokens per row
        self.tokens = dict.fromkeys(MODES, 0.0)  # the current (or last) window's sums
        self.seconds = dict.fromkeys(MODES, 0.0)
        self.steps = dict.fromkeys(MODES, 0)  # steps drafted in each mode (statistics)
        self.windows = 0  # exploration windows completed
        self.chosen: str | None = None  # the faster mode of the last window
        self._warm = WARMUP
        self._exploring = 0  # steps of the current window drafted so far (0: not exploring)
        self._cycle = {mode: [0.0, 0.0] for mode in MODES}  # the current cycle's tokens and seconds per mode
        self._votes = dict.fromkeys(MODES, 0)  # cycles of the current window that each mode won
        self._left = 0  # steps left in the current stretch of the chosen mode
        self._stretch = [0.0, 0.0, 0]  # the current stretch's measured tokens, seconds and steps
        self.rechecks = 0  # stretches ended early because their rate drifted (statistics)
        self.patience = 1  # the checks wait this many times CHECK / SATURATION_STEPS stretch steps (PATIENCE)
        self._history = {mode: (0.0, 0.0) for mode in MODES}  # decayed tokens and seconds of all windows
        self._rechecked: str | None = None  # the mode whose stretch a check ended, until the window closes

    def observe(self, mode: str, tokens: float, seconds: float, rows: int = 1) -> None:
        """A step of ``mode`` committed ``tokens`` (all ``rows`` rows) in ``seconds``: counts in the
        current window, or in the current stretch of the chosen mode."""
        if seconds <= 0:
            return
        if self._exploring:
            self.tokens[mode] += tokens
            self.seconds[mode] += seconds
            cycle = self._cycle[mode]
            cycle[0], cycle[1] = cycle[0] + tokens, cycle[1] + seconds
            if self._exploring % (2 * BLOCK) == 0:  # a cycle (a block of each mode) is complete: its vote
                rates = {name: sums[0] / sums[1] if sums[1] > 0 else 0.0 for name, sums in self._cycle.items()}
                self._votes[max(MODES, key=rates.get)] += 1
                self._cycle = {name: [0.0, 0.0] for name in MODES}
        elif self._left and mode == self.chosen:
            self._stretch[0] += tokens
            self._stretch[1] += seconds
            self._stretch[2] += 1
            self._recent = (self._recent + [tokens / max(1, rows)])[-SATURATION_STEPS:]

    def _saturated(self) -> bool:
        """True when the stretch's last :data:`SATURATION_STEPS` steps committed, per row, at least
        :data:`SATURATION` of what its mode can (its tree's depth + 1) while the other mode drafts
        deeper: on easy text a shallow tree caps the gain, and its rate hardly moves, so the drift
        check cannot see that the deeper mode would now commit far more."""
        ceiling = self.ceilings.get(self.chosen)
        if ceiling is None or len(self._recent) < SATURATION_STEPS or self._stretch[2] < SATURATION_STEPS * self.patience:
            return False
        return sum(self._recent) / len(self._recent) >= SATURATION * ceiling

    def _drifted(self) -> bool:
        """True once the stretch has :data:`CHECK` measured steps and its mode's rate has moved more
        than :data:`DRIFT` from the rate it had in the window."""
        tokens, seconds, steps = self._stretch
        if steps < CHECK * self.patience or seconds <= 0:
            return False
        before = self.rate(self.chosen)
        return before is not None and abs(tokens / seconds / before - 1.0) > DRIFT

    def rate(self, mode: str) -> float | None:
        """Tokens per second of ``mode`` in the current (or last) window; None before it was measured."""
        return self.tokens[mode] / self.seconds[mode] if self.seconds[mode] > 0 else None

    def _decided(self) -> bool:
        """True when the window so far shows one mode faster by more than :data:`EARLY_GAP`."""
        rates = [self.rate(mode) for mode in MODES]
        if None in rates or min(rates) <= 0:
            return False
        return max(rates) / min(rates) - 1.0 > EARLY_GAP

    def faster(self) -> str | None:
        """The faster mode of the last completed window (None before one)."""
        return self.chosen

    def _close_window(self) -> None:
        for mode in MODES:  # earlier windows still count, decayed (WINDOW_DECAY)
            self._history[mode] = (WINDOW_DECAY * self._history[mode][0] + self.tokens[mode],
                                   WINDOW_DECAY * self._history[mode][1] + self.seconds[mode])
        rates = {mode: tokens / seconds if seconds > 0 else 0.0 for mode, (tokens, seconds) in self._history.items()}
        best = max(MODES, key=rates.get)
        other = MODES[1 - MODES.index(best)]
        gap = rates[best] / rates[other] - 1.0 if rates[other] > 0 else 1.0
        if self._rechecked is not None:  # a check opened this window: back off if it changed nothing
            self.patience = min(PATIENCE, 2 * self.patience) if best == self._rechecked else 1
            self._rechecked = None
        self.chosen, self.windows = best, self.windows + 1
        scale = min(4.0, max(0.25, gap / 0.1))
        if self._votes[other] * 2 >= self._votes[best] > 0:  # a split window: as good as a tie
            scale = 0.25
        self._left = int(EXPLOIT * scale)
        self._stretch = [0.0, 0.0, 0]
        self._recent = []

    def choose(self) -> tuple[str, bool]:
        """The next step's mode, and whether that step is left unmeasured (the warm-up steps; window
        and stretch steps are measured). Call after :meth:`observe` of the step before it."""
        length = FIRST_EXPLORE if not self.windows else EXPLORE
        if self._exploring == length or (self._exploring == EARLY and self._decided()):  # choose
            self._exploring = 0
            self._close_window()
        if self._warm:
            self._warm -= 1
            mode, skip = MODES[0], True
        elif self._left and (self._drifted() or self._saturated()):
            self._left, self.rechecks, self._rechecked = 0, self.rechecks + 1, self.chosen
            return self.choose()  # a window starts now
        elif self._left:
            self._left -= 1
            mode, skip = self.chosen, False  # measured: the stretch's rate is checked (see CHECK)
        else:
            if not self._exploring:  # a new window
                self._cycle, self._votes = {name: [0.0, 0.0] for name in MODES}, dict.fromkeys(MODES, 0)
                self.tokens, self.seconds = dict.fromkeys(MODES, 0.0), dict.fromkeys(MODES, 0.0)
            mode, skip = MODES[(self._exploring // BLOCK) % 2], False
            self._exploring += 1
        self.steps[mode] += 1
        return mode, skip


RETRY_CALLS = 8
"""A sampled call in the mode that is not the faster one, every this many calls (traffic changes)."""
CALL_MIN_STEPS = 4
"""Measured steps a sampled call needs to count in :class:`CallModeChoice` (a warm-up call's do not)."""
CALL_DECAY = 0.5
"""Weight of a mode's earlier calls against its newest one in :class:`CallModeChoice`'s rates."""


class CallModeChoice:
    """The mode of whole sampled calls under one sampling setting: each mode's committed tokens and
    seconds over its calls (earlier calls decayed by :data:`CALL_DECAY`); untried modes first (the
    sequential one before the parallel one), then the faster, the slower every :data:`RETRY_CALLS`
    calls. Kept on the drafter's heads across calls (serving statistics, never saved)."""

    def __init__(self) -> None:
        self.tokens = dict.fromkeys(MODES, 0.0)
        self.seconds = dict.fromkeys(MODES, 0.0)
        self.calls = dict.fromkeys(MODES, 0)

    def rate(self, mode: str) -> float | None:
        return self.tokens[mode] / self.seconds[mode] if self.seconds[mode] > 0 else None

    def choose(self) -> str:
        untried = [mode for mode in MODES if not self.calls[mode]]
        if untried:
            return untried[0]
        best = max(MODES, key=lambda mode: self.rate(mode) or 0.0)
        if sum(self.calls.values()) % RETRY_CALLS == RETRY_CALLS - 1:
            return MODES[1 - MODES.index(best)]
        return best

    def observe(self, mode: str, tokens: float, seconds: float) -> None:
        """A finished call of ``mode`` committed ``tokens`` in ``seconds`` (its measured steps)."""
        if seconds <= 0 or tokens <= 0:
            return
        self.tokens[mode] = CALL_DECAY * self.tokens[mode] + tokens
        self.seconds[mode] = CALL_DECAY * self.seconds[mode] + seconds
        self.calls[mode] += 1


@dataclass
class SampledCall:
    """One sampled call's mode and what its measured steps (all but the first) committed."""

    choice: CallModeChoice
    mode: str
    started: float  # when its first step's propose began
    last: float = 0.0  # when its latest step's propose began
    tokens: float = 0.0
    steps: int = 0

    def close(self) -> None:
        """Report the call to its choice (a warm-up call's few steps say little: not reported)."""
        if self.steps >= CALL_MIN_STEPS:
            self.choice.observe(self.mode, self.tokens, self.last - self.started)


def parallel_tree_config(config: EagleConfig, accuracy) -> EagleConfig:
    """The parallel mode's config under ``drafting="auto"``: every one of the ``parallel`` depths, the
    ranks of the accuracy table (the prior's without one), ``parallel_tokens`` nodes best-first."""
    ranks = len(accuracy[0]) if accuracy and accuracy[0] else PRIOR_RANKS
    if config.draft_vocab_size is not None:
        ranks = min(ranks, config.draft_vocab_size)
    depth = min(config.parallel, config.parallel_tokens)
    return replace(config, depth=depth, top_k=ranks, total_tokens=config.parallel_tokens, drafting="parallel")


class SwitchingEagleDrafter:
    """A ``tree_attention.decode.Drafter`` that drafts each step sequentially or in parallel (see the
    module docstring); ``choosing`` is set per call by the kind's ``bind_rule`` (greedy rules only)."""

    def __init__(self, heads: EagleHeads, target: Backbone, config: EagleConfig, accuracy=None) -> None:
        self.heads, self.target = heads, target
        self.sequential = EagleDrafter(heads, target, replace(config, drafting="sequential"))
        parallel_config = parallel_tree_config(config, accuracy)
        self.parallel = ParallelEagleDrafter(heads, target, parallel_config, accuracy)
        key = (config.depth, config.top_k, config.total_tokens, parallel_config.total_tokens)
        parallel_depth = self.parallel.template.max_depth
        ceilings = {"parallel": parallel_depth + 1.0} if parallel_depth < self.sequential.depth else {}
        self.choice = heads.drafting_choices.setdefault(key, DraftingChoice(ceilings))
        self.sample = self.sequential.sample
        self.choosing = False
        self.call_choice: CallModeChoice | None = None  # a sampled call's mode choice (set by bind_rule)
        self._key = key
        self._call: SampledCall | None = None  # the sampled call in progress
        self._last: tuple[str, bool] | None = None  # the last step's mode, and whether it goes unmeasured
        self._started: float | None = None  # when the last step's propose began
        self._forced: str | None = None  # the mode a planner asked for (use_mode), None: choose here
        self.reset(1)

    modes = MODES
    fixed_modes = ("parallel",)
    """Modes whose trees :meth:`resize` leaves unchanged: a parallel step drafts its whole static tree
    in one forward, whatever its size."""

    @property
    def nested(self) -> bool:
        """As the sequential drafter's trees (:attr:`EagleDrafter.nested`)."""
        return self.sequential.nested

    def resize(self, tree: int | None) -> None:
        """Sequential trees at ``tree`` drafted nodes (None: configured); the shared cache is kept."""
        self.sequential.resize(tree)

    def use_mode(self, mode: str | None) -> None:
        """Draft the next steps in ``mode`` (``speculate="auto"`` chooses per step); None: this
        drafter's own choice again."""
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or None; got {mode!r}")
        self._forced = mode

    @staticmethod
    def _share(source, target) -> None:
        """``target`` continues from ``source``'s drafter cache and committed counts (one cache for both modes)."""
        target.cache, target.committed = source.cache, source.committed

    def sample_with(self, warp, generator) -> None:
        self.sequential.sample_with(warp, generator)

    def couple_with(self, rule) -> None:
        self.sequential.couple_with(rule)

    @property
    def sampling(self) -> bool:
        return self.sequential.sampling

    def bind_sampling(self, rule_key: str | None) -> None:
        """Under a lossless sampling rule (``rule_key``: its settings) each call drafts in the mode
        :class:`CallModeChoice` gives it; None: sequential drafting (typical acceptance)."""
        self.call_choice = None if rule_key is None else self.heads.drafting_choices.setdefault(
            (self._key, "sampled", rule_key), CallModeChoice())

    def reset(self, batch_size: int) -> None:
        if self._call is not None:
            self._call.close()
            self._call = None
        self.sequential.reset(batch_size)
        self._share(self.sequential, self.parallel)
        self._last = self._started = None

    def retire(self, keep: torch.Tensor) -> None:
        self.sequential.retire(keep)
        self._share(self.sequential, self.parallel)
        self._started = None  # the next batch's lengths no longer match the last step's rows

    def _mode(self, batch: DraftBatch) -> str:
        if self._forced is not None:
            return self._forced if self.sequential.total_tokens else "sequential"
        if not self.choosing and self.call_choice is not None and self.sequential.total_tokens:
            now = time.perf_counter()
            call = self._call
            if call is None:  # the call's first step (it also commits the prompt): not measured
                call = self._call = SampledCall(self.call_choice, self.call_choice.choose(), now)
            else:
                call.tokens += float(batch.lengths.sum())
                call.last = now
                call.steps += 1
            return call.mode
        if not self.choosing or self.sequential.total_tokens == 0:
            self._last = None
            return "sequential"
        now = time.perf_counter()
        fresh = self._started is None  # a call's first step (it also commits the prompt) or one after retire()
        if not fresh and self._last is not None and not self._last[1]:
            self.choice.observe(self._last[0], float(batch.lengths.sum()), now - self._started, batch.rows)
        self._started = now
        mode, first = self.choice.choose()
        self._last = (mode, first or fresh)
        return mode

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        mode = self._mode(batch)
        if mode == "parallel":
            if self.sequential.min_acceptance > 0:  # the last sequential chains still calibrate on what was produced
                self.sequential._learn(batch)
            trees = self.parallel.propose(batch)
            self._share(self.parallel, self.sequential)
        else:
            trees = self.sequential.propose(batch)
            self._share(self.sequential, self.parallel)
        return trees

