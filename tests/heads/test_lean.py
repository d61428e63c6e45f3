"""The lean drafter forward (heads/lean.py) equals the decoder copy's public forward: same outputs,
same cache entries, for every family it accepts and both layouts it serves; other families keep the
public forward."""

from __future__ import annotations

import pytest
import torch

import heads
from tests.conftest import build_model
from tree_attention import cache as cache_ops
from tree_attention.mask import layout_masks

LEAN_FAMILIES = ("llama", "llama-tied", "mistral", "qwen2")


def _masks(heads_module, committed: int, new: int, tree: bool):
    """A causal prefill over ``committed`` pairs, or ``new`` tree queries (siblings at one depth,
    each seeing the cache and itself) over a cache of ``committed``."""
    if not tree:
        visible = torch.ones(1, committed, committed, dtype=torch.bool).tril_()
        positions = torch.arange(committed)[None]
        return positions, layout_masks(visible, positions, positions, heads_module.layout, torch.float32)
    visible = torch.cat([torch.ones(1, new, committed, dtype=torch.bool),
                         torch.eye(new, dtype=torch.bool)[None]], dim=2)
    queries = torch.full((1, new), committed)
    keys = torch.cat([torch.arange(committed)[None], queries], dim=1)
    return queries, layout_masks(visible, queries, keys, heads_module.layout, torch.float32)


@pytest.mark.parametrize("layout, name", [(layout, name) for layout in ("native", "eagle1") for name in LEAN_FAMILIES]
                         + [("eagle3", "llama"), ("eagle3", "llama-tied")])
def test_lean_forward_equals_the_decoders_forward(name, layout):
    """Native and EAGLE-1 decoder copies (two layers) and the EAGLE-3 midlayer (fused-feature
    input, pre-norm output)."""
    model = build_model(name)
    options = dict(feature_layers=[0, 1, 2], num_layers=1) if layout == "eagle3" else dict(num_layers=2)
    drafter = heads.attach_heads(model, kind="eagle", layout=layout, **options).heads
    assert drafter._lean is not None
    torch.manual_seed(0)
    for parameter in drafter.parameters():  # trained-looking weights, not the zero/identity init
        torch.nn.init.normal_(parameter, std=0.3)
    committed, new, d = 20, 3, drafter.hidden_size
    features, embeddings = torch.randn(1, committed + new, d), torch.randn(1, committed + new, d)
    outputs, caches = {}, {}
    lean = drafter._lean
    for mode in ("public", "lean"):
        drafter._lean = lean if mode == "lean" else None
        cache = cache_ops.new_cache()
        with torch.no_grad():
            positions, mask = _masks(drafter, committed, new, tree=False)
            first = drafter.step(features[:, :committed], embeddings[:, :committed], positions, mask, cache)
            positions, mask = _masks(drafter, committed, new, tree=True)
            second = drafter.step(features[:, committed:], embeddings[:, committed:], positions, mask, cache)
        outputs[mode], caches[mode] = (first, second), cache
    for public, lean_output in zip(outputs["public"], outputs["lean"]):
        torch.testing.assert_close(lean_output, public, rtol=1e-5, atol=1e-5)
    for public_layer, lean_layer in zip(caches["public"].layers, caches["lean"].layers):
        torch.testing.assert_close(lean_layer.keys, public_layer.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lean_layer.values, public_layer.values, rtol=1e-5, atol=1e-5)


def test_lean_forward_is_inference_only():
    """With gradients on (training) the decoder's own forward runs, so its autograd graph is the
    library's; the lean one is never called."""
    model = build_model("llama")
    drafter = heads.attach_heads(model, kind="eagle").heads
    calls = []
    original = drafter._lean
    drafter._lean = lambda *args: calls.append(1) or original(*args)
    features = torch.randn(1, 4, drafter.hidden_size)
    positions, mask = _masks(drafter, 4, 0, tree=False)
    drafter.step(features, features, positions, mask, cache_ops.new_cache()).sum().backward()
    assert not calls and drafter.projection.weight.grad is not None
    with torch.no_grad():
        drafter.step(features, features, positions, mask, cache_ops.new_cache())
    assert calls == [1]


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "phi3", "gemma2"])
def test_other_families_keep_the_public_forward(name):
    drafter = heads.attach_heads(build_model(name), kind="eagle").heads
    assert drafter._lean is None


