"""The lookup drafter: trees of continuations found in the text itself, no model at all.

Each row keeps its own :class:`~heads.lookup.index.SuffixIndex` over its prompt and output;
a :class:`LookupMemory` shared by a ``SpeculativeModel`` holds the corpus and the text of earlier
requests (cross-request history), each under its own bound. Every step the row's committed tokens
are appended to its index and :func:`~heads.lookup.index.propose` matches the longest suffix (root included)
against both, returning up to ``budget`` nodes chosen best-first by estimated acceptance.
"""

from __future__ import annotations

import logging

import numpy
import torch
from torch import nn

from tree_attention.draft_batch import DraftBatch
from tree_attention.tree import TreeBatch

from .config import LookupConfig, corpus_ids
from .corpus import CorpusIndex
from .index import Proposal, SuffixIndex, pad_proposals, propose

logger = logging.getLogger(__name__)


class LookupMemory(nn.Module):
    """What a lookup drafter remembers across ``generate`` calls, under two separate bounds: the
    corpus in a static :class:`~heads.lookup.corpus.CorpusIndex` (at most ``corpus_tokens``, never
    evicted) and earlier requests' text in a :class:`SuffixIndex` of at most ``history_tokens``
    (oldest requests evicted first). No parameters."""

    def __init__(self, config: LookupConfig) -> None:
        super().__init__()
        self.config = config
        self.history = None
        if config.history_tokens:
            self.history = SuffixIndex(config.max_ngram, 1, config.max_occurrences, config.history_tokens)
        self._corpus: list[numpy.ndarray] = []
        self.corpus: CorpusIndex | None = None
        if config.corpus:
            self.add_corpus(config.corpus)

    def sources(self) -> list[tuple[SuffixIndex | CorpusIndex, float]]:
        """The non-empty shared indexes with their confidence, in tie-break order: history, then corpus."""
        confidence = self.config.history_confidence
        return [(index, confidence) for index in (self.history, self.corpus) if index is not None and len(index)]

    def remember(self, sequences: list[list[int]]) -> None:
        """Add finished requests' text to the history (unless ``config.remember`` is off)."""
        if self.history is not None and self.config.remember:
            for sequence in sequences:
                if sequence:
                    self.history.add_stream(sequence)

    def add_corpus(self, sequences) -> None:
        """Add token sequences (ids) to match against; the corpus index is rebuilt (a vectorised pass
        over the whole corpus). Beyond ``corpus_tokens`` in all, the excess is cut off the end, with
        a logged warning."""
        bound = self.config.corpus_tokens
        if not bound:
            raise ValueError("this lookup drafter indexes no corpus (corpus_tokens=0): give corpus_tokens > 0")
        added = [corpus_ids(sequence, f"corpus[{number}]") for number, sequence in enumerate(sequences)]
        held = sum(part.size for part in self._corpus)
        offered = held + sum(part.size for part in added)
        kept = []
        for part in added:
            part = part[:max(0, bound - held)]
            if part.size:
                kept.append(part)
                held += part.size
        if offered > bound:
            logger.warning("lookup corpus: %d tokens exceed corpus_tokens=%d; indexing the first %d and dropping "
                           "the rest (raise LookupConfig.corpus_tokens to keep more)", offered, bound, held)
        if kept:
            self._corpus.extend(kept)
            self.corpus = CorpusIndex(self._corpus, self.config.max_ngram, self.config.max_occurrences)


