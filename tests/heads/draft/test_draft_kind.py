"""Kind ``draft`` end to end: a separate small causal LM drafts chains and dynamic trees.

Greedy parity with ``model.generate`` on every family, with three drafts each: the target itself
(every drafted token is accepted, which pins down the draft cache's bookkeeping: a row that kept a
stale or missing entry would draft something else), a noisy copy of the target (partial acceptance:
rejected expansions must leave the draft cache) and a 1-layer model of the family with other
weights; left-padded batches with a row ending early at eos; eos inside an accepted chain; exact
``max_new_tokens``; lossless sampling, for top-k (point-mass) candidates through
``spec.generate`` and for sampled chains (draft probabilities, min(1, p/q) and the residual) through
the decode loop, each with a negative control; the vocabulary checks.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import heads
from heads.draft import DraftModelDrafter, bind_rule
from heads.generation import acceptance_rule, resolve_sampling, warper
from tests.conftest import ARCHITECTURES, build_model, left_pad, random_prompt, train_toy_target
from tests.stats import FALSE_ALARM, chi_square_pvalue
from tree_attention.decode import speculative_generate
from tree_attention.verify import SamplingRule

CHAIN = dict(depth=4, top_k=1, total_tokens=4, adaptive=False)  # a fixed chain (the default adapts: test_adaptive_chain.py)
TREE = dict(depth=3, top_k=2, total_tokens=6)


def reference(model, ids, mask, max_new_tokens) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)


def noisy_copy(model, scale: float = 0.2, seed: int = 0):
    """The target with Gaussian noise (``scale`` x each tensor's std) on every weight."""
    generator = torch.Generator().manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in draft.parameters():
            spread = parameter.std() if parameter.numel() > 1 else 1.0
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * spread)
    return draft


