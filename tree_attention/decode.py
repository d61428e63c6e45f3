"""The speculative decoding loop: draft → verify → accept → commit.

One prefill forward over the prompt gives the first token (the root of the first tree). Each
later step asks the drafter for a tree rooted at the last committed token, runs one target
forward over all its nodes with a tree mask, keeps the accepted path in the cache and commits
the accepted drafts plus the target's bonus token. The loop knows nothing about how drafts are
made; it talks to a :class:`Target` (one forward) and a :class:`Drafter` (one tree per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Collection, Protocol

import torch

from . import cache as cache_ops
from .mask import AttentionMask, MaskLayout, prefill_attention_mask, tree_attention_mask, tree_position_ids
from .tree import Tree, truncate_depth
from .verify import AcceptanceRule, GreedyRule


class Target(Protocol):
    """The frozen model, seen as one forward."""

    layout: MaskLayout
    dtype: torch.dtype

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: AttentionMask,
                cache, logits_rows: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[1, T, d]`` for all rows and logits ``[1, T or 1, V]`` (``logits_rows`` "all" or "last")."""


class Drafter(Protocol):
    """Proposes one tree per step."""

    def reset(self) -> None:
        """Forget any state from an earlier sequence (called once per ``generate``)."""

    def propose(self, features: torch.Tensor, tokens: torch.Tensor, root: int) -> Tree:
        """A tree whose node 0 holds ``root``.

        ``features`` ``[1, n, d]`` are the target's features at the ``n`` positions committed
        since the last call (the whole prompt on the first call) and ``tokens`` ``[1, n]`` the
        tokens at those positions; ``root`` is the token the target committed after them.
        """


@dataclass
class DecodeStats:
    """What one ``generate`` call did. ``mean_accepted`` (tau) counts tokens committed per target
    forward, bonus token included, over all target forwards (the prefill too)."""

    new_tokens: int = 0
    target_forwards: int = 0
    tree_size: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # drafted tokens accepted per verify step
    acceptance_by_position: list[float] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    tau = mean_accepted

    def finish(self, max_depth: int) -> None:
        steps = len(self.accepted_lengths)
        self.acceptance_by_position = [
            sum(length > depth for length in self.accepted_lengths) / steps if steps else 0.0
            for depth in range(max_depth)
        ]

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens, "target_forwards": self.target_forwards,
            "tau": self.mean_accepted, "tree_size": self.tree_size,
            "acceptance_by_position": self.acceptance_by_position,
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
        }


def _emit(chunk: list[int], output: list[int], budget: int, eos: Collection[int]) -> bool:
    """Append ``chunk`` to ``output`` up to ``budget`` tokens and the first eos; True when done."""
    for token in chunk[:budget]:
        output.append(token)
        if token in eos:
            return True
    return len(chunk) >= budget


def speculative_generate(target: Target, drafter: Drafter, input_ids: torch.Tensor, max_new_tokens: int,
                         eos_token_ids: Collection[int] = (),
                         rule: AcceptanceRule | None = None) -> tuple[torch.Tensor, DecodeStats]:
    """Generate up to ``max_new_tokens`` after ``input_ids`` (``[1, T]``), stopping at eos.

    ``rule`` picks tokens and accepted paths (default :class:`~tree_attention.verify.GreedyRule`).
    Returns the ids ``[1, T + new]`` and the step statistics.
    """
    rule = rule or GreedyRule()
    stats = DecodeStats()
    start = time.perf_counter()
    prompt_length = input_ids.shape[1]
    output: list[int] = []
    if max_new_tokens == 0:
        return input_ids.clone(), stats
    device = input_ids.device
    drafter.reset()
    cache = cache_ops.new_cache()
    positions = torch.arange(prompt_length, device=device).unsqueeze(0)
    mask = prefill_attention_mask(prompt_length, target.layout, target.dtype, device)
    features, logits = target.forward(input_ids, positions, mask, cache, "last")
    stats.target_forwards = 1
    root = rule.first_token(logits[0, -1])
    done = _emit([root], output, max_new_tokens, eos_token_ids)
    new_features, new_tokens = features, input_ids
    max_depth = 0
    while not done:
        budget = max_new_tokens - len(output)
        draft_start = time.perf_counter()
        tree = truncate_depth(drafter.propose(new_features, new_tokens, root), budget - 1)
        verify_start = time.perf_counter()
        prefix_length = cache_ops.cache_length(cache)
        mask = tree_attention_mask(prefix_length, tree.ancestors, tree.depths, target.layout, target.dtype)
        features, logits = target.forward(
            tree.tokens.unsqueeze(0), tree_position_ids(prefix_length, tree.depths), mask, cache, "all"
        )
        acceptance = rule.accept(tree, logits[0])
        cache_ops.keep_path(cache, prefix_length, acceptance.path)
        stats.target_forwards += 1
        stats.accepted_lengths.append(acceptance.accepted_drafts)
        stats.tree_size = max(stats.tree_size, tree.size)
        max_depth = max(max_depth, int(tree.depths.max()))
        path_tokens = tree.tokens[acceptance.path]
        chunk = path_tokens[1:].tolist() + [acceptance.next_token]
        done = _emit(chunk, output, budget, eos_token_ids)
        new_features, new_tokens = features[:, acceptance.path], path_tokens.unsqueeze(0)
        root = acceptance.next_token
        stats.draft_seconds += verify_start - draft_start
        stats.verify_seconds += time.perf_counter() - verify_start
    stats.new_tokens = len(output)
    stats.finish(max_depth)
    new = torch.tensor(output, dtype=input_ids.dtype, device=device).unsqueeze(0)
    stats.total_seconds = time.perf_counter() - start
    return torch.cat([input_ids, new], dim=1), stats
