"""Bad input gets a clear, specific error."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

import heads
from tests.conftest import build_model, random_prompt


def test_not_a_pretrained_model():
    with pytest.raises(TypeError, match="Linear is not a transformers PreTrainedModel"):
        heads.attach_heads(nn.Linear(3, 3))


def test_encoder_only_model():
    model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=32))
    with pytest.raises(TypeError, match="BertForMaskedLM.*not a decoder-only causal LM"):
        heads.attach_heads(model)


def test_seq2seq_model():
    model = T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                                d_kv=8))
    with pytest.raises(TypeError, match="encoder-decoder"):
        heads.attach_heads(model)


def test_unsupported_attention_implementation():
    model = build_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(TypeError, match="flash_attention_2.*4D attention mask"):
        heads.attach_heads(model)


def test_model_that_ignores_the_4d_mask_is_refused():
    model = build_model("llama")
    target = heads.inspect_backbone(model)
    original = target.base.forward

    def causal_only(*args, attention_mask=None, **kwargs):  # a forward that drops custom masks
        return original(*args, attention_mask=None, **kwargs)

    target.base.forward = causal_only
    with pytest.raises(TypeError, match="does not honour a custom 4D attention mask"):
        heads.backbone.probe_backbone(target)


def test_unknown_kind_and_eagle_works():
    model = build_model("llama")
    with pytest.raises(ValueError, match="kind must be one of"):
        heads.attach_heads(model, kind="lookahead")
    spec = heads.attach_heads(model, kind="eagle")
    assert spec.kind == "eagle" and isinstance(spec.heads, heads.EagleHeads)
    prompt = random_prompt(5, 0)
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8)
    assert torch.equal(spec.generate(prompt, max_new_tokens=8), expected)


@pytest.mark.parametrize("field", ["num_heads", "num_layers"])
def test_bad_head_counts(field):
    with pytest.raises(ValueError, match=f"MedusaConfig.{field}"):
        heads.attach_heads(build_model("llama"), **{field: 0})


def test_invalid_tree_argument():
    model = build_model("llama")
    with pytest.raises(heads.InvalidTreeError, match="no parent"):
        heads.attach_heads(model, tree=[(0, 0)])
    with pytest.raises(heads.InvalidTreeError, match="depth 5"):
        heads.attach_heads(model, num_heads=4, tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)])
    with pytest.raises(ValueError, match="tree size must be >= 0"):
        heads.attach_heads(model, tree=-3)


@pytest.fixture(scope="module")
def spec():
    return heads.attach_heads(build_model("llama"))


def test_input_ids_not_2d(spec):
    with pytest.raises(ValueError, match="input_ids must be 2-D"):
        spec.generate(torch.tensor([1, 2, 3]))


def test_input_ids_not_integer(spec):
    with pytest.raises(TypeError, match="integer token ids"):
        spec.generate(torch.ones(1, 3))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        spec.generate([[1, 2, 3]])


def test_empty_prompt(spec):
    with pytest.raises(ValueError, match="empty"):
        spec.generate(torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_bad_max_new_tokens(spec, value):
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int"):
        spec.generate(random_prompt(3, 0), max_new_tokens=value)


def test_attention_mask_checks(spec):
    prompt = random_prompt(4, 0)
    with pytest.raises(ValueError, match="attention_mask must have the shape"):
        spec.generate(prompt, attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="right padding"):
        spec.generate(prompt, attention_mask=torch.tensor([[1, 1, 1, 0]]))
    assert spec.generate(prompt, attention_mask=torch.tensor([[0, 1, 1, 1]]), max_new_tokens=2).shape == (1, 6)
    assert spec.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2).shape == (1, 6)
