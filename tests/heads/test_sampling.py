"""Speculative sampling on a real (tiny, 16-token) model follows the target's distribution exactly.

The target is a tiny Llama trained on noisy progressions (its distributions are peaked but spread,
top-1 about 0.7) with briefly trained Medusa heads, so drafts are accepted often and the
acceptance rule, not just the bonus token, decides the output.

The target's distribution of the first three generated tokens is computed exactly by enumerating
all 16 x 16 prefixes (with the same warpers ``generate`` uses); thousands of seeded speculative runs
are compared with it by a chi-square test at false-alarm rate 1e-3.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import heads
from heads.generation import resolve_sampling, warper
from tests.conftest import greedy_reference, left_pad, progression_batch, train_toy_target
from training.online import learn
from training.trainer import TrainConfig, kind_trainer, make_trainer
from tests.stats import FALSE_ALARM, chi_square_pvalue
from tree_attention.verify import SamplingRule

MedusaTrainer = kind_trainer("medusa")  # what make_trainer builds for a Medusa spec

VOCAB = 16
PROMPT = torch.tensor([[3, 5, 7, 9]])
RUNS = 1000


@pytest.fixture(scope="module")
def model():
    return train_toy_target(vocab=VOCAB, noise=0.2)


@pytest.fixture(scope="module")
def spec(model):
    spec = heads.attach_heads(model, num_heads=2, tree=16)
    generator = torch.Generator().manual_seed(7)
    sequences = [progression_batch(1, 24, generator, VOCAB, 0.2)[0] for _ in range(64)]
    MedusaTrainer(spec, sequences, TrainConfig(steps=40, batch_size=8, learning_rate=1e-2, warmup_steps=5),
                  progress=False).train()
    return spec


@torch.no_grad()
def exact_joint(model, temperature=1.0, top_k=None, top_p=None) -> dict:
    """P(x1, x2, x3 | PROMPT) under the warped target."""
    warp = warper(*resolve_sampling(model.generation_config, temperature, top_k, top_p))
    probs = lambda sequences: torch.softmax(warp(model(sequences).logits[:, -1].float()), -1)
    first = probs(PROMPT)[0]
    pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=1)))
    second = probs(torch.cat([PROMPT.expand(VOCAB, -1), pairs], 1))  # (V, V)
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))
    third = probs(torch.cat([PROMPT.expand(VOCAB * VOCAB, -1), prefixes], 1)).view(VOCAB, VOCAB, VOCAB)
    joint = first[:, None, None] * second[:, :, None] * third
    return {(a, b, c): float(joint[a, b, c]) for a, b, c in itertools.product(range(VOCAB), repeat=3)}


def sample_runs(spec, runs=RUNS, seed=0, **settings) -> list[tuple[int, int, int]]:
    generator = torch.Generator().manual_seed(seed)
    samples, accepted = [], 0
    for _ in range(runs):
        output = spec.generate(PROMPT, max_new_tokens=3, do_sample=True, generator=generator, **settings)
        samples.append(tuple(output[0, -3:].tolist()))
        accepted += sum(spec.last_stats.accepted_lengths)
    assert accepted > runs * 0.1, "drafts were almost never accepted: the test would not exercise the rule"
    return samples


CASES = [
    pytest.param(dict(temperature=1.0, top_k=0), 0, id="chain-T1"),
    pytest.param(dict(temperature=0.7, top_k=8), 16, id="tree16-T0.7-topk8"),
    pytest.param(dict(temperature=1.5, top_k=0, top_p=0.9), 8, id="tree8-T1.5-topp0.9"),
]


@pytest.mark.parametrize("settings, tree", CASES)
def test_speculative_sampling_matches_the_target(model, spec, settings, tree):
    spec.set_tree(tree if tree else [(0,), (0, 0)])
    samples = sample_runs(spec, **settings)
    pvalue = chi_square_pvalue(samples, exact_joint(model, **settings))
    assert pvalue > FALSE_ALARM, pvalue


def test_a_wrong_rule_is_caught(model, spec, monkeypatch):
    settings = dict(temperature=1.0, top_k=0)
    original = SamplingRule.__init__

    def no_residual(self, warp, generator=None, use_residual=True):
        original(self, warp, generator, use_residual=False)

    monkeypatch.setattr(SamplingRule, "__init__", no_residual)
    spec.set_tree(16)
    pvalue = chi_square_pvalue(sample_runs(spec, **settings), exact_joint(model, **settings))
    assert pvalue < FALSE_ALARM, pvalue


def test_seeded_sampling_is_reproducible(model):
    spec = heads.attach_heads(model, tree=8)
    run = lambda: spec.generate(PROMPT, max_new_tokens=12, do_sample=True, temperature=0.9,
                                generator=torch.Generator().manual_seed(11))
    assert torch.equal(run(), run())


def test_typical_is_opt_in_and_plain_sampling_at_a_huge_threshold(model, spec):
    spec.set_tree(16)
    generator = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(RUNS):
        output = spec.generate(PROMPT, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0,
                               generator=generator, acceptance="typical", posterior_threshold=1e9,
                               posterior_alpha=1e9)
        assert sum(spec.last_stats.accepted_lengths) == 0
        samples.append(tuple(output[0, -3:].tolist()))
    assert chi_square_pvalue(samples, exact_joint(model, 1.0, 0, None)) > FALSE_ALARM


def test_greedy_unchanged(model, spec):
    spec.set_tree(16)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=20), greedy_reference(model, PROMPT, 20))


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(acceptance="nucleus"), "acceptance must be one of"),
])
def test_bad_sampling_arguments(model, settings, message):
    spec = heads.attach_heads(model)
    with pytest.raises(ValueError, match=message):
        spec.generate(PROMPT, do_sample=True, **settings)


def test_typical_needs_sampling(model):
    with pytest.raises(ValueError, match="needs do_sample=True"):
        heads.attach_heads(model).generate(PROMPT, acceptance="typical")


def test_processors_speculation_does_not_reproduce_are_refused(model):
    """Context-dependent processors are honoured (tests/heads/test_processors*.py); the others are refused."""
    spec = heads.attach_heads(model)
    model.generation_config.sequence_bias = {(5,): 2.0}
    try:
        with pytest.raises(NotImplementedError, match="sequence_bias"):
            spec.generate(PROMPT)
    finally:
        model.generation_config.sequence_bias = None


def test_unset_top_k_resolves_like_generate(model):
    assert resolve_sampling(model.generation_config, 1.0, None, None) == (1.0, 50, 1.0)
    model.generation_config.top_k = 5
    try:
        assert resolve_sampling(model.generation_config, 0.5, None, None) == (0.5, 5, 1.0)
    finally:
        model.generation_config.top_k = None


def _distilled(spec, seed: int):
    """``spec`` after 60 steps of distillation on 64 noisy progressions drawn with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    sequences = [progression_batch(1, 24, generator, VOCAB, 0.2)[0] for _ in range(64)]
    make_trainer(spec, sequences, TrainConfig(steps=60, batch_size=8, learning_rate=3e-3, warmup_steps=5),
                 progress=False).train()
    return spec


