"""``drafting="auto"``: a drafter trained for parallel drafting drafts each step in whichever mode
commits more tokens per second on this machine.

Sequential EAGLE spends one drafter forward per tree level; parallel drafting one forward per step,
with a static tree that accepts less per node. Which wins depends on what a drafter forward costs
next to the verification forward: on stories260K (5 layers of width 64, where every forward is
Python overhead) a drafter level costs about a seventh of a verification and the parallel tree wins;
on demo-llama (whose verification grows by about 0.5 ms per node) the sequential chain does. A
drafter trained with ``parallel = K`` serves both: its teacher-forced pairs are trained exactly as a
sequential drafter's first step, and its mask queries give the parallel depths.

:class:`SwitchingEagleDrafter` holds one drafter of each mode over one shared drafter cache (both
append a step's committed pairs the same way and crop whatever they drafted past them at the next
step), so a step of either mode may follow a step of the other. :class:`DraftingChoice` keeps, per
mode, running estimates of the tokens a step commits and of the wall-clock seconds from one
``propose`` to the next (drafting, verification and the rest of the loop), and picks the mode with
the higher ratio, in bursts: each mode is measured first, then the faster drafts for a stretch and
the other a short burst, so that its estimate follows the machine.

Which tree is verified never changes a greedy output, so greedy calls choose; a sampled call drafts
sequentially at every step (its candidates drawn from the drafter's distribution), so that a seeded
call's draws never depend on timings.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from tree_attention.decode import DraftBatch
from tree_attention.tree import PRIOR_RANKS, TreeBatch

from ..backbone import Backbone
from .config import EagleConfig
from .drafter import EagleDrafter
from .modules import EagleHeads
from .parallel import ParallelEagleDrafter

logger = logging.getLogger(__name__)

MODES = ("sequential", "parallel")
MIN_SEEN = 8
"""Measured steps of each mode before the choice acts on the measurements."""
WARMUP = 4
"""Unmeasured steps before a mode's first measured one (sequential chains start long, till their
calibration has seen a few outcomes)."""
EXPLORE = 48
"""Steps of the chosen mode between two bursts of the other, when their estimated rates are within
10%; the interval grows with the gap (a mode 30% slower is revisited every 144 steps)."""
BURST = 6
"""Steps of the other mode in a burst; the first step of every burst is not measured (it follows a
step of the other mode)."""
DECAY = 0.1
"""Weight of the newest measured step in the running estimates."""


class DraftingChoice:
    """Per mode: running estimates of tokens committed per step and seconds per step, and the
    choice of the next step's mode, in bursts: each mode is tried until measured :data:`MIN_SEEN`
    times, then the faster drafts :data:`EXPLORE` steps or more and the other :data:`BURST`. Kept on the
    drafter's heads across ``generate`` calls, per drafting configuration (serving statistics,
    never saved)."""

    def __init__(self) -> None:
        self.tokens = dict.fromkeys(MODES, 0.0)
        self.seconds = dict.fromkeys(MODES, 0.0)
        self.seen = dict.fromkeys(MODES, 0)
        self.steps = dict.fromkeys(MODES, 0)  # steps drafted in each mode (statistics)
        self.mode = MODES[0]  # the current burst's mode
        self._left = 0  # steps left in it
        self._skip = 0  # of which the first ones are not measured

    def observe(self, mode: str, tokens: float, seconds: float) -> None:
        """One measured step of ``mode`` committed ``tokens`` (all rows) in ``seconds``."""
        if seconds <= 0:
            return
        if self.seen[mode] == 0:
            self.tokens[mode], self.seconds[mode] = tokens, seconds
        else:
            self.tokens[mode] += DECAY * (tokens - self.tokens[mode])
            self.seconds[mode] += DECAY * (seconds - self.seconds[mode])
        self.seen[mode] += 1

    def rate(self, mode: str) -> float | None:
        """Estimated tokens per second of ``mode`` (None before it was measured)."""
        return self.tokens[mode] / self.seconds[mode] if self.seen[mode] else None

    def faster(self) -> str | None:
        """The mode with the higher estimated rate, once both were measured :data:`MIN_SEEN` times."""
        if any(self.seen[mode] < MIN_SEEN for mode in MODES):
            return None
        return max(MODES, key=self.rate)

    def choose(self) -> tuple[str, bool]:
        """The next step's mode, and whether that step is left unmeasured (the first of a burst, or
        a mode's warm-up)."""
        if self._left == 0:
            unseen = [mode for mode in MODES if self.seen[mode] < MIN_SEEN]
            if unseen:
                self.mode = unseen[0]
                self._skip = 1 + (WARMUP if self.seen[self.mode] == 0 else 0)
                self._left = self._skip + MIN_SEEN - self.seen[self.mode]
            else:
                best = self.faster()
                other = MODES[1 - MODES.index(best)]
                explore = self.mode == best
                gap = self.rate(best) / self.rate(other) - 1.0
                self.mode, self._skip = (other if explore else best), 1
                self._left = BURST if explore else int(EXPLORE * max(1.0, gap / 0.1))
        self._left -= 1
        self.steps[self.mode] += 1
        skip = self._skip > 0
        self._skip -= skip
        return self.mode, skip


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
        self.choice = heads.drafting_choices.setdefault(key, DraftingChoice())
        self.sample = self.sequential.sample
        self.choosing = False
        self._last: tuple[str, bool] | None = None  # the last step's mode, and whether it began a burst
        self._started: float | None = None  # when the last step's propose began
        self.reset(1)

    @property
    def cache(self):
        return self.sequential.cache

    @property
    def committed(self) -> torch.Tensor:
        return self.sequential.committed

    def _share(self) -> None:
        """The parallel drafter works on the sequential one's cache and counts."""
        self.parallel.cache, self.parallel.committed = self.sequential.cache, self.sequential.committed

    def sample_with(self, warp, generator) -> None:
        self.sequential.sample_with(warp, generator)

    @property
    def sampling(self) -> bool:
        return self.sequential.sampling

    def reset(self, batch_size: int) -> None:
        self.sequential.reset(batch_size)
        self._share()
        self._last = self._started = None

    def retire(self, keep: torch.Tensor) -> None:
        self.sequential.retire(keep)
        self._share()
        self._started = None  # the next batch's lengths no longer match the last step's rows

    def _mode(self, batch: DraftBatch) -> str:
        if not self.choosing or self.sequential.total_tokens == 0:
            self._last = None
            return "sequential"
        now = time.perf_counter()
        fresh = self._started is None  # a call's first step (it also commits the prompt) or one after retire()
        if not fresh and self._last is not None and not self._last[1]:
            self.choice.observe(self._last[0], float(batch.lengths.sum()), now - self._started)
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
            self.sequential.cache, self.sequential.committed = self.parallel.cache, self.parallel.committed
        else:
            trees = self.sequential.propose(batch)
            self._share()
        return trees


