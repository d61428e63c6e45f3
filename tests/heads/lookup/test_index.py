"""heads.lookup.index: the incremental n-gram index, tree proposals against a brute-force reference,
and the padded tensors of a batch of proposals.

The reference (``naive_propose``) scans the raw streams for every occurrence of every suffix,
keeps the last ``max_occurrences`` per n-gram like the index, builds the whole continuation trie
and sorts all of its nodes by the documented tie rule: higher score, then smaller depth, then the
node's first-ranked occurrence (ranks: longest level before the backoff level, sources in order,
most recent first). Scores use the documented formula ``sum_k c_k * (share_k * confidence_k) / N_k``,
so they are compared exactly.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st

from heads.lookup.index import Proposal, Source, SuffixIndex, pad_proposals, propose

VOCAB = 5
SETTINGS = settings(deadline=None, max_examples=100)
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=40)


@dataclass
class Built:
    """An index and the raw streams it was built from, in creation order."""

    index: SuffixIndex
    streams: list[list[int]]
    confidence: float


def build(streams: list[list[int]], confidence: float = 1.0, **options) -> Built:
    index = SuffixIndex(**options)
    for stream in streams:
        index.add_stream(stream)
    return Built(index, [list(s) for s in streams], confidence)


# ----------------------------------------------------------------------------- the naive reference


def naive_occurrences(built: Built, key: tuple[int, ...]) -> list[tuple[int, int]]:
    """Every retained (stream number, following offset) of ``key``, oldest first."""
    index, n = built.index, len(key)
    if not index.min_ngram <= n <= index.max_ngram:
        return []
    found = [(number, end) for number, stream in enumerate(built.streams)
             for end in range(n, len(stream) + 1) if tuple(stream[end - n:end]) == key]
    return found[-index.max_occurrences:]


def naive_found(context, sources: list[Built], n: int, exclude) -> list[tuple[int, list[tuple[int, ...]]]]:
    key = tuple(context[len(context) - n:])
    found = []
    for number, built in enumerate(sources):
        continuations = []
        for stream, end in reversed(naive_occurrences(built, key)):
            continuation = []
            for token in built.streams[stream][end:]:
                if token in exclude:
                    break
                continuation.append(token)
            if continuation:
                continuations.append(tuple(continuation))
        if continuations:
            found.append((number, continuations))
    return found


def naive_select(levels, sources: list[Built], budget: int, max_depth: int) -> list[tuple[tuple[int, ...], float]]:
    classes, nodes, rank = [], {}, 0
    for share, found in levels:
        total = sum(len(c) for _, c in found)
        for number, continuations in found:
            k = len(classes)
            classes.append((share * sources[number].confidence, total))
            for continuation in continuations:
                for depth in range(1, min(len(continuation), max_depth) + 1):
                    node = nodes.setdefault(continuation[:depth], [defaultdict(int), rank])
                    node[0][k] += 1
                rank += 1

    def score(counts) -> float:
        value = 0.0
        for k, (factor, total) in enumerate(classes):
            if counts[k]:
                value += counts[k] * factor / total
        return value

    scored = {path: score(counts) for path, (counts, _) in nodes.items()}
    order = sorted(nodes, key=lambda path: (-scored[path], len(path), nodes[path][1]))
    return [(path, scored[path]) for path in order[:budget]]


def naive_propose(context, sources: list[Built], budget, max_depth, min_match=1, exclude=(), backoff=0.0):
    """``(match length, [(path, score)] in selection order)``."""
    if budget <= 0 or max_depth <= 0 or not context:
        return 0, []
    top = min(len(context), max(b.index.max_ngram for b in sources))
    for length in range(top, min_match - 1, -1):
        found = naive_found(context, sources, length, exclude)
        if found:
            break
    else:
        return 0, []
    chosen = naive_select([(1.0, found)], sources, budget, max_depth)
    if backoff and len(chosen) < budget and length > min_match:
        shorter = naive_found(context, sources, length - 1, exclude)
        if shorter:
            chosen = naive_select([(1.0 - backoff, found), (backoff, shorter)], sources, budget, max_depth)
    return length, chosen


def paths(proposal: Proposal) -> list[tuple[int, ...]]:
    result = []
    for token, parent in zip(proposal.tokens, proposal.parents):
        result.append((result[parent] if parent >= 0 else ()) + (token,))
    return result


# ----------------------------------------------------------------------------- scenarios


@st.composite
def scenarios(draw):
    max_ngram = draw(st.integers(1, 5))
    options = dict(max_ngram=max_ngram, min_ngram=draw(st.sampled_from([1, 1, 1, min(2, max_ngram), max_ngram])),
                   max_occurrences=draw(st.integers(1, 8)))
    row = draw(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=40))
    own_history = draw(st.lists(tokens, max_size=2))
    own = build(own_history + ([row] if draw(st.integers(0, 3)) else []), 1.0, **options)
    sources = [own]
    if draw(st.booleans()):
        corpus_options = dict(options, max_occurrences=draw(st.integers(1, 8)))
        confidence = draw(st.sampled_from([0.8, 0.5, 1.0]))
        sources.insert(draw(st.integers(0, 1)), build(draw(st.lists(tokens, min_size=1, max_size=3)), confidence,
                                                      **corpus_options))
    return dict(context=row, sources=sources, budget=draw(st.integers(1, 20)), max_depth=draw(st.integers(1, 6)),
                min_match=draw(st.sampled_from([1, 1, 1, 2, 3])),
                exclude=draw(st.sets(st.integers(0, VOCAB - 1), max_size=1)),
                backoff=draw(st.sampled_from([0.0, 0.0, 0.25, 0.6])))


def run(scenario) -> Proposal:
    return propose(scenario["context"], [Source(b.index, b.confidence) for b in scenario["sources"]],
                   scenario["budget"], scenario["max_depth"], scenario["min_match"], scenario["exclude"],
                   scenario["backoff"])


@SETTINGS
@given(scenarios())
def test_propose_equals_naive_best_first(scenario):
    proposal = run(scenario)
    length, chosen = naive_propose(scenario["context"], scenario["sources"], scenario["budget"],
                                   scenario["max_depth"], scenario["min_match"], scenario["exclude"],
                                   scenario["backoff"])
    assert proposal.match_length == length
    assert paths(proposal) == [path for path, _ in chosen]
    assert proposal.scores == [score for _, score in chosen]


@SETTINGS
@given(scenarios())
def test_trees_are_well_formed_real_continuations(scenario):
    proposal = run(scenario)
    context, budget, max_depth = scenario["context"], scenario["budget"], scenario["max_depth"]
    assert len(proposal.tokens) == len(proposal.parents) == len(proposal.scores) <= max(budget, 0)
    depths = []
    for i, parent in enumerate(proposal.parents):
        assert -1 <= parent < i
        depths.append(1 if parent < 0 else depths[parent] + 1)
        assert depths[-1] <= max_depth
        assert 0.0 < proposal.scores[i] <= (1.0 if parent < 0 else proposal.scores[parent])
    siblings = [(parent, token) for token, parent in zip(proposal.tokens, proposal.parents)]
    assert len(set(siblings)) == len(siblings)
    root_sum = sum(s for s, p in zip(proposal.scores, proposal.parents) if p < 0)
    assert root_sum <= max(b.confidence for b in scenario["sources"]) + 1e-9
    assert not set(proposal.tokens) & scenario["exclude"]
    if proposal.tokens:
        shortest = proposal.match_length - (1 if scenario["backoff"] else 0)
        key = tuple(context[len(context) - shortest:])
        for path in paths(proposal):
            assert any(tuple(s[end - shortest:end]) == key and tuple(s[end:end + len(path)]) == path
                       for b in scenario["sources"] for s in b.streams for end in range(shortest, len(s)))


def test_first_level_counts_and_own_position():
    index = SuffixIndex(max_ngram=3)
    row = index.add_stream([1, 2, 7, 1, 2, 8, 1, 2, 7, 1, 2])
    proposal = propose(index.tokens(row), [(index, 1.0)], budget=2, max_depth=1)
    # the longest suffix (7, 1, 2) occurs twice: followed by 8, and at the row's own end (no continuation)
    assert proposal.match_length == 3
    assert proposal.tokens == [8] and proposal.scores == [1.0]
    # the row's own end is an occurrence of every suffix but never counts: N excludes it
    only = SuffixIndex()
    row = only.add_stream([5, 5])
    assert propose(only.tokens(row), [(only, 1.0)], 4, 4) == Proposal([5], [-1], [1.0], 1)
    unique = SuffixIndex()
    row = unique.add_stream([0, 1, 2, 3])
    assert propose(unique.tokens(row), [(unique, 1.0)], 4, 4) == Proposal()


def test_counts_scores_and_tie_rule():
    index = SuffixIndex(max_ngram=1)
    row = index.add_stream([0, 3, 0, 4, 0, 3, 0, 4, 0, 5, 0])
    proposal = propose(index.tokens(row), [(index, 1.0)], budget=3, max_depth=1)
    # after 0: 3, 4, 3, 4, 5 -> counts 2, 2, 1 of N = 5; 3 and 4 tie, 4 occurred most recently
    assert proposal.tokens == [4, 3, 5]
    assert proposal.scores == [2 / 5, 2 / 5, 1 / 5]


def test_backoff_interpolates_only_when_short_of_budget():
    index = SuffixIndex(max_ngram=2)
    row = index.add_stream([1, 2, 3, 1, 2, 4, 9, 2, 5, 1, 2])
    context, sources = index.tokens(row), [(index, 1.0)]
    # (1, 2) -> 3, 4 (N = 2); (2,) -> 3, 4, 5 (N = 3)
    assert propose(context, sources, 2, 1, backoff=0.25) == propose(context, sources, 2, 1)  # full: no backoff
    proposal = propose(context, sources, 8, 1, backoff=0.25)
    both = 0.0 + 1 * 0.75 / 2 + 1 * 0.25 / 3
    assert proposal == Proposal([4, 3, 5], [-1, -1, -1], [both, both, 0.0 + 1 * 0.25 / 3], 2)
    assert propose(context, sources, 8, 1, min_match=2, backoff=0.25).tokens == [4, 3]


def test_sources_merge_at_the_longest_length_only():
    own = SuffixIndex()
    row = own.add_stream([1, 2, 3, 9, 1, 2, 3])
    corpus = SuffixIndex()
    corpus.add_stream([1, 2, 3, 4, 1, 2, 3, 4, 2, 3, 5])
    sources = [Source(own, 1.0), Source(corpus, 0.8)]
    proposal = propose(own.tokens(row), sources, budget=4, max_depth=1)
    # (1, 2, 3) -> own: 9 (1 of 1); corpus: 4, 4 (2 of 2): N = 3
    assert proposal.match_length == 3
    assert proposal.tokens == [4, 9]
    assert proposal.scores == [2 * 0.8 / 3, 1 * 1.0 / 3]
    longer = SuffixIndex()
    longer.add_stream([0, 9, 1, 2, 3, 6])
    proposal = propose([0, 9, 1, 2, 3], [Source(own, 1.0), Source(longer, 0.5)], budget=4, max_depth=2)
    assert proposal.match_length == 5 and proposal.tokens == [6] and proposal.scores == [0.5]


def test_exclude_cuts_continuations():
    index = SuffixIndex(max_ngram=2)
    row = index.add_stream([1, 2, 3, 0, 4, 1, 2, 0, 1, 2])
    proposal = propose(index.tokens(row), [(index, 1.0)], budget=8, max_depth=4, exclude={0})
    assert paths(proposal) == [(3,)]  # (1, 2) -> 3 0 ..., 0 ...: the second occurrence has no continuation
    assert proposal.scores == [1.0]


def test_budget_depth_and_argument_errors():
    index = SuffixIndex()
    row = index.add_stream([1, 2, 1, 2, 1, 2])
    assert propose(index.tokens(row), [(index, 1.0)], 0, 4) == Proposal()
    assert propose(index.tokens(row), [(index, 1.0)], 4, 0) == Proposal()
    assert propose([], [(index, 1.0)], 4, 4) == Proposal()
    for bad in (dict(min_match=0), dict(backoff=1.0), dict(backoff=-0.1)):
        with pytest.raises(ValueError):
            propose(index.tokens(row), [(index, 1.0)], 4, 4, **bad)
    with pytest.raises(ValueError):
        propose(index.tokens(row), [(index, 1.5)], 4, 4)
    for bad in (dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_occurrences=0), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SuffixIndex(**bad)


# ----------------------------------------------------------------------------- the index


def table_by_stream_order(index: SuffixIndex) -> dict:
    order = {stream: number for number, stream in enumerate(index.streams)}
    return {key: [(order[s], end) for s, end in bucket] for key, bucket in index._table.items()}


@SETTINGS
@given(st.lists(tokens, min_size=1, max_size=3), st.data(), st.integers(1, 4), st.integers(1, 6))
def test_incremental_extend_equals_scratch_and_naive(streams, data, max_ngram, max_occurrences):
    options = dict(max_ngram=max_ngram, max_occurrences=max_occurrences)
    incremental = SuffixIndex(**options)
    for stream in streams:
        ident = incremental.add_stream()
        cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
        for start, stop in zip([0] + cuts, cuts + [len(stream)]):
            incremental.extend(ident, stream[start:stop])
    scratch = build(streams, **options)
    assert table_by_stream_order(incremental) == table_by_stream_order(scratch.index)
    assert len(incremental) == sum(map(len, streams))
    assert [incremental.tokens(s) for s in incremental.streams] == streams
    for key, bucket in table_by_stream_order(incremental).items():
        assert len(bucket) <= max_occurrences
        assert bucket == naive_occurrences(scratch, key)
    for n in range(1, max_ngram + 1):  # every n-gram of every stream is indexed
        for stream in streams:
            for end in range(n, len(stream) + 1):
                assert tuple(stream[end - n:end]) in incremental._table


@SETTINGS
@given(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30), min_size=1, max_size=6),
       st.integers(5, 60))
def test_max_tokens_evicts_oldest_streams(streams, max_tokens):
    index = SuffixIndex(max_ngram=3, max_occurrences=1000, max_tokens=max_tokens)
    created = []
    for stream in streams:
        created.append(index.add_stream(stream))
        live = index.streams
        assert live == created[len(created) - len(live):]  # the newest streams survive
        assert live[-1] == created[-1]
        assert len(index) == sum(len(index.tokens(s)) for s in live)
        assert len(index) <= max_tokens or live == [created[-1]]
        remaining = [index.tokens(s) for s in live]
        assert table_by_stream_order(index) == table_by_stream_order(build(remaining, max_ngram=3).index)
        assert all(s in index for bucket in index._table.values() for s, _ in bucket)


def test_drop_stream_and_clear():
    streams = [[1, 2, 3, 1, 2], [2, 3, 4], [1, 2, 3, 5]]
    index = build(streams).index
    first, middle, last = index.streams
    index.drop_stream(middle)
    assert middle not in index and index.streams == [first, last]
    assert table_by_stream_order(index) == table_by_stream_order(build([streams[0], streams[2]]).index)
    assert propose([2, 3], [(index, 1.0)], 4, 1).tokens == [5, 1]
    with pytest.raises(KeyError):
        index.drop_stream(middle)
    with pytest.raises(KeyError):
        index.extend(middle, [1])
    index.extend(last, index.tokens(last))  # a stream extended by itself doubles once
    assert index.tokens(last) == streams[2] * 2 and len(index) == len(streams[0]) + 2 * len(streams[2])
    index.clear()
    assert len(index) == 0 and index.streams == [] and index._table == {}
    assert index.add_stream([1]) == last + 1  # ids are never reused


# ----------------------------------------------------------------------------- pad_proposals


@st.composite
def proposals(draw):
    size = draw(st.integers(0, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(size)]
    scores = [draw(st.floats(0.01, 1.0)) for _ in range(size)]
    return Proposal(draw(st.lists(st.integers(1, 50), min_size=size, max_size=size)), parents, scores, 1)


def naive_ancestors(parents: list[int]) -> torch.Tensor:
    """``[n, n]``: ``[i, j]`` when ``j`` is ``i`` or an ancestor, from tree parents (-1 at the root)."""
    sees = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            sees[i, j] = True
            j = parents[j]
    return sees


def check_row(batch: dict, r: int, root: int, proposal: Proposal) -> None:
    size, width = 1 + len(proposal), batch["tokens"].shape[1]
    parents = [-1] + [p + 1 for p in proposal.parents]
    assert batch["sizes"][r].item() == size
    assert batch["tokens"][r].tolist() == [root, *proposal.tokens] + [0] * (width - size)
    assert batch["parents"][r].tolist() == parents + [-1] * (width - size)
    depths = [0]
    for parent in parents[1:]:
        depths.append(depths[parent] + 1)
    assert batch["depths"][r].tolist() == depths + [0] * (width - size)
    expected = torch.eye(width, dtype=torch.bool)
    expected[:size, :size] = naive_ancestors(parents)
    assert torch.equal(batch["visibility"][r], expected)  # padding sees itself only, nothing sees it


@SETTINGS
@given(st.lists(proposals(), min_size=1, max_size=5), st.data())
def test_pad_proposals_matches_naive_and_rows_are_independent(batch_proposals, data):
    roots = data.draw(st.lists(st.integers(0, 50), min_size=len(batch_proposals), max_size=len(batch_proposals)))
    batch = pad_proposals(roots, batch_proposals)
    rows, width = len(roots), 1 + max(len(p) for p in batch_proposals)
    shapes = dict(tokens=(rows, width), parents=(rows, width), depths=(rows, width), sizes=(rows,),
                  visibility=(rows, width, width))
    assert {k: tuple(v.shape) for k, v in batch.items()} == shapes
    assert batch["visibility"].dtype == torch.bool
    assert all(batch[k].dtype == torch.long for k in ("tokens", "parents", "depths", "sizes"))
    for r, (root, proposal) in enumerate(zip(roots, batch_proposals)):
        check_row(batch, r, root, proposal)
        alone = pad_proposals([root], [proposal])
        size = 1 + len(proposal)
        for name in ("tokens", "parents", "depths"):
            assert torch.equal(alone[name][0], batch[name][r, :size])
        assert torch.equal(alone["visibility"][0], batch["visibility"][r, :size, :size])


def test_pad_proposals_wide_trees_and_errors():
    chain = Proposal(list(range(1, 101)), list(range(-1, 99)), [0.5] * 100, 3)
    bushy = Proposal([7] * 70, [-1] * 35 + list(range(35)), [0.25] * 70, 2)
    batch = pad_proposals([11, 12, 13], [chain, bushy, Proposal()])
    assert batch["tokens"].shape == (3, 101)
    for r, (root, proposal) in enumerate(zip([11, 12, 13], [chain, bushy, Proposal()])):
        check_row(batch, r, root, proposal)
    empty = pad_proposals([], [])
    assert empty["visibility"].shape == (0, 1, 1) and empty["sizes"].shape == (0,)
    with pytest.raises(ValueError):
        pad_proposals([1], [Proposal([1, 2], [-1, 1], [0.5, 0.5], 1)])
    with pytest.raises(ValueError):
        pad_proposals([1, 2], [Proposal()])


def test_proposals_feed_pad_proposals():
    index = SuffixIndex()
    rows = [index.add_stream(s) for s in ([1, 2, 3, 1, 2, 4, 1, 2], [3, 3, 3], [9])]
    props = [propose(index.tokens(r), [(index, 1.0)], 6, 3) for r in rows]
    batch = pad_proposals([index.tokens(r)[-1] for r in rows], props)
    for r, proposal in enumerate(props):
        check_row(batch, r, index.tokens(rows[r])[-1], proposal)
