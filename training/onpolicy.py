"""On-policy distillation data (DistillSpec-style): sequences produced by speculative generation
with the *current* drafter at the serving temperature, mixed into the training batches at a
chosen ratio and regenerated every N steps.

The trainer re-scores every sequence with the target (its one backbone forward per batch gives
the target's distribution at each position), so the drafter is trained on the contexts it meets
when serving at that temperature. With a lossless acceptance rule these sequences follow the
target's own distribution at the serving temperature — what changes compared with greedy
(off-policy) data is the distribution of contexts, which is what acceptance at that temperature
depends on; speculative generation just produces them faster than plain sampling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


@dataclass
class OnPolicyConfig:
    """How on-policy data is produced and mixed."""

    temperature: float = 1.0
    """Serving temperature the sequences are sampled at (0: greedy)."""
    ratio: float = 0.5
    """Share of each batch drawn from the on-policy pool (the rest from the fixed data)."""
    refresh_every: int = 50
    """Regenerate the pool with the current drafter every N optimizer steps."""
    pool_size: int = 32
    """Sequences per refresh (prompts are taken round-robin)."""
    max_new_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"on-policy ratio must be in [0, 1]; got {self.ratio!r}")
        if not self.temperature >= 0:
            raise ValueError(f"on-policy temperature must be >= 0; got {self.temperature!r}")
        for name in ("refresh_every", "pool_size", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"on-policy {name} must be a positive int; got {value!r}")


@dataclass
class OnPolicyPool:
    """The current on-policy sequences and the prompts they are generated from."""

    prompts: Sequence[torch.Tensor]  # each [1, L]
    config: OnPolicyConfig
    sequences: list[torch.Tensor] = field(default_factory=list)
    refreshed_at: int = -1
    taus: list[float] = field(default_factory=list)  # tau of the drafter at each refresh

    def __post_init__(self) -> None:
        if len(self.prompts) == 0:
            raise ValueError("on-policy data needs at least one prompt")

    def due(self, step: int) -> bool:
        return self.refreshed_at < 0 or step - self.refreshed_at >= self.config.refresh_every

    @torch.no_grad()
    def refresh(self, spec, step: int) -> None:
        """Regenerate the pool with ``spec``'s current drafter (deterministic given seed and step)."""
        config = self.config
        round_index = step // config.refresh_every
        generator = torch.Generator(device=spec.target.device).manual_seed(config.seed * 7919 + round_index)
        sequences, tokens, forwards = [], 0, 0
        for index in range(config.pool_size):
            prompt = self.prompts[(round_index * config.pool_size + index) % len(self.prompts)]
            sampled = config.temperature > 0
            output = spec.generate(prompt, max_new_tokens=config.max_new_tokens, do_sample=sampled,
                                   temperature=config.temperature if sampled else 1.0, top_k=0,
                                   generator=generator if sampled else None)
            sequences.append(output[0].cpu())
            tokens += spec.last_stats.new_tokens
            forwards += spec.last_stats.target_forwards
        self.sequences = sequences
        self.refreshed_at = step
        self.taus.append(tokens / max(1, forwards))
        logger.info("on-policy pool refreshed at step %d: %d sequences, drafter tau %.3f", step, len(sequences),
                    self.taus[-1])

    def take(self, count: int, step: int) -> list[torch.Tensor]:
        """``count`` pool sequences for ``step`` (a seeded choice, no state)."""
        generator = torch.Generator().manual_seed(self.config.seed * 104729 + step)
        order = torch.randint(0, len(self.sequences), (count,), generator=generator)
        return [self.sequences[i] for i in order.tolist()]
