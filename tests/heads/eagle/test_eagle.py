"""EAGLE drafter: greedy parity on every family (random and trained drafters, several dynamic
tree shapes), the drafter's own cache against a sequential run, the training-time unroll against
decode-time drafting, EAGLE-3 options, adapter contents and bad input."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import heads
from heads.eagle import EagleConfig, unrolled_attention_mask
from tree_attention.draft_batch import DraftBatch
from tests.conftest import (
    ARCHITECTURES, VOCAB, build_model, greedy_reference, left_pad, progression_batch, random_prompt,
    record_drafted_tokens,
)
from training.trainer import TrainConfig, make_trainer
from tree_attention import cache as cache_ops
from tree_attention.decode import speculative_generate
from tree_attention.mask import prefill_attention_mask, tree_attention_mask

SHAPES = [dict(depth=1, top_k=1, total_tokens=1), dict(depth=3, top_k=2, total_tokens=5),
          dict(depth=5, top_k=4, total_tokens=12), dict(depth=6, top_k=3, total_tokens=16),
          dict(depth=4, top_k=8, total_tokens=30), dict(depth=8, top_k=1, total_tokens=8)]


def _own_continuations(model, count: int, length: int, seed: int) -> list[torch.Tensor]:
    prompts = torch.cat([random_prompt(4, seed + i) for i in range(count)])
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=length)
    return list(out)


def _train(spec, sequences, steps: int, **config) -> None:
    torch.manual_seed(0)
    options = {**dict(steps=steps, batch_size=4, learning_rate=1e-2, warmup_steps=3, token_weight=1.0), **config}
    make_trainer(spec, sequences, TrainConfig(**options), progress=False).train()


def _check_parity(spec, model, prompts, max_new_tokens: int = 24) -> float:
    tokens = forwards = 0
    for prompt in prompts:
        expected = greedy_reference(model, prompt, max_new_tokens)
        assert torch.equal(spec.generate(prompt, max_new_tokens=max_new_tokens), expected), tuple(prompt.shape)
        tokens += spec.last_stats.new_tokens
        forwards += spec.last_stats.target_forwards
    return tokens / forwards


@pytest.mark.parametrize("index, name", list(enumerate(ARCHITECTURES)))
def test_greedy_parity_every_architecture_random_then_trained(index, name):
    """A random drafter first; then a briefly trained one. Random tiny models fall into loops that
    the drafter learns, so deep paths get accepted and its cache is cropped to varied lengths."""
    model = build_model(name, seed=3)
    spec = heads.attach_heads(model, kind="eagle", **SHAPES[index % len(SHAPES)])
    _check_parity(spec, model, [random_prompt(1, index), random_prompt(19, index + 1)], 16)
    _train(spec, _own_continuations(model, 12, 24, seed=100), steps=20)
    spec.set_tree(None)
    prompts = [random_prompt(4, 100), random_prompt(4, 101)]  # among the training prompts: drafts get accepted
    _check_parity(spec, model, prompts[:1], 24)
    accepted = sum(spec.last_stats.accepted_lengths)
    spec.set_tree(SHAPES[(index + 3) % len(SHAPES)])
    _check_parity(spec, model, prompts[1:], 16)
    assert accepted + sum(spec.last_stats.accepted_lengths) >= 6


@pytest.fixture(scope="module")
def trained(toy_target):
    """An EAGLE drafter trained on the toy target's continuations (accepts several tokens per step)."""
    sequences = list(greedy_reference(toy_target, progression_batch(48, 6, torch.Generator().manual_seed(7)), 24))
    spec = heads.attach_heads(toy_target, kind="eagle")
    _train(spec, sequences, steps=60, batch_size=8, unroll_steps=2)
    return spec


