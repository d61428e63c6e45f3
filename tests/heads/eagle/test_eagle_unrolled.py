"""Training-time test (``unroll_steps`` > 1) through the drafter's cache, on every EAGLE layout."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import heads
from tests.conftest import greedy_reference, progression_batch
from training.trainer import TrainConfig, make_trainer


@pytest.mark.parametrize("layout, options", [("eagle3", dict(feature_layers=(0, 1, 2))), ("eagle1", {}),
                                             ("native", {})])
def test_unrolled_training_through_the_drafter_cache(layout, options):
    """Training-time test (``unroll_steps`` > 1) appends each unrolled step to the drafter's cache with
    gradients on: the cache must not overwrite what autograd kept (the EAGLE-3 layout's attention
    reads the cache's own tensors); every step trains."""
    torch.manual_seed(6)  # head_dim 64: CPU attention then keeps the cache's own tensors for its backward
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    spec = heads.attach_heads(model, kind="eagle", layout=layout, **options)
    sequences = list(greedy_reference(model, progression_batch(16, 6, torch.Generator().manual_seed(2), 96), 40))
    torch.manual_seed(0)
    before = [parameter.detach().clone() for parameter in spec.heads.parameters()]
    result = make_trainer(spec, sequences, TrainConfig(steps=6, batch_size=4, unroll_steps=3, learning_rate=1e-2,
                                                        warmup_steps=1), progress=False).train()
    assert len(result.losses) == 6 and all(torch.isfinite(torch.tensor(result.losses)))
    assert any(not torch.equal(old, new) for old, new in zip(before, spec.heads.parameters()))
