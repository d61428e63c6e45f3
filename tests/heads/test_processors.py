"""Context-dependent logits processors (repetition penalty, n-gram bans, minimum lengths, suppressed
tokens): each vectorised processor equals transformers' own class applied sequence by sequence, and
greedy speculative generation with them is token-identical to ``model.generate`` on several
families, drafter kinds and left-padded batches."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor,
)

import heads
from heads.processors import GenerateProcessors, context_processors, no_repeat_ngram, repetition_penalty
from tests.conftest import build_model, left_pad, random_prompt
from tree_attention.context import FILL, Contexts

VOCAB = 40
WIDTH = 5  # padded prompt width of the crafted contexts


def _contexts(seed: int = 0, count: int = 12, alphabet: int = 6) -> tuple[Contexts, list[torch.Tensor], list[int]]:
    """Crafted right-aligned contexts: sequences of WIDTH prompt columns (some left padding) plus 0-9
    new tokens drawn from a small alphabet (so n-grams repeat); also each sequence and its padding."""
    generator = torch.Generator().manual_seed(seed)
    sequences, paddings = [], []
    for _ in range(count):
        length = WIDTH + int(torch.randint(0, 10, (1,), generator=generator))
        sequence = torch.randint(0, alphabet, (length,), generator=generator)
        padding = int(torch.randint(0, 3, (1,), generator=generator))
        sequence[:padding] = 0
        sequences.append(sequence)
        paddings.append(padding)
    longest = max(len(sequence) for sequence in sequences)
    ids = torch.full((count, longest), FILL, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, longest - len(sequence):] = sequence
    lengths = torch.tensor([len(sequence) for sequence in sequences])
    starts = longest - lengths + torch.tensor(paddings)
    return Contexts(ids, lengths, starts, WIDTH), sequences, paddings


def _one_by_one(processor_for, sequences, scores) -> torch.Tensor:
    return torch.cat([processor_for(index)(sequence[None], scores[index:index + 1].clone())
                      for index, sequence in enumerate(sequences)])


@pytest.mark.parametrize("penalty", [1.3, 0.6])
def test_repetition_penalty_is_transformers_own(penalty):
    contexts, sequences, paddings = _contexts()
    scores = torch.randn(len(sequences), VOCAB, generator=torch.Generator().manual_seed(1))
    expected = _one_by_one(lambda index: RepetitionPenaltyLogitsProcessor(
        penalty, prompt_ignore_length=torch.tensor([paddings[index]])), sequences, scores)
    assert torch.equal(repetition_penalty(contexts, scores, penalty), expected)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_no_repeat_ngram_is_transformers_own(size):
    contexts, sequences, _ = _contexts(seed=size, count=24, alphabet=3)
    scores = torch.randn(len(sequences), VOCAB, generator=torch.Generator().manual_seed(2))
    expected = _one_by_one(lambda index: NoRepeatNGramLogitsProcessor(size), sequences, scores)
    actual = no_repeat_ngram(contexts, scores, size)
    assert torch.equal(actual, expected)
    assert bool(torch.isinf(actual).any())  # the crafted contexts do repeat n-grams


def test_lengths_and_suppression_are_transformers_own():
    from transformers import GenerationConfig

    contexts, sequences, _ = _contexts(seed=5)
    scores = torch.randn(len(sequences), VOCAB, generator=torch.Generator().manual_seed(3))
    eos = [2, 7]
    config = GenerationConfig(repetition_penalty=1.2, no_repeat_ngram_size=2, min_new_tokens=4,
                              suppress_tokens=[9, 11], begin_suppress_tokens=[3, 4])
    expected = []
    for index, sequence in enumerate(sequences):
        row = scores[index:index + 1].clone()
        padding = int(contexts.starts[index] - (contexts.ids.shape[1] - contexts.lengths[index]))
        for processor in (RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=torch.tensor([padding])),
                          NoRepeatNGramLogitsProcessor(2), MinLengthLogitsProcessor(WIDTH + 4, eos),
                          MinNewTokensLengthLogitsProcessor(WIDTH, 4, eos), SuppressTokensLogitsProcessor([9, 11]),
                          SuppressTokensAtBeginLogitsProcessor([3, 4], WIDTH)):
            row = processor(sequence[None], row)
        expected.append(row)
    actual = GenerateProcessors(config, frozenset(eos), WIDTH)(contexts, scores)
    assert torch.equal(actual, torch.cat(expected))
    short = contexts.lengths < WIDTH + 4
    assert bool(short.any()) and bool((~short).any()) and bool((contexts.lengths == WIDTH).any())


def test_nothing_set_means_no_processing():
    model = build_model("llama")
    assert context_processors(model.generation_config, frozenset({2}), 7) is None
    config = model.generation_config
    config.repetition_penalty, config.min_new_tokens = 1.0, 0
    assert context_processors(config, frozenset({2}), 7) is None
    config.min_new_tokens = 3
    assert context_processors(config, frozenset(), 7) is None  # no eos: generate adds no length processor


@pytest.mark.parametrize("settings, message", [
    (dict(repetition_penalty=2), "repetition_penalty must be a float > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be a float > 0"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be an int >= 0"),
    (dict(min_new_tokens=1.5), "min_new_tokens must be an int >= 0"),
    (dict(suppress_tokens=[1, "a"]), "suppress_tokens must be a list of token ids"),
])
def test_bad_processor_settings_name_the_field(settings, message):
    model = build_model("llama")
    spec = heads.attach_heads(model, kind="lookup", tree=4)
    with pytest.raises(ValueError, match=message):
        spec.generate(random_prompt(5, seed=0), max_new_tokens=4, **settings)


KINDS = {
    "lookup": dict(kind="lookup", tree=8, history_tokens=0),
    "medusa": dict(kind="medusa", num_heads=3, tree=16),
    "eagle": dict(kind="eagle", depth=3, top_k=2, total_tokens=8),
}
NEW = 24


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts that repeat themselves (lookup drafts get accepted)."""
    prompts = [random_prompt(length, seed=length).repeat(1, 2)[0] for length in (3, 6, 5)]
    return left_pad(prompts)