def _toy_prompts(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [progression_batch(1, 5, generator) for _ in range(count)]


@pytest.mark.parametrize("shape", SHAPES)
def test_trained_drafter_parity_every_tree_shape(trained, shape):
    trained.set_tree(shape)
    tau = _check_parity(trained, trained.backbone, _toy_prompts(1, seed=11), 24)
    if shape["depth"] > 1:
        assert tau > 1.4, shape
    assert trained.last_stats.tree_size <= shape["total_tokens"] + 1
    trained.set_tree(None)


def test_eos_inside_an_accepted_chunk(trained):
    model = trained.backbone
    prompt = _toy_prompts(1, seed=12)[0]
    free_run = greedy_reference(model, prompt, 30)[0, prompt.shape[1]:]
    inside = 0
    try:
        for position in (5, 8):
            model.generation_config.eos_token_id = int(free_run[position])
            expected = greedy_reference(model, prompt, 30)
            actual = trained.generate(prompt, max_new_tokens=30)
            assert torch.equal(actual, expected) and actual.shape[1] < prompt.shape[1] + 30
            inside += trained.last_stats.accepted_lengths[-1] > 0
    finally:
        model.generation_config.eos_token_id = None
    assert inside  # eos arrived among accepted drafts at least once


def test_max_new_tokens_ends_inside_an_accepted_chunk(trained):
    prompt = _toy_prompts(1, seed=13)[0]
    cut_inside = 0
    for max_new_tokens in (1, 2, 3, 4, 5, 6, 7, 9, 12):
        actual = trained.generate(prompt, max_new_tokens=max_new_tokens)
        assert actual.shape[1] == prompt.shape[1] + max_new_tokens
        assert torch.equal(actual, greedy_reference(trained.backbone, prompt, max_new_tokens))
        lengths = trained.last_stats.accepted_lengths
        cut_inside += bool(lengths) and lengths[-1] > 0
    assert cut_inside >= 2  # the budget ran out right after accepted drafts, not only after a bonus token


class RecordingDrafter:
    """Wraps an EagleDrafter; after each proposal compares its cache with a sequential run of the
    drafter over every committed (feature, token) pair."""

    def __init__(self, inner, spec) -> None:
        self.inner, self.spec, self.checks = inner, spec, 0

    def reset(self, batch_size):
        assert batch_size == 1
        self.inner.reset(batch_size)
        self.features, self.tokens = [], []

    def retire(self, keep):
        self.inner.retire(keep)

    def propose(self, batch):
        trees = self.inner.propose(batch)
        length = int(batch.lengths[0])
        self.features.append(batch.features[0:1, :length])
        self.tokens.append(batch.tokens[0, :length])
        self._compare(int(batch.roots[0]), trees.row(0))
        return trees

    def _compare(self, root: int, tree) -> None:
        heads_module, target = self.spec.heads, self.spec.target
        features = torch.cat(self.features, dim=1)  # (1, N, F)
        next_tokens = torch.cat(self.tokens + [torch.tensor([root])])[1:]
        count = next_tokens.numel()
        assert int(self.inner.committed[0]) == count == self.inner.cache.width
        reference = cache_ops.new_cache()
        with torch.no_grad():
            outputs = heads_module.step(heads_module.fuse(features), target.input_embeddings(next_tokens)[None],
                                        torch.arange(count)[None],
                                        prefill_attention_mask(count, heads_module.layout, torch.float32, "cpu"),
                                        reference)
        kept = copy.deepcopy(self.inner.cache.cache)
        cache_ops.crop(kept, count)
        for layer, reference_layer in zip(kept.layers, reference.layers):
            torch.testing.assert_close(layer.keys, reference_layer.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(layer.values, reference_layer.values, rtol=1e-4, atol=1e-5)
        probe = [torch.randn(1, 1, heads_module.hidden_size, generator=torch.Generator().manual_seed(count)),
                 target.input_embeddings(torch.tensor([[7]])), torch.tensor([[count]]),
                 tree_attention_mask(count, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                                     heads_module.layout, torch.float32)]
        with torch.no_grad():
            probed = [heads_module.step(*probe, cache) for cache in (kept, reference)]
            best = heads_module.target_ids(target.logits(outputs[0, -1], heads_module.draft_rows(target)).argmax())
        torch.testing.assert_close(probed[0], probed[1], rtol=1e-4, atol=1e-5)
        if tree.size > 1:  # the root's best child scores highest of all nodes: always drafted
            assert int(best) in tree.tokens[tree.depths == 1].tolist()
        self.checks += 1


def _check_drafter_cache(spec, prompt, max_new_tokens: int = 20):
    recording = RecordingDrafter(spec.drafter, spec)
    output, stats = speculative_generate(spec.target, recording, prompt, max_new_tokens)
    assert torch.equal(output, greedy_reference(spec.backbone, prompt, max_new_tokens))
    assert recording.checks == stats.target_forwards - 1 > 1
    return stats


def test_drafter_cache_follows_the_accepted_path_trained(trained):
    accepted = [length for prompt in _toy_prompts(2, seed=14)
                for length in _check_drafter_cache(trained, prompt).accepted_lengths]
    assert max(accepted) >= 2 and min(accepted) < max(accepted)  # crops after varied acceptances checked


@pytest.mark.parametrize("name, options", [
    ("mistral", {}), ("gemma2", {}), ("gpt2", {}), ("gpt_neox", dict(feature_layers=(0, 1, 2))),
    ("qwen2", dict(draft_vocab_size=40, top_k=3, num_layers=2)),
])
@pytest.mark.usefixtures("full_precision_drafters")
def test_drafter_cache_follows_the_accepted_path_random(name, options):
    model = build_model(name, seed=5)
    spec = heads.attach_heads(model, kind="eagle", **options)
    _check_drafter_cache(spec, random_prompt(15, seed=6))  # longer than the tiny sliding windows


@pytest.mark.parametrize("name, options", [
    ("mistral", {}), ("gemma2", {}), ("gpt2", {}), ("qwen2", dict(layout="eagle1")),
    ("llama", dict(layout="eagle3", feature_layers=(0, 1, 2))),
])
@pytest.mark.usefixtures("full_precision_drafters")
def test_training_unroll_equals_decode_time_drafting(name, options):
    """Step j of the training forward at origin t equals drafting a chain at decode time: commit the
    pairs up to t, then feed back the drafter's own predictions along one path."""
    model = build_model(name, seed=8)
    spec = heads.attach_heads(model, kind="eagle", **options)
    drafter = spec.heads
    length, steps = 14, 3
    ids = random_prompt(length, seed=9)
    with torch.no_grad():
        features, _ = spec.target.forward(ids, torch.arange(length)[None], None, None, "last")
        embeddings = spec.target.input_embeddings(ids)
        unrolled = drafter(features, embeddings, steps)
        for origin in (0, 6, length - steps - 1):
            cache = cache_ops.new_cache()
            mask = prefill_attention_mask(origin + 1, drafter.layout, torch.float32, "cpu")
            hidden = drafter.step(drafter.fuse(features[:, :origin + 1]), embeddings[:, 1:origin + 2],
                                  torch.arange(origin + 1)[None], mask, cache)[:, -1:]
            torch.testing.assert_close(hidden, unrolled[0][:, origin:origin + 1], rtol=1e-4, atol=1e-5)
            for step in range(2, steps + 1):
                position = origin + step - 1
                mask = _chain_mask(origin + 1, step - 1, drafter.layout)
                hidden = drafter.step(hidden, embeddings[:, position + 1:position + 2], torch.tensor([[position]]),
                                      mask, cache)
                torch.testing.assert_close(hidden, unrolled[step - 1][:, origin:origin + 1], rtol=1e-4, atol=1e-5)


def _chain_mask(prefix: int, depth: int, layout):
    """Mask of the depth-``depth`` node of a chain below a root at position ``prefix - 1``, whose
    ``depth - 1`` chain ancestors sit in the cache after the prefix."""
    from tree_attention.mask import layout_masks

    visible = torch.ones(1, 1, prefix + depth, dtype=torch.bool)
    keys = torch.cat([torch.arange(prefix), prefix - 1 + torch.arange(1, depth + 1)])[None]
    return layout_masks(visible, torch.tensor([[prefix - 1 + depth]]), keys, layout, torch.float32)


def test_unrolled_mask_blocks():
    mask = unrolled_attention_mask(3, 2, None, torch.float32, "cpu")
    assert (mask[0, 0] == 0).int().tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_feature_layers_parity_and_features(name):
    model = build_model(name, seed=2)
    spec = heads.attach_heads(model, kind="eagle", feature_layers=(0, 1, 2))
    assert spec.heads.fusion.in_features == 3 * model.config.hidden_size
    ids = random_prompt(6, seed=3)
    with torch.no_grad():
        features, logits = spec.target.forward(ids, torch.arange(6)[None], None, None, "all")
        states = model(ids, output_hidden_states=True)
    expected = torch.cat([states.hidden_states[0], states.hidden_states[1], spec.target.features(
        ids, torch.arange(6)[None], None, None)], dim=-1)
    torch.testing.assert_close(features, expected)
    torch.testing.assert_close(logits, states.logits, rtol=1e-5, atol=1e-5)
    _check_parity(spec, model, [random_prompt(9, seed=4)])


def test_draft_vocabulary_parity_and_token_map():
    model = build_model("phi3", seed=2)
    spec = heads.attach_heads(model, kind="eagle", draft_vocab_size=30, top_k=3)
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:30]
    spec.heads.set_token_map(token_map)
    prompt = random_prompt(8, seed=5)
    proposed = record_drafted_tokens(spec)
    _check_parity(spec, model, [prompt])
    assert proposed and set(proposed) <= set(token_map.tolist())
    with pytest.raises(ValueError, match="30 distinct ids"):
        spec.heads.set_token_map(torch.zeros(30, dtype=torch.long))


def test_adapter_holds_only_drafter_tensors(tmp_path):
    from safetensors.torch import load_file

    model = build_model("gpt2")
    spec = heads.attach_heads(model, kind="eagle", draft_vocab_size=50, feature_layers=(1, 2))
    spec.save_pretrained(tmp_path / "adapter")
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    trainable = {name for name, parameter in spec.heads.named_parameters() if parameter.requires_grad}
    assert set(tensors) == trainable | {"token_map"}
    embedding = model.get_input_embeddings().weight
    assert all(tensor.shape != embedding.shape for tensor in tensors.values())
    assert not any(parameter.requires_grad for parameter in model.parameters())


def _shape(spec):
    return spec.drafter.depth, spec.drafter.top_k, spec.drafter.total_tokens


def test_set_tree_on_an_eagle_spec():
    model = build_model("llama")
    spec = heads.attach_heads(model, kind="eagle", depth=3, top_k=2, total_tokens=4)
    spec.set_tree(7)
    assert _shape(spec) == (3, 2, 7)
    spec.set_tree(dict(depth=2, top_k=5))
    assert _shape(spec) == (2, 5, 4)
    spec.set_tree(None)
    assert _shape(spec) == (3, 2, 4)
    with pytest.raises(ValueError, match="unknown"):
        spec.set_tree(dict(width=3))
    with pytest.raises(ValueError, match="top_k"):
        spec.set_tree(dict(top_k=0))


@pytest.mark.parametrize("field, value, message", [
    ("depth", 0, "EagleConfig.depth must be an int >= 1"),
    ("top_k", 2.5, "EagleConfig.top_k must be an int >= 1"),
    ("total_tokens", -1, "EagleConfig.total_tokens must be an int >= 0"),
    ("num_layers", 0, "EagleConfig.num_layers must be an int >= 1"),
    ("feature_layers", (), "EagleConfig.feature_layers must be non-negative"),
    ("feature_layers", (1, -1), "EagleConfig.feature_layers must be non-negative"),
    ("feature_layers", (1, 1), "repeated"),
    ("feature_layers", "012", "list of layer indices"),
    ("draft_vocab_size", 0, "EagleConfig.draft_vocab_size must be an int >= 1"),
    ("layout", "eagle2", "EagleConfig.layout must be one of"),
    ("siblings", -1, "EagleConfig.siblings must be an int >= 0"),
    ("siblings", True, "EagleConfig.siblings must be an int >= 0"),
    ("layout", "eagle3", "'eagle3' fuses exactly three backbone layers"),
])
def test_bad_eagle_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        EagleConfig(**{field: value})


def test_draft_vocabulary_smaller_than_top_k():
    with pytest.raises(ValueError, match=r"draft_vocab_size \(1\) must be >= top_k \(2\)"):
        EagleConfig(top_k=2, draft_vocab_size=1)
    with pytest.raises(ValueError, match=r"draft_vocab_size \(2\) must exceed siblings \(2\)"):
        EagleConfig(siblings=2, draft_vocab_size=2)
    EagleConfig(siblings=0, draft_vocab_size=1)


def test_tree_budget_smaller_than_the_depth():
    with pytest.raises(ValueError, match=r"EagleConfig.total_tokens \(3\) must be >= depth \(6\)"):
        EagleConfig(depth=6, total_tokens=3)
    with pytest.raises(ValueError, match=r"total_tokens \(2\) must be >= depth \(4\)"):
        EagleConfig(depth=3, total_tokens=4).with_tree(dict(depth=4, total_tokens=2))
    with pytest.raises(ValueError, match=r"total_tokens \(4\) must be >= depth \(5\)"):
        EagleConfig(depth=3, total_tokens=4).with_tree(dict(depth=5))
    # a node count alone lowers the depth to fit, never raises it
    assert EagleConfig(depth=6, top_k=2, total_tokens=12).with_tree(4).tree == dict(depth=4, top_k=2, total_tokens=4)
    assert EagleConfig(depth=3, total_tokens=4).with_tree(dict(total_tokens=2, top_k=3)).tree == dict(
        depth=2, top_k=3, total_tokens=2)
    assert EagleConfig(depth=3, top_k=2, total_tokens=4).with_tree(20).tree == dict(depth=3, top_k=2, total_tokens=20)
    # total_tokens 0: no drafting, whatever the depth
    assert EagleConfig(depth=6, total_tokens=0).total_tokens == 0
    assert EagleConfig(depth=6, top_k=2, total_tokens=6).with_tree(0).tree == dict(depth=6, top_k=2, total_tokens=0)
    with pytest.raises(ValueError, match="total_tokens must be an int >= 0"):
        EagleConfig().with_tree(-2)
    model = build_model("llama")
    spec = heads.attach_heads(model, kind="eagle", total_tokens=3)  # the default depth is lowered too
    assert (spec.config.depth, spec.config.total_tokens) == (3, 3)
    with pytest.raises(ValueError, match=r"total_tokens \(3\) must be >= depth \(5\)"):
        heads.attach_heads(model, kind="eagle", depth=5, total_tokens=3)
    spec.set_tree(2)
    assert (spec.drafter.depth, spec.drafter.total_tokens) == (2, 2)
    spec.set_tree(0)  # root only: the loop verifies one node per step, as plain decoding
    prompt = random_prompt(6, 5)
    assert torch.equal(spec.generate(prompt, max_new_tokens=10), greedy_reference(model, prompt, 10))
    assert spec.last_stats.mean_accepted == pytest.approx(1.0) and spec.last_stats.tree_size == 1


def test_bad_eagle_options_for_the_backbone():
    model = build_model("llama")  # 2 layers, vocab 96
    with pytest.raises(ValueError, match=r"feature_layers \[0, 3\]: \[3\] out of range 0..2"):
        heads.attach_heads(model, kind="eagle", feature_layers=(0, 3))
    with pytest.raises(ValueError, match=r"draft_vocab_size \(200\) exceeds the backbone's vocabulary \(96\)"):
        heads.attach_heads(model, kind="eagle", draft_vocab_size=200)
    with pytest.raises(ValueError, match=r"top_k \(100\) exceeds the draft vocabulary \(96\)"):
        heads.attach_heads(model, kind="eagle", top_k=100)
    with pytest.raises(ValueError, match="num_heads: option\\(s\\) of kind='medusa'"):
        heads.attach_heads(model, kind="eagle", num_heads=3)
    with pytest.raises(ValueError, match=r"depth, top_k: option\(s\) of kind.*'eagle'.*, not of kind='medusa'"):
        heads.attach_heads(model, kind="medusa", depth=3, top_k=2)


LAYOUT_CASES = [("llama", dict(layout="eagle1")), ("mistral", dict(layout="eagle1")),
                ("qwen2", dict(layout="eagle1", num_layers=2)), ("llama-tied", dict(layout="eagle1")),
                ("llama", dict(layout="eagle3", feature_layers=(0, 1, 2))),
                ("llama", dict(layout="eagle3", feature_layers=(1, 2, 0), draft_vocab_size=40, top_k=3))]


@pytest.mark.parametrize("name, options", LAYOUT_CASES)
def test_layout_greedy_parity_random_then_trained(name, options):
    model = build_model(name, seed=3)
    spec = heads.attach_heads(model, kind="eagle", **{"depth": 4, "top_k": 2, "total_tokens": 8, **options})
    _check_parity(spec, model, [random_prompt(1, 1), random_prompt(17, 2)], 16)
    _train(spec, _own_continuations(model, 12, 24, seed=100), steps=15, unroll_steps=2)
    _check_parity(spec, model, [random_prompt(4, 100)], 24)
    assert sum(spec.last_stats.accepted_lengths) >= 2


def test_layout_modules():
    """eagle1: the first layer's input layernorm and the final norm are identities, the projection
    has a bias; eagle3: no projection, q/k/v take 2d inputs, the final norm sits before the head."""
    model = build_model("llama")
    eagle1 = heads.attach_heads(model, kind="eagle", layout="eagle1", num_layers=2).heads
    assert isinstance(eagle1.decoder.layers[0].input_layernorm, torch.nn.Identity)
    assert not isinstance(eagle1.decoder.layers[1].input_layernorm, torch.nn.Identity)  # as cnets1 index != 0
    assert isinstance(eagle1.decoder.norm, torch.nn.Identity) and eagle1.projection.bias is not None
    assert eagle1.draft_rows(heads.inspect_backbone(model)) is None
    eagle3 = heads.attach_heads(model, kind="eagle", layout="eagle3", feature_layers=(0, 1, 2)).heads
    assert eagle3.projection is None and eagle3.fusion.bias is None
    assert eagle3.decoder.self_attn.q_proj.in_features == 2 * 32 == eagle3.decoder.self_attn.v_proj.in_features
    target = heads.inspect_backbone(model)
    hidden = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(target.logits(hidden, eagle3.draft_rows(target)),
                                   model.lm_head(eagle3.decoder.norm(hidden)))


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "phi3", "gemma2"])
def test_layouts_refuse_other_families(name):
    model = build_model(name)
    with pytest.raises(ValueError, match=rf"layout 'eagle1' .*\['llama', 'mistral', 'qwen2'\]; this backbone is "
                                         rf"'{name}', which supports the layouts \['native'\]"):
        heads.attach_heads(model, kind="eagle", layout="eagle1")
    with pytest.raises(ValueError, match=rf"layout 'eagle3' .*\['llama'\]; this backbone is '{name}'"):
        heads.attach_heads(model, kind="eagle", layout="eagle3", feature_layers=(0, 1, 2))
    with pytest.raises(ValueError, match="layout: option\\(s\\) of kind='eagle'"):
        heads.attach_heads(build_model("llama"), kind="medusa", layout="eagle1")
    with pytest.raises(ValueError, match="'eagle3'.*supports the layouts \\['native', 'eagle1'\\]"):
        heads.attach_heads(build_model("qwen2"), kind="eagle", layout="eagle3", feature_layers=(0, 1, 2))


