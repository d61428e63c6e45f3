"""Seeded sampling (``generate(seed=...)``) gives one text per (prompt, settings, seed): the text a
plain sequential Gumbel-max sampler gives with the same noise, whatever the drafter kind, its
history, the tree size, ``speculate="auto"`` and the row's place in a batch.

The reference below is written from the definition: one backbone forward per token over the whole
sequence, transformers' own processors and warpers, then the argmax of the warped logits plus the
noise of (row key, position, token). Its distribution is checked in tests/heads/test_sampling.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

import heads
from tests.conftest import left_pad, train_toy_target
from tree_attention import gumbel
from tree_attention.gumbel import gumbel_noise, row_keys

NEW = 24
SETTINGS = dict(temperature=0.8, top_k=20, top_p=0.95)


@pytest.fixture(scope="module")
def model():
    return train_toy_target(steps=120, noise=0.1)


@pytest.fixture(scope="module")
def draft_model():
    return train_toy_target(steps=40, seed=1, noise=0.1)


@torch.no_grad()
def reference(model, prompt: torch.Tensor, seed: int, new: int = NEW, temperature=0.8, top_k=20, top_p=0.95,
              repetition_penalty=None) -> list[int]:
    """Sequential Gumbel-max sampling of ``new`` tokens after ``prompt`` ``[T]`` (no padding)."""
    key = row_keys([seed], prompt[None])
    processors = [RepetitionPenaltyLogitsProcessor(repetition_penalty)] if repetition_penalty else []
    processors.append(TemperatureLogitsWarper(temperature))
    processors += [TopKLogitsWarper(top_k)] if top_k else []
    processors += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    ids = prompt[None]
    for _ in range(new):
        scores = model(ids).logits[:, -1].float()
        for processor in processors:
            scores = processor(ids, scores)
        noise = gumbel_noise(key, torch.tensor([ids.shape[1]]), torch.arange(scores.shape[-1]))
        ids = torch.cat([ids, (scores.double() + noise).argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.numel():].tolist()


def repeating(length: int, seed: int) -> torch.Tensor:
    """A prompt ``[length * 2 + 3]`` that repeats itself, so lookup drafts from it."""
    piece = torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([piece, piece, piece[:3]])


def _specs(model, draft_model) -> dict:
    return {
        "medusa": heads.attach_heads(model, kind="medusa", num_heads=3, tree=8),
        "eagle": heads.attach_heads(model, kind="eagle", depth=4, top_k=2, total_tokens=8),
        "lookup": heads.attach_heads(model, kind="lookup", budget=6),
        "medusa+lookup": heads.attach_heads(model, kind="medusa", num_heads=3, tree=8, lookup={"budget": 4}),
        "draft": heads.attach_heads(model, kind="draft", draft_model=draft_model, depth=3, total_tokens=3),
    }


SMALL_TREE = {"medusa": 2, "eagle": 2, "lookup": 2, "medusa+lookup": 2, "draft": 1}


@pytest.mark.parametrize("kind", list(SMALL_TREE))
def test_same_seed_same_text_whatever_drafts(model, draft_model, kind):
    """Every kind, at its configured tree, a small tree and ``speculate="auto"``, after calls that
    filled lookup's history with other text, gives the reference's text for each seed."""
    spec = _specs(model, draft_model)[kind]
    prompt = repeating(6, seed=1)
    accepted = 0
    for seed in (0, 1, 2):
        expected = reference(model, prompt, seed)
        for tree, speculate in ((None, None), (SMALL_TREE[kind], None), (None, "auto")):
            spec.set_tree(tree)
            spec.generate(repeating(5, seed=10 + seed)[None], max_new_tokens=NEW, do_sample=True, seed=seed + 5,
                          **SETTINGS)  # other text first: lookup's history changes
            output = spec.generate(prompt[None], max_new_tokens=NEW, do_sample=True, seed=seed,
                                   speculate=speculate, **SETTINGS)
            assert output[0, prompt.numel():].tolist() == expected, (kind, seed, tree, speculate)
            accepted += sum(spec.last_stats.accepted_lengths)
    if kind != "eagle":  # (untrained EAGLE heads rarely draft the target's choice)
        assert accepted > 0, "no draft was ever accepted: the rule's walk was not exercised"


@pytest.mark.parametrize("walk", [False, True], ids=["draws-at-every-node", "draws-where-the-walk-goes"])
def test_the_row_place_in_a_batch_does_not_matter(model, walk, monkeypatch):
    monkeypatch.setattr(gumbel, "LAZY_ELEMENTS", 0 if walk else gumbel.LAZY_ELEMENTS)
    spec = heads.attach_heads(model, kind="medusa", num_heads=3, tree=8, lookup={"budget": 4})
    prompt = repeating(6, seed=3)
    others = [repeating(4, seed=4), repeating(7, seed=5)]
    expected = reference(model, prompt, 9)
    for rows in ([prompt, *others], [*others, prompt], [others[0], prompt]):
        ids, mask = left_pad(rows)
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, seed=9, **SETTINGS)
        place = next(index for index, row in enumerate(rows) if row is prompt)
        assert output[place, ids.shape[1]:].tolist() == expected
        for index, row in enumerate(rows):  # the other rows are their own references
            assert output[index, ids.shape[1]:].tolist() == reference(model, row, 9)


def test_one_seed_per_row(model):
    """The same prompt twice gives the same text under one seed, different texts under two."""
    spec = heads.attach_heads(model, kind="lookup", budget=6)
    prompt = repeating(6, seed=6)
    ids = prompt[None].repeat(2, 1)
    same = spec.generate(ids, max_new_tokens=NEW, do_sample=True, seed=4, temperature=1.0, top_k=0)
    assert torch.equal(same[0], same[1])
    two = spec.generate(ids, max_new_tokens=NEW, do_sample=True, seed=[4, 5], temperature=1.0, top_k=0)
    assert torch.equal(two[0], same[0])
    assert two[1, prompt.numel():].tolist() == reference(model, prompt, 5, temperature=1.0, top_k=0, top_p=1.0)
    assert not torch.equal(two[0], two[1])


def test_processors_apply_before_the_noise(model):
    spec = heads.attach_heads(model, kind="medusa", num_heads=3, tree=8)
    prompt = repeating(6, seed=7)
    output = spec.generate(prompt[None], max_new_tokens=NEW, do_sample=True, seed=3, repetition_penalty=1.3,
                           **SETTINGS)
    assert output[0, prompt.numel():].tolist() == reference(model, prompt, 3, repetition_penalty=1.3)


def test_seed_arguments_are_checked(model):
    spec = heads.attach_heads(model, kind="lookup")
    prompt = repeating(4, seed=8)[None]
    with pytest.raises(ValueError, match="not both"):
        spec.generate(prompt, do_sample=True, seed=1, generator=torch.Generator().manual_seed(1))
    with pytest.raises(TypeError, match="seed must be"):
        spec.generate(prompt, do_sample=True, seed="1")
    with pytest.raises(ValueError, match="one seed per row"):
        spec.generate(prompt, do_sample=True, seed=[1, 2])
    with pytest.raises(ValueError, match="acceptance='typical'"):
        spec.generate(prompt, do_sample=True, seed=1, acceptance="typical")


def test_the_backbones_own_generate_with_the_plain_processor(model):
    """The bound rule as a logits processor for greedy ``model.generate`` commits the same tokens
    (what a call that hands plain decoding to the backbone must use), padded rows included."""
    from heads.generation import acceptance_rule

    prompts = [repeating(6, seed=11), repeating(4, seed=12)]
    ids, mask = left_pad(prompts)
    rule = acceptance_rule(model.generation_config, True, 0.8, 20, 0.95, None, seed=2).for_prompts(ids, mask)
    output = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                            logits_processor=[rule.plain_processor(mask)])
    for row, prompt in enumerate(prompts):
        assert output[row, ids.shape[1]:].tolist() == reference(model, prompt, 2)


def test_medusa_couples_its_candidates_to_the_seeded_noise(model):
    """Under seeded sampling Medusa's candidates at depth d are its head's tokens ranked by warped
    logits plus the target's noise at position root + d (among the head's 32 best), not its top-k;
    under unseeded sampling and greedy decoding they are not coupled."""
    from heads.generation import acceptance_rule
    from tree_attention.draft_batch import DraftBatch

    spec = heads.attach_heads(model, kind="medusa", num_heads=3, tree=8)
    prompts = torch.stack([repeating(4, seed=1), repeating(4, seed=2)])
    rule = acceptance_rule(model.generation_config, True, seed=7, generator=None, **SETTINGS)
    rule = rule.for_prompts(prompts, None)
    drafter = spec._bind(spec._drafter, rule)
    assert drafter.coupled is rule
    features = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    batch = DraftBatch(features, torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 2]), torch.tensor([5, 9]),
                       torch.tensor([14, 20]), (1, 0))
    trees = drafter.propose(batch)
    with torch.no_grad():
        logits = drafter.heads(features[torch.arange(2), batch.lengths - 1], drafter.shared_logits, count=3)
    positions = torch.tensor([[14], [20]]) + torch.arange(1, 4)[None, :]
    expected = rule.coupled_pool(logits.transpose(0, 1), (1, 0), positions, drafter.top_k, 32)  # (R, depth, k)
    template = drafter.template
    for node in range(1, template.size):
        depth, rank = int(template.depths[node]), int(template.ranks[node])
        assert torch.equal(trees.tokens[:, node], expected[:, depth - 1, rank]), node
    top_k = torch.topk(logits, drafter.top_k, dim=-1).indices.transpose(0, 1)
    assert not torch.equal(expected, top_k)  # the noise reorders
    unseeded = acceptance_rule(model.generation_config, True, generator=None, **SETTINGS).for_prompts(prompts, None)
    assert spec._bind(spec._drafter, unseeded).coupled is None
    assert spec._bind(spec._drafter, acceptance_rule(model.generation_config, False, None, None, None,
                                                     None)).coupled is None


@pytest.mark.parametrize("options", [dict(depth=4, top_k=2, total_tokens=8), dict(depth=3, top_k=1, total_tokens=3)],
                         ids=["tree", "chain"])
def test_eagle_couples_its_children_to_the_seeded_noise(model, monkeypatch, options):
    """Under seeded sampling EAGLE's children (dynamic trees and chains) are ranked by the noise at
    their own positions: every level asks the rule for coupled candidates, at the roots' position
    plus the children's depth, and the text is the reference's; greedy and unseeded calls are not
    coupled."""
    from heads.generation import acceptance_rule
    from tree_attention.gumbel import GumbelRule

    spec = heads.attach_heads(model, kind="eagle", **options)
    prompt = repeating(6, seed=1)
    asked = []
    original = GumbelRule.coupled_pool

    def recording(self, draft_logits, batch_rows, positions, count, pool, token_ids=None):
        asked.append(positions[:, 0].tolist())
        return original(self, draft_logits, batch_rows, positions, count, pool, token_ids)

    monkeypatch.setattr(GumbelRule, "coupled_pool", recording)
    output = spec.generate(prompt[None], max_new_tokens=NEW, do_sample=True, seed=4, **SETTINGS)
    assert output[0, prompt.numel():].tolist() == reference(model, prompt, 4)
    assert asked and asked[0] == [prompt.numel() + 1]  # the first tree's depth-1 children, after the root
    assert all(min(positions) > prompt.numel() for positions in asked)
    rule = acceptance_rule(model.generation_config, True, generator=None, **SETTINGS).for_prompts(prompt[None], None)
    assert spec._bind(spec._drafter, rule).coupled is None
    greedy = acceptance_rule(model.generation_config, False, None, None, None, None)
    assert spec._bind(spec._drafter, greedy).coupled is None