def shallow_model(model, seed: int = 1):
    """A 1-layer model of ``model``'s family and vocabulary with other random weights."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    torch.manual_seed(seed)
    draft = type(model)(config)
    draft.set_attn_implementation(model.config._attn_implementation)
    return draft.eval()


# ------------------------------------------------------------------------------ greedy, batch 1


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_parity_every_architecture(name):
    model = build_model(name)
    prompt = random_prompt(9, seed=0)
    expected = reference(model, prompt, torch.ones_like(prompt), 36)
    # the target as its own draft: a chain of 4 is accepted whole at every step (36 = 1 + 7 x 5)
    spec = heads.attach_heads(model, kind="draft", draft_model=model, **CHAIN)
    assert torch.equal(spec.generate(prompt, max_new_tokens=36), expected), name
    stats = spec.last_stats
    assert stats.accepted_lengths == [4] * 7 and stats.mean_accepted == 4.5, stats.accepted_lengths
    assert not model.training  # generate restores the (shared) model's mode
    # the same as a tree: the draft's best child of every root is the target's choice
    spec.set_tree(TREE)
    assert torch.equal(spec.generate(prompt, max_new_tokens=36), expected), name
    assert min(spec.last_stats.accepted_lengths[:-1]) >= 1
    for draft, shape in ((noisy_copy(model), TREE), (shallow_model(model), CHAIN)):
        spec = heads.attach_heads(model, kind="draft", draft_model=draft, **shape)
        assert torch.equal(spec.generate(prompt, max_new_tokens=36), expected), (name, shape)


def test_a_noisy_draft_is_accepted_in_part():
    """Rejections at every depth happen (so rejected expansions really leave the draft cache)."""
    model = build_model("llama")
    prompt = random_prompt(9, seed=0)
    spec = heads.attach_heads(model, kind="draft", draft_model=noisy_copy(model, 0.15), **CHAIN)
    assert torch.equal(spec.generate(prompt, max_new_tokens=60), reference(model, prompt, torch.ones_like(prompt), 60))
    lengths = set(spec.last_stats.accepted_lengths)
    assert lengths == {0, 1, 2, 3, 4}, lengths


def first_new_token_at(model, prompt, at_least: int, length: int = 30):
    """Index and value of the first greedy token at index >= ``at_least`` not seen before it."""
    free = reference(model, prompt, torch.ones_like(prompt), length)[0, prompt.shape[1]:].tolist()
    return next(((i, free[i]) for i in range(at_least, len(free)) if free[i] not in free[:i]), None)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_eos_inside_an_accepted_chain(name):
    """The target drafting for itself with a chain of 8: the first step accepts a path through eos."""
    model, found = None, None
    for seed in range(20):
        model, prompt = build_model(name, seed=seed), random_prompt(7, seed=seed)
        found = first_new_token_at(model, prompt, at_least=3)
        if found and found[0] < 8:
            break
    stop, eos = found
    spec = heads.attach_heads(model, kind="draft", draft_model=model, depth=8, total_tokens=8, adaptive=False)
    model.generation_config.eos_token_id = eos
    expected = reference(model, prompt, torch.ones_like(prompt), 30)
    actual = spec.generate(prompt, max_new_tokens=30)
    assert torch.equal(actual, expected), name
    assert actual.shape[1] == prompt.shape[1] + stop + 1 and int(actual[0, -1]) == eos
    assert spec.last_stats.target_forwards == 2 and spec.last_stats.accepted_lengths[0] >= stop


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 5, 13])
def test_max_new_tokens_is_exact(max_new_tokens):
    model = build_model("qwen2", seed=3)
    prompt = random_prompt(8, seed=4)
    spec = heads.attach_heads(model, kind="draft", draft_model=model, **CHAIN)
    actual = spec.generate(prompt, max_new_tokens=max_new_tokens)
    assert actual.shape[1] == prompt.shape[1] + max_new_tokens
    if max_new_tokens:
        assert torch.equal(actual, reference(model, prompt, torch.ones_like(prompt), max_new_tokens))


# ------------------------------------------------------------------------------ padded batches


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_batched_greedy_parity(name):
    """Four left-padded prompts of different lengths; row 1 ends early at eos (the drafter retires
    it); equal to ``model.generate`` on the same batch and to each row alone."""
    model = build_model(name, seed=1)
    generator = torch.Generator().manual_seed(2)
    ids, mask = left_pad([torch.randint(3, 96, (length,), generator=generator) for length in (5, 11, 8, 2)])
    model.generation_config.eos_token_id = int(reference(model, ids, mask, 5)[1, ids.shape[1] + 4])
    for shape in (CHAIN, TREE):
        spec = heads.attach_heads(model, kind="draft", draft_model=noisy_copy(model, 0.1), **shape)
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=20)
        assert torch.equal(output, reference(model, ids, mask, 20)), (name, shape)
        stats = spec.last_stats
        assert stats.batch_size == 4 and stats.row_forwards > stats.target_forwards
        assert sum(stats.accepted_lengths) > 0, name
        for row in range(4):
            prompt = ids[row, mask[row].bool()][None]
            alone = spec.generate(prompt, max_new_tokens=20)[0, prompt.shape[1]:]
            assert torch.equal(output[row, ids.shape[1]:ids.shape[1] + alone.numel()], alone), (name, row)


class Recorder:
    """A drafter that records the size of every tree it proposes."""

    def __init__(self, drafter) -> None:
        self.drafter, self.sizes = drafter, []

    def reset(self, batch_size: int) -> None:
        self.drafter.reset(batch_size)

    def retire(self, keep: torch.Tensor) -> None:
        self.drafter.retire(keep)

    def propose(self, batch):
        trees = self.drafter.propose(batch)
        self.sizes += trees.sizes.tolist()
        return trees


def test_confident_chains_grow_ragged(toy_target):
    """With ``confidence``, each row's chain stops below its first unsure node: in one batch, chains
    of every length from 1 to ``depth`` (and the verify tree padded to the longest) stay lossless."""
    generator = torch.Generator().manual_seed(3)
    prompts = [3 + (torch.arange(length) * stride + start) % 93 for length, stride, start in
               ((6, 1, 10), (9, 2, 40), (4, 3, 70), (12, 1, 5))]
    prompts[1][4:6] = torch.randint(3, 96, (2,), generator=generator)  # a surprise: some steps are unsure
    ids, mask = left_pad(prompts)
    spec = heads.attach_heads(toy_target, kind="draft", draft_model=noisy_copy(toy_target, 0.3), depth=5,
                              total_tokens=5, confidence=0.6, adaptive=False)
    recorder = Recorder(spec.drafter_for(None))
    output, stats = speculative_generate(spec.target, recorder, ids, 30, (), None, mask, spec.pad_token_id)
    assert torch.equal(output, reference(toy_target, ids, mask, 30))
    assert set(recorder.sizes) == {2, 3, 4, 5, 6}, sorted(set(recorder.sizes))


# ------------------------------------------------------------------------------ lossless sampling

SAMPLING_VOCAB = 16
PROMPT = torch.tensor([[3, 5, 7, 9]])
SAMPLED = 3  # the joint law of the first 3 tokens (of 4 generated) is compared
RUNS = 1000
ROWS = 8  # copies of the prompt per generate call


@pytest.fixture(scope="module")
def toy_pair():
    """A tiny 16-token target trained on noisy progressions and a weaker draft (fewer steps, other seed)."""
    target = train_toy_target(vocab=SAMPLING_VOCAB, noise=0.2)
    draft = train_toy_target(vocab=SAMPLING_VOCAB, noise=0.2, steps=15, seed=1)
    return target, draft


@torch.no_grad()
def exact_joint(model, temperature=1.0, top_k=None, top_p=None) -> dict:
    """P(x1..x_SAMPLED | PROMPT) under the warped target, by enumerating every prefix."""
    warp = warper(*resolve_sampling(model.generation_config, temperature, top_k, top_p))
    joint = torch.ones(1, dtype=torch.float64)
    for step in range(SAMPLED):
        prefixes = torch.tensor(list(itertools.product(range(SAMPLING_VOCAB), repeat=step)), dtype=torch.long)
        ids = torch.cat([PROMPT.expand(SAMPLING_VOCAB ** step, -1), prefixes.view(SAMPLING_VOCAB ** step, step)], 1)
        probs = torch.softmax(warp(model(ids).logits[:, -1].float()), dim=-1).double()
        joint = (joint[:, None] * probs).reshape(-1)
    return dict(zip(itertools.product(range(SAMPLING_VOCAB), repeat=SAMPLED), joint.tolist()))


def sample_runs(run, runs: int = RUNS, least: float = 0.4) -> list[tuple[int, ...]]:
    """``run(ids, mask, generator)`` → (output, stats), called on batches of ROWS prompt copies,
    ``runs`` samples; at least ``least`` drafted tokens accepted per sample (else the test would
    hardly exercise the rule)."""
    ids, mask = left_pad([PROMPT[0]] * ROWS, width=PROMPT.shape[1] + 2)
    generator = torch.Generator().manual_seed(0)
    samples, accepted = [], 0
    for _ in range(runs // ROWS):
        output, stats = run(ids, mask, generator)
        samples += [tuple(row) for row in output[:, ids.shape[1]:ids.shape[1] + SAMPLED].tolist()]
        accepted += sum(stats.accepted_lengths)
    assert accepted > runs * least, f"{accepted} drafted tokens accepted in {runs} samples: the rule was hardly exercised"
    return samples


def top_k_candidates(toy_pair, settings):
    """Through ``spec.generate``: a dynamic tree of the draft's top-k tokens (point masses)."""
    target, draft = toy_pair
    spec = heads.attach_heads(target, kind="draft", draft_model=draft, **TREE)

    def run(ids, mask, generator):
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=SAMPLED + 1, do_sample=True,
                               generator=generator, **settings)
        assert spec.last_stats.verified_nodes > spec.last_stats.target_forwards  # trees were verified
        return output, spec.last_stats

    return sample_runs(run)