class RowByRow:
    """Wraps the batched drafter; checks every tree it grows for a batch against a batch-1
    drafter per row fed the same features and tokens."""

    def __init__(self, spec, shape) -> None:
        self.inner, self.spec, self.compared, self.accepted = spec.drafter, spec, 0, []
        self.config = spec.config.with_tree(shape)

    def reset(self, batch_size):
        self.inner.reset(batch_size)
        self.alone = [heads.eagle.EagleDrafter(self.spec.heads, self.spec.target, self.config)
                      for _ in range(batch_size)]
        for drafter in self.alone:
            drafter.reset(1)
        self.rows = list(range(batch_size))

    def retire(self, keep):
        self.inner.retire(keep)
        self.rows = [self.rows[index] for index in keep.tolist()]

    def propose(self, batch):
        trees = self.inner.propose(batch)
        for index, (row, tree) in enumerate(zip(self.rows, trees.trees())):
            length = int(batch.lengths[index])
            self.accepted.append(length)
            single = DraftBatch(batch.features[index:index + 1, :length], batch.tokens[index:index + 1, :length],
                                batch.lengths[index:index + 1], batch.roots[index:index + 1])
            alone = self.alone[row].propose(single).row(0)
            assert torch.equal(tree.tokens, alone.tokens) and torch.equal(tree.parents, alone.parents)
            self.compared += 1
        return trees


