"""Acceptance of an EAGLE drafter's chain nodes by their drafter probability, learned while serving
(what ``EagleConfig.min_acceptance`` stops chains on)."""

from __future__ import annotations

import torch


class ChainCalibration:
    """How often this drafter's chain nodes were accepted, by their drafter probability (bins
    :attr:`EDGES`), learned while serving: a node counts when it was reached (every node above it
    accepted) and as accepted when its token is what the target produced there. Rates start
    optimistic (:attr:`PRIOR` pseudo-acceptances per bin), so chains stop early only on evidence.
    One per drafter's heads, shared by its drafters for every tree shape and by every greedy call
    (greedy outputs do not depend on where a chain stops); a sampled call starts its own, so that its
    draws, and a seeded call's output, depend on that call alone."""

    EDGES = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9)
    PRIOR = 2.0

    def __init__(self, prior_rate: float = 1.0) -> None:
        self.prior_rate = prior_rate  # the acceptance assumed before any evidence (PRIOR pseudo-nodes)
        self.edges = torch.tensor(self.EDGES)
        self.accepted = torch.zeros(len(self.EDGES) + 1, dtype=torch.float64)
        self.seen = torch.zeros(len(self.EDGES) + 1, dtype=torch.float64)

    def bins(self, probabilities: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(probabilities.float().cpu(), self.edges)

    def rates(self, bins: torch.Tensor) -> torch.Tensor:
        """Estimated acceptance of a reached node in each of ``bins``."""
        return ((self.accepted + self.PRIOR * self.prior_rate) / (self.seen + self.PRIOR))[bins]

    def observe(self, chains: list[list[int]], bins: list[list[int]], produced: list[list[int]]) -> None:
        """Per row: the drafted tokens of a chain, their bins, and the tokens the target produced
        after the chain's root (its accepted path, then its bonus token and anything after)."""
        for drafted, row_bins, target in zip(chains, bins, produced):
            matched = 0
            while matched < min(len(drafted), len(target)) and drafted[matched] == target[matched]:
                matched += 1
            for index in range(min(matched + 1, len(drafted))):  # the reached nodes
                self.seen[row_bins[index]] += 1
                self.accepted[row_bins[index]] += index < matched
