"""Parallel drafting for EAGLE (``parallel=K``, both ``parallel_mode``s): greedy parity on several
families and batches with padding, the mask queries at decode time and in the training forward
against a naive per-anchor run, the heads mode's drafts and stopped gradient, adapters (round trip, older adapters, export refusal), the static tree, training."""

from __future__ import annotations

import json

import pytest
import torch

import heads
from heads import interop
from heads.eagle import EagleConfig, ParallelEagleDrafter, parallel_attention_mask, parallel_template
from heads.eagle import parallel as parallel_module
from tests.conftest import build_model, greedy_reference, left_pad, progression_batch, random_prompt
from training.trainer import TrainConfig, make_trainer
from tree_attention import cache as cache_ops
from tree_attention.draft_batch import DraftBatch
from tree_attention.mask import layout_masks, prefill_attention_mask


def _batch_parity(spec, model, prompts, max_new_tokens: int = 20) -> None:
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens), expected)


@pytest.mark.parametrize("name, options", [
    ("llama", dict(top_k=2, total_tokens=5)), ("mistral", {}), ("gpt2", dict(top_k=3, total_tokens=6)),
    ("gemma2", dict(top_k=2, total_tokens=4)), ("qwen2", dict(layout="eagle1", draft_vocab_size=40, top_k=2)),
    ("phi3", dict(feature_layers=(0, 1, 2))),
])
@pytest.mark.parametrize("mode, head_input", [("heads", "prediction"), ("heads", "feature"), ("mask", None)])
def test_greedy_parity_random_drafter_batch_1_and_padded(name, options, mode, head_input):
    model = build_model(name, seed=3)
    spec = heads.attach_heads(model, kind="eagle", parallel=3, parallel_mode=mode, head_input=head_input, **options)
    assert isinstance(spec.drafter, ParallelEagleDrafter)
    assert (spec.heads.parallel_heads is not None) == (mode == "heads")
    if mode == "heads":  # heads that do not merely repeat the root's next token
        torch.manual_seed(4)
        with torch.no_grad():
            for parameter in spec.heads.parallel_heads.parameters():
                parameter.add_(torch.randn_like(parameter), alpha=0.3)
    for seed, length in enumerate((1, 15)):  # longer than the tiny sliding windows once generated
        prompt = random_prompt(length, seed)
        assert torch.equal(spec.generate(prompt, max_new_tokens=20), greedy_reference(model, prompt, 20))
    _batch_parity(spec, model, [random_prompt(length, length)[0] for length in (3, 11, 6)])


def _mask_query_mask(prefix: int, count: int, layout):
    """Mask of ``count`` mask queries after ``prefix`` committed pairs in a cache: query ``j`` sees
    the pairs and mask queries ``1..j``."""
    visible = torch.ones(1, count, prefix + count, dtype=torch.bool)
    visible[0, :, prefix:] = torch.ones(count, count, dtype=torch.bool).tril_()
    positions = prefix - 1 + torch.arange(1, count + 1)[None]
    keys = torch.cat([torch.arange(prefix)[None], positions], dim=1)
    return layout_masks(visible, positions, keys, layout, torch.float32)