def test_batched_drafter_grows_the_trees_of_batch_1_runs(trained):
    generator = torch.Generator().manual_seed(21)
    prompts = [progression_batch(1, length, generator)[0] for length in (5, 9, 3, 7)]
    ids, mask = left_pad(prompts)
    shape = dict(depth=4, top_k=3, total_tokens=10)
    trained.set_tree(shape)
    checker = RowByRow(trained, shape)
    output, stats = speculative_generate(trained.target, checker, ids, 30, attention_mask=mask, pad_token_id=0)
    with torch.no_grad():
        expected = trained.backbone.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    assert torch.equal(output, expected)
    assert checker.compared > 20 and len(set(checker.accepted[len(prompts):])) >= 2  # ragged commits
    assert stats.mean_accepted > 1.5
    trained.set_tree(None)


class TreePathDrafter(heads.eagle.EagleDrafter):
    """The dynamic-tree path (EAGLE-2 growth) even for chains, to compare the chain path with."""

    @torch.no_grad()
    def propose(self, batch):
        root_features = self._commit(batch)
        self.cache.compact()
        return self._tree(batch.roots.tolist(), root_features, self.heads.draft_rows(self.target))


class ChainVsTree:
    """Runs the chain path and the tree path side by side on the same batches (ragged rows), and the
    chain path with siblings, whose trees are verified: its chain is the plain chain, and every other
    node is a leaf beside a chain node with another token."""

    def __init__(self, spec, shape) -> None:
        config = dataclasses.replace(spec.config.with_tree(shape), min_acceptance=0.0, siblings=0)  # full chains
        self.chain = heads.eagle.EagleDrafter(spec.heads, spec.target, config)
        self.tree = TreePathDrafter(spec.heads, spec.target, config)
        self.sided = heads.eagle.EagleDrafter(spec.heads, spec.target, dataclasses.replace(config, siblings=2))
        self.compared = self.siblings = 0

    def reset(self, batch_size):
        self.chain.reset(batch_size), self.tree.reset(batch_size), self.sided.reset(batch_size)

    def retire(self, keep):
        self.chain.retire(keep), self.tree.retire(keep), self.sided.retire(keep)

    def propose(self, batch):
        chains, trees, sided = self.chain.propose(batch), self.tree.propose(batch), self.sided.propose(batch)
        for chain, tree, with_siblings in zip(chains.trees(), trees.trees(), sided.trees()):
            assert torch.equal(chain.tokens, tree.tokens) and torch.equal(chain.parents, tree.parents)
            size = chain.size
            assert torch.equal(with_siblings.tokens[:size], chain.tokens)
            assert torch.equal(with_siblings.parents[:size], chain.parents)
            for node in range(size, with_siblings.size):
                parent = int(with_siblings.parents[node])
                assert 0 <= parent < size - 1 and int(with_siblings.depths[node]) == parent + 1
                assert int(with_siblings.tokens[node]) != int(chain.tokens[parent + 1])
                assert node not in with_siblings.parents.tolist()  # a leaf
            self.siblings += with_siblings.size - size
            self.compared += 1
        return sided