@pytest.fixture(scope="module")
def eagle_spec(model):
    torch.manual_seed(3)
    return _distilled(heads.attach_heads(model, kind="eagle", depth=3, top_k=2, total_tokens=6), seed=8)


def test_eagle_speculative_sampling_matches_the_target(model, eagle_spec):
    """The EAGLE drafter's dynamic trees go through the same lossless rule."""
    settings = dict(temperature=0.8, top_k=0)
    pvalue = chi_square_pvalue(sample_runs(eagle_spec, **settings), exact_joint(model, **settings))
    assert pvalue > FALSE_ALARM, pvalue


def test_eagle_greedy_unchanged(model, eagle_spec):
    assert torch.equal(eagle_spec.generate(PROMPT, max_new_tokens=20), greedy_reference(model, PROMPT, 20))


def batched_samples(spec, runs: int = RUNS, rows: int = 8, seed: int = 0, **settings) -> list[tuple[int, int, int]]:
    """``runs`` samples from batched runs of ``rows`` copies of PROMPT, each left-padded by 2 tokens."""
    ids, mask = left_pad([PROMPT[0]] * rows, width=PROMPT.shape[1] + 2)
    generator = torch.Generator().manual_seed(seed)
    samples, accepted = [], 0
    for _ in range(runs // rows):
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, generator=generator,
                               **settings)
        samples += [tuple(row) for row in output[:, -3:].tolist()]
        accepted += sum(spec.last_stats.accepted_lengths)
    assert accepted > runs * 0.1, "drafts were almost never accepted: the test would not exercise the rule"
    return samples


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_batched_sampling_matches_the_target_in_every_row(model, spec, eagle_spec, kind):
    """Rows of a padded batch accept independently; each still samples the target's distribution."""
    settings = dict(temperature=0.7, top_k=8)
    chosen = spec if kind == "medusa" else eagle_spec
    if kind == "medusa":
        chosen.set_tree(16)
    pvalue = chi_square_pvalue(batched_samples(chosen, **settings), exact_joint(model, **settings))
    assert pvalue > FALSE_ALARM, pvalue