@pytest.mark.parametrize("name, options", [
    ("mistral", {}), ("gemma2", {}), ("gpt2", {}), ("qwen2", dict(layout="eagle1")),
    ("llama", dict(layout="eagle3", feature_layers=(0, 1, 2))),
])
@pytest.mark.usefixtures("full_precision_drafters")
def test_training_forward_equals_naive_and_decode_time_mask_queries(name, options):
    """Anchor t's mask query j in the extended-sequence training forward equals (a) committing the
    pairs up to t and then running mask queries one by one against the cache, and (b) the drafter's
    own decode-time forward for a sequence that ends at t (pairs, root and mask queries together)."""
    model = build_model(name, seed=8)
    parallel = 4
    spec = heads.attach_heads(model, kind="eagle", parallel=parallel, parallel_mode="mask", **options)
    drafter = spec.heads
    torch.manual_seed(1)
    with torch.no_grad():
        drafter.mask_embedding.normal_()
        drafter.mask_feature.normal_()
    length = 16
    ids = random_prompt(length, seed=9)
    with torch.no_grad():
        features, _ = spec.target.forward(ids, torch.arange(length)[None], None, None, "last")
        embeddings = spec.target.input_embeddings(ids)
        extended = drafter(features, embeddings, parallel=True)
        assert len(extended) == parallel
        for anchor in (0, 5, 12, length - 2):
            cache = cache_ops.new_cache()
            mask = prefill_attention_mask(anchor + 1, drafter.layout, torch.float32, "cpu")
            hidden = drafter.step(drafter.fuse(features[:, :anchor + 1]), embeddings[:, 1:anchor + 2],
                                  torch.arange(anchor + 1)[None], mask, cache)[:, -1]
            torch.testing.assert_close(hidden, extended[0][:, anchor], rtol=1e-4, atol=1e-5)
            for query in range(1, parallel):
                mask_features, mask_embeddings = drafter.mask_inputs(1, 1)
                position = torch.tensor([[anchor + query]])
                mask = _mask_query_mask(anchor + 1, query, drafter.layout)  # the last row is this query's
                mask = ({kind: value[:, :, -1:] for kind, value in mask.items()} if isinstance(mask, dict)
                        else mask[:, :, -1:])
                hidden = drafter.step(mask_features, mask_embeddings, position, mask, cache)[:, -1]
                torch.testing.assert_close(hidden, extended[query][:, anchor], rtol=1e-4, atol=1e-5)
            live = ParallelEagleDrafter(drafter, spec.target, spec.config)
            batch = DraftBatch(features[:, :anchor + 1], ids[:, :anchor + 1], torch.tensor([anchor + 1]),
                               ids[:, anchor + 1])
            drafted = live._draft(batch)[0]  # (K, d)
            expected = torch.stack([extended[depth][0, anchor] for depth in range(parallel)])
            torch.testing.assert_close(drafted, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, options", [
    ("mistral", {}), ("gpt2", dict(draft_vocab_size=40)), ("gemma2", {}),
    ("llama", dict(layout="eagle3", feature_layers=(0, 1, 2))),
])
@pytest.mark.usefixtures("full_precision_drafters")
@pytest.mark.parametrize("head_input", ["prediction", "feature"])
def test_heads_mode_drafts_medusa_heads_with_a_stopped_gradient(name, options, head_input):
    """``heads`` mode: the drafter's own forward is the sequential one (depth 1), head ``j`` reads the
    drafter's depth-1 prediction (``prediction``) or the root's input feature (``feature``) and gives
    depth ``j + 1`` through its own output rows (started as the output head's rows of the draft
    vocabulary); the decode-time draft for a sequence that ends at anchor t equals the training-time
    values at t, on the dense and the general path; and the heads' outputs send no gradient into the
    drafter's layer, projection or fusion."""
    model = build_model(name, seed=8)
    parallel = 3
    spec = heads.attach_heads(model, kind="eagle", parallel=parallel, head_input=head_input, **options)
    drafter, target = spec.heads, spec.target
    assert drafter.mask_feature is None and len(drafter.parallel_heads) == parallel - 1
    rows = target.output_rows(drafter.token_map).weight
    assert all(torch.equal(head.weight, rows) for head in drafter.parallel_heads)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in drafter.parallel_heads.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.3)
    length = 16
    ids = random_prompt(length, seed=9)
    with torch.no_grad():
        features, _ = spec.target.forward(ids, torch.arange(length)[None], None, None, "last")
        if target.feature_layers is not None:
            _, features = target.hidden_features(ids, None, torch.ones_like(ids), None, target.feature_layers)
    embeddings = target.input_embeddings(ids)
    first = drafter(features, embeddings, 1)[0]  # (1, T, d)
    inputs = drafter.head_inputs(first, features)
    if head_input == "feature":
        torch.testing.assert_close(inputs, drafter.fuse(features))
    else:
        torch.testing.assert_close(inputs, drafter.head_features(first))
    depth_logits = drafter.depth_logits(target, inputs)
    assert len(depth_logits) == parallel - 1
    for head, logits in zip(drafter.parallel_heads, depth_logits):
        expected = target.logits(inputs + torch.nn.functional.silu(head.linear(inputs)),
                                 heads.backbone.OutputRows(head.weight, None))
        torch.testing.assert_close(logits, expected)
    draft_rows = drafter.draft_rows(target)
    with torch.no_grad():
        trained = torch.stack([target.logits(first, draft_rows)] + depth_logits, dim=2)[0]  # (T, K, V')
        for anchor in (0, 5, length - 2):
            live = ParallelEagleDrafter(drafter, target, spec.config)
            batch = DraftBatch(features[:, :anchor + 1], ids[:, :anchor + 1], torch.tensor([anchor + 1]),
                               ids[:, anchor + 1])
            torch.testing.assert_close(live._logits(batch, parallel)[0], trained[anchor], rtol=1e-4, atol=1e-4)
        # a left-padded row (the general path, with holes) drafts what the row alone drafts
        live = ParallelEagleDrafter(drafter, target, spec.config)
        live.reset(2)
        anchor = 7
        padded = torch.zeros(2, anchor + 1, features.shape[-1])
        padded[0] = features[0, :anchor + 1]
        padded[1, :4] = features[0, anchor - 3:anchor + 1]
        tokens = torch.stack([ids[0, :anchor + 1], torch.cat([ids[0, anchor - 3:anchor + 1], ids.new_zeros(anchor - 3)])])
        batch = DraftBatch(padded, tokens, torch.tensor([anchor + 1, 4]), ids[:, anchor + 1].expand(2))
        drafted = live._logits(batch, parallel)
        torch.testing.assert_close(drafted[0], trained[anchor], rtol=1e-4, atol=1e-4)
        alone = ParallelEagleDrafter(drafter, target, spec.config)  # the padded row's last 4 entries on their own
        short = DraftBatch(features[:, anchor - 3:anchor + 1], ids[:, anchor - 3:anchor + 1], torch.tensor([4]),
                           ids[:, anchor + 1])
        torch.testing.assert_close(drafted[1], alone._logits(short, parallel)[0], rtol=1e-4, atol=1e-4)
        if head_input == "feature":  # the heads read the root's feature alone
            torch.testing.assert_close(drafted[1, 1:], trained[anchor, 1:], rtol=1e-4, atol=1e-4)
    drafter.zero_grad()
    first = drafter(features, embeddings, 1)[0]
    sum(logits.square().sum() for logits in drafter.depth_logits(target, drafter.head_inputs(first, features))).backward()
    shared = [(key, parameter) for key, parameter in drafter.named_parameters() if not key.startswith("parallel_heads")]
    assert shared and all(parameter.grad is None or not parameter.grad.any() for _, parameter in shared)
    assert all(parameter.grad is not None and parameter.grad.any() for parameter in drafter.parallel_heads.parameters())
    with pytest.raises(ValueError, match="parallel_mode 'mask'"):
        drafter(features, embeddings, parallel=True)
    # serving stacks the heads' tensors once; an in-place update (an optimizer step) rebuilds them
    for scale in (1.0, 1.5):
        with torch.no_grad():
            for parameter in drafter.parallel_heads.parameters():
                parameter.mul_(scale)
            served = drafter.depth_logits(target, inputs)
        with torch.enable_grad():
            reference = drafter.depth_logits(target, inputs)
        for got, want in zip(served, reference):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_heads_mode_drafter_trains_exactly_as_a_sequential_drafter():
    """The parallel heads never touch the drafter's training: same start, same data and steps, the
    drafter's own tensors end equal to a sequential-only drafter's (their gradients are apart from the
    heads', clipped apart too: a shared clip would let the heads' large early gradients shrink the
    drafter's updates); the heads themselves did train."""
    model = build_model("llama", seed=4)
    sequences = list(greedy_reference(model, progression_batch(24, 6, torch.Generator().manual_seed(7)), 12))
    trained = {}
    for parallel in (1, 3):
        torch.manual_seed(0)
        spec = heads.attach_heads(model, kind="eagle", parallel=parallel)
        start = {key: value.clone() for key, value in spec.heads.state_dict().items()}
        _train(spec, sequences, steps=4, batch_size=4, max_grad_norm=0.05)
        trained[parallel] = (start, spec.heads.state_dict())
    (start_1, end_1), (start_3, end_3) = trained[1], trained[3]
    for key, value in end_1.items():
        torch.testing.assert_close(start_3[key], start_1[key])
        torch.testing.assert_close(end_3[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert sum(not torch.equal(value, start_1[key]) for key, value in end_1.items()) > len(end_1) // 2
    moved = [key for key in end_3 if key.startswith("parallel_heads") and not torch.equal(end_3[key], start_3[key])]
    assert moved


def test_parallel_mask_blocks():
    mask = parallel_attention_mask(3, 3, None, torch.float32, "cpu")
    seen = (mask[0, 0] == 0).int().tolist()
    assert seen[0] == [1, 0, 0, 0, 0, 0, 0, 0, 0]  # real pair at 0
    assert seen[2] == [1, 1, 1, 0, 0, 0, 0, 0, 0]  # real pair at 2: causal
    assert seen[4] == [1, 1, 0, 0, 1, 0, 0, 0, 0]  # anchor 1, mask query 1
    assert seen[7] == [1, 1, 0, 0, 1, 0, 0, 1, 0]  # anchor 1, mask query 2: its query 1 and itself


def test_static_tree_shape_and_config():
    config = EagleConfig(parallel=3, depth=4, top_k=2, total_tokens=5)
    template = parallel_template(config)
    assert template.max_depth <= 3 and template.max_rank == 1 and template.size == 6
    assert parallel_template(EagleConfig(parallel=3, total_tokens=6, depth=6)).paths == ((0,), (0, 0), (0, 0, 0))
    assert parallel_template(EagleConfig(parallel=3)).paths == ((0,), (0, 0), (0, 0, 0))  # the default chain, cut
    measured = [[0.9, 0.05], [0.2, 0.6], [0.5, 0.1]]  # rank 1 better than rank 0 at depth 2
    assert (0, 1) in parallel_template(config, measured).paths
    with pytest.raises(ValueError, match="parallel must be an int >= 1"):
        EagleConfig(parallel=0)
    assert EagleConfig().parallel == 1 and EagleConfig().to_dict()["parallel"] == 1


def _train(spec, sequences, steps: int, **config):
    torch.manual_seed(0)
    options = {**dict(steps=steps, batch_size=8, learning_rate=1e-2, warmup_steps=3, token_weight=1.0), **config}
    return make_trainer(spec, sequences, TrainConfig(**options), progress=False).train()


@pytest.fixture(scope="module", params=["heads", "mask"])
def trained(toy_target, request):
    sequences = list(greedy_reference(toy_target, progression_batch(48, 6, torch.Generator().manual_seed(7)), 24))
    spec = heads.attach_heads(toy_target, kind="eagle", parallel=3, parallel_mode=request.param)
    before = [row[0] for row in make_trainer(spec, sequences, TrainConfig(steps=1), progress=False).rank_accuracy()]
    result = _train(spec, sequences, steps=120)
    return spec, before, result


def test_training_lifts_parallel_depth_accuracy_and_decodes_losslessly(trained):
    spec, before, result = trained
    after = [row[0] for row in result.accuracy]  # top-1 per depth, held out
    assert len(after) == 3 and spec.accuracy == result.accuracy
    assert min(after) > 0.2 and min(after[1] - before[1], after[2] - before[2]) > 0.2, (before, after)
    generator = torch.Generator().manual_seed(11)
    prompts = [progression_batch(1, length, generator)[0] for length in (5, 8, 3)]
    for prompt in prompts[:2]:
        assert torch.equal(spec.generate(prompt[None], max_new_tokens=24),
                           greedy_reference(spec.backbone, prompt[None], 24))
        assert spec.last_stats.mean_accepted > 1.6  # beyond 2 only with depths 2-3 from the mask queries or heads
    _batch_parity(spec, spec.backbone, prompts, 24)
    with pytest.raises(ValueError, match="unroll_steps"):
        _train(heads.attach_heads(spec.backbone, kind="eagle", parallel=2, parallel_mode="mask"), [prompts[0]] * 8, 1,
               unroll_steps=2)
    unrolled = heads.attach_heads(spec.backbone, kind="eagle", parallel=2)  # heads mode trains unrolled steps too
    assert len(_train(unrolled, [prompts[0]] * 8, 1, unroll_steps=2).accuracy) == 2


def test_adapter_round_trip_and_older_adapters(trained, tmp_path):
    spec, _, _ = trained
    spec.save_pretrained(tmp_path / "parallel")
    config = json.loads((tmp_path / "parallel" / "adapter_config.json").read_text())
    assert config["drafter"]["parallel"] == 3 and len(config["tree_accuracy"]) == 3
    loaded = heads.load_heads(spec.backbone, tmp_path / "parallel")
    assert loaded.config.parallel == 3 and isinstance(loaded.drafter, ParallelEagleDrafter)
    mode = spec.config.parallel_mode
    assert config["drafter"]["parallel_mode"] == mode and loaded.config.parallel_mode == mode
    state = loaded.heads.state_dict()
    for key, value in spec.heads.state_dict().items():
        torch.testing.assert_close(state[key], value)
    assert any(key.startswith("parallel_heads." if mode == "heads" else "mask_embedding") for key in state)
    assert loaded.drafter.template.paths == spec.drafter.template.paths
    prompt = progression_batch(1, 6, torch.Generator().manual_seed(5))
    expected = spec.generate(prompt, max_new_tokens=16)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=16), expected)
    if mode == "heads":
        assert config["drafter"]["head_input"] == "prediction" and loaded.config.head_input == "prediction"
    # an adapter written before the mode's newest field existed: heads read the root's feature (head_input),
    # a parallel drafter drafts with its mask queries (parallel_mode)
    field, older_value = ("head_input", "feature") if mode == "heads" else ("parallel_mode", "mask")
    path = tmp_path / "parallel" / "adapter_config.json"
    del config["drafter"][field]
    path.write_text(json.dumps(config))
    older = heads.load_heads(spec.backbone, tmp_path / "parallel")
    assert getattr(older.config, field) == older_value
    assert torch.equal(older.generate(prompt, max_new_tokens=16), expected)
    sequential = heads.attach_heads(spec.backbone, kind="eagle")
    assert "mask_embedding" not in sequential.heads.state_dict()
    sequential.save_pretrained(tmp_path / "older")
    path = tmp_path / "older" / "adapter_config.json"
    older = json.loads(path.read_text())
    del older["drafter"]["parallel"]  # written before the field existed
    path.write_text(json.dumps(older))
    assert heads.load_heads(spec.backbone, tmp_path / "older").config.parallel == 1


