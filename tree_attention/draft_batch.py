"""What a drafter sees at one step of the loop (:mod:`tree_attention.decode`): the features the
target committed since the drafter's last call, row by row."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftBatch:
    """What a drafter sees at one step, for the ``R`` rows still decoding (in batch order).

    Attributes:
        features: ``[R, n, F]`` the target's features at the positions each row committed since
            the last call (the whole prompt on the first call), left-aligned: row ``r``'s are
            ``features[r, :lengths[r]]``, the rest padding.
        tokens: ``[R, n]`` the tokens at those positions (padding 0).
        lengths: ``[R]`` long, valid entries per row (>= 1).
        roots: ``[R]`` long, the token the target committed after them: each tree's node 0.
        positions: ``[R]`` long, the roots' position ids (prompt padding excluded): a node at depth
            ``d`` sits at ``positions + d``; None where the loop did not say.
        batch_rows: each row's index in the call's batch (as the acceptance rule sees it); None
            where the loop did not say. With ``positions``, what a drafter coupled to a seeded rule
            reads the rule's noise with (:meth:`tree_attention.gumbel.GumbelRule.coupled_candidates`).
    """

    features: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor
    roots: torch.Tensor
    positions: torch.Tensor | None = None
    batch_rows: tuple[int, ...] | None = None

    def select(self, index: torch.Tensor) -> "DraftBatch":
        """The rows ``index`` ``[R']`` (long) of this batch, in that order."""
        index = index.to(self.lengths.device)
        rows = None if self.batch_rows is None else tuple(self.batch_rows[i] for i in index.tolist())
        return DraftBatch(self.features[index], self.tokens[index], self.lengths[index], self.roots[index],
                          None if self.positions is None else self.positions[index.to(self.positions.device)], rows)

    @property
    def rows(self) -> int:
        return int(self.roots.shape[0])

    def full(self) -> bool:
        """True when every row has all ``n`` entries (no padding): batch 1 always."""
        return self.tokens.shape[0] == 1 or bool((self.lengths == self.tokens.shape[1]).all())

    def next_tokens(self) -> torch.Tensor:
        """``[R, n]`` the token the target committed after each entry: ``tokens[r, i + 1]``, and the
        root after the row's last entry (padding 0)."""
        rows = self.tokens.shape[0]
        if self.full():
            return torch.cat([self.tokens[:, 1:], self.roots.to(self.tokens.device)[:, None]], dim=1)
        following = torch.cat([self.tokens[:, 1:], self.tokens.new_zeros(rows, 1)], dim=1)
        following[torch.arange(rows, device=following.device), self.lengths.to(following.device) - 1] = \
            self.roots.to(following.device)
        return following

    def then(self, *later: "DraftBatch") -> "DraftBatch":
        """This batch's entries followed, row by row, by each of ``later``'s in turn (same rows),
        with the last one's roots: what a drafter that skipped steps must see at its next call."""
        if self.full() and all(batch.full() for batch in later):  # no padding (batch 1): one concatenation
            return DraftBatch(torch.cat([self.features, *(batch.features.to(self.features.dtype) for batch in later)], 1),
                              torch.cat([self.tokens, *(batch.tokens for batch in later)], 1),
                              self.lengths + sum(batch.lengths for batch in later), later[-1].roots,
                              later[-1].positions, later[-1].batch_rows)
        joined = self
        for batch in later:
            joined = joined._then(batch)
        return joined

    def _then(self, later: "DraftBatch") -> "DraftBatch":
        rows = self.features.shape[0]
        # rows that left the batch may have been the longest: the padded width can exceed lengths.max()
        width = max(self.features.shape[1], int(self.lengths.max()) + later.features.shape[1])
        features = self.features.new_zeros(rows, width, self.features.shape[-1])
        tokens = self.tokens.new_zeros(rows, width)
        features[:, :self.features.shape[1]] = self.features
        tokens[:, :self.tokens.shape[1]] = self.tokens
        columns = (self.lengths[:, None] + torch.arange(later.features.shape[1], device=self.lengths.device)[None, :])
        features.scatter_(1, columns[..., None].expand(-1, -1, features.shape[-1]), later.features.to(features.dtype))
        tokens.scatter_(1, columns, later.tokens)
        return DraftBatch(features, tokens, self.lengths + later.lengths, later.roots, later.positions,
                          later.batch_rows)
