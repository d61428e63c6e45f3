"""Training-free "lookup" drafting: an incremental n-gram index over token streams that proposes a
*tree* of continuations (prompt lookup decoding, Saxena 2023; SuffixDecoding, Oliaro et al. 2024).

:class:`SuffixIndex` maps every n-gram (``min_ngram <= n <= max_ngram``) of its streams to the
positions that follow its most recent occurrences. :func:`propose` matches the longest suffix of a
row's committed text against one or more indexes (the row's own text, a shared history...), counts
what followed each occurrence of that suffix and picks up to ``budget`` tree nodes best-first by
estimated acceptance probability. :func:`pad_proposals` turns a batch of proposals into the padded
tensors of a :class:`tree_attention.tree.TreeBatch`.

Scores. Let ``L`` be the longest suffix length that has an occurrence with a continuation in some
source; every source matching at ``L`` contributes (merged counts). With ``c_s(node)`` the number of
source ``s``'s occurrences whose continuation passes through the node and ``N`` the number of valid
occurrences over all sources at ``L``, a node scores ``sum_s c_s(node) * confidence_s / N``:
``count(node) / N`` for one source of confidence 1. So scores never increase from parent to child
and the root's children sum to at most ``max(confidence)``. No match-length factor is applied:
inside one proposal every node shares the match length, so a factor would rescale every score
without changing the tree; ``match_length`` is returned for callers that combine drafters (the
benchmark prints how the first node's score compares with its hit rate per match length).
With ``backoff = b > 0``, when the longest match alone yields fewer than ``budget`` nodes, the
whole tree is re-selected with scores interpolated with the next shorter match length
(Jelinek-Mercer smoothing): ``(1 - b) * score_L + b * score_{L-1}``; this adds branches seen only
after the shorter suffix. It adds little matched length where the longest match already fills the
budget (``benchmarks/studies/lookup_index``), so it is off by default.
Scores are computed exactly as ``sum_k c_k * (share_k * confidence_k) / N_k`` over classes
``k`` = (level, source) in class order (share 1 without backoff), which tests reproduce bit for bit.

Tie rule (deterministic): higher score first, then smaller depth, then the node whose first-ranked
occurrence ranks first. Occurrences are ranked: longest-match level before the backoff level, then
sources in the order given, then most recent first within an index (the order occurrences were
appended). Nodes of one depth have disjoint occurrence sets, so the order is total.

Cost: ``extend`` ``O(max_ngram)`` dict operations per token; ``propose`` ``O(max_ngram)`` lookups,
one slice per retained occurrence of the match (at most ``max_occurrences`` per source and level),
then best-first over *distinct* continuations (a selected node regroups only those passing
through it). Pure Python, no torch.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass, field
from typing import Collection, Iterable, NamedTuple, Sequence

import numpy
import torch

Occurrence = tuple[int, int]
"""``(stream id, offset)``: the position that follows one occurrence of an n-gram in a stream."""


class SuffixIndex:
    """An incremental n-gram index over token streams.

    Every n-gram ending at a stream position (``min_ngram <= n <= max_ngram``) maps to a list of
    its most recent ``max_occurrences`` occurrences, oldest first, each the :data:`Occurrence`
    that *follows* it (a list trimmed from the front: a deque costs ~760 bytes even when it holds
    one entry, and most long n-grams occur once). An occurrence indexed at the end of its stream
    has no continuation yet (it is the stream's own current position) and gains one when the stream
    is extended. ``extend`` costs ``O(max_ngram)`` dict operations per token; memory is
    ``O(max_ngram)`` entries per token.

    ``max_tokens`` (optional) bounds the total: after ``add_stream``/``extend`` the oldest streams
    (in creation order) are dropped until the total fits, never the stream just written, which is
    kept whole even when it alone exceeds the bound. Dropping a stream removes its occurrences;
    occurrences of other streams that it pushed out of a full bucket earlier do not come back.
    Stream ids are never reused.
    """

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1, max_occurrences: int = 64,
                 max_tokens: int | None = None) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1; got {max_occurrences}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be None or >= 1; got {max_tokens}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_occurrences = max_occurrences
        self.max_tokens = max_tokens
        self._streams: dict[int, list[int]] = {}
        self._table: dict[tuple[int, ...], list[Occurrence]] = {}
        self._next_id = 0
        self._total = 0

    def __len__(self) -> int:
        """Total tokens held over all streams."""
        return self._total

    def __contains__(self, stream: object) -> bool:
        return stream in self._streams

    @property
    def streams(self) -> list[int]:
        """Live stream ids, oldest first."""
        return list(self._streams)

    def tokens(self, stream: int) -> list[int]:
        """The stream's tokens: the live list itself (no copy), so it can be passed to
        :func:`propose` as ``context``. Do not mutate it; use :meth:`extend`."""
        return self._stream(stream)

    def occurrences(self, ngram: Sequence[int]) -> list[Occurrence]:
        """The retained occurrences of ``ngram``, oldest first (empty when not indexed)."""
        return list(self._table.get(tuple(ngram), ()))

    def continuations(self, ngram: tuple[int, ...], max_depth: int) -> list[tuple[int, ...]]:
        """What followed the retained occurrences of ``ngram`` (up to ``max_depth`` tokens each),
        most recent first; occurrences at the end of their stream (no continuation yet) are left out."""
        bucket = self._table.get(ngram)
        if not bucket:
            return []
        streams = self._streams
        found = []
        for stream, offset in reversed(bucket):
            sequence = streams[stream]
            if offset < len(sequence):
                found.append(tuple(sequence[offset:offset + max_depth]))
        return found

    def add_stream(self, tokens: Sequence[int] = ()) -> int:
        """Start a new stream holding ``tokens``; returns its id."""
        stream = self._next_id
        self._next_id += 1
        self._streams[stream] = []
        self.extend(stream, tokens)
        return stream

    def extend(self, stream: int, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (ints) to ``stream`` and index the n-grams ending at each new position."""
        sequence = self._stream(stream)
        tokens = [int(token) for token in tokens]  # also a copy, should ``tokens`` be this very stream
        table, cap = self._table, self.max_occurrences
        low, high = self.min_ngram, self.max_ngram
        for token in tokens:
            sequence.append(token)
            end = len(sequence)
            occurrence = (stream, end)
            for n in range(low, min(high, end) + 1):
                key = tuple(sequence[end - n:end])
                bucket = table.get(key)
                if bucket is None:
                    table[key] = [occurrence]
                else:
                    bucket.append(occurrence)
                    if len(bucket) > cap:
                        del bucket[0]
        self._total += len(tokens)
        if self.max_tokens is not None and self._total > self.max_tokens:
            self._evict(keep=stream)

    def drop_stream(self, stream: int) -> None:
        """Forget ``stream``: its tokens and every occurrence in it (cost ``O(len * max_ngram)`` lookups)."""
        sequence = self._streams.pop(self._check(stream))
        self._total -= len(sequence)
        table = self._table
        keys = {tuple(sequence[end - n:end]) for end in range(1, len(sequence) + 1)
                for n in range(self.min_ngram, min(self.max_ngram, end) + 1)}
        for key in keys:
            bucket = table.get(key)
            if bucket is None:
                continue
            kept = [occurrence for occurrence in bucket if occurrence[0] != stream]
            if not kept:
                del table[key]
            elif len(kept) < len(bucket):
                table[key] = kept

    def clear(self) -> None:
        """Drop every stream (ids are still never reused)."""
        self._streams.clear()
        self._table.clear()
        self._total = 0

    def _evict(self, keep: int) -> None:
        for stream in list(self._streams):
            if self._total <= self.max_tokens:
                return
            if stream != keep:
                self.drop_stream(stream)

    def _check(self, stream: int) -> int:
        if stream not in self._streams:
            raise KeyError(f"unknown or dropped stream {stream!r}")
        return stream

    def _stream(self, stream: int) -> list[int]:
        return self._streams[self._check(stream)]


class Source(NamedTuple):
    """An index to match against (a :class:`SuffixIndex` or a
    :class:`~heads.lookup.corpus.CorpusIndex`) and the confidence (``0 < confidence <= 1``) its counts get."""

    index: SuffixIndex
    confidence: float = 1.0


@dataclass
class Proposal:
    """A draft tree below the root (the last committed token, not included).

    ``tokens[i]``, ``parents[i]`` (an index into these nodes, ``-1`` = the root; ``parents[i] < i``)
    and ``scores[i]`` (estimated probability that the path to node ``i`` is accepted;
    ``scores[i] <= scores[parents[i]]``) describe node ``i``; nodes are in selection order.
    ``match_length``: length of the matched suffix, 0 when nothing matched.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    match_length: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


Found = list[tuple[int, list[tuple[int, ...]]]]
"""Per source with a valid occurrence: ``(source number, continuations)``, most recent first; a
continuation is at most ``max_depth`` tokens, cut before the first excluded token, never empty."""


def propose(context: Sequence[int], sources: Sequence[tuple[SuffixIndex, float]], budget: int, max_depth: int,
            min_match: int = 1, exclude: Collection[int] = (), backoff: float = 0.0) -> Proposal:
    """Draft a tree continuing ``context`` from what followed its longest suffix in ``sources``.

    Args:
        context: the row's committed tokens (Python ints), its last token being the root.
        sources: ``(index, confidence)`` pairs (e.g. :class:`Source`), in tie-break priority order.
        budget: at most this many nodes (the root not counted).
        max_depth: at most this many tokens below the root on any path.
        min_match: shortest suffix accepted as a match (also capped by each index's n-gram range).
        exclude: tokens never proposed; a continuation stops before the first of them.
        backoff: interpolation weight ``0 <= backoff < 1`` of the next shorter match, used only when
            the longest match alone yields fewer than ``budget`` nodes (module doc).

    Returns:
        a :class:`Proposal`; empty when ``budget`` or ``max_depth`` is 0 or nothing matches. An
        occurrence without a continuation (the end of a stream, e.g. the row's own current
        position, or one followed by an excluded token) never counts as a match.
    """
    if min_match < 1:
        raise ValueError(f"min_match must be >= 1; got {min_match}")
    if not 0.0 <= backoff < 1.0:
        raise ValueError(f"backoff must be in [0, 1); got {backoff}")
    for _, confidence in sources:
        if not 0.0 < confidence <= 1.0:
            raise ValueError(f"a source's confidence must be in (0, 1]; got {confidence}")
    if budget <= 0 or max_depth <= 0 or not context or not sources:
        return Proposal()
    exclude = frozenset(exclude)
    top = min(len(context), max(index.max_ngram for index, _ in sources))
    depth = min(max_depth, budget)  # no path of a budget-node tree is deeper than the budget
    for length in range(top, min_match - 1, -1):
        found = _gather(context, sources, length, depth, exclude)
        if found:
            break
    else:
        return Proposal()
    tokens, parents, scores = _best_first(*_distinct([(1.0, found)], sources), budget, depth)
    if backoff and len(tokens) < budget and length > min_match:
        shorter = _gather(context, sources, length - 1, depth, exclude)
        if shorter:
            levels = [(1.0 - backoff, found), (backoff, shorter)]
            tokens, parents, scores = _best_first(*_distinct(levels, sources), budget, depth)
    return Proposal(tokens, parents, scores, length)


def _gather(context: Sequence[int], sources: Sequence[tuple[SuffixIndex, float]], n: int, max_depth: int,
            exclude: frozenset[int]) -> Found:
    """The valid continuations of the length-``n`` suffix of ``context`` in each source (see :data:`Found`)."""
    key = tuple(context[-n:])
    found = []
    for number, (index, _) in enumerate(sources):
        if not index.min_ngram <= n <= index.max_ngram:
            continue
        continuations = index.continuations(key, max_depth)
        if exclude:
            continuations = [cut for cut in (_cut(continuation, exclude) for continuation in continuations) if cut]
        if continuations:
            found.append((number, continuations))
    return found


def _cut(continuation: tuple[int, ...], exclude: frozenset[int]) -> tuple[int, ...]:
    for position, token in enumerate(continuation):
        if token in exclude:
            return continuation[:position]
    return continuation


def _distinct(levels: list[tuple[float, Found]], sources: Sequence[tuple[SuffixIndex, float]]
              ) -> tuple[list[list], list[tuple[float, int]]]:
    """Group occurrences by ``(level, source)`` = *class* ``k`` and by continuation.

    Returns ``entries`` (``[continuation, k, count, first rank]``, ascending first rank: ranks
    number occurrences level by level, source by source, most recent first) and ``factors``
    (``(share * confidence, occurrences at the level)`` per class): a node whose paths carry
    ``c_k`` occurrences of class ``k`` scores ``sum_k c_k * share_k * confidence_k / total_k``.
    """
    entries: list[list] = []
    factors: list[tuple[float, int]] = []
    rank = 0
    for share, found in levels:
        total = sum(len(continuations) for _, continuations in found)
        for number, continuations in found:
            k = len(factors)
            factors.append((share * sources[number][1], total))
            seen: dict[tuple[int, ...], list] = {}
            for continuation in continuations:
                entry = seen.get(continuation)
                if entry is None:
                    seen[continuation] = entry = [continuation, k, 0, rank]
                    entries.append(entry)
                entry[2] += 1
                rank += 1
    return entries, factors


def _best_first(entries: list[list], factors: list[tuple[float, int]], budget: int,
                max_depth: int) -> tuple[list[int], list[int], list[float]]:
    """Select up to ``budget`` nodes of the entries' continuation trie, best first.

    The trie is expanded lazily: a node holds the indices of the entries passing through it, and
    its children are grouped only once it is selected. Heap entries are
    ``(-score, depth, first rank, token, parent, entry indices)``; ``(depth, first rank)`` is unique.
    A node with one entry has at most one child, with the same counts hence the same score.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    heap: list = []
    _push_children(heap, entries, factors, range(len(entries)), 0, -1)
    push, pop = heapq.heappush, heapq.heappop
    while heap and len(tokens) < budget:
        negative, depth, first, token, parent, members = pop(heap)
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        scores.append(-negative)
        if depth >= max_depth:
            continue
        if len(members) == 1:
            continuation = entries[members[0]][0]
            if depth < len(continuation):
                push(heap, (negative, depth + 1, first, continuation[depth], node, members))
        else:
            _push_children(heap, entries, factors, members, depth, node)
    return tokens, parents, scores


def _push_children(heap: list, entries: list[list], factors: list[tuple[float, int]], members: Iterable[int],
                   depth: int, parent: int) -> None:
    """Group ``members`` (entry indices, ascending) by their token at ``depth`` below the root and
    push one heap entry per group: the children of node ``parent`` (at depth ``depth``)."""
    classes = len(factors)
    groups: dict[int, list] = {}
    for member in members:
        continuation, k, count, first = entries[member]
        if depth < len(continuation):
            token = continuation[depth]
            group = groups.get(token)
            if group is None:
                groups[token] = group = [first, [], [0] * classes]
            group[1].append(member)
            group[2][k] += count
    child_depth = depth + 1
    for token, (first, group_members, counts) in groups.items():
        score = 0.0
        for count, (factor, total) in zip(counts, factors):
            if count:
                score += count * factor / total
        heapq.heappush(heap, (-score, child_depth, first, token, parent, group_members))


def pad_proposals(roots: Sequence[int], proposals: Sequence[Proposal],
                  device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """A batch of ``R`` trees, row ``r`` = ``roots[r]`` (node 0) + ``proposals[r]`` (node ``i + 1`` =
    proposal node ``i``), padded to ``N = 1 + max(len(proposal))``.

    Returns tensors on ``device`` (CPU when None), the fields of a
    :class:`tree_attention.tree.TreeBatch`:
        tokens ``[R, N]`` long (padding 0); parents ``[R, N]`` long (-1 at the root and padding);
        depths ``[R, N]`` long (root and padding 0); visibility ``[R, N, N]`` bool (``[r, i, j]``:
        ``j`` is ``i`` or an ancestor of ``i``; padding sees only itself, no real node sees it);
        sizes ``[R]`` long (``1 + len(proposal)``).

    Per node, Python list work only (an ancestor set is a Python int bit mask: one OR per node);
    the lists become tensors through ``array`` buffers (much cheaper than ``torch.tensor`` on nested
    lists), the masks through ``numpy.unpackbits`` (cheaper than depth-level tensor gathers at
    lookup's tree sizes: ``benchmarks/studies/lookup_index``).
    """
    if len(roots) != len(proposals):
        raise ValueError(f"{len(roots)} roots but {len(proposals)} proposals")
    rows = len(proposals)
    width = 1 + max((len(proposal.tokens) for proposal in proposals), default=0)
    if rows == 0:
        return _empty(width, device)
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    masks: list[int] = []
    for root, proposal in zip(roots, proposals):
        _append_row(int(root), proposal, width, tokens, parents, depths, masks)
    sizes = [1 + len(proposal.tokens) for proposal in proposals]
    longs = torch.frombuffer(array("q", tokens + parents + depths + sizes), dtype=torch.long)
    token_grid, parent_grid, depth_grid = longs[:3 * rows * width].view(3, rows, width).unbind(0)
    fields = {"tokens": token_grid, "parents": parent_grid, "depths": depth_grid,
              "visibility": _unpack_masks(masks, rows, width), "sizes": longs[3 * rows * width:]}
    if device is not None:
        fields = {name: value.to(device) for name, value in fields.items()}
    return fields


def _append_row(root: int, proposal: Proposal, width: int, tokens: list[int], parents: list[int],
                depths: list[int], masks: list[int]) -> None:
    """Append one padded row (``width`` nodes) to each flat list; bit ``j`` of node ``i``'s mask: ``i`` sees ``j``."""
    size = 1 + len(proposal.tokens)
    if len(proposal.parents) != size - 1 or len(proposal.scores) != size - 1:
        raise ValueError("a proposal needs one parent and one score per token")
    row_depths, row_masks = [0], [1]
    for node, parent in enumerate(proposal.parents, start=1):
        if not -1 <= parent < node - 1:
            raise ValueError(f"proposal node {node - 1} has parent {parent}: parents must come first")
        row_depths.append(row_depths[parent + 1] + 1)
        row_masks.append(row_masks[parent + 1] | (1 << node))
    pad = width - size
    tokens.append(root)
    tokens.extend(proposal.tokens)
    tokens.extend([0] * pad)
    parents.append(-1)
    parents.extend([parent + 1 for parent in proposal.parents])
    parents.extend([-1] * pad)
    depths.extend(row_depths)
    depths.extend([0] * pad)
    masks.extend(row_masks)
    masks.extend([1 << node for node in range(size, width)])


def _empty(width: int, device: torch.device | str | None) -> dict[str, torch.Tensor]:
    long = dict(dtype=torch.long, device=device)
    return {"tokens": torch.zeros(0, width, **long), "parents": torch.zeros(0, width, **long),
            "depths": torch.zeros(0, width, **long),
            "visibility": torch.zeros(0, width, width, dtype=torch.bool, device=device),
            "sizes": torch.zeros(0, **long)}


def _unpack_masks(masks: list[int], rows: int, width: int) -> torch.Tensor:
    """``[R, N, N]`` bool from ``R * N`` Python int bit masks (bit ``j`` of ``masks[r * N + i]`` = entry ``[r, i, j]``):
    little-endian bytes, unpacked by numpy (a third of the cost of shifting a tensor), any ``N``."""
    count = (width + 7) // 8
    packed = numpy.frombuffer(b"".join([mask.to_bytes(count, "little") for mask in masks]), dtype=numpy.uint8)
    bits = numpy.unpackbits(packed.reshape(rows, width, count), axis=-1, count=width, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)
