"""When a hybrid step drafts with lookup alone: the trained drafter skipped where it would not pay.

A hybrid step costs the trained drafter's forward(s) on top of lookup's (nearly free) search, and
where the text repeats itself lookup's continuation is usually what gets accepted anyway. The
:class:`LookupGate` learns, per class of lookup match (the matched suffix's length and whether every
occurrence agrees on the next token), how many drafts the lookup proposal alone and the merged tree
got accepted (lookup's counterfactually at steps that verified both, from the tokens the target
produced), and what a step of each costs on this machine (the drafter's propose and the rest of the
step, timed). Where lookup found nothing for any row, "lookup alone" is a step that verifies the
roots alone: one token a row, at the cost of a plain step.

A step drafts with lookup alone when that is worth more as ``tokens - rate x seconds``, with ``rate``
the hybrid's own running tokens per second: a step is worth the tokens it commits less the tokens
that its time would have bought at the rate the loop runs at (the relative value of a semi-Markov
decision). Comparing the two steps' own tokens per second instead ignores that a cheaper step leaves
time for the next: on demo prose the trained drafter ran wherever lookup found nothing, 2.5 tokens in
9.4 ms against a plain step's 1 token in 4.6 ms (0.27 against 0.22 tokens per ms), while the loop ran
at 0.51 tokens per ms; the hybrid was 6% slower than lookup alone.

Which tree is verified never changes a greedy output (every verified path is checked against the
target), so the gate is used for greedy rules only; a sampled call verifies the merged tree at
every step, so that a seeded call's draws never depend on timings.
"""

from __future__ import annotations

import torch

from tree_attention.tree import TreeBatch

from .index import Proposal

MIN_SEEN = 2
"""Observations of a class (each mode) before the gate acts on it: till then both drafters run (a class
where lookup found something may instead borrow the merged tree's evidence from others, :data:`POOLED`)."""
POOLED = 4
"""Merged-tree steps, over classes where lookup found something, after which a class with no merged
evidence of its own is judged by lookup's drafts in it plus what the trained drafter added over lookup's
in the others (with its own upper confidence bound): the merged tree holds lookup's proposal, so it
accepts at least as much, and each class's first two merged steps had been most of what a 40-prompt
run on demo code spent exploring (18 of 44 merged steps, each 16 ms for 5 tokens against lookup
alone's 8 ms for 7)."""
EXPLORE = 8
"""A class of match whose steps ran lookup alone (or the roots alone) this many times since its merged
tree was last verified, or more where there is more evidence, verifies the merged tree again: as many
times as that tree has been verified for the class, times ``1 + gap``, ``gap`` the tokens a step by
which skipping won the decision. The estimate stays current, and the explored steps thin out as the
evidence grows and where the decision is clear (a fixed one step in eight cost the hybrid about 5% on
demo prose, where lookup alone wins by far)."""
SURE = 2.0
"""Width of the merged tree's upper confidence bound, in standard errors of its drafts accepted a step
(spread at least one draft). Where even that optimistic tree loses to lookup alone the decision is
settled: the class does not verify the merged tree again until the bound, widening as its evidence
ages (:data:`HORIZON`), reaches lookup alone's value. On demo code, where EAGLE's drafter costs as much
as a backbone step, exploring classes whose decision was clear was most of the hybrid's 5% gap to
lookup alone over 60 prompts."""
HORIZON = 100
"""Steps of a class after which its merged-tree evidence counts half (a third after twice as many...):
what was measured on other text may no longer hold, so a settled decision is looked at again, later
the more evidence and the clearer the decision."""
DECAY = 0.25
"""Weight of the newest timing in the running costs."""
RATE_DECAY = 0.05
"""Weight of the newest step in the running tokens per second (about the last 20 steps)."""


def match_class(proposal: Proposal) -> tuple[int, bool]:
    """``(matched suffix length, whether every occurrence agrees on the first token)``; ``(0, False)``
    when lookup found nothing."""
    if not proposal.tokens:
        return (0, False)
    return (proposal.match_length, proposal.scores[0] >= 0.999)


