"""The speculative decoding loop: draft → verify → accept → commit, for a batch of sequences.

One prefill forward over the (left-padded) prompts gives each row its first token, the root of
its first tree. Each later step asks the drafter for one tree per row rooted at that row's last
committed token, runs one target forward over all rows' nodes (trees padded to the largest one)
with a tree mask, and lets every row accept its own path: the accepted path's keys and values
move to the front of the step's cache region, and the slots a row did not use stay in the cache
as holes that the mask hides (:class:`~tree_attention.cache.RaggedCache`) while position ids stay per row. Rows that reach
eos or their token budget leave the batch; holes are compacted away only once they make up half
of the cache. Batch 1 is the same code with no holes.

The loop knows nothing about how drafts are made; it talks to a :class:`Target` (one forward) and
a :class:`Drafter` (one tree per row per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Collection, Protocol, Sequence

import torch

from . import cache as cache_ops
from .mask import AttentionMask, MaskLayout
from .tree import Tree, truncate_depth
from .verify import AcceptanceRule, GreedyRule


class Target(Protocol):
    """The frozen model, seen as one forward."""

    layout: MaskLayout
    dtype: torch.dtype

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: AttentionMask,
                cache, logits_rows: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[B, T, F]`` for all rows and logits ``[B, T or 1, V]`` (``logits_rows`` "all" or "last")."""


class RowDrafter(Protocol):
    """Proposes one tree per step for one sequence."""

    def reset(self) -> None:
        """Forget any state from an earlier sequence."""

    def propose(self, features: torch.Tensor, tokens: torch.Tensor, root: int) -> Tree:
        """A tree whose node 0 holds ``root``.

        ``features`` ``[1, n, F]`` are the target's features at the ``n`` positions committed
        since the last call (the whole prompt, padding removed, on the first call) and ``tokens``
        ``[1, n]`` the tokens at those positions; ``root`` is the token the target committed after them.
        """


class Drafter(Protocol):
    """Proposes one tree per step for every row still decoding."""

    def reset(self, batch_size: int) -> None:
        """Forget earlier sequences; ``batch_size`` rows follow (called once per ``generate``)."""

    def propose(self, rows: Sequence[int], features: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor],
                roots: Sequence[int]) -> list[Tree]:
        """One tree per entry of ``rows`` (the rows' indices in the batch, increasing); the other
        arguments are per row, as in :meth:`RowDrafter.propose`."""


class PerRowDrafter:
    """A :class:`Drafter` made of one :class:`RowDrafter` per row (drafters written for one
    sequence, with per-sequence state); serves batches of up to ``len(drafters)`` rows."""

    def __init__(self, drafters: Sequence[RowDrafter]) -> None:
        if not drafters:
            raise ValueError("PerRowDrafter needs at least one row drafter")
        self.drafters = list(drafters)

    def reset(self, batch_size: int) -> None:
        if batch_size > len(self.drafters):
            raise ValueError(f"PerRowDrafter holds {len(self.drafters)} row drafters; a batch of {batch_size} "
                             "needs one per row")
        for drafter in self.drafters[:batch_size]:
            drafter.reset()

    def propose(self, rows, features, tokens, roots) -> list[Tree]:
        return [self.drafters[row].propose(f, t, root) for row, f, t, root in zip(rows, features, tokens, roots)]