def auto_samples(spec, runs=RUNS, **settings) -> list[tuple[int, int, int]]:
    """Samples of ``speculate="auto"`` calls of 3 tokens whose planner, at every step, takes a plain
    step or drafts at one of the drafter's sizes, at random (from its own generator): whatever a planner decides
    from the past, the output must follow the target's distribution."""
    from heads.adaptive import CallPlanner, Choice

    choices = torch.Generator().manual_seed(12)

    def random_plan(self, rows):
        pick = int(torch.randint(len(self.options) + 1, (1,), generator=choices))
        if pick == 0:
            return Choice(False, reason="test")
        mode, size = self.options[pick - 1]
        return Choice(True, mode, size, nodes=4, reason="test")

    samples, kinds = [], set()
    original = CallPlanner._plan
    CallPlanner._plan = random_plan
    try:
        for _ in range(runs):
            output = spec.generate(PROMPT, max_new_tokens=3, do_sample=True, speculate="auto", **settings)
            kinds.update(step.kind for step in spec.last_stats.steps)
            samples.append(tuple(output[0, -3:].tolist()))
    finally:
        CallPlanner._plan = original
    assert {"plain", "drafted"} <= kinds, kinds
    return samples


def test_sampling_matches_the_target_while_the_drafter_learns(model, spec):
    """Online learning (training/online.py) changes the drafter between calls, never within one: every
    call still samples the target (1000 samples over 125 calls, the drafter updated after each)."""
    learning = heads.attach_heads(model, num_heads=2, tree=16)
    learning.heads.load_state_dict(spec.heads.state_dict())
    learner = learn(learning, budget=1.0, batch_size=4, held_out=2, hold_every=4, steps_per_update=1,
                    tolerance=1e9)  # every update kept: the drafter keeps changing
    settings = dict(temperature=1.0, top_k=0)
    samples = batched_samples(learning, **settings)
    assert learner.kept >= 20, learner.summary()
    assert chi_square_pvalue(samples, exact_joint(model, **settings)) > FALSE_ALARM


