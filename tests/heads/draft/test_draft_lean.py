"""The draft model's per-level forward (``DraftModel.decode``): the lean decoder where the family
allows it, the public forward otherwise, and the same features either way (to float rounding) over a
ragged batch with holes, as the drafter runs it; its logits through the lean output head (float16
weights on a CPU with float32 ones: equal to half-precision rounding)."""

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


def ragged_forward(draft, decode: bool, dtype=torch.float32, grad: bool = False, features: bool = False):
    """Feed two rows (the second with two leading holes) then one more token each; the logits (or
    the features) of both forwards, through ``draft.decode`` or the public forward."""
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
        outputs.append(forward(tokens, positions, mask, cache.cache, "all")[0 if features else 1])
        cache.extend(valid, positions)
        step = positions[:, -1:] + 1
        mask = cache.mask(step, torch.ones(2, 1, 1, dtype=torch.bool), backbone.layout, dtype)
        outputs.append(forward(torch.tensor([[5], [9]]), step, mask, cache.cache, "last")[0 if features else 1])
    return outputs


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_lean_decode_matches_the_public_forward(name):
    _, draft = draft_heads(name)
    assert draft._lean is not None, name
    calls = []
    lean = draft._lean
    draft._lean = lambda *args: calls.append(1) or lean(*args)
    for ours, theirs in zip(ragged_forward(draft, True, features=True), ragged_forward(draft, False, features=True)):
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (name, (ours - theirs).abs().max())
    for ours, theirs in zip(ragged_forward(draft, True), ragged_forward(draft, False)):
        assert half_close(ours, theirs), (name, (ours - theirs).abs().max())
    assert len(calls) == 4  # the lean path served every forward


def half_close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Logits through a float16 head against float32 ones: within half precision's rounding of the
    weights, the features and the products' sum."""
    return ours.dtype == torch.float32 and torch.allclose(ours, theirs, atol=4e-3 * float(theirs.abs().max()) + 1e-3)


def test_the_lean_output_head_halves_the_weights_on_a_cpu_and_follows_them():
    """On a CPU with float32 weights a single row of features is multiplied by a float16 copy
    (float32 logits, equal to rounding), rebuilt after an in-place update of the weights; several
    rows (where float16 products are slower on a CPU), float64 or half precision use the head
    itself, exactly."""
    from heads.lean import LeanOutputHead

    _, draft = draft_heads("llama")
    backbone = draft.backbone
    head = LeanOutputHead(backbone)
    one = torch.randn(1, 1, backbone.output_head.weight.shape[1])
    reference = backbone.logits(one)
    ours = head(one)
    assert half_close(ours, reference) and not torch.equal(ours, reference.float())
    assert head._product[1].half_weight.dtype == torch.float16
    with torch.no_grad():
        backbone.output_head.weight.mul_(-1.0)
    assert half_close(head(one), -reference)
    rows = torch.randn(2, 3, backbone.output_head.weight.shape[1])
    assert torch.equal(head(rows), backbone.logits(rows).float())
    draft.model.double()
    assert torch.equal(head(one.double()), backbone.logits(one.double()).float())


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
        assert half_close(ours, theirs)