@dataclass
class DecodeStats:
    """What one ``generate`` call did. ``mean_accepted`` (tau) counts tokens committed per target
    forward and row, bonus token included, over all forwards (the prefill too)."""

    new_tokens: int = 0
    target_forwards: int = 0
    row_forwards: int = 0  # sum over forwards of the rows they served (= target_forwards at batch 1)
    batch_size: int = 1
    tree_size: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # drafted tokens accepted per row and verify step
    acceptance_by_position: list[float] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    speculation: dict | None = None  # the setting an adaptive policy chose, and why

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.row_forwards if self.row_forwards else 0.0

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
            "row_forwards": self.row_forwards, "batch_size": self.batch_size,
            "tau": self.mean_accepted, "tree_size": self.tree_size,
            "acceptance_by_position": self.acceptance_by_position,
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds, "speculation": self.speculation,
        }


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded prompts, as ``generate`` computes them (padding at 1)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def _pad_trees(trees: Sequence[Tree]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``[R, N]``, depths ``[R, N]`` and ancestors ``[R, N, N]`` of trees padded to the
    largest; a padding node sees only itself and nobody sees it."""
    size = max(tree.size for tree in trees)
    if all(tree.size == size for tree in trees):  # one static shape (Medusa, batch 1): no padding
        return (torch.stack([tree.tokens for tree in trees]), torch.stack([tree.depths for tree in trees]),
                torch.stack([tree.ancestors for tree in trees]))
    device = trees[0].tokens.device
    tokens = torch.zeros(len(trees), size, dtype=torch.long, device=device)
    depths = torch.zeros(len(trees), size, dtype=torch.long, device=device)
    ancestors = torch.eye(size, dtype=torch.bool, device=device).repeat(len(trees), 1, 1)
    for row, tree in enumerate(trees):
        tokens[row, :tree.size] = tree.tokens
        depths[row, :tree.size] = tree.depths
        ancestors[row, :tree.size, :tree.size] = tree.ancestors
    return tokens, depths, ancestors


class SpeculativeDecoder:
    """State of one batched speculative generation; :meth:`run` is the whole loop.

    Cache row ``i`` belongs to batch row ``rows[i]`` (finished rows leave); ``cache`` is a
    :class:`~tree_attention.cache.RaggedCache` (prompt padding and rejected slots are holes) and
    ``lengths`` ``[R]`` each row's committed length (the position of its next root).
    """

    def __init__(self, target: Target, drafter: Drafter, input_ids: torch.Tensor, max_new_tokens: int,
                 eos_token_ids: Collection[int] = (), rule: AcceptanceRule | None = None,
                 attention_mask: torch.Tensor | None = None, pad_token_id: int | None = None) -> None:
        self.target, self.drafter, self.rule = target, drafter, rule or GreedyRule()
        self.input_ids = input_ids
        self.prompt_mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).bool()
        self.max_new_tokens, self.eos = max_new_tokens, frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        batch = input_ids.shape[0]
        self.outputs: list[list[int]] = [[] for _ in range(batch)]
        self.stats = DecodeStats(batch_size=batch)
        self.cache = cache_ops.RaggedCache(batch, input_ids.device)
        self.rows: list[int] = list(range(batch))
        self.max_depth = 0

    # -- state per row ------------------------------------------------------------------------

    def _emit(self, row: int, chunk: list[int]) -> bool:
        """Append ``chunk`` to row's output up to its budget and first eos; True when the row is done."""
        output = self.outputs[row]
        for token in chunk:
            if len(output) >= self.max_new_tokens:
                return True
            output.append(token)
            if token in self.eos:
                return True
        return len(output) >= self.max_new_tokens

    def _keep_rows(self, done: list[bool]) -> None:
        if not any(done):
            return
        keep = [index for index, finished in enumerate(done) if not finished]
        self.rows = [self.rows[index] for index in keep]
        if not keep:
            return
        index = torch.tensor(keep, device=self.lengths.device)
        self.cache.select_rows(index)
        self.lengths = self.lengths[index]
        self.features = [self.features[i] for i in keep]
        self.tokens = [self.tokens[i] for i in keep]
        self.roots = [self.roots[i] for i in keep]

    # -- the loop -----------------------------------------------------------------------------

    def prefill(self) -> None:
        ids, mask = self.input_ids, self.prompt_mask
        batch, length = ids.shape
        positions = prompt_positions(mask)
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril_()
        visible = causal[None] & mask[:, None, :]  # (B, T, T)
        attention = self.cache.mask(positions, visible, self.target.layout, self.target.dtype)
        self.drafter.reset(batch)
        features, logits = self.target.forward(ids, positions, attention, self.cache.cache, "last")
        self.stats.target_forwards, self.stats.row_forwards = 1, batch
        self.cache.extend(mask.clone(), positions)
        self.lengths = mask.long().sum(dim=1)
        self.features = [features[row, mask[row]][None] for row in range(batch)]  # (1, n_b, F)
        self.tokens = [ids[row, mask[row]][None] for row in range(batch)]
        self.roots = [self.rule.first_token(logits[row, -1]) for row in range(batch)]
        self._keep_rows([self._emit(row, [root]) for row, root in enumerate(self.roots)])

    def step(self) -> None:
        """One draft → verify → accept → commit step for every row still decoding."""
        draft_start = time.perf_counter()
        trees = self.drafter.propose(self.rows, self.features, self.tokens, self.roots)
        trees = [truncate_depth(tree, self.max_new_tokens - len(self.outputs[row]) - 1)
                 for row, tree in zip(self.rows, trees)]
        verify_start = time.perf_counter()
        tokens, depths, ancestors = _pad_trees(trees)
        rows, size = tokens.shape
        query_positions = self.lengths[:, None] + depths  # (R, N)
        mask = self.cache.mask(query_positions, ancestors, self.target.layout, self.target.dtype)
        features, logits = self.target.forward(tokens, query_positions, mask, self.cache.cache, "all")
        acceptances = [self.rule.accept(tree, logits[row, :tree.size]) for row, tree in enumerate(trees)]
        lengths = [int(acceptance.path.numel()) for acceptance in acceptances]
        longest = max(lengths)
        paths = torch.stack([torch.cat([a.path, a.path[-1:].expand(longest - length)]) if length < longest else a.path
                             for a, length in zip(acceptances, lengths)])  # (R, L) padded with the last kept node
        kept = torch.arange(longest, device=paths.device)[None, :] < torch.tensor(lengths, device=paths.device)[:, None]
        self.cache.keep(paths, kept, query_positions)
        self.lengths = self.lengths + torch.tensor(lengths, device=paths.device)
        self.stats.target_forwards += 1
        self.stats.row_forwards += rows
        done = []
        for index, (row, tree, acceptance) in enumerate(zip(self.rows, trees, acceptances)):
            self.stats.accepted_lengths.append(acceptance.accepted_drafts)
            self.stats.tree_size = max(self.stats.tree_size, tree.size)
            self.max_depth = max(self.max_depth, int(tree.depths.max()))
            path_tokens = tree.tokens[acceptance.path]
            done.append(self._emit(row, path_tokens[1:].tolist() + [acceptance.next_token]))
            self.features[index] = features[index:index + 1, acceptance.path]
            self.tokens[index] = path_tokens[None]
            self.roots[index] = acceptance.next_token
        self.stats.draft_seconds += verify_start - draft_start
        self.stats.verify_seconds += time.perf_counter() - verify_start
        self._keep_rows(done)
        if self.rows:
            self.cache.compact()

    def result(self) -> torch.Tensor:
        """Prompts plus new tokens, rows that stopped early filled with ``pad_token_id`` (as ``generate``)."""
        longest = max(len(output) for output in self.outputs)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        new = torch.full((len(self.outputs), longest), pad, dtype=self.input_ids.dtype, device=self.input_ids.device)
        for row, output in enumerate(self.outputs):
            new[row, :len(output)] = torch.tensor(output, dtype=self.input_ids.dtype)
        return torch.cat([self.input_ids, new], dim=1)

    def run(self) -> tuple[torch.Tensor, DecodeStats]:
        start = time.perf_counter()
        if self.max_new_tokens == 0:
            return self.input_ids.clone(), self.stats
        self.prefill()
        while self.rows:
            self.step()
        self.stats.new_tokens = sum(len(output) for output in self.outputs)
        self.stats.finish(self.max_depth)
        output = self.result()
        self.stats.total_seconds = time.perf_counter() - start
        return output, self.stats


def speculative_generate(target: Target, drafter: Drafter, input_ids: torch.Tensor, max_new_tokens: int,
                         eos_token_ids: Collection[int] = (), rule: AcceptanceRule | None = None,
                         attention_mask: torch.Tensor | None = None,
                         pad_token_id: int | None = None) -> tuple[torch.Tensor, DecodeStats]:
    """Generate up to ``max_new_tokens`` after each row of ``input_ids`` (``[B, T]``, left-padded
    where ``attention_mask`` has zeros), each row stopping at its first eos.

    ``rule`` picks tokens and accepted paths (default :class:`~tree_attention.verify.GreedyRule`).
    Returns the ids ``[B, T + new]`` (rows that stopped early padded with ``pad_token_id``) and the
    step statistics.
    """
    decoder = SpeculativeDecoder(target, drafter, input_ids, max_new_tokens, eos_token_ids, rule,
                                 attention_mask, pad_token_id)
    return decoder.run()