@pytest.mark.parametrize("kind", ["medusa", "eagle", "draft"])
def test_auto_steps_sample_the_target(model, spec, eagle_spec, kind, monkeypatch):
    """Plain steps and drafted steps of every size, mixed per step by the planner, follow the target's
    distribution (the drafter sees a plain step's tokens at its next call; a resized drafter keeps
    its state; the draft kind drafts every step the planner asks for, its own chain lengths within).
    The draft kind's chain lengths follow its prices, which follow wall-clock timings: here the prices
    are drawn from a seeded generator instead, so the lengths still vary step by step and the samples
    are fixed by the seeds (the test passes or fails the same way on every run)."""
    settings = dict(temperature=0.7, top_k=8)
    if kind == "draft":
        from heads.draft.calibration import ChainCosts
        from tests.heads.draft.test_draft_kind import noisy_copy
        prices = torch.Generator().manual_seed(13)
        monkeypatch.setattr(ChainCosts, "prices", lambda self: tuple((torch.rand(2, generator=prices) * torch.tensor(
            [0.6, 0.3])).tolist()))  # (draft forward, verified node) in tokens
        monkeypatch.setattr(ChainCosts, "jump_price", lambda self: float(torch.rand(1, generator=prices)) * 0.5)
        chosen = heads.attach_heads(model, kind="draft", draft_model=noisy_copy(model))
    else:
        chosen = spec if kind == "medusa" else eagle_spec
    if kind == "medusa":
        chosen.set_tree(16)
    torch.manual_seed(5)
    pvalue = chi_square_pvalue(auto_samples(chosen, **settings), exact_joint(model, **settings))
    assert pvalue > FALSE_ALARM, pvalue



def test_a_wrong_plain_step_draw_is_caught(model, spec, monkeypatch):
    """The same test fails when a plain step draws from the unwarped distribution."""
    settings = dict(temperature=0.5, top_k=0)

    def unwarped(self, logits, batch_rows=None, positions=None):
        return torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=self.generator)[:, 0]

    monkeypatch.setattr(SamplingRule, "first_tokens", unwarped)
    spec.set_tree(16)
    pvalue = chi_square_pvalue(auto_samples(spec, **settings), exact_joint(model, **settings))
    assert pvalue < FALSE_ALARM, pvalue


@pytest.fixture(scope="module", params=["heads", "mask"])
def parallel_eagle_spec(model, request):
    torch.manual_seed(4)
    spec = heads.attach_heads(model, kind="eagle", parallel=3, drafting="auto", depth=3, top_k=2, total_tokens=6,
                              parallel_mode=request.param)
    return _distilled(spec, seed=9)


@pytest.mark.parametrize("wrong", [False, True], ids=["rule", "no-residual"])
def test_parallel_drafting_under_sampling_matches_the_target(model, parallel_eagle_spec, monkeypatch, wrong):
    """A sampled call of a ``drafting="auto"`` drafter may draft in parallel (its top-k tokens, point
    masses to the rule): still the target's law, batched and padded; skipping the residual is caught."""
    from heads.eagle import switch

    monkeypatch.setattr(switch.CallModeChoice, "choose", lambda self: "parallel")
    if wrong:
        original = SamplingRule.__init__
        monkeypatch.setattr(SamplingRule, "__init__", lambda self, warp, generator=None, use_residual=True:
                            original(self, warp, generator, use_residual=False))
    settings = dict(temperature=0.8, top_k=0)
    pvalue = chi_square_pvalue(batched_samples(parallel_eagle_spec, runs=2 * RUNS, **settings),
                               exact_joint(model, **settings))
    assert parallel_eagle_spec.drafter.parallel.cache is parallel_eagle_spec.drafter.sequential.cache
    assert (pvalue < FALSE_ALARM) if wrong else (pvalue > FALSE_ALARM), pvalue


def seeded_runs(spec, runs=RUNS, first_seed=0, batch=False, **settings) -> list[tuple[int, int, int]]:
    """Samples of seeded calls (``seed=``, one seed per call, so the calls are independent draws);
    ``batch``: 8 padded copies of PROMPT per call, each row its own seed."""
    ids, mask = left_pad([PROMPT[0]] * 8, width=PROMPT.shape[1] + 2) if batch else (PROMPT, None)
    rows = ids.shape[0]
    samples, accepted = [], 0
    for call in range(runs // rows):
        seeds = list(range(first_seed + call * rows, first_seed + (call + 1) * rows))
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True,
                               seed=seeds if batch else seeds[0], **settings)
        samples += [tuple(row) for row in output[:, -3:].tolist()]
        accepted += sum(spec.last_stats.accepted_lengths)
    assert accepted > runs * 0.1, "drafts were almost never accepted: the test would not exercise the rule"
    return samples


