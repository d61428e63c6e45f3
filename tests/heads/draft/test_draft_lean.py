"""The draft model's per-level forward (``DraftModel.decode``): the lean decoder where the family
allows it, the public forward otherwise, and the same logits either way (to float rounding) over a
ragged batch with holes, as the drafter runs it."""

from __future__ import annotations

import pytest
import torch

import heads
from tests.conftest import build_model, random_prompt
from tree_attention import cache as cache_ops
from tree_attention.mask import causal_visibility


def draft_heads(name: str):
    model = build_model(name)
    spec = heads.attach_heads(model, kind="draft", draft_model=build_model(name, seed=3), depth=3, total_tokens=3,
                              adaptive=False)
    return model, spec.heads


def ragged_forward(draft, decode: bool, dtype=torch.float32, grad: bool = False):
    """Feed two rows (the second with two leading holes) then one more token each; the logits of
    both forwards, through ``draft.decode`` or the public forward."""
    backbone = draft.backbone
    cache = cache_ops.RaggedCache(2, torch.device("cpu"))
    tokens = torch.stack([random_prompt(7, seed=1)[0], random_prompt(7, seed=2)[0]])
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :2] = False
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    visible = causal_visibility(7, tokens.device) & (valid[:, None, :] | torch.eye(7, dtype=torch.bool)[None])
    forward = draft.decode if decode else backbone.forward
    outputs = []
    with torch.set_grad_enabled(grad):
        mask = cache.mask(positions, visible, backbone.layout, dtype)
        outputs.append(forward(tokens, positions, mask, cache.cache, "all")[1])
        cache.extend(valid, positions)
        step = positions[:, -1:] + 1
        mask = cache.mask(step, torch.ones(2, 1, 1, dtype=torch.bool), backbone.layout, dtype)
        outputs.append(forward(torch.tensor([[5], [9]]), step, mask, cache.cache, "last")[1])
    return outputs


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_lean_decode_matches_the_public_forward(name):
    _, draft = draft_heads(name)
    assert draft._lean is not None, name
    calls = []
    lean = draft._lean
    draft._lean = lambda *args: calls.append(1) or lean(*args)
    for ours, theirs in zip(ragged_forward(draft, True), ragged_forward(draft, False)):
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (name, (ours - theirs).abs().max())
    assert len(calls) == 2  # the lean path served both forwards


@pytest.mark.parametrize("name", ["gpt2", "gemma2"])
def test_other_families_use_the_public_forward(name):
    _, draft = draft_heads(name)
    assert draft._lean is None
    for ours, theirs in zip(ragged_forward(draft, True), ragged_forward(draft, False)):
        assert torch.equal(ours, theirs)


def test_gradients_and_a_lora_use_the_public_forward():
    """Training differentiates through the public forward; a peft LoRA is not in the lean weights."""
    _, draft = draft_heads("llama")
    draft._lean = lambda *args: pytest.fail("the lean decoder ran")
    ragged_forward(draft, True, grad=True)
    draft.add_lora(4, 8.0, None)
    ragged_forward(draft, True)


def test_a_draft_model_kept_after_an_optimizer_step_drafts_with_the_new_weights():
    """The lean decoder's fused weights follow in-place updates of the draft's weights."""
    _, draft = draft_heads("llama")
    before = ragged_forward(draft, True)
    with torch.no_grad():
        for parameter in draft.model.model.layers[0].self_attn.q_proj.parameters():
            parameter.mul_(1.5)
    after, public = ragged_forward(draft, True), ragged_forward(draft, False)
    assert not torch.allclose(before[0], after[0])
    for ours, theirs in zip(after, public):
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
