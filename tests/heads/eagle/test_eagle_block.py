"""The block drafter (EAGLE ``parallel_mode="block"``): greedy parity on every family, chains and
dynamic trees, batch 1 and padded; the training forward's refinement and the decode-time children
(a node's children come from the sequential head over its own token); training lifts the later
depths and the sequential head pays over mask queries alone; adapters round trip; the CLI's
defaults and refusals. Sampling: ``tests/heads/test_sampled_candidates.py``."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import heads
from heads import interop
from heads.eagle import BlockDrafter, EagleConfig
from heads.eagle import cli as eagle_cli
from tests.conftest import (
    build_model, greedy_reference, left_pad, progression_batch, random_prompt, train_toy_target,
)
from training.trainer import TrainConfig, make_trainer
from tree_attention.draft_batch import DraftBatch

FAMILIES = ["llama", "llama-tied", "mistral", "gpt2", "gpt_neox", "gemma2", "qwen2", "phi3"]


def _perturb(spec, scale: float = 0.3, seed: int = 4) -> None:
    """A sequential head and mask inputs that are not the identity and zeros (an untrained head
    would not show whether children follow their parent's token)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in [*spec.heads.sequential_head.parameters(), spec.heads.mask_feature,
                          spec.heads.mask_embedding]:
            parameter.add_(torch.randn_like(parameter), alpha=scale)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("shape", [dict(), dict(depth=3, top_k=2, total_tokens=5), dict(depth=4, top_k=1,
                                                                                        total_tokens=4, siblings=0,
                                                                                        min_acceptance=0.0)],
                         ids=["chain-calibrated", "tree", "chain-full"])
def test_greedy_parity_batch_1_and_padded(name, shape):
    model = build_model(name, seed=3)
    spec = heads.attach_heads(model, kind="eagle", parallel=4, parallel_mode="block", **shape)
    assert isinstance(spec.drafter, BlockDrafter) and spec.config.drafting == "parallel"
    _perturb(spec)
    for seed, length in enumerate((1, 15)):  # longer than the tiny sliding windows once generated
        prompt = random_prompt(length, seed)
        assert torch.equal(spec.generate(prompt, max_new_tokens=20), greedy_reference(model, prompt, 20))
    ids, mask = left_pad([random_prompt(length, length)[0] for length in (3, 11, 6)])
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20), expected)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_training_forward_refines_each_depth_with_the_token_above_it(name):
    """Entry ``j >= 1`` of the block's training forward at anchor ``t`` is the mask query's feature
    refined with the embedding of the token at ``t + j + 1``; the decode-time block of a sequence
    that ends at ``t`` is the unrefined one, and the children the drafter gives a node of depth ``j``
    with token ``x`` are the output head's top tokens of ``refine(h_{j+1}, e(x))``."""
    model = build_model(name, seed=8)
    parallel = 4
    spec = heads.attach_heads(model, kind="eagle", parallel=parallel, parallel_mode="block", depth=3, top_k=3,
                              total_tokens=9)
    _perturb(spec)
    drafter, target = spec.heads, spec.target
    length = 14
    ids = random_prompt(length, seed=9)
    with torch.no_grad():
        features, _ = target.forward(ids, torch.arange(length)[None], None, None, "last")
        embeddings = target.input_embeddings(ids)
        refined = drafter(features, embeddings, parallel=True)
        head, drafter.sequential_head = drafter.sequential_head, None
        try:
            plain = drafter.parallel_forward(features, embeddings)  # mask mode's features
        finally:
            drafter.sequential_head = head
        torch.testing.assert_close(refined[0], plain[0])
        for depth in range(1, parallel):
            for anchor in range(length - depth - 1):
                expected = drafter.refine(plain[depth][:, anchor], embeddings[:, anchor + depth + 1])
                # (the batched forward and one anchor's refine multiply matrices of other shapes: fp32 rounding)
                torch.testing.assert_close(refined[depth][:, anchor], expected, rtol=1e-5, atol=1e-5)
        anchor = 8
        live = BlockDrafter(drafter, target, spec.config)
        batch = DraftBatch(features[:, :anchor + 1], ids[:, :anchor + 1], torch.tensor([anchor + 1]),
                           ids[:, anchor + 1])
        trees = live.propose(batch)
        block = torch.stack([plain[depth][0, anchor] for depth in range(parallel)])
        torch.testing.assert_close(live.block[0], block, rtol=1e-4, atol=1e-5)
        rows = drafter.draft_rows(target)
        tokens, parents, depths = trees.tokens[0].tolist(), trees.parents[0].tolist(), trees.depths[0].tolist()
        size = int(trees.sizes[0])
        checked = 0
        for node in range(1, size):
            children = [child for child in range(1, size) if parents[child] == node]
            if not children:
                continue
            hidden = drafter.refine(block[depths[node]], target.input_embeddings(torch.tensor(tokens[node])))
            ranked = drafter.target_ids(target.logits(hidden[None], rows)[0].topk(3).indices).tolist()
            assert {tokens[child] for child in children} <= set(ranked)
            checked += 1
        assert checked, "the tree had no node below depth 1 with children"
        # two siblings at depth 1 get children of their own tokens, not one shared set
        first = [node for node in range(1, size) if depths[node] == 1]
        assert len(first) >= 2


