"""Greedy speculative generation is token-identical to the backbone's own generate."""

from __future__ import annotations

import pytest
import torch

import heads
import heads.backbone as backbone_module
from tests.conftest import ARCHITECTURES, build_model, greedy_reference, random_prompt, record_drafted_tokens
from tree_attention.tree import DEFAULT_TREE_SIZES

pytestmark = pytest.mark.fast  # in `make test-fast`

PROMPT_LENGTHS = (1, 7, 19)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_parity_every_architecture(name):
    model = build_model(name)
    spec = heads.attach_heads(model, num_heads=4, tree=16)
    for seed, length in enumerate(PROMPT_LENGTHS):
        prompt = random_prompt(length, seed)
        expected = greedy_reference(model, prompt, 24)
        actual = spec.generate(prompt, max_new_tokens=24)
        assert torch.equal(actual, expected), f"{name}, prompt length {length}"
        assert spec.last_stats.new_tokens == 24


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_plain_steps_pass_no_mask_and_match_generate(name, monkeypatch):
    """A step that verifies each row's root alone over a cache without holes passes no 4D mask (as
    the backbone's own decoding step does; sliding-window layouts keep theirs), and plain decoding
    in the loop stays token-identical to ``generate``."""
    model = build_model(name, seed=6)
    spec = heads.attach_heads(model, num_heads=2, tree=0)
    masks = []
    original = backbone_module.Backbone.forward

    def recording(self, input_ids, position_ids, attention_mask, cache, logits_rows="all"):
        masks.append(attention_mask)
        return original(self, input_ids, position_ids, attention_mask, cache, logits_rows)

    monkeypatch.setattr(backbone_module.Backbone, "forward", recording)
    prompt = random_prompt(11, seed=7)
    assert torch.equal(spec.generate(prompt, max_new_tokens=16), greedy_reference(model, prompt, 16))
    plain = masks[1:]  # after the prefill
    assert len(plain) == 15
    if spec.target.layout is None:
        assert all(mask is None for mask in plain)
    else:
        assert all(mask is not None for mask in plain)


@pytest.mark.parametrize("size", DEFAULT_TREE_SIZES)
@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_greedy_parity_every_default_tree(name, size):
    model = build_model(name, seed=1)
    spec = heads.attach_heads(model, num_heads=4, tree=size)
    assert spec.tree.size == size + 1
    prompt = random_prompt(9, seed=size)
    assert torch.equal(spec.generate(prompt, max_new_tokens=30), greedy_reference(model, prompt, 30))


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt_neox", "phi3"])
def test_eos_in_the_middle(name):
    model = build_model(name, seed=2)
    prompt = random_prompt(5, seed=3)
    free_run = greedy_reference(model, prompt, 30)[0, prompt.shape[1]:]
    eos = int(free_run[6])
    model.generation_config.eos_token_id = eos
    spec = heads.attach_heads(model, tree=32)
    expected = greedy_reference(model, prompt, 30)
    actual = spec.generate(prompt, max_new_tokens=30)
    assert torch.equal(actual, expected)
    assert int(actual[0, -1]) == eos and actual.shape[1] < prompt.shape[1] + 30


def test_eos_list_in_generation_config():
    model = build_model("qwen2", seed=4)
    prompt = random_prompt(6, seed=5)
    free_run = greedy_reference(model, prompt, 20)[0, prompt.shape[1]:]
    model.generation_config.eos_token_id = [int(free_run[9]), int(free_run[4])]
    spec = heads.attach_heads(model)
    assert torch.equal(spec.generate(prompt, max_new_tokens=20), greedy_reference(model, prompt, 20))


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 5, 13])
def test_max_new_tokens_is_exact(max_new_tokens):
    model = build_model("llama", seed=6)
    spec = heads.attach_heads(model, tree=64)
    prompt = random_prompt(8, seed=7)
    actual = spec.generate(prompt, max_new_tokens=max_new_tokens)
    assert actual.shape[1] == prompt.shape[1] + max_new_tokens
    if max_new_tokens:
        assert torch.equal(actual, greedy_reference(model, prompt, max_new_tokens))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_eager_attention_parity(name):
    model = build_model(name, attn_implementation="eager")
    spec = heads.attach_heads(model, tree=16)
    prompt = random_prompt(11, seed=8)
    assert torch.equal(spec.generate(prompt, max_new_tokens=20), greedy_reference(model, prompt, 20))


def test_share_lm_head_parity_and_size():
    model = build_model("gemma2")
    shared = heads.attach_heads(model, share_lm_head=True)
    separate = heads.attach_heads(model, share_lm_head=False)
    prompt = random_prompt(6, seed=9)
    assert torch.equal(shared.generate(prompt, max_new_tokens=16), greedy_reference(model, prompt, 16))
    count = lambda module: sum(p.numel() for p in module.parameters())
    assert count(separate.heads) - count(shared.heads) == 4 * model.config.vocab_size * model.config.hidden_size


def test_untrained_heads_start_as_the_backbone_head():
    model = build_model("llama")
    spec = heads.attach_heads(model, num_heads=3)
    ids = random_prompt(5, seed=10)
    with torch.no_grad():
        features = spec.target.features(ids, torch.arange(5)[None], None, None)
        head_logits = spec.heads(features)
        own = model(ids).logits
    assert head_logits.shape == (3, 1, 5, model.config.vocab_size)
    for k in range(3):
        torch.testing.assert_close(head_logits[k], own, rtol=1e-5, atol=1e-5)


def test_attach_freezes_backbone_and_keeps_outputs():
    model = build_model("mistral")
    ids = random_prompt(9, seed=11)
    with torch.no_grad():
        before = model(ids).logits
    spec = heads.attach_heads(model)
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.requires_grad for p in spec.heads.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    assert spec.backbone is model


@pytest.mark.parametrize("name", ["llama", "gpt2", "phi3"])
def test_draft_vocabulary_parity_and_token_map(name):
    """Heads that score a draft vocabulary draft only its tokens (mapped back to target ids) and stay
    token-identical to the backbone; the projections restart from the output head's rows."""
    model = build_model(name, seed=2)
    spec = heads.attach_heads(model, num_heads=3, tree=16, draft_vocab_size=30)
    token_map = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:30]
    spec.heads.set_token_map(token_map, model.get_output_embeddings())
    torch.testing.assert_close(spec.heads.projections[1].weight, model.get_output_embeddings().weight[token_map])
    proposed = record_drafted_tokens(spec)
    for seed, length in enumerate(PROMPT_LENGTHS):
        prompt = random_prompt(length, seed)
        assert torch.equal(spec.generate(prompt, max_new_tokens=24), greedy_reference(model, prompt, 24))
    assert proposed and set(proposed) <= set(token_map.tolist())
    with pytest.raises(ValueError, match="30 distinct ids"):
        spec.heads.set_token_map(torch.zeros(30, dtype=torch.long))
    with pytest.raises(heads.InvalidTreeError, match="tree rank 30 .* the draft vocabulary has 30 tokens"):
        spec.set_tree([[0], [30]])
    with pytest.raises(ValueError, match="share_lm_head"):
        heads.attach_heads(model, draft_vocab_size=30, share_lm_head=True)
    with pytest.raises(ValueError, match="exceeds the backbone's vocabulary"):
        heads.attach_heads(model, draft_vocab_size=10 ** 6)
    with pytest.raises(ValueError, match="positive int"):
        heads.attach_heads(model, draft_vocab_size=0)