def test_export_refuses_parallel_depths_that_share_the_drafters_layer(tmp_path):
    model = build_model("llama", seed=2)
    heads.attach_heads(model, kind="eagle", layout="eagle1", parallel=2,
                       parallel_mode="mask").save_pretrained(tmp_path / "eagle")
    with pytest.raises(heads.AdapterError, match=r"mask \(parallel > 1\).*--parallel 1, or with --parallel-mode heads"):
        interop.export_adapter(tmp_path / "eagle", "eagle", tmp_path / "out", model=model)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["llama", "llama-tied", "phi3"])
def test_dense_fast_path_drafts_what_the_general_path_drafts(name, monkeypatch):
    """Batch 1 without padding takes the dense path (causal extension mask, contiguous positions);
    forcing the general path (holes and per-row bookkeeping) on the same steps gives the same
    features to float rounding and the same trees (mask queries; the heads mode's commit forward is
    the sequential drafter's, and its general path is checked in the heads-mode test above)."""
    model = build_model(name, seed=4)
    spec = heads.attach_heads(model, kind="eagle", parallel=3, top_k=2, total_tokens=5, parallel_mode="mask")
    torch.manual_seed(2)
    with torch.no_grad():
        for parameter in spec.heads.parameters():
            parameter.normal_(std=0.3)
    ids = random_prompt(24, seed=5)
    with torch.no_grad():
        features, _ = spec.target.forward(ids, torch.arange(24)[None], None, None, "last")
    steps = [(0, 9), (9, 12), (12, 13), (13, 17), (17, 23)]  # (start, end): pairs committed per step

    def run(general: bool):
        if general:
            monkeypatch.setattr(cache_ops.RaggedCache, "dense", lambda self: False)
        drafter = ParallelEagleDrafter(spec.heads, spec.target, spec.config)
        outputs = []
        for start, end in steps:
            batch = DraftBatch(features[:, start:end], ids[:, start:end], torch.tensor([end - start]), ids[:, end])
            with torch.no_grad():
                outputs.append((drafter._draft(batch), drafter.cache.width))
        monkeypatch.undo()
        return outputs

    calls = []
    original = parallel_module.dense_forward
    monkeypatch.setattr(parallel_module, "dense_forward", lambda *a: calls.append(1) or original(*a))
    dense = run(general=False)
    assert len(calls) == len(steps)
    general = run(general=True)
    for (fast, fast_width), (slow, slow_width) in zip(dense, general):
        assert fast_width == slow_width
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
