"""Hyper-parameters of the training-free lookup drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


def _positive_int(value: object, name: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"LookupConfig.{name} must be an int >= {low}; got {value!r}")


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
    """Cross-request history: tokens of earlier requests (and the corpus) kept for matching; 0: none."""
    remember: bool = True
    """Add each finished request's text to the history (False: the history holds the corpus alone,
    and no request's text outlives its call)."""
    history_confidence: float = 0.8
    """Weight of counts from the history/corpus against the row's own text (1.0)."""
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
    """Extra token sequences to match against (kept with the history; never saved in an adapter)."""

    def __post_init__(self) -> None:
        _positive_int(self.budget, "budget", low=0)
        _positive_int(self.max_depth, "max_depth")
        _positive_int(self.max_ngram, "max_ngram")
        _positive_int(self.min_match, "min_match")
        _positive_int(self.max_occurrences, "max_occurrences")
        _positive_int(self.history_tokens, "history_tokens", low=0)
        _positive_int(self.extend, "extend")
        if not isinstance(self.remember, bool):
            raise ValueError(f"LookupConfig.remember must be True or False; got {self.remember!r}")
        if not isinstance(self.gate, bool):
            raise ValueError(f"LookupConfig.gate must be True or False; got {self.gate!r}")
        if self.min_match > self.max_ngram:
            raise ValueError(f"LookupConfig.min_match ({self.min_match}) must be <= max_ngram ({self.max_ngram})")
        if not isinstance(self.history_confidence, (int, float)) or not 0.0 < self.history_confidence <= 1.0:
            raise ValueError(f"LookupConfig.history_confidence must be in (0, 1]; got {self.history_confidence!r}")
        corpus = []
        for number, sequence in enumerate(self.corpus):
            if isinstance(sequence, (str, bytes)):
                raise ValueError(f"LookupConfig.corpus[{number}] is text; give token ids (tokenize it with the "
                                 "target's tokenizer, or pass corpus= and tokenizer= to attach_heads)")
            ids = [int(token) for token in sequence]
            if any(token < 0 for token in ids):
                raise ValueError(f"LookupConfig.corpus[{number}] holds negative token ids")
            corpus.append(ids)
        if corpus and not self.history_tokens:
            raise ValueError("LookupConfig.corpus is kept in the cross-request history, which history_tokens=0 "
                             "turns off: the corpus would be ignored; give history_tokens > 0 or no corpus")
        self.corpus = corpus

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
                                                       "max_occurrences", "history_tokens", "history_confidence",
                                                       "adaptive", "extend", "gate", "remember")}