def test_a_rotary_table_grows_past_its_first_size():
    """Positions beyond the first cached rotary table (256) are rotated like the model does."""
    model = build_model("llama")
    drafter = heads.attach_heads(model, kind="eagle").heads
    torch.manual_seed(1)
    for parameter in drafter.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    inputs = torch.randn(1, 2, drafter.hidden_size)
    lean = drafter._lean
    for positions in (torch.tensor([[3, 4]]), torch.tensor([[300, 301]])):
        visible = torch.ones(1, 2, 2, dtype=torch.bool).tril_()
        mask = layout_masks(visible, positions, positions, drafter.layout, torch.float32)
        with torch.no_grad():
            drafter._lean = lean
            fast = drafter.step(inputs, inputs, positions, mask, None)
            drafter._lean = None
            slow = drafter.step(inputs, inputs, positions, mask, None)
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_fused_weights_follow_in_place_updates_and_moves():
    """The lean forward's fused projections are rebuilt when a source weight changes in place (an
    optimizer step, ``load_state_dict``) or moves (``.to()``): it keeps equalling the public forward."""
    model = build_model("qwen2")  # q/k/v biases
    drafter = heads.attach_heads(model, kind="eagle").heads
    lean = drafter._lean
    features = torch.randn(1, 5, drafter.hidden_size)
    positions, mask = _masks(drafter, 5, 0, tree=False)

    def both():
        with torch.no_grad():
            drafter._lean = None
            public = drafter.step(features, features, positions, mask, cache_ops.new_cache())
            drafter._lean = lean
            return public, drafter.step(features, features, positions, mask, cache_ops.new_cache())

    torch.testing.assert_close(*reversed(both()), rtol=1e-5, atol=1e-5)
    layer = drafter.decoder.layers[0]
    with torch.no_grad():
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.up_proj):
            module.weight.mul_(1.5)
        layer.self_attn.q_proj.bias.add_(0.3)
    public, fast = both()
    torch.testing.assert_close(fast, public, rtol=1e-5, atol=1e-5)
    drafter.to(torch.float64)
    features = features.double()
    positions, mask = _masks(drafter, 5, 0, tree=False)
    mask = mask.double() if isinstance(mask, torch.Tensor) else mask
    public, fast = both()
    assert fast.dtype == torch.float64
    torch.testing.assert_close(fast, public, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layout, name", [("native", "llama"), ("eagle3", "llama")])
def test_a_single_query_multiplies_by_half_precision_copies(layout, name):
    """One query (a chain level at batch 1) on a CPU with float32 weights runs every projection on a
    float16 copy of its weights: equal to the public forward to half-precision rounding, not
    bitwise; the cache gets the same keys to that rounding, and the copies follow in-place updates.
    Two or more queries keep the float32 weights (equal to float rounding)."""
    options = dict(feature_layers=[0, 1, 2], num_layers=1) if layout == "eagle3" else dict(num_layers=1)
    drafter = heads.attach_heads(build_model(name), kind="eagle", layout=layout, **options).heads
    torch.manual_seed(2)
    for parameter in drafter.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    lean, d = drafter._lean, drafter.hidden_size
    features, embeddings = torch.randn(1, 9, d), torch.randn(1, 9, d)

    def both(new: int):
        outputs = []
        for module in (None, lean):
            drafter._lean = module
            cache = cache_ops.new_cache()
            with torch.no_grad():
                positions, mask = _masks(drafter, 8, 0, tree=False)
                drafter.step(features[:, :8], embeddings[:, :8], positions, mask, cache)
                positions, mask = _masks(drafter, 8, new, tree=True)
                outputs.append(drafter.step(features[:, 8:8 + new].expand(-1, new, -1),
                                            embeddings[:, 8:8 + new].expand(-1, new, -1), positions, mask, cache))
        return outputs

    public, fast = both(1)
    assert not torch.equal(fast, public)  # the float16 copies ran
    torch.testing.assert_close(fast, public, rtol=2e-2, atol=2e-2)
    public, fast = both(2)
    torch.testing.assert_close(fast, public, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        first = drafter.decoder.mlp.up_proj if layout == "eagle3" else drafter.decoder.layers[0].mlp.up_proj
        first.weight.mul_(-2.0)
    public, fast = both(1)
    torch.testing.assert_close(fast, public, rtol=2e-2, atol=2e-2)


def test_a_single_row_past_half_precisions_range_is_computed_in_float32():
    """A float16 product that overflows (activations past 65504) falls back to the float32 weights:
    finite and equal to the exact product."""
    from heads.lean import _Product

    torch.manual_seed(3)
    weight, bias = torch.randn(8, 4), torch.randn(8)
    product = _Product.of(weight, bias)
    small = torch.randn(1, 1, 4)
    assert not torch.equal(product(small, True), torch.nn.functional.linear(small, weight, bias))  # float16 ran
    large = torch.full((1, 1, 4), 1e5)
    out = product(large, True)
    assert torch.isfinite(out).all()
    assert torch.equal(out, torch.nn.functional.linear(large, weight, bias))
