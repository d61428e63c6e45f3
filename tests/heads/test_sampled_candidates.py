"""Sampled candidates for Medusa and EAGLE (``sample="auto"``): under lossless sampling each node's
children are drawn without replacement from the drafter's warped distribution and carry it as
``draft_probs``; the output still follows the target's distribution exactly.

Same set-up as ``test_sampling.py``: a tiny 16-token target trained on noisy progressions, briefly
trained Medusa heads and EAGLE drafter, the target's exact law of the first three generated tokens
by enumeration, and a chi-square test at false-alarm rate 1e-3 over 1000 samples from padded
batches of 8 prompt copies. Drafts come from a flatter q than p (:func:`hot_drafts`), and every case
is also run with a wrong rule (no residual; rows that are not the q drawn from), which the same test
must reject. ``test_sampling.py`` runs the unheated drafters (sampled by default) at batch 1 and 8
with top-k and top-p warps.
"""

from __future__ import annotations

import pytest
import torch

import heads
import tree_attention.verify as verify
from heads.generation import acceptance_rule
from heads.eagle import EagleDrafter
from heads.medusa import MedusaDrafter
from tests.conftest import greedy_reference, left_pad, progression_batch, train_toy_target
from tests.heads.test_sampling import PROMPT, VOCAB, exact_joint
from tests.stats import FALSE_ALARM, chi_square_pvalue
from training.trainer import TrainConfig, make_trainer
from tree_attention.draft_batch import DraftBatch
from tree_attention.verify import SamplingRule

RUNS, ROWS = 1000, 8
CHAIN = [(0,), (0, 0)]
WIDE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]  # three children at the root, two below the first
CORPUS = [[3, 5, 7, 9, 11, 13, 15, 1, 3, 5], [9, 11, 12, 14, 0]]  # lookup continuations of the prompt


def trained(spec, steps: int, learning_rate: float, seed: int):
    generator = torch.Generator().manual_seed(seed)
    sequences = [progression_batch(1, 24, generator, VOCAB, 0.2)[0] for _ in range(64)]
    make_trainer(spec, sequences, TrainConfig(steps=steps, batch_size=8, learning_rate=learning_rate,
                                              warmup_steps=5), progress=False).train()
    return spec


@pytest.fixture(scope="module")
def model():
    return train_toy_target(vocab=VOCAB, noise=0.2)


@pytest.fixture(scope="module")
def medusa(model):
    torch.manual_seed(2)
    return trained(heads.attach_heads(model, num_heads=2, tree=WIDE), 40, 1e-2, 7)


