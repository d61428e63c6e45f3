"""Hyper-parameters of the training-free lookup drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy

from tree_attention.tree import check_tree_size


def _positive_int(value: object, name: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"LookupConfig.{name} must be an int >= {low}; got {value!r}")


def corpus_ids(sequence, name: str) -> numpy.ndarray:
    """``sequence`` (token ids) as a 1-D int64 array; text and negative ids are a ValueError naming ``name``."""
    if isinstance(sequence, (str, bytes)):
        raise ValueError(f"{name} is text; give token ids (tokenize it with the target's tokenizer, or pass "
                         "corpus= and tokenizer= to attach_heads)")
    try:
        if isinstance(sequence, numpy.ndarray):
            ids = sequence
        else:  # a tensor through its list (one conversion), any other iterable of ints as a list
            ids = numpy.asarray(sequence.tolist() if hasattr(sequence, "tolist") else list(sequence))
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of token ids; got {type(sequence).__name__}") from None
    if ids.size and (ids.ndim != 1 or ids.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a flat sequence of integer token ids; got {ids.dtype} of shape {ids.shape}")
    ids = ids.reshape(-1).astype(numpy.int64, copy=False)
    if ids.size and int(ids.min()) < 0:
        raise ValueError(f"{name} holds negative token ids")
    return ids


@dataclass
class LookupConfig:
    """How a lookup drafter matches and how big a tree it proposes."""

    budget: int = 10
    """Drafted nodes per step (the root not counted): the tree size verified each step."""
    max_depth: int = 10
    """Deepest path below the root."""
    max_ngram: int = 4
    """Longest suffix of the text matched (longer matches are tried first)."""
    min_match: int = 1
    """Shortest suffix that counts as a match."""
    max_occurrences: int = 64
    """Most recent occurrences of an n-gram kept per index."""
    history_tokens: int = 200_000
    """Cross-request history: tokens of earlier requests kept for matching, oldest requests evicted
    first (a request longer than this is kept whole until the next one); 0: none. The corpus has its
    own bound (``corpus_tokens``) and is never evicted."""
    corpus_tokens: int = 4_000_000
    """Most corpus tokens indexed (about ``4 + 12 * max_ngram`` bytes each: 52 MB per million tokens at
    ``max_ngram`` 4); a larger corpus is truncated to its first ``corpus_tokens`` tokens, with a logged
    warning. 0: no corpus."""
    remember: bool = True
    """Add each finished request's text to the history (False: no request's text outlives its call)."""
    history_confidence: float = 0.8
    """Weight of counts from the history and the corpus against the row's own text (1.0)."""
    adaptive: bool = True
    """Shrink a row's tree (down to a quarter of ``budget``) while its drafts are rejected, and grow
    it back as they are accepted: verifying nodes that will not be accepted costs time (sampling,
    text that does not repeat)."""
    extend: int = 4
    """With ``adaptive``: a row whose last step accepted every draft down to its depth limit drafts
    twice as deep next step (the budget grows by the added depth), up to ``extend x max_depth``; any
    shorter acceptance sets it back to ``max_depth``. Text that repeats a long span (a function copied
    with edits) then commits tens of tokens a step, where a fixed depth stops at ``max_depth``
    (speculation that grows with the match, as SuffixDecoding does). 1: never deeper."""
    gate: bool = True
    """In a hybrid with a trained kind, greedy: verify lookup's proposals alone (skipping the trained
    drafter) at steps where that is expected to commit more tokens per second, learned while serving
    (:class:`heads.lookup.gate.LookupGate`). Outputs are the same either way."""
    corpus: Sequence[Sequence[int]] = field(default=(), repr=False, compare=False)
    """Extra token sequences to match against (held as 1-D int arrays; never saved in an adapter)."""

    def __post_init__(self) -> None:
        _positive_int(self.budget, "budget", low=0)
        _positive_int(self.max_depth, "max_depth")
        _positive_int(self.max_ngram, "max_ngram")
        _positive_int(self.min_match, "min_match")
        _positive_int(self.max_occurrences, "max_occurrences")
        _positive_int(self.history_tokens, "history_tokens", low=0)
        _positive_int(self.corpus_tokens, "corpus_tokens", low=0)
        _positive_int(self.extend, "extend")
        check_tree_size(self.budget, "LookupConfig.budget")
        if self.adaptive and self.budget:  # a row drafting deeper (``extend``) adds the extra depth to its budget
            check_tree_size(self.budget + (self.extend - 1) * self.max_depth,
                            "LookupConfig.budget + (extend - 1) * max_depth (the deepest adaptive step's budget)")
        if not isinstance(self.remember, bool):
            raise ValueError(f"LookupConfig.remember must be True or False; got {self.remember!r}")
        if not isinstance(self.gate, bool):
            raise ValueError(f"LookupConfig.gate must be True or False; got {self.gate!r}")
        if self.min_match > self.max_ngram:
            raise ValueError(f"LookupConfig.min_match ({self.min_match}) must be <= max_ngram ({self.max_ngram})")
        if not isinstance(self.history_confidence, (int, float)) or not 0.0 < self.history_confidence <= 1.0:
            raise ValueError(f"LookupConfig.history_confidence must be in (0, 1]; got {self.history_confidence!r}")
        self.corpus = [corpus_ids(sequence, f"LookupConfig.corpus[{number}]")
                       for number, sequence in enumerate(self.corpus)]
        if self.corpus and not self.corpus_tokens:
            raise ValueError("LookupConfig.corpus is given but corpus_tokens=0 indexes none of it; give "
                             "corpus_tokens > 0 or no corpus")

    @property
    def tree(self) -> int:
        """The configured tree size (what ``SpeculativeModel.set_tree(None)`` uses)."""
        return self.budget

    def with_tree(self, tree) -> "LookupConfig":
        """This config with a node budget ``tree`` (None: unchanged)."""
        if tree is None:
            return self
        if isinstance(tree, bool) or not isinstance(tree, int) or tree < 0:
            raise ValueError(f"a lookup tree is a node budget (an int >= 0); got {tree!r}")
        from dataclasses import replace

        return replace(self, budget=tree, max_depth=max(1, min(self.max_depth, tree)) if tree else self.max_depth)

    def to_dict(self) -> dict:
        """The hyper-parameters (the corpus is data, not recorded)."""
        return {name: getattr(self, name) for name in ("budget", "max_depth", "max_ngram", "min_match",
                                                       "max_occurrences", "history_tokens", "corpus_tokens",
                                                       "history_confidence", "adaptive", "extend", "gate",
                                                       "remember")}