class LookupDrafter:
    """Proposes lookup trees for every row (``tree_attention.decode.Drafter``)."""

    def __init__(self, config: LookupConfig, memory: LookupMemory | None = None) -> None:
        self.config = self.configured = config
        self._resized: dict[int | None, LookupConfig] = {None: config}  # resize's config per size (built once: with_tree validates)
        self.memory = memory
        self.rows: list[SuffixIndex] = []
        self.expected: list[float] = []  # per row: running mean of drafts accepted per step that proposed
        self.proposed: list[bool] = []  # per row: whether the last step proposed anything
        self.scales: list[float] = []  # per row: the budget scale of its last proposal (1.0 when not adaptive)
        self.found: list[int] = []  # per row: nodes its last proposal held
        self.depths: list[int] = []  # per row: the depth limit of its last proposal (``extend``)

    def _new_row(self) -> SuffixIndex:
        return SuffixIndex(self.config.max_ngram, 1, self.config.max_occurrences)

    def reset(self, batch_size: int) -> None:
        """Earlier rows' text goes to the history; ``batch_size`` fresh rows."""
        self._remember()
        self.rows = [self._new_row() for _ in range(batch_size)]
        for index in self.rows:
            index.add_stream()
        self.expected = [float(self.config.budget)] * batch_size  # optimistic start
        self.proposed = [False] * batch_size
        self.scales, self.found = [1.0] * batch_size, [0] * batch_size
        self.depths = [self.config.max_depth] * batch_size

    def _remember(self) -> None:
        if self.memory is not None and self.rows:
            self.memory.remember([index.tokens(0) for index in self.rows])
        self.rows = []

    def retire(self, keep: torch.Tensor) -> None:
        order = keep.tolist()
        if self.memory is not None:
            kept = set(order)
            self.memory.remember([index.tokens(0) for number, index in enumerate(self.rows) if number not in kept])
        for name in ("rows", "expected", "proposed", "scales", "found", "depths"):  # the per-row lists
            values = getattr(self, name)
            setattr(self, name, [values[number] for number in order])

    def _row_scale(self, row: int, length: int) -> float:
        """The row's budget scale after the last step accepted ``length - 1`` drafts (adaptive:
        shrinks to a quarter while drafts are rejected, back to 1 as they are accepted)."""
        if not self.config.adaptive:
            return 1.0
        if self.proposed[row]:
            self.expected[row] = 0.5 * self.expected[row] + 0.5 * (length - 1)
        return min(1.0, 0.25 + self.expected[row] / 2)

    def _row_depth(self, row: int, length: int) -> int:
        """The row's depth limit after the last step accepted ``length - 1`` drafts (see
        ``LookupConfig.extend``): twice the last one after it was accepted in full, else ``max_depth``."""
        config, depth = self.config, self.depths[row]
        if config.adaptive and config.extend > 1 and self.proposed[row] and length - 1 >= depth:
            return min(config.extend * config.max_depth, 2 * depth)
        return config.max_depth

    @staticmethod
    def _scaled(budget: int, scale: float) -> int:
        return max(1, round(budget * scale)) if budget else 0

    nested = True
    """A smaller budget's proposal is the first nodes of a larger one's (best-first selection with a
    unique order; ``tests/heads/lookup/test_nested.py``), taken at this drafter's per-row budget
    scale (``LookupConfig.adaptive``)."""

    def resize(self, tree: int | None) -> None:
        """Propose at most ``tree`` nodes a step from the next step on (None: the configured budget);
        the rows' indices and adaptive state are kept (``tree_attention.capabilities.SizedDrafter``).
        Drafting costs about the same at any budget; what a smaller one saves is verify width."""
        config = self._resized.get(tree)
        self.config = config if config is not None else self._resized.setdefault(tree, self.configured.with_tree(tree))

    @staticmethod
    def host(batch: DraftBatch) -> tuple[list[int], list[list[int]], list[int]]:
        """``batch``'s lengths, tokens and roots as Python lists (three host reads)."""
        return batch.lengths.tolist(), batch.tokens.tolist(), batch.roots.tolist()

    def proposals(self, batch: DraftBatch, budget: int | None = None, host: tuple | None = None) -> list[Proposal]:
        """Append each row's newly committed tokens to its index and match its text (root included);
        ``host``: :meth:`host` of ``batch`` when the caller has read it already."""
        config = self.config
        budget = config.budget if budget is None else budget
        lengths, tokens, roots = self.host(batch) if host is None else host
        shared = [] if self.memory is None else self.memory.sources()
        found = []
        for row, (index, row_tokens, length, root) in enumerate(zip(self.rows, tokens, lengths, roots)):
            depth = self.depths[row] = self._row_depth(row, length)  # (before the scale sees this step)
            scale = self.scales[row] = self._row_scale(row, length)
            row_budget = self._scaled(budget, scale) + depth - config.max_depth if budget else 0
            index.extend(0, row_tokens[:length])
            sources = [(index, 1.0), *shared]
            context = index.tokens(0)[-config.max_ngram:] + [root]
            proposal = propose(context, sources, row_budget, depth, config.min_match)
            self.proposed[row] = bool(proposal.tokens)
            self.found[row] = len(proposal.tokens)
            found.append(proposal)
        return found

    @staticmethod
    def as_trees(batch: DraftBatch, proposals: list[Proposal]) -> TreeBatch:
        """Each row's proposal below its root, padded into one batch."""
        fields = pad_proposals(batch.roots.tolist(), proposals, batch.roots.device)
        uniform = bool((fields["sizes"] == fields["tokens"].shape[1]).all())
        return TreeBatch(fields["tokens"], fields["parents"], fields["depths"], fields["visibility"],
                         fields["sizes"], uniform=uniform)

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        return self.as_trees(batch, self.proposals(batch))