def _cases(model, ids, mask) -> list[dict]:
    """Settings that change the greedy output of this model on this batch."""
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)[:, ids.shape[1]:]
    eos = int(free[0, 2])  # an early token of row 0: min lengths must hold it back
    seen = list(dict.fromkeys(free[0, :6].tolist()))
    return [
        dict(repetition_penalty=1.3), dict(repetition_penalty=0.6), dict(no_repeat_ngram_size=2),
        dict(no_repeat_ngram_size=3), dict(min_new_tokens=10, eos_token_id=eos),
        dict(min_length=ids.shape[1] + 8, eos_token_id=eos), dict(suppress_tokens=seen[:3]),
        dict(begin_suppress_tokens=free[:, 0].tolist()),
        dict(repetition_penalty=1.2, no_repeat_ngram_size=3, min_new_tokens=6, eos_token_id=eos,
             suppress_tokens=seen[:1]),
    ]


@pytest.mark.parametrize("name, kind", [(name, kind) for name in ("llama", "gpt2", "mistral")
                                         for kind in ("lookup", "medusa")] + [("llama", "eagle")])
def test_greedy_parity_with_processors(name, kind):
    model = build_model(name, seed=3)
    spec = heads.attach_heads(model, **KINDS[kind])
    ids, mask = _batch()
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    accepted = 0
    for settings in _cases(model, ids, mask):
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **settings)
        assert not torch.equal(expected, free), settings  # the setting bites
        actual = spec.generate(ids, attention_mask=mask, max_new_tokens=NEW, **settings)
        assert torch.equal(actual, expected), settings
        accepted += sum(spec.last_stats.accepted_lengths)
        if name == "llama" and kind == "medusa":  # batch 1 as well (no padding)
            row = ids[1:2, int((mask[1] == 0).sum()):]
            one = model.generate(row, attention_mask=torch.ones_like(row), do_sample=False, max_new_tokens=NEW,
                                 **settings)
            assert torch.equal(spec.generate(row, max_new_tokens=NEW, **settings), one), settings
    if kind != "eagle":  # an untrained EAGLE drafter rarely guesses right on a random model
        assert accepted > 0, "no draft was accepted: the processors never met a tree"