def proposal_accepted(proposal: Proposal, produced: list[int]) -> int:
    """Drafts of ``proposal`` on the path the target produced (``produced``: the tokens committed after the root)."""
    depth = [0] * len(proposal.tokens)
    best = 0
    for node, (token, parent) in enumerate(zip(proposal.tokens, proposal.parents)):
        above = 0 if parent < 0 else depth[parent]
        if parent >= 0 and above == 0:
            continue
        if above < len(produced) and produced[above] == token:
            depth[node] = above + 1
            best = max(best, above + 1)
    return best


def tree_accepted(trees: TreeBatch, produced: list[list[int]]) -> list[int]:
    """Per row, the deepest node of ``trees`` whose path the target produced (``produced``: each row's
    tokens committed after its root, as lists)."""
    if trees.rows == 1:  # one row: read the tree to the host once and walk it (a fifth of the tensor form's time)
        (tokens,), (parents,), (depth_list,) = torch.stack([trees.tokens, trees.parents, trees.depths]).tolist()
        row = produced[0]
        size = trees.width if trees.uniform else int(trees.sizes[0])
        ok, best = [True] + [False] * (size - 1), 0
        for node in range(1, size):
            depth = depth_list[node]
            if ok[parents[node]] and depth <= len(row) and tokens[node] == row[depth - 1]:
                ok[node] = True
                best = max(best, depth)
        return [best]
    device = trees.tokens.device
    longest = max(1, max(len(row) for row in produced))
    padded = torch.tensor([row + [0] * (longest - len(row)) for row in produced], dtype=torch.long, device=device)
    lengths = torch.tensor([len(row) for row in produced], dtype=torch.long, device=device)
    depths = trees.depths
    index = (depths - 1).clamp(min=0, max=longest - 1)
    ok = (depths == 0) | ((depths <= lengths[:, None]) & (trees.tokens == padded.gather(1, index)))
    path_ok = ~(trees.visibility & ~ok[:, None, :]).any(dim=-1)  # (R, N): the node and all its ancestors
    return (depths * path_ok).max(dim=1).values.tolist()


def _bound(seen: float, total: float, squares: float, since: int) -> tuple[float, float]:
    """Mean and upper confidence bound (:data:`SURE`) of ``seen`` values summing to ``total`` (squares
    ``squares``), the evidence weighted down ``since`` steps after it was last added to (:data:`HORIZON`)."""
    mean = total / seen
    spread = max(1.0, squares / seen - mean * mean)
    weight = seen / (1.0 + since / HORIZON)
    return mean, mean + SURE * (spread / weight) ** 0.5


class _Class:
    __slots__ = ("lookup_seen", "lookup_sum", "merged_seen", "merged_sum", "merged_squares", "since_merged")

    def __init__(self) -> None:
        self.lookup_seen = self.lookup_sum = self.merged_seen = self.merged_sum = self.merged_squares = 0.0
        self.since_merged = 0  # steps of this class that skipped the merged tree since it was last verified

    def explore_due(self, gap: float) -> bool:
        return self.since_merged >= max(EXPLORE, self.merged_seen * (1.0 + max(0.0, gap)))