PROMPTS = 8
"""Held-out sequences :func:`choose_drafting` times generation on."""
NEW_TOKENS = 48
ROUNDS = 2


def choose_drafting(spec, sequences, prompts: int = PROMPTS, max_new_tokens: int = NEW_TOKENS,
                    rounds: int = ROUNDS) -> dict[str, float]:
    """Set ``spec``'s drafting (``auto``, trained for parallel drafting) to the mode that generates
    faster: greedy, the first half of up to ``prompts`` held-out token ``sequences`` as prompts,
    ``max_new_tokens`` each, the modes alternating over ``rounds`` rounds (the sequential mode's
    chains calibrate during a first untimed round). The parallel mode keeps the tree it has under
    ``auto`` (:func:`parallel_tree_config`). Returns the measured tokens per second of each mode."""
    config = spec.config
    candidates = {"sequential": replace(config, drafting="sequential"),
                  "parallel": parallel_tree_config(config, spec.accuracy)}
    chosen = [sequence[: max(1, sequence.numel() // 2)][None] for sequence in sequences[:prompts] if sequence.numel() > 1]
    if not chosen:
        spec.config = candidates["sequential"]
        spec.set_tree(None)
        return {}
    device = spec.target.device
    tokens = dict.fromkeys(candidates, 0)
    seconds = dict.fromkeys(candidates, 0.0)
    for round_index in range(rounds + 1):
        order = list(candidates) if round_index % 2 == 0 else list(reversed(candidates))
        for mode in order:
            spec.config = candidates[mode]
            spec.set_tree(None)
            for prompt in chosen:
                prompt = prompt.to(device)
                start = time.perf_counter()
                output = spec.generate(prompt, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
                if round_index:  # round 0 warms up (and calibrates the sequential chains)
                    seconds[mode] += time.perf_counter() - start
                    tokens[mode] += output.shape[1] - prompt.shape[1]
    rates = {mode: tokens[mode] / seconds[mode] for mode in candidates if seconds[mode] > 0}
    best = max(rates, key=rates.get)
    logger.info("drafting: %s (greedy, %d held-out prompts x %d tokens: %s)", best, len(chosen), max_new_tokens,
                ", ".join(f"{mode} {rate:.1f} tokens/s" for mode, rate in rates.items()))
    spec.config = candidates[best]
    spec.set_tree(None)
    return rates