def test_config_cli_and_refusals():
    with pytest.raises(ValueError, match="block.*drafting 'parallel'"):
        EagleConfig(parallel=3, parallel_mode="block", drafting="auto")
    model = build_model("llama", seed=1)
    with pytest.raises(ValueError, match="parallel_mode 'block'"):
        BlockDrafter(heads.attach_heads(model, kind="eagle", parallel=3, parallel_mode="mask").heads,
                     heads.attach_heads(model, kind="eagle").target, EagleConfig(parallel=3, parallel_mode="mask"))
    parser = argparse.ArgumentParser()
    eagle_cli.add_arguments(parser)
    args = parser.parse_args(["--parallel-mode", "block"])
    args.kind = "eagle"
    options = eagle_cli.options(args)
    assert options["parallel_mode"] == "block" and options["drafting"] == "parallel" and options["parallel"] == 4
    assert eagle_cli.train_options(args)["mask_query_weight"] == eagle_cli.MASK_QUERY_WEIGHT["block"]
    args = parser.parse_args(["--parallel-mode", "block", "--mask-query-weight", "0.5"])
    assert eagle_cli.train_options(args)["mask_query_weight"] == 0.5
    assert eagle_cli.train_options(parser.parse_args([]))["mask_query_weight"] == eagle_cli.MASK_QUERY_WEIGHT["mask"]
    assert eagle_cli.PARALLEL_MODES == ("heads", "mask", "block")


def _train(spec, sequences, steps: int):
    torch.manual_seed(0)
    config = TrainConfig(steps=steps, batch_size=8, learning_rate=1e-2, warmup_steps=3, token_weight=1.0,
                         mask_query_weight=1.0)
    return make_trainer(spec, sequences, config, progress=False).train()


@pytest.fixture(scope="module")
def trained(toy_target):
    """A block drafter and a mask-mode drafter trained alike on the toy target's greedy text."""
    sequences = list(greedy_reference(toy_target, progression_batch(48, 6, torch.Generator().manual_seed(7)), 24))
    results = {}
    for mode in ("block", "mask"):
        spec = heads.attach_heads(toy_target, kind="eagle", parallel=3, parallel_mode=mode, drafting="parallel")
        results[mode] = (spec, _train(spec, sequences, steps=120))
    return results


def test_training_lifts_later_depths_and_decodes_losslessly(trained):
    spec, result = trained["block"]
    block = [row[0] for row in result.accuracy]  # top-1 per depth, held out, given the tokens above
    mask = [row[0] for row in trained["mask"][1].accuracy]
    assert len(block) == 3 and min(block) > 0.3, (block, mask)
    # the token above a depth is information mask queries lack
    assert block[1] + block[2] > mask[1] + mask[2], (block, mask)
    assert spec.heads.sequential_head.outer.weight.abs().sum() > 0  # it trained (it starts at zero)
    generator = torch.Generator().manual_seed(11)
    prompts = [progression_batch(1, length, generator)[0] for length in (5, 8, 3)]
    for prompt in prompts[:2]:
        assert torch.equal(spec.generate(prompt[None], max_new_tokens=24),
                           greedy_reference(spec.backbone, prompt[None], 24))
        assert spec.last_stats.mean_accepted > 1.6
    ids, attention = left_pad(prompts)
    with torch.no_grad():
        expected = spec.backbone.generate(ids, attention_mask=attention, do_sample=False, max_new_tokens=24)
    assert torch.equal(spec.generate(ids, attention_mask=attention, max_new_tokens=24), expected)