def sampled_chain(toy_pair, settings):
    """Through the decode loop with the drafter bound to the rule (what ``generate`` does once it
    calls ``bind_rule``): chain tokens drawn from the draft's warped q, carried as ``draft_probs``;
    chains stop below an unsure draft distribution (``confidence``), so their lengths vary."""
    target, draft = toy_pair
    spec = heads.attach_heads(target, kind="draft", draft_model=draft, depth=3, total_tokens=3, confidence=0.18,
                              adaptive=False)

    def run(ids, mask, generator):
        rule = acceptance_rule(target.generation_config, True, generator=generator, **settings)
        drafter = bind_rule(spec.drafter_for(None), rule)
        assert drafter.sampling
        recorder.drafter = drafter
        return speculative_generate(spec.target, recorder, ids, SAMPLED + 1, (), rule, mask, spec.pad_token_id)

    recorder = Recorder(None)
    samples = sample_runs(run)
    assert {2, 3, 4} <= set(recorder.sizes), sorted(set(recorder.sizes))  # chains of 1, 2 and 3 drafted tokens
    return samples


def sampled_chain_through_generate(toy_pair, settings):
    """As :func:`sampled_chain`, through ``spec.generate`` (which binds the drafter to the rule)."""
    target, draft = toy_pair
    spec = heads.attach_heads(target, kind="draft", draft_model=draft, depth=3, total_tokens=3, adaptive=False)

    def run(ids, mask, generator):
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=SAMPLED + 1, do_sample=True,
                               generator=generator, **settings)
        assert spec.drafter.sampling  # generate bound the chain to the sampling rule
        return output, spec.last_stats

    return sample_runs(run)