class LookupGate:
    """Per match class, drafts accepted from lookup alone and from the merged tree; the timed costs
    of a step of each; and the decision for the next step. Kept by a ``SpeculativeModel`` across
    ``generate`` calls."""

    def __init__(self) -> None:
        self.classes: dict[tuple[int, bool], _Class] = {}
        self.base_seconds: float | None = None  # the trained drafter's propose
        self.lookup_seconds: float | None = None  # lookup's search
        # rest of a step, by mode: lookup alone (True), merged (False), roots alone where nothing was found (None)
        self.rest_seconds: dict[bool | None, float | None] = {True: None, False: None, None: None}
        self.lookup_steps = self.merged_steps = self.root_steps = 0
        self.tokens_run = self.seconds_run = 0.0  # decayed sums: the running tokens per second
        # merged-tree steps where lookup found something: [count, sum, sum of squares] of the drafts the
        # merged tree accepted beyond lookup's own (:data:`POOLED`)
        self.extra = [0.0, 0.0, 0.0]

    def _class(self, key) -> _Class:
        entry = self.classes.get(key)
        if entry is None:
            entry = self.classes[key] = _Class()
        return entry

    @staticmethod
    def _running(old: float | None, new: float) -> float:
        if old is None:
            return new
        return (1 - DECAY) * old + DECAY * min(new, 3 * old)  # one outlier (a plain step between) moves it little

    def timed(self, name: str, seconds: float) -> None:
        setattr(self, name, self._running(getattr(self, name), seconds))

    def rest(self, alone: bool | None, seconds: float) -> None:
        """The rest of a step after the drafter's propose, by mode (``None``: the roots alone)."""
        self.rest_seconds[alone] = self._running(self.rest_seconds[alone], seconds)

    def step(self, tokens: int, seconds: float) -> None:
        """A step (from one propose to the next) committed ``tokens`` over all rows in ``seconds``."""
        self.tokens_run = (1 - RATE_DECAY) * self.tokens_run + RATE_DECAY * tokens
        self.seconds_run = (1 - RATE_DECAY) * self.seconds_run + RATE_DECAY * seconds

    @property
    def rate(self) -> float | None:
        """Running tokens per second of the hybrid's steps (None before any)."""
        return self.tokens_run / self.seconds_run if self.seconds_run > 0 else None

    def observe(self, keys, proposals: list[Proposal], produced: list[list[int]], merged: list[int] | None) -> None:
        """What the last step's rows got: lookup's drafts on the produced path (always) and the merged
        tree's (``merged``, None when lookup ran alone)."""
        for row, (key, proposal) in enumerate(zip(keys, proposals)):
            entry = self._class(key)
            accepted = proposal_accepted(proposal, produced[row])
            entry.lookup_seen += 1
            entry.lookup_sum += accepted
            entry.since_merged = 0 if merged is not None else entry.since_merged + 1
            if merged is not None:
                entry.merged_seen += 1
                entry.merged_sum += merged[row]
                entry.merged_squares += merged[row] * merged[row]
                if key[0]:
                    extra = merged[row] - accepted
                    self.extra[0] += 1
                    self.extra[1] += extra
                    self.extra[2] += extra * extra

    def lookup_alone(self, keys) -> bool:
        """Whether the next step should verify lookup's proposals alone (rows' classes ``keys``; where
        no row's lookup found anything, the roots alone)."""
        if self.base_seconds is None or self.rest_seconds[False] is None:
            return False
        alone = merged = optimistic = 0.0
        for key in keys:
            entry = self.classes.get(key) or _Class()
            own = entry.lookup_sum / entry.lookup_seen if entry.lookup_seen else 0.0
            if entry.merged_seen >= MIN_SEEN and (not key[0] or entry.lookup_seen >= MIN_SEEN):
                mean, bound = _bound(entry.merged_seen, entry.merged_sum, entry.merged_squares, entry.since_merged)
            elif key[0] and self.extra[0] >= POOLED:
                # lookup's drafts here plus what the drafter added over them elsewhere: lookup's own
                # acceptance, on both sides, does not move the decision (a new class's is learnt by
                # any step, lookup alone too)
                mean, bound = (own + value for value in _bound(*self.extra, entry.since_merged))
            else:
                return False
            alone += 1 + own
            merged += 1 + mean
            optimistic += 1 + bound
        found = any(key[0] for key in keys)
        lookup = self.lookup_seconds or 0.0
        rest_merged = self.rest_seconds[False]
        if found:
            rest_alone = self.rest_seconds[True] if self.rest_seconds[True] is not None else rest_merged
        else:
            rest_alone = self.rest_seconds[None]
            if rest_alone is None:  # a plain step's cost not measured yet: one such step measures it
                return True
        merged_seconds = lookup + self.base_seconds + rest_merged
        rate = self.rate if self.rate is not None else merged / merged_seconds  # (then: tokens per second)
        gap = (alone - rate * (lookup + rest_alone)) - (merged - rate * merged_seconds)  # tokens a step
        if gap <= 0:
            return False
        if gap > optimistic - merged:  # lookup alone wins even against the merged tree's bound: settled
            return True
        return not any(key in self.classes and self.classes[key].explore_due(gap / len(keys)) for key in keys)

    def summary(self) -> dict:
        """Steps of each mode so far and the timed costs (for benchmarks and diagnostics)."""
        return {"lookup_alone_steps": self.lookup_steps, "merged_steps": self.merged_steps,
                "roots_alone_steps": self.root_steps, "base_seconds": self.base_seconds,
                "lookup_seconds": self.lookup_seconds, "rest_seconds": {str(k): v for k, v in self.rest_seconds.items()},
                "tokens_per_second": self.rate}

