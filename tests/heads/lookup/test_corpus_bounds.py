"""The lookup corpus under its own bound (issue 36 item 8): indexed in one vectorised pass
(:class:`heads.lookup.CorpusIndex`, the same occurrences as a ``SuffixIndex``), never evicted by
request traffic, truncated with a logged warning beyond ``corpus_tokens``."""

from __future__ import annotations

import logging

import numpy
import pytest
import torch
from hypothesis import given, settings, strategies as st

import heads
import heads.lookup.corpus as corpus_module
from heads.lookup import CorpusIndex, LookupConfig, LookupMemory, SuffixIndex, propose
from tests.conftest import build_model, greedy_reference, random_prompt


def _ngrams(streams, max_ngram):
    return {tuple(stream[end - n:end]) for stream in streams for end in range(1, len(stream) + 1)
            for n in range(1, min(max_ngram, end) + 1)}


def _same_as_suffix_index(streams, max_ngram, max_occurrences, depth):
    reference = SuffixIndex(max_ngram, 1, max_occurrences)
    for stream in streams:
        reference.add_stream(stream)
    index = CorpusIndex(streams, max_ngram, max_occurrences)
    assert len(index) == len(reference)
    for ngram in _ngrams(streams, max_ngram) | {(1,) * max_ngram, (10 ** 9,)}:
        assert index.continuations(ngram, depth) == reference.continuations(ngram, depth), ngram
    return index


@settings(max_examples=60, deadline=None)
@given(streams=st.lists(st.lists(st.integers(0, 5), max_size=40), min_size=1, max_size=5),
       max_ngram=st.integers(1, 5), max_occurrences=st.integers(1, 4), depth=st.integers(1, 6))
def test_corpus_index_matches_the_incremental_index(streams, max_ngram, max_occurrences, depth):
    _same_as_suffix_index(streams, max_ngram, max_occurrences, depth)


@pytest.mark.parametrize("multiplier", [corpus_module._HASH_MULTIPLIER, 0])
def test_hashed_keys_are_checked_against_the_tokens(monkeypatch, multiplier):
    """Ids of 20 bits: 4-grams do not fit 64 bits and are hashed; multiplier 0 makes every 4-gram
    with the same last token collide, and the tokens still decide."""
    monkeypatch.setattr(corpus_module, "_HASH_MULTIPLIER", multiplier)
    generator = numpy.random.default_rng(0)
    alphabet = generator.integers(1 << 19, 1 << 20, size=6)
    streams = [alphabet[generator.integers(0, 6, size=length)].tolist() for length in (60, 45, 1, 30)]
    index = _same_as_suffix_index(streams, 4, 3, 5)
    assert not index._packed(4) and index._packed(3)


def test_propose_is_the_same_from_either_index():
    generator = numpy.random.default_rng(1)
    streams = [generator.integers(0, 7, size=length).tolist() for length in (80, 50, 120)]
    reference = SuffixIndex(4, 1, 8)
    for stream in streams:
        reference.add_stream(stream)
    index = CorpusIndex(streams, 4, 8)
    for context in ([1, 2, 3], [4], [6, 6, 5, 1], [0, 2]):
        expected = propose(context, [(reference, 0.8)], 12, 6)
        assert propose(context, [(index, 0.8)], 12, 6) == expected


def test_the_index_memory_is_bounded_per_token():
    tokens = numpy.random.default_rng(2).integers(0, 32000, size=200_000)
    index = CorpusIndex([tokens[:150_000], tokens[150_000:]], max_ngram=4)
    assert index.nbytes <= (4 + 12 * 4) * len(index) + 1024


def test_traffic_never_evicts_the_corpus():
    """A corpus of more tokens than history_tokens was kept whole, then evicted by the first
    request: lookup matched request text only from then on."""
    model = build_model("qwen2", seed=8)
    prompt = random_prompt(10, seed=9)
    expected = greedy_reference(model, prompt, 20)
    corpus = [expected[0].tolist(), random_prompt(300, seed=4)[0].tolist()]
    spec = heads.attach_heads(model, kind="lookup", tree=10, corpus=corpus, history_tokens=50)
    other = random_prompt(12, seed=5)
    assert torch.equal(spec.generate(other, max_new_tokens=30), greedy_reference(model, other, 30))
    assert len(spec.heads.corpus) == sum(len(sequence) for sequence in corpus)
    assert torch.equal(spec.generate(prompt, max_new_tokens=20), expected)
    assert spec.last_stats.accepted_lengths[0] == 10  # the corpus' continuation, a whole chain at once


def test_a_corpus_beyond_its_bound_is_truncated_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="heads.lookup.drafter"):
        memory = LookupMemory(LookupConfig(corpus=[list(range(3, 63)), list(range(3, 43))], corpus_tokens=70))
    assert len(memory.corpus) == 70
    assert "100 tokens exceed corpus_tokens=70; indexing the first 70" in caplog.text
    with caplog.at_level(logging.WARNING, logger="heads.lookup.drafter"):
        memory.add_corpus([[5, 6, 7]])
    assert len(memory.corpus) == 70 and "73 tokens exceed corpus_tokens=70" in caplog.text


def test_the_corpus_has_its_own_bound():
    memory = LookupMemory(LookupConfig(corpus=[[5, 6, 7, 5, 6]], history_tokens=0))  # no traffic history
    assert memory.history is None and len(memory.corpus) == 5
    with pytest.raises(ValueError, match="corpus_tokens=0"):
        LookupConfig(corpus=[[5, 6]], corpus_tokens=0)
    with pytest.raises(ValueError, match="corpus_tokens must be an int >= 0"):
        LookupConfig(corpus_tokens=-1)
    with pytest.raises(ValueError, match=r"corpus\[0\] holds negative"):
        LookupConfig(corpus=[[5, -6]])
    assert LookupConfig().to_dict()["corpus_tokens"] == 4_000_000
