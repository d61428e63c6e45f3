"""Speculative sampling with context-dependent processors follows ``model.generate``'s distribution:
the exact law of the first three tokens is enumerated with transformers' own processor classes
applied to every prefix, then the warpers; seeded speculative runs are compared with it by a
chi-square test. A rule that processes each node's logits with its parent's sequence (one token
short) is caught."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
)

from heads.generation import resolve_sampling, warper
from tests.heads.test_sampling import PROMPT, VOCAB, model, sample_runs, spec  # noqa: F401 (fixtures)
from tests.stats import FALSE_ALARM, chi_square_pvalue
from tree_attention.context import FILL, ContextTracker, Contexts

SAMPLING = dict(temperature=1.0, top_k=0)
EOS = 15  # after 3 5 7 9 the toy target's likely third token
CASES = {
    "repetition_penalty": (dict(repetition_penalty=0.2), lambda: [RepetitionPenaltyLogitsProcessor(0.2)]),
    "min_new_tokens": (dict(min_new_tokens=2, eos_token_id=EOS),
                       lambda: [MinNewTokensLengthLogitsProcessor(PROMPT.shape[1], 2, EOS)]),
}


@torch.no_grad()
def exact_joint(model, processors: LogitsProcessorList) -> dict:
    """P(x1, x2, x3 | PROMPT) under ``generate``'s processors and warpers."""
    warp = warper(*resolve_sampling(model.generation_config, SAMPLING["temperature"], SAMPLING["top_k"], None))

    def probs(sequences):
        logits = model(sequences).logits[:, -1].float()
        return torch.softmax(warp(processors(sequences, logits)), -1)

    first = probs(PROMPT)[0]
    singles = torch.arange(VOCAB)[:, None]
    second = probs(torch.cat([PROMPT.expand(VOCAB, -1), singles], 1))  # (V, V)
    pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))
    third = probs(torch.cat([PROMPT.expand(VOCAB * VOCAB, -1), pairs], 1)).view(VOCAB, VOCAB, VOCAB)
    joint = first[:, None, None] * second[:, :, None] * third
    return {(a, b, c): float(joint[a, b, c]) for a, b, c in itertools.product(range(VOCAB), repeat=3)}


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_with_processors_matches_generate(model, spec, case):  # noqa: F811
    settings, processors = CASES[case]
    spec.set_tree(16)
    samples = sample_runs(spec, runs=600, **SAMPLING, **settings)
    pvalue = chi_square_pvalue(samples, exact_joint(model, LogitsProcessorList(processors())))
    assert pvalue > FALSE_ALARM, pvalue


def _parent_contexts(original):
    """The wrong rule: each node's logits processed with its parent's sequence (its own token left out)."""

    def nodes(self, rows, trees) -> Contexts:
        contexts = original(self, rows, trees)
        ids = torch.cat([torch.full_like(contexts.ids[:, :1], FILL), contexts.ids[:, :-1]], dim=1)
        return Contexts(ids, contexts.lengths - 1, contexts.starts + 1, contexts.prompt_width)

    return nodes


@pytest.mark.parametrize("case", list(CASES))
def test_processing_with_the_parents_sequence_is_caught(model, spec, case, monkeypatch):  # noqa: F811
    settings, processors = CASES[case]
    monkeypatch.setattr(ContextTracker, "nodes", _parent_contexts(ContextTracker.nodes))
    spec.set_tree(16)
    samples = sample_runs(spec, runs=300, **SAMPLING, **settings)
    pvalue = chi_square_pvalue(samples, exact_joint(model, LogitsProcessorList(processors())))
    assert pvalue < FALSE_ALARM, pvalue
