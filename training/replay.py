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


def _nbytes(values: tuple[torch.Tensor, ...]) -> int:
    return sum(value.numel() * value.element_size() for value in values)


class BackboneMemo:
    """The frozen backbone's per-position outputs for buffered sequences, kept across optimizer steps.

    A loss hook's backbone forward (features at every position, before any drafter runs) depends on
    the sequence alone, and online learning draws each buffered sequence many times; the memo keeps
    each sequence's outputs (a tuple of ``[L, ...]`` tensors, unpadded, on the backbone's device and in
    its dtype) under the sequence's buffer key, bounded at ``max_bytes`` (oldest keys dropped first,
    as the buffer drops its oldest sequences). Rows a batch needs that it lacks are computed in one
    forward over just those rows (padded to their own longest); what it returns is the batch padded
    with zeros, which every hook masks out."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0; got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.rows: dict[int, tuple[torch.Tensor, ...]] = {}  # insertion order: oldest first
        self.bytes = 0
        self.hits = self.misses = 0

    def outputs(self, keys, input_ids: torch.Tensor, attention_mask: torch.Tensor, compute) -> tuple[torch.Tensor, ...]:
        """``compute(input_ids, attention_mask)``'s tuple of ``[B, T, ...]`` outputs for the right-padded
        batch whose rows are the sequences ``keys``, from the memo where it holds them."""
        lengths = attention_mask.sum(-1).tolist()
        found = {key: self.rows[key] for key in keys if key in self.rows}
        missing = [row for row, key in enumerate(keys) if key not in found]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            longest = max(lengths[row] for row in missing)
            index = torch.tensor(missing, device=input_ids.device)
            computed = compute(input_ids[index, :longest], attention_mask[index, :longest])
            for position, row in enumerate(missing):
                values = tuple(tensor[position, :lengths[row]].detach().clone() for tensor in computed)
                found[keys[row]] = values
                self._store(keys[row], values)
        first = found[keys[0]]
        batch, length = input_ids.shape
        padded = tuple(tensor.new_zeros((batch, length, *tensor.shape[1:])) for tensor in first)
        for row, key in enumerate(keys):
            for out, value in zip(padded, found[key]):
                out[row, :value.shape[0]] = value
        return padded

    def _store(self, key: int, values: tuple[torch.Tensor, ...]) -> None:
        size = _nbytes(values)
        if size > self.max_bytes:
            return
        self.rows[key] = values
        self.bytes += size
        while self.bytes > self.max_bytes:
            oldest = next(iter(self.rows))
            self.bytes -= _nbytes(self.rows.pop(oldest))

    def retain(self, keys) -> None:
        """Drop every sequence not in ``keys`` (those the buffer no longer holds)."""
        keep = set(keys)
        for key in [key for key in self.rows if key not in keep]:
            self.bytes -= _nbytes(self.rows.pop(key))

    def clear(self) -> None:
        self.rows.clear()
        self.bytes = 0