@pytest.fixture(scope="module")
def medusa_draft_vocab(model):
    """Medusa heads scoring a draft vocabulary of half the tokens (chosen from the training data):
    q has no probability elsewhere, which the rule must handle (the target's p does)."""
    torch.manual_seed(4)
    return trained(heads.attach_heads(model, num_heads=2, tree=WIDE, draft_vocab_size=VOCAB // 2), 40, 1e-2, 7)


@pytest.fixture(scope="module")
def eagle(model):
    torch.manual_seed(3)
    return trained(heads.attach_heads(model, kind="eagle", depth=3, top_k=2, total_tokens=4), 60, 3e-3, 8)


@pytest.fixture(scope="module")
def block(model):
    """A block drafter (EAGLE ``parallel_mode="block"``): its children come from the sequential head."""
    torch.manual_seed(3)
    return trained(heads.attach_heads(model, kind="eagle", parallel=3, parallel_mode="block", depth=3, top_k=2,
                                      total_tokens=4, sample="auto"), 60, 3e-3, 8)


def configure(spec, shape):
    """``spec`` drafting ``shape`` (Medusa: a choice list; EAGLE: depth/top_k/total_tokens), or
    with lookup continuations from :data:`CORPUS` merged in (``"hybrid"``, Medusa's wide tree)."""
    spec.set_lookup(corpus=CORPUS) if shape == "hybrid" else spec.set_lookup(False)
    stops = {}
    if isinstance(shape, dict):  # a chain that stops where the drafter is unsure (raw or calibrated)
        shape = dict(shape)
        stops = {name: shape.pop(name) for name in ("confidence", "min_acceptance") if name in shape}
    spec.set_tree(WIDE if shape == "hybrid" else shape)
    for name, value in stops.items():
        setattr(spec.drafter, name, value)
    return spec


def samples(spec, settings: dict, runs: int = RUNS, seed: int = 0) -> list[tuple[int, int, int]]:
    """First three new tokens of ``runs`` sequences from batches of ROWS left-padded PROMPT copies."""
    ids, mask = left_pad([PROMPT[0]] * ROWS, width=PROMPT.shape[1] + 2)
    generator = torch.Generator().manual_seed(seed)
    found, accepted = [], 0
    for _ in range(runs // ROWS):
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, generator=generator,
                               **settings)
        found += [tuple(row) for row in output[:, -3:].tolist()]
        accepted += sum(spec.last_stats.accepted_lengths)
    drafter = getattr(spec.drafter, "base", spec.drafter)
    assert drafter.sampling, "generate did not bind the drafter to sampled candidates"
    assert accepted > runs * 0.3, "drafts were seldom accepted: the test would not exercise the rule"
    return found


CASES = [
    pytest.param("medusa", CHAIN, dict(temperature=1.0, top_k=0), id="medusa-chain-T1"),
    pytest.param("medusa", WIDE, dict(temperature=1.0, top_k=0), id="medusa-tree-T1"),
    pytest.param("medusa", "hybrid", dict(temperature=1.0, top_k=0), id="medusa-lookup-hybrid-T1"),
    pytest.param("medusa_draft_vocab", WIDE, dict(temperature=1.0, top_k=0), id="medusa-draft-vocab-tree-T1"),
    pytest.param("eagle", dict(depth=3, top_k=1, total_tokens=3), dict(temperature=1.0, top_k=0),
                 id="eagle-chain-T1"),
    pytest.param("eagle", dict(depth=3, top_k=2, total_tokens=4), dict(temperature=1.0, top_k=0),
                 id="eagle-tree-T1"),
    pytest.param("eagle", dict(depth=3, top_k=1, total_tokens=3, confidence=0.3), dict(temperature=1.0, top_k=0),
                 id="eagle-chain-confidence-T1"),
    pytest.param("eagle", dict(depth=3, top_k=1, total_tokens=3, min_acceptance=0.2), dict(temperature=1.0, top_k=0),
                 id="eagle-chain-calibrated-T1"),
    pytest.param("block", dict(depth=3, top_k=1, total_tokens=3), dict(temperature=1.0, top_k=0), id="block-chain-T1"),
    pytest.param("block", dict(depth=3, top_k=2, total_tokens=4), dict(temperature=1.0, top_k=0), id="block-tree-T1"),
]
HEAT = 2.0


@pytest.fixture
def hot_drafts(monkeypatch):
    """Drafts drawn from a flatter q than the target's p (the drafter's warped logits / HEAT): still
    lossless when q is carried, and far enough from p that a wrong rule shows (the trained drafters
    are so close to p on this toy task that their rejections, and so the residual, are rare)."""
    for drafter in (MedusaDrafter, EagleDrafter):
        original = drafter.sample_with
        monkeypatch.setattr(drafter, "sample_with", lambda self, warp, generator, original=original: original(
            self, None if warp is None else (lambda logits: warp(logits) / HEAT), generator))


@pytest.mark.parametrize("kind, shape, settings", CASES)
def test_sampled_candidates_keep_the_target_law(model, hot_drafts, kind, shape, settings, request):
    spec = configure(request.getfixturevalue(kind), shape)
    proposed, propose = [], spec.drafter.propose
    spec.drafter.propose = lambda batch: proposed.append(propose(batch)) or proposed[-1]
    pvalue = chi_square_pvalue(samples(spec, settings), exact_joint(model, **settings))
    assert pvalue > FALSE_ALARM, pvalue
    assert all(trees.draft_probs is not None for trees in proposed)
    if shape == "hybrid":  # lookup continuations (point masses) were merged into the sampled trees
        assert any(trees.width > len(WIDE) + 1 for trees in proposed)
    if isinstance(shape, dict) and shape.get("min_acceptance"):  # the calibration stopped some chains early
        sizes = {int(size) for trees in proposed for size in trees.sizes}
        assert len(sizes) > 1 and max(sizes) == shape["depth"] + 1, sizes


def no_residual(monkeypatch):
    original = SamplingRule.__init__
    monkeypatch.setattr(SamplingRule, "__init__", lambda self, warp, generator=None, use_residual=True:
                        original(self, warp, generator, use_residual=False))


def wrong_q(monkeypatch):
    """Rows that are not what the candidates were drawn from: q sharpened (squared, renormalised)."""
    def sharpen(original):
        def sharpened(tree, probs, generator=None, draft_probs=None, use_residual=True, **options):
            rows = draft_probs.double() ** 2
            rows = rows / rows.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            return original(tree, probs, generator, rows, use_residual, **options)
        return sharpened

    monkeypatch.setattr(verify, "sample_accept", sharpen(verify.sample_accept))
    monkeypatch.setattr(verify, "sample_accept_batch", sharpen(verify.sample_accept_batch))


WRONG_CASES = [pytest.param(no_residual, *case.values, id=f"no-residual-{case.id}") for case in CASES]
WRONG_CASES += [pytest.param(wrong_q, *CASES[index].values, id=f"wrong-q-{CASES[index].id}") for index in (1, 3, 4, 5, 6, 9)]


@pytest.mark.parametrize("wrong, kind, shape, settings", WRONG_CASES)
def test_a_wrong_rule_is_caught(model, hot_drafts, wrong, kind, shape, settings, monkeypatch, request):
    """Note that verifying sampled candidates as point masses (accept with r(x)) is *not* wrong:
    a candidate drawn independently of the target is a fixed token given the drafter's draws."""
    spec = configure(request.getfixturevalue(kind), shape)
    wrong(monkeypatch)  # twice the samples: some wrong rules here are only a little off the target law
    pvalue = chi_square_pvalue(samples(spec, settings, runs=2 * RUNS), exact_joint(model, **settings))
    assert pvalue < FALSE_ALARM, pvalue


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_seeded_runs_reproduce_and_greedy_is_unchanged(model, medusa, eagle, kind):
    spec = configure(medusa if kind == "medusa" else eagle, WIDE if kind == "medusa" else {})
    run = lambda seed: spec.generate(PROMPT, max_new_tokens=12, do_sample=True, temperature=0.9,
                                     generator=torch.Generator().manual_seed(seed))
    first = run(11)
    assert spec.drafter.sampling
    assert torch.equal(first, run(11))
    assert any(not torch.equal(first, run(seed)) for seed in (12, 13, 14))
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=20), greedy_reference(model, PROMPT, 20))
    assert not spec.drafter.sampling  # greedy drafts the top-k tokens