@pytest.mark.parametrize("settings, tree", CASES)
def test_seeded_sampling_matches_the_target(model, spec, settings, tree):
    """Gumbel-max sampling on the counter-based stream, verified by the greedy walk on perturbed
    logits, samples the target's distribution (a seed per call)."""
    spec.set_tree(tree if tree else [(0,), (0, 0)])
    pvalue = chi_square_pvalue(seeded_runs(spec, first_seed=1000, **settings), exact_joint(model, **settings))
    assert pvalue > FALSE_ALARM, pvalue


def test_seeded_batched_and_eagle_sampling_match_the_target(model, spec, eagle_spec):
    settings = dict(temperature=0.7, top_k=8)
    spec.set_tree(16)
    pvalue = chi_square_pvalue(seeded_runs(spec, first_seed=5000, batch=True, **settings),
                               exact_joint(model, **settings))
    assert pvalue > FALSE_ALARM, pvalue
    settings = dict(temperature=0.8, top_k=0)
    pvalue = chi_square_pvalue(seeded_runs(eagle_spec, first_seed=9000, **settings), exact_joint(model, **settings))
    assert pvalue > FALSE_ALARM, pvalue


@pytest.mark.parametrize("wrong", ["one-noise-per-row", "noise-before-warp"])
def test_a_wrong_seeded_rule_is_caught(model, spec, monkeypatch, wrong):
    """The same test fails when every position of a row reuses one noise vector (positions left
    out of the key: draws correlate across positions), or when the noise is added before the
    temperature (a sample of the unwarped distribution)."""
    from tree_attention import gumbel

    settings = dict(temperature=1.0 if wrong == "one-noise-per-row" else 0.5, top_k=0)
    if wrong == "one-noise-per-row":
        original = gumbel.gumbel_noise
        monkeypatch.setattr(gumbel, "gumbel_noise", lambda keys, positions, tokens:
                            original(keys, torch.zeros_like(positions), tokens))
    else:
        original = gumbel.perturbed_argmax
        monkeypatch.setattr(gumbel, "perturbed_argmax", lambda warped, keys, positions, **blocks:
                            original(warped * settings["temperature"], keys, positions, **blocks))
    spec.set_tree(16)
    pvalue = chi_square_pvalue(seeded_runs(spec, first_seed=1000, **settings), exact_joint(model, **settings))
    assert pvalue < FALSE_ALARM, pvalue


@pytest.fixture(scope="module")
def eagle3_chain_spec(model):
    torch.manual_seed(5)
    spec = heads.attach_heads(model, kind="eagle", layout="eagle3", feature_layers=(0, 1, 2), depth=3, top_k=1,
                              total_tokens=3, min_acceptance=0)
    return _distilled(spec, seed=10)


@pytest.mark.parametrize("wrong", [False, True], ids=["rule", "no-residual"])
def test_eagle3_chain_sampling_matches_the_target(model, eagle3_chain_spec, monkeypatch, wrong):
    """Sampled chains of the EAGLE-3 midlayer, drafted through its lean forward (one query a level:
    the float16 copies on a CPU), keep the target's law; skipping the residual is caught."""
    assert eagle3_chain_spec.heads._lean is not None
    if wrong:
        original = SamplingRule.__init__
        monkeypatch.setattr(SamplingRule, "__init__", lambda self, warp, generator=None, use_residual=True:
                            original(self, warp, generator, use_residual=False))
    settings = dict(temperature=0.8, top_k=0)
    pvalue = chi_square_pvalue(sample_runs(eagle3_chain_spec, **settings), exact_joint(model, **settings))
    assert (pvalue < FALSE_ALARM) if wrong else (pvalue > FALSE_ALARM), pvalue
    assert torch.equal(eagle3_chain_spec.generate(PROMPT, max_new_tokens=20), greedy_reference(model, PROMPT, 20))
