"""A static n-gram index over a lookup corpus, built in one vectorised pass.

:class:`CorpusIndex` answers what :class:`~heads.lookup.index.SuffixIndex` answers for
:func:`~heads.lookup.index.propose` (``continuations`` of an n-gram, most recent first) over token
sequences fixed at construction. Per n-gram length ``n`` it keeps every n-gram's key (the
n tokens packed into 64 bits when they fit, else a 64-bit polynomial hash whose matches are checked
against the tokens) sorted stably, beside the offset that follows each occurrence; a lookup is two
binary searches and one gather. Building costs a few numpy sorts per ``n``; memory is
``4 + 12 * (max_ngram - min_ngram + 1)`` bytes per token (tokens as int32, keys uint64, offsets
int32), against a few hundred bytes per token for the incremental dict of ``SuffixIndex``.

Same occurrences as a ``SuffixIndex`` fed the same streams: n-grams never cross a sequence
boundary, the ``max_occurrences`` most recent occurrences of an n-gram are retained (an occurrence
that ends its sequence counts among them but has no continuation), most recent = highest offset.
"""

from __future__ import annotations

from typing import Sequence

import numpy

_MASK = (1 << 64) - 1
_HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # odd, well-mixed bits (2^64 / golden ratio)


class CorpusIndex:
    """An immutable n-gram index over ``sequences`` (token ids ``>= 0``), for :func:`propose`."""

    def __init__(self, sequences: Sequence[Sequence[int]], max_ngram: int = 4, max_occurrences: int = 64,
                 min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1; got {max_occurrences}")
        self.max_ngram, self.min_ngram, self.max_occurrences = max_ngram, min_ngram, max_occurrences
        parts = [numpy.asarray(sequence, dtype=numpy.int64).reshape(-1) for sequence in sequences]
        parts = [part for part in parts if part.size]
        tokens = numpy.concatenate(parts) if parts else numpy.zeros(0, dtype=numpy.int64)
        if tokens.size and int(tokens.min()) < 0:
            raise ValueError("a lookup corpus holds token ids >= 0; got a negative id")
        self._largest = int(tokens.max()) if tokens.size else 0
        self._bits = max(1, self._largest.bit_length())  # bits per token in a packed key
        self._tokens = tokens.astype(numpy.int32 if self._largest < 2 ** 31 else numpy.int64)
        self._ends = numpy.cumsum([part.size for part in parts], dtype=numpy.int64)  # (S,) sequence ends
        self.streams = len(parts)
        self._keys: dict[int, numpy.ndarray] = {}  # n -> (M_n,) uint64 sorted keys
        self._offsets: dict[int, numpy.ndarray] = {}  # n -> (M_n,) offsets following each occurrence
        self._build(tokens)

    def __len__(self) -> int:
        """Tokens held over all sequences."""
        return int(self._tokens.size)

    @property
    def nbytes(self) -> int:
        """Bytes held by the index's arrays (tokens, keys, offsets, sequence ends)."""
        arrays = [self._tokens, self._ends, *self._keys.values(), *self._offsets.values()]
        return sum(array.nbytes for array in arrays)

    def _packed(self, n: int) -> bool:
        return n * self._bits <= 64

    def _build(self, tokens: numpy.ndarray) -> None:
        total = tokens.size
        if not total:
            return
        sequence_of = numpy.repeat(numpy.arange(self.streams), numpy.diff(self._ends, prepend=0))  # (T,)
        values = tokens.astype(numpy.uint64)
        offset_type = numpy.int32 if total < 2 ** 31 else numpy.int64
        keys = numpy.zeros(total, dtype=numpy.uint64)  # keys[s]: the n-gram starting at s, for the current n
        with numpy.errstate(over="ignore"):
            for n in range(1, self.max_ngram + 1):
                starts = total - n + 1  # n-grams tokens[s:s + n], s < starts
                if starts <= 0:
                    break
                keys = keys[:starts]
                if self._packed(n):
                    keys = (keys << numpy.uint64(self._bits)) | values[n - 1:]
                else:
                    keys = keys * numpy.uint64(_HASH_MULTIPLIER) + values[n - 1:] + numpy.uint64(1)
                if n < self.min_ngram:
                    continue
                inside = numpy.flatnonzero(sequence_of[:starts] == sequence_of[n - 1:])  # no boundary crossed
                order = numpy.argsort(keys[inside], kind="stable")  # equal keys keep ascending offsets
                self._keys[n] = keys[inside][order]
                self._offsets[n] = (inside[order] + n).astype(offset_type)

    def _key(self, ngram: Sequence[int]) -> int | None:
        """``ngram``'s key as ``_build`` computes it; None when it holds a token the corpus lacks."""
        key = 0
        for length, token in enumerate(ngram, start=1):
            if not 0 <= token <= self._largest:
                return None
            if self._packed(length):
                key = (key << self._bits) | token
            else:
                key = (key * _HASH_MULTIPLIER + token + 1) & _MASK
        return key

    def _retained(self, ngram: Sequence[int]) -> numpy.ndarray:
        """Offsets following the ``max_occurrences`` most recent occurrences of ``ngram``, ascending."""
        n = len(ngram)
        key = self._key(ngram) if n in self._keys else None
        if key is None:
            return numpy.zeros(0, dtype=numpy.int64)
        keys = self._keys[n]
        value = numpy.uint64(key)
        low, high = numpy.searchsorted(keys, value, "left"), numpy.searchsorted(keys, value, "right")
        offsets, cap = self._offsets[n][low:high], self.max_occurrences
        if self._packed(n):
            return offsets[-cap:].astype(numpy.int64)
        # a hashed key: keep the candidates whose tokens are ``ngram``; collisions are rare, so the
        # latest few candidates usually hold the ``cap`` most recent matches
        latest = offsets[-4 * cap:]
        matched = self._matching(latest, ngram)
        if matched.size < cap and latest.size < offsets.size:
            matched = self._matching(offsets, ngram)
        return matched[-cap:]

    def _matching(self, offsets: numpy.ndarray, ngram: Sequence[int]) -> numpy.ndarray:
        """The ``offsets`` (``[C]``) that follow an occurrence of ``ngram``, as int64."""
        offsets = offsets.astype(numpy.int64)
        grams = self._tokens[offsets[:, None] - len(ngram) + numpy.arange(len(ngram))]  # (C, n)
        return offsets[(grams == numpy.asarray(ngram)).all(axis=1)]

    def occurrences(self, ngram: Sequence[int]) -> list[int]:
        """Offsets (into the concatenated corpus) that follow the retained occurrences of ``ngram``, oldest first."""
        return self._retained(tuple(ngram)).tolist()

    def continuations(self, ngram: tuple[int, ...], max_depth: int) -> list[tuple[int, ...]]:
        """What followed the retained occurrences of ``ngram`` (up to ``max_depth`` tokens, never past
        its sequence's end), most recent first; occurrences that end their sequence are left out."""
        if not self.min_ngram <= len(ngram) <= self.max_ngram or not len(self):
            return []
        offsets = self._retained(ngram)[::-1]
        if not offsets.size:
            return []
        ends = self._ends[numpy.searchsorted(self._ends, offsets - 1, "right")]  # (C,) end of each one's sequence
        lengths = numpy.minimum(ends - offsets, max_depth)
        keep = lengths > 0
        offsets, lengths = offsets[keep], lengths[keep].tolist()
        rows = self._tokens[numpy.minimum(offsets[:, None] + numpy.arange(max_depth), len(self) - 1)].tolist()
        return [tuple(row[:length]) for row, length in zip(rows, lengths)]