def test_chains_take_the_dynamic_trees_tokens(trained):
    """The chain path (top_k 1: no tree bookkeeping) proposes what EAGLE-2's growth of a top-1 tree
    proposes, row by row in a ragged batch, and decoding with siblings beside its nodes stays
    identical to generate."""
    generator = torch.Generator().manual_seed(5)
    prompts = [progression_batch(1, length, generator)[0] for length in (6, 3, 8)]
    ids, mask = left_pad(prompts)
    checker = ChainVsTree(trained, dict(depth=5, top_k=1, total_tokens=9))  # room for siblings
    output, _ = speculative_generate(trained.target, checker, ids, 30, attention_mask=mask, pad_token_id=0)
    with torch.no_grad():
        expected = trained.backbone.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    assert torch.equal(output, expected) and checker.compared > 10 and checker.siblings > 0


def test_a_chain_stops_where_the_drafter_is_unsure(trained):
    """``confidence``: a chain ends below a node whose drafter probability is under it (ragged
    chains, fewer drafter forwards); outputs stay identical; 0 drafts the full depth every step."""
    model = trained.backbone
    prompt = progression_batch(1, 6, torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.generate(prompt, do_sample=False, max_new_tokens=24)
    trained.set_tree(dict(depth=6, top_k=1, total_tokens=6))
    trained.drafter.min_acceptance, trained.drafter.siblings = 0.0, 0  # the raw threshold alone, plain chains
    sizes = {}
    for confidence in (0.0, 0.9, 0.999999):
        trained.drafter.confidence = confidence
        seen, propose = [], trained.drafter.propose
        trained.drafter.propose = lambda batch, propose=propose: seen.append(propose(batch)) or seen[-1]
        output = trained.generate(prompt, max_new_tokens=24)
        del trained.drafter.propose
        assert torch.equal(output, expected)
        sizes[confidence] = [int(trees.sizes.max()) for trees in seen]
    assert set(sizes[0.0]) == {7}  # the root and six drafted nodes every step
    assert max(sizes[0.999999]) < 7 and sum(sizes[0.9]) <= sum(sizes[0.0])
    with pytest.raises(ValueError, match="confidence must be a probability"):
        heads.attach_heads(model, kind="eagle", confidence=1.5)
    trained.set_tree(None)


def test_chain_calibration_counts_reached_and_accepted_nodes():
    from heads.eagle.calibration import ChainCalibration

    calibration = ChainCalibration()
    # row 0: drafted 5 6 7, the target produced 5 6 9 ...: two accepted, the third reached and rejected
    # row 1: drafted 4 4, the target produced 3: the first reached and rejected, the second never reached
    calibration.observe([[5, 6, 7], [4, 4]], [[9, 3, 1], [2, 8]], [[5, 6, 9, 1], [3]])
    assert calibration.seen.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 1]
    assert calibration.accepted.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    prior = ChainCalibration.PRIOR
    rates = calibration.rates(torch.tensor([9, 1, 5]))
    torch.testing.assert_close(rates, torch.tensor([1.0, prior / (1 + prior), 1.0], dtype=torch.float64))
    assert calibration.bins(torch.tensor([0.01, 0.12, 0.95])).tolist() == [0, 3, 9]


