"""The bounded memory of served traffic an online learner trains on (:mod:`training.online`).

Every finished sequence (prompt + what the target generated) enters :class:`ReplayBuffer`. A
seeded share of them is held back for the guard (never trained on) in a small pool of the most
recent ones; the rest form the training pool. Both pools are bounded, the training pool in tokens
(oldest dropped first), the held-back pool in sequences (a sequence pushed out of it joins the
training pool: it was measured on, not trained on, and is now old traffic like the rest).
"""

from __future__ import annotations

from collections import deque

import torch


class ReplayBuffer:
    """Served sequences ``[L]`` (long, CPU), each under a running id (the sequence's key in loss hooks).

    ``max_tokens``: bound of the training pool, in tokens; ``max_length``: a longer sequence keeps
    its first ``max_length`` tokens; ``held_out``: size of the guard's pool; ``hold_every``: one
    sequence in this many is held back (deterministic: the ``hold_every``-th, 2 ``hold_every``-th, ...)."""

    def __init__(self, max_tokens: int, max_length: int, held_out: int, hold_every: int) -> None:
        if max_length < 2 or max_tokens < max_length:
            raise ValueError(f"max_tokens ({max_tokens}) must be >= max_length ({max_length}) >= 2")
        self.max_tokens = max_tokens
        self.max_length = max_length
        self.hold_every = hold_every
        self.train: deque[tuple[int, torch.Tensor]] = deque()
        self.held: deque[tuple[int, torch.Tensor]] = deque(maxlen=held_out) if held_out else deque(maxlen=0)
        self.tokens = 0  # tokens in the training pool
        self.seen = 0  # sequences ever added
        self.seen_tokens = 0  # their tokens (after truncation)
        self.held_version = 0  # changes whenever the held-back pool does

    def add(self, sequence: torch.Tensor) -> None:
        """Add one sequence (fewer than 2 tokens: nothing to learn from, skipped)."""
        sequence = sequence.detach().to("cpu", torch.long)[: self.max_length].clone()
        if sequence.numel() < 2:
            return
        self.seen += 1
        self.seen_tokens += sequence.numel()
        item = (self.seen, sequence)
        if self.held.maxlen and self.seen % self.hold_every == 0:
            if len(self.held) == self.held.maxlen:
                self._train_on(self.held[0])  # the oldest held-back sequence joins the training pool
            self.held.append(item)
            self.held_version += 1
        else:
            self._train_on(item)

    def _train_on(self, item: tuple[int, torch.Tensor]) -> None:
        self.train.append(item)
        self.tokens += item[1].numel()
        while self.tokens > self.max_tokens:
            self.tokens -= self.train.popleft()[1].numel()

    def sample(self, count: int, generator: torch.Generator) -> list[tuple[int, torch.Tensor]]:
        """``count`` training sequences drawn uniformly without replacement (all when fewer)."""
        order = torch.randperm(len(self.train), generator=generator)[:count].tolist()
        return [self.train[index] for index in order]

    def held_sequences(self) -> list[torch.Tensor]:
        return [sequence for _, sequence in self.held]

    def clear(self) -> None:
        self.train.clear()
        self.held.clear()
        self.tokens = 0
        self.held_version += 1