SAMPLING_CASES = [
    pytest.param(sampled_chain_through_generate, dict(temperature=1.0, top_k=0, top_p=None),
                 id="sampled-chain-generate-T1"),
    pytest.param(top_k_candidates, dict(temperature=0.7, top_k=8, top_p=None), id="top-k-tree-T0.7-topk8"),
    pytest.param(sampled_chain, dict(temperature=1.0, top_k=0, top_p=None), id="sampled-chain-T1"),
]


@pytest.mark.parametrize("sample, settings", SAMPLING_CASES)
def test_speculative_sampling_matches_the_target(toy_pair, sample, settings):
    pvalue = chi_square_pvalue(sample(toy_pair, settings), exact_joint(toy_pair[0], **settings))
    assert pvalue > FALSE_ALARM, pvalue


@pytest.mark.parametrize("sample, settings", SAMPLING_CASES)
def test_a_wrong_residual_is_caught(toy_pair, sample, settings, monkeypatch):
    original = SamplingRule.__init__

    def no_residual(self, warp, generator=None, use_residual=True):
        original(self, warp, generator, use_residual=False)

    monkeypatch.setattr(SamplingRule, "__init__", no_residual)
    pvalue = chi_square_pvalue(sample(toy_pair, settings), exact_joint(toy_pair[0], **settings))
    assert pvalue < FALSE_ALARM, pvalue


def test_bind_rule_chooses_the_candidates(toy_pair):
    target, draft = toy_pair
    sampling = acceptance_rule(target.generation_config, True, 1.0, 0, None, None)
    greedy = acceptance_rule(target.generation_config, False, 1.0, None, None, None)
    typical = acceptance_rule(target.generation_config, True, 1.0, 0, None, None, acceptance="typical")
    chain = heads.attach_heads(target, kind="draft", draft_model=draft, depth=3, total_tokens=3)
    assert bind_rule(chain.drafter_for(None), sampling).sampling
    assert not bind_rule(chain.drafter_for(None), greedy).sampling
    assert not bind_rule(chain.drafter_for(None), typical).sampling  # lossy rules get point masses
    tree = heads.attach_heads(target, kind="draft", draft_model=draft, **TREE)
    assert not bind_rule(tree.drafter_for(None), sampling).sampling  # trees draft their top-k tokens
    never = heads.attach_heads(target, kind="draft", draft_model=draft, depth=3, total_tokens=3, sample="never")
    assert not bind_rule(never.drafter_for(None), sampling).sampling
    with pytest.raises(ValueError, match="top_k=2"):
        heads.attach_heads(target, kind="draft", draft_model=draft, sample="always", top_k=2, total_tokens=4)


# ------------------------------------------------------------------------------ checks and options


class FakeTokenizer:
    def __init__(self, vocabulary: dict[str, int]) -> None:
        self.vocabulary = vocabulary

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocabulary)


VOCABULARY = {f"t{i}": i for i in range(96)}