def test_min_acceptance_stops_chains_on_evidence_only(trained):
    """``min_acceptance``: a fresh calibration is optimistic (full chains); once this drafter's nodes of
    some probability were seen rejected, chains through them stop there; outputs stay identical."""
    from heads.eagle.calibration import ChainCalibration

    model = trained.backbone
    prompt = progression_batch(1, 6, torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model.generate(prompt, do_sample=False, max_new_tokens=24)
    trained.set_tree(dict(depth=6, top_k=1, total_tokens=6))
    drafter = trained.drafter
    drafter.min_acceptance, drafter.siblings, saved = 0.5, 0, trained.heads.chain_calibration
    sizes = {}
    for evidence in ("none", "rejected"):
        calibration = trained.heads.chain_calibration = drafter.calibration = ChainCalibration()
        if evidence == "rejected":  # every probability bin seen rejected a hundred times
            calibration.seen += 100
        seen, propose = [], drafter.propose
        drafter.propose = lambda batch, propose=propose: seen.append(propose(batch)) or seen[-1]
        output = trained.generate(prompt, max_new_tokens=24)
        del drafter.propose
        assert torch.equal(output, expected)
        sizes[evidence] = [int(trees.sizes.max()) for trees in seen]
    assert max(sizes["none"]) == 7 and set(sizes["rejected"]) == {2}  # the root and one node
    assert calibration.seen.sum() > 1000  # it went on learning from the chains it drafted
    trained.heads.chain_calibration = saved
    with pytest.raises(ValueError, match="min_acceptance must be a probability"):
        heads.attach_heads(model, kind="eagle", min_acceptance=-0.1)
    trained.set_tree(None)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_chain_siblings_greedy_parity_every_architecture(name):
    """Siblings beside unsure chain nodes (a random drafter is unsure everywhere): greedy outputs are
    identical to generate at batch 1 and in a left-padded batch, with sibling nodes in the verified
    trees; a lossless sampled call's trees stay chains (its chain is drawn, not a top-k pick)."""
    model = build_model(name, seed=5)
    spec = heads.attach_heads(model, kind="eagle", depth=4, top_k=1, total_tokens=8, min_acceptance=0.0)
    trees, propose = [], spec.drafter.propose
    spec.drafter.propose = lambda batch: trees.append(propose(batch)) or trees[-1]
    _check_parity(spec, model, [random_prompt(6, 7), random_prompt(11, 8)], 16)
    prompts = [random_prompt(length, 20 + length)[0] for length in (3, 9, 6)]
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), expected)
    widest = [max(len(tree.parents) - 1 - int(tree.depths.max()) for tree in step.trees()) for step in trees]
    assert max(widest) > 0  # some verified tree held more nodes than its chain's depth: siblings
    trees.clear()
    spec.generate(random_prompt(6, 9), max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0)
    assert trees and all(torch.equal(tree.parents, torch.arange(tree.size) - 1) for step in trees
                         for tree in step.trees())