def draft_batch(spec, rows: int = 3) -> DraftBatch:
    generator = torch.Generator().manual_seed(4)
    features = torch.randn(rows, 2, spec.target.hidden_size, generator=generator)
    return DraftBatch(features, torch.zeros(rows, 2, dtype=torch.long), torch.tensor([2, 1, 2][:rows]),
                      torch.tensor([3, 4, 5][:rows]))


def test_medusa_sampled_tree_rows_and_the_never_option(model, medusa):
    """``sample="never"`` (and greedy, typical) keep the heads' top-k tokens; sampled trees keep the
    template's shape and carry, per node, q without its earlier siblings, renormalised."""
    sampling = acceptance_rule(model.generation_config, True, 0.8, 0, None, torch.Generator().manual_seed(0))
    greedy = acceptance_rule(model.generation_config, False, 1.0, None, None, None)
    typical = acceptance_rule(model.generation_config, True, 0.8, 0, None, None, acceptance="typical")
    bind = heads.kinds.get("medusa").bind_rule
    medusa.set_lookup(False)
    topk = MedusaDrafter(medusa.heads, medusa.drafter_for(WIDE).template, sample="never")
    batch = draft_batch(medusa)
    expected = topk.propose(batch)
    for rule in (sampling, greedy, typical):
        trees = bind(topk, rule).propose(batch)
        assert not topk.sampling and trees.draft_probs is None and torch.equal(trees.tokens, expected.tokens)
    auto = bind(medusa.drafter_for(WIDE), sampling)
    assert auto.sampling and not bind(medusa.drafter_for(WIDE), typical).sampling
    trees = auto.propose(batch)
    assert torch.equal(trees.parents, expected.parents) and trees.draft_probs.shape == (3, len(WIDE) + 1, VOCAB)
    last = batch.features[torch.arange(3), batch.lengths - 1]
    q = torch.softmax(medusa.heads(last)[trees.depths[0, 1:] - 1].transpose(0, 1) / 0.8, dim=-1)  # (R, N-1, V)
    for row in range(3):
        for node in range(1, trees.width):
            siblings = [other for other in range(1, node) if trees.parents[row, other] == trees.parents[row, node]]
            rest = q[row, node - 1].clone()
            rest[trees.tokens[row, siblings]] = 0.0
            assert torch.allclose(trees.draft_probs[row, node], rest / rest.sum(), atol=1e-6)
    with pytest.raises(ValueError, match="MedusaConfig.sample must be one of"):
        heads.attach_heads(model, sample="sometimes")


def test_eagle_never_option(model, eagle):
    never = heads.attach_heads(model, kind="eagle", depth=3, top_k=2, total_tokens=4, sample="never")
    never.heads.load_state_dict(eagle.heads.state_dict())
    never.generate(PROMPT, max_new_tokens=4, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert not never.drafter.sampling
    assert never.config.to_dict()["sample"] == "never"
    with pytest.raises(ValueError, match="EagleConfig.sample must be one of"):
        heads.attach_heads(model, kind="eagle", sample="sometimes")
