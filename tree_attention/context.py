"""The token sequence behind every row of logits, for logits processors that read it.

``generate`` processes the logits of step ``t`` with the whole sequence so far (the left-padded
prompt row, then the new tokens): repetition penalties, n-gram bans and minimum lengths depend on
it. In a verified tree, node ``c``'s logits predict the token after ``c``, so its sequence is the
row's committed sequence (which ends with the root) followed by the tokens on the path from the
root down to ``c``. :class:`ContextTracker` keeps the committed sequences and builds those
sequences for all nodes of a :class:`~tree_attention.tree.TreeBatch` at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .tree import TreeBatch

FILL = -1
"""Id in :attr:`Contexts.ids` columns before a sequence starts (never a token)."""


@dataclass(frozen=True)
class Contexts:
    """One token sequence per row of a logits matrix ``[M, V]``, right-aligned.

    Attributes:
        ids: ``[M, L]`` long; sequence ``m`` is ``ids[m, L - lengths[m]:]``, the columns before it
            hold :data:`FILL`.
        lengths: ``[M]`` long, tokens per sequence, prompt padding included (what ``generate``
            sees as ``input_ids.shape[-1]`` at that step).
        starts: ``[M]`` long, the first column after the fill and the prompt's left padding
            (``generate``'s repetition penalty skips the padding).
        prompt_width: the padded prompt width ``T``: a sequence holds ``lengths - T`` new tokens.
    """

    ids: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    prompt_width: int


class ContextProcessor(Protocol):
    """Logits ``[M, V]`` processed as ``generate`` processes them after each row's sequence."""

    def __call__(self, contexts: Contexts, logits: torch.Tensor) -> torch.Tensor: ...


class ContextTracker:
    """Each row's committed sequence: its prompt row (padding included), then its new tokens.

    ``input_ids`` ``[B, T]`` and ``attention_mask`` ``[B, T]`` (zeros first) as the loop takes them;
    ``max_new_tokens`` bounds the new tokens per row.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> None:
        batch, width = input_ids.shape
        self.prompt_width = width
        self.sequences = torch.full((batch, width + max_new_tokens), FILL, dtype=torch.long, device=input_ids.device)
        self.sequences[:, :width] = input_ids
        self.lengths = [width] * batch
        self.padding = (attention_mask == 0).long().sum(dim=1)  # (B,) left padding per row

    def append(self, row: int, tokens: list[int]) -> None:
        """Row ``row`` (a batch index) committed ``tokens``."""
        start = self.lengths[row]
        self.sequences[row, start:start + len(tokens)] = torch.tensor(tokens, dtype=torch.long,
                                                                      device=self.sequences.device)
        self.lengths[row] = start + len(tokens)

    def prompts(self) -> Contexts:
        """The sequences behind the prefill's last logits: each row's prompt, ``[B, T]``."""
        width = self.prompt_width
        batch = self.sequences.shape[0]
        lengths = torch.full((batch,), width, dtype=torch.long, device=self.sequences.device)
        return Contexts(self.sequences[:, :width], lengths, self.padding.clone(), width)

    def nodes(self, rows: list[int], trees: TreeBatch) -> Contexts:
        """The sequences behind every node's logits, ``M = R * N`` in row-major order (row ``r`` of
        ``trees`` is batch row ``rows[r]``); a padding node gets its row's committed sequence."""
        device = trees.tokens.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        committed = self.sequences[index]  # (R, W)
        base = torch.tensor([self.lengths[row] for row in rows], dtype=torch.long, device=device)  # (R,)
        count, width = trees.tokens.shape
        depth = max(trees.max_depth, 1)
        # path[r, c, d - 1]: the token of c's ancestor at depth d >= 1 (c itself included)
        path = torch.zeros(count, width, depth, dtype=torch.long, device=device)
        row_index, node_index, ancestor = torch.nonzero(trees.visibility, as_tuple=True)
        ancestor_depth = trees.depths[row_index, ancestor]
        below = ancestor_depth > 0
        path[row_index[below], node_index[below], ancestor_depth[below] - 1] = trees.tokens[row_index[below],
                                                                                           ancestor[below]]
        lengths = base[:, None] + trees.depths  # (R, N)
        longest = int(lengths.max())
        offset = longest - lengths  # (R, N) fill columns
        position = torch.arange(longest, device=device)[None, None, :] - offset[..., None]  # (R, N, L)
        limit = base[:, None, None]
        from_committed = committed.gather(1, position.clamp(0, committed.shape[1] - 1).view(count, -1))
        from_path = path.gather(2, (position - limit).clamp(0, depth - 1))
        ids = torch.where(position < limit, from_committed.view(count, width, longest), from_path)
        ids = ids.masked_fill(position < 0, FILL)
        starts = offset + self.padding[index][:, None]
        return Contexts(ids.view(count * width, longest), lengths.view(-1), starts.view(-1), self.prompt_width)