def test_adapter_round_trip_and_export_refusal(trained, tmp_path):
    spec, _ = trained["block"]
    spec.save_pretrained(tmp_path / "block")
    config = json.loads((tmp_path / "block" / "adapter_config.json").read_text())
    assert config["drafter"]["parallel_mode"] == "block" and config["drafter"]["drafting"] == "parallel"
    loaded = heads.load_heads(spec.backbone, tmp_path / "block")
    assert isinstance(loaded.drafter, BlockDrafter)
    state = loaded.heads.state_dict()
    assert any(key.startswith("sequential_head.") for key in state)
    for key, value in spec.heads.state_dict().items():
        torch.testing.assert_close(state[key], value)
    prompt = progression_batch(1, 6, torch.Generator().manual_seed(5))
    assert torch.equal(loaded.generate(prompt, max_new_tokens=16), spec.generate(prompt, max_new_tokens=16))
    for dtype in (torch.float16, torch.bfloat16):  # a half-precision target loads the adapter too
        half = heads.load_heads(spec.backbone.to(dtype), tmp_path / "block")
        assert half.generate(prompt, max_new_tokens=8).shape[1] == prompt.shape[1] + 8
    spec.backbone.float()
    with pytest.raises(heads.AdapterError, match=r"parallel > 1"):
        interop.export_adapter(tmp_path / "block", "speculators", tmp_path / "out", model=spec.backbone)
    assert not (tmp_path / "out").exists()


def test_static_trees_are_nested_best_first_and_auto_keeps_parity():
    """Greedy steps draft the static tree of the accuracy table, best first: a smaller size is the
    first nodes of a larger one (what ``speculate="auto"``'s acceptance model needs), each shape is
    built once; auto sizing keeps greedy parity."""
    model = build_model("llama", seed=5)
    spec = heads.attach_heads(model, kind="eagle", parallel=4, parallel_mode="block")
    assert (spec.config.depth, spec.config.top_k, spec.config.total_tokens) == (4, 4, 16)
    _perturb(spec)
    drafter = spec.drafter
    assert drafter.nested and drafter.template.size == 17 and drafter.template.max_depth <= 4
    prompt = random_prompt(7, 3)
    with torch.no_grad():
        features, _ = spec.target.forward(prompt, torch.arange(7)[None], None, None, "last")
    batch = DraftBatch(features, prompt, torch.tensor([7]), prompt[:, -1])
    drafter.reset(1)
    large = drafter.propose(batch)
    template = drafter.template
    drafter.resize(5)
    assert drafter.template.size == 6
    drafter.reset(1)
    small = drafter.propose(batch)
    assert torch.equal(small.tokens[0], large.tokens[0, :6])
    assert torch.equal(small.parents[0], large.parents[0, :6])
    drafter.resize(None)
    assert drafter.template is template  # built once per shape
    for length in (2, 9):
        prompt = random_prompt(length, length)
        assert torch.equal(spec.generate(prompt, max_new_tokens=24, speculate="auto"),
                           greedy_reference(model, prompt, 24))


@pytest.mark.parametrize("wrong", [False, True], ids=["rule", "no-residual"])
def test_default_top_k_candidates_under_sampling_keep_the_target_law(wrong, monkeypatch):
    """By default a block drafter offers its top-k tokens (point masses) to the lossless sampling
    rule: the first three sampled tokens still follow the target's law, batched and padded; a rule
    without the residual is caught by the same test."""
    from tests.heads.test_sampling import VOCAB, batched_samples, exact_joint
    from tests.stats import FALSE_ALARM, chi_square_pvalue
    from tree_attention.verify import SamplingRule

    model = train_toy_target(vocab=VOCAB, noise=0.2)
    torch.manual_seed(3)
    spec = heads.attach_heads(model, kind="eagle", parallel=3, parallel_mode="block", depth=3, top_k=2, total_tokens=4)
    assert spec.config.sample == "never"
    generator = torch.Generator().manual_seed(8)
    sequences = [progression_batch(1, 24, generator, VOCAB, 0.2)[0] for _ in range(64)]
    make_trainer(spec, sequences, TrainConfig(steps=60, batch_size=8, learning_rate=3e-3, warmup_steps=5),
                 progress=False).train()
    if wrong:
        original = SamplingRule.__init__
        monkeypatch.setattr(SamplingRule, "__init__", lambda self, warp, generator=None, use_residual=True:
                            original(self, warp, generator, use_residual=False))
    settings = dict(temperature=0.8, top_k=0)
    pvalue = chi_square_pvalue(batched_samples(spec, runs=2000, **settings), exact_joint(model, **settings))
    assert not spec.drafter.sampling  # point masses
    assert (pvalue < FALSE_ALARM) if wrong else (pvalue > FALSE_ALARM), pvalue