def test_vocabulary_checks():
    model = build_model("llama")
    with pytest.raises(ValueError, match="needs draft_model="):
        heads.attach_heads(model, kind="draft")
    with pytest.raises(ValueError, match="PreTrainedModel"):
        heads.attach_heads(model, kind="draft", draft_model=torch.nn.Linear(2, 2))
    other = copy.deepcopy(model)
    other.resize_token_embeddings(100)
    with pytest.raises(ValueError, match="vocabulary has 100 tokens, the target's 96"):
        heads.attach_heads(model, kind="draft", draft_model=other)
    other = copy.deepcopy(model)
    other.config.eos_token_id = 7
    with pytest.raises(ValueError, match=r"eos_token_id=\[7\] differs from the target's \[2\]"):
        heads.attach_heads(model, kind="draft", draft_model=other)
    renamed = {**VOCABULARY, "t40": 41, "t41": 40}
    with pytest.raises(ValueError, match="tokenizers differ at id 40: the target's is 't40', the draft's 't41'"):
        heads.attach_heads(model, kind="draft", draft_model=model, tokenizer=FakeTokenizer(VOCABULARY),
                           draft_tokenizer=FakeTokenizer(renamed))
    shorter = {token: index for token, index in VOCABULARY.items() if index < 90}
    with pytest.raises(ValueError, match="at id 90: the target's is 't90', the draft's None"):
        heads.attach_heads(model, kind="draft", draft_model=model, tokenizer=FakeTokenizer(VOCABULARY),
                           draft_tokenizer=FakeTokenizer(shorter))
    with pytest.raises(ValueError, match="tokenizer given without draft_tokenizer"):
        heads.attach_heads(model, kind="draft", draft_model=model, tokenizer=FakeTokenizer(VOCABULARY))
    spec = heads.attach_heads(model, kind="draft", draft_model=model, tokenizer=FakeTokenizer(VOCABULARY),
                              draft_tokenizer=FakeTokenizer(dict(VOCABULARY)))
    assert isinstance(spec.drafter, DraftModelDrafter)


@pytest.mark.parametrize("options, message", [
    (dict(depth=0), r"DraftConfig.depth must be an int >= 1; got 0"),
    (dict(depth=5, total_tokens=3), r"total_tokens \(3\) must be >= depth \(5\)"),
    (dict(sample="sometimes"), r"DraftConfig.sample must be one of"),
    (dict(num_heads=4), r"num_heads: option\(s\) of kind='medusa', not of kind='draft'"),
])
def test_bad_options(options, message):
    model = build_model("llama")
    with pytest.raises(ValueError, match=message):
        heads.attach_heads(model, kind="draft", draft_model=model, **options)


def test_tree_shapes_dtype_and_saving(tmp_path):
    model = build_model("mistral", seed=5)
    draft = shallow_model(model).to(torch.bfloat16)
    spec = heads.attach_heads(model, kind="draft", draft_model=draft, total_tokens=2)
    assert spec.config.tree == dict(depth=2, top_k=1, total_tokens=2)  # a lone budget lowers the depth
    assert spec.heads.model is draft and draft.dtype == torch.float32  # moved to the target's dtype
    assert not any(p.requires_grad for p in draft.parameters())
    spec.set_tree(dict(depth=2, top_k=3, total_tokens=5))
    assert spec.drafter.top_k == 3 and spec.config.top_k == 1
    prompt = random_prompt(6, seed=6)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), reference(model, prompt, torch.ones_like(prompt), 12))
    assert spec.last_stats.tree_size <= 6
    hybrid = heads.attach_heads(model, kind="draft", draft_model=draft, lookup=True)  # lookup merged into chains
    repeated = torch.cat([prompt, prompt], dim=1)
    expected = reference(model, repeated, torch.ones_like(repeated), 12)
    assert torch.equal(hybrid.generate(repeated, max_new_tokens=12), expected)
    hybrid.save_pretrained(str(tmp_path / "adapter"))  # the draft as a model folder, the lookup settings recorded
    assert (tmp_path / "adapter" / "draft_model" / "model.safetensors").is_file()
    loaded = heads.load_heads(model, tmp_path / "adapter")
    assert loaded.lookup is not None and loaded.config.tree == hybrid.config.tree
    assert torch.equal(loaded.generate(repeated, max_new_tokens=12), expected)
