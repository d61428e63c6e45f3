"""Distillation on a tiny random model: loss falls, agreement and tau rise, resume is exact."""

from __future__ import annotations

import pytest
import torch

import heads
from tests.conftest import greedy_reference, progression_batch
from training.trainer import TrainConfig, batch_indices, kind_trainer, make_trainer

MedusaTrainer = kind_trainer("medusa")  # what make_trainer builds for a Medusa spec


def _sequences(model, count: int, seed: int = 7) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [greedy_reference(model, progression_batch(1, 6, generator), 24)[0] for _ in range(count)]


@pytest.fixture(scope="module")
def model(toy_target):
    return toy_target


@pytest.fixture(scope="module")
def sequences(model):
    return _sequences(model, 64)


def _tau(spec, prompts) -> float:
    forwards = tokens = 0
    for prompt in prompts:
        spec.generate(prompt, max_new_tokens=30)
        forwards += spec.last_stats.target_forwards
        tokens += spec.last_stats.new_tokens
    return tokens / forwards


def test_training_lowers_loss_and_raises_agreement_and_tau(model, sequences):
    spec = heads.attach_heads(model, num_heads=3, tree=16)
    generator = torch.Generator().manual_seed(900)
    prompts = [progression_batch(1, 5, generator) for _ in range(4)]
    trainer = MedusaTrainer(spec, sequences, TrainConfig(steps=60, batch_size=8, learning_rate=1e-2, warmup_steps=5,
                                                      validation_fraction=0.25),
                            progress=False)
    before_accuracy = trainer.rank_accuracy()
    tau_before = _tau(spec, prompts)
    result = trainer.train()
    tau_after = _tau(spec, prompts)
    assert sum(result.losses[-5:]) / 5 < 0.5 * sum(result.losses[:5]) / 5
    for head in range(3):
        assert result.accuracy[head][0] > before_accuracy[head][0] + 0.2, (head, before_accuracy, result.accuracy)
    assert tau_after > tau_before + 0.5, (tau_before, tau_after)
    assert result.tokens_per_second > 0 and result.peak_memory_mb > 0
    # measured accuracies now shape the default tree; decoding stays exact
    assert spec.accuracy == result.accuracy
    for prompt in prompts[:2]:
        assert torch.equal(spec.generate(prompt, max_new_tokens=30), greedy_reference(model, prompt, 30))


def test_only_heads_get_gradients(model, sequences):
    spec = heads.attach_heads(model, num_heads=2)
    MedusaTrainer(spec, sequences, TrainConfig(steps=1, batch_size=4), progress=False).train()
    assert all(p.grad is None for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())


def test_resume_gives_the_same_parameters(model, sequences, tmp_path):
    config = TrainConfig(steps=8, batch_size=4, learning_rate=5e-3, warmup_steps=2, checkpoint_every=4)
    straight = heads.attach_heads(model, num_heads=2)
    MedusaTrainer(straight, sequences, config, progress=False).train()

    interrupted = heads.attach_heads(model, num_heads=2)
    MedusaTrainer(interrupted, sequences, config, checkpoint_dir=tmp_path, progress=False).train(stop_after=4)
    resumed = heads.attach_heads(model, num_heads=2)
    MedusaTrainer(resumed, sequences, config, checkpoint_dir=tmp_path, progress=False).train(resume=True)
    for (name, a), (_, b) in zip(straight.heads.state_dict().items(), resumed.heads.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    first = heads.attach_heads(model, num_heads=2).heads.state_dict()
    assert any(not torch.equal(first[n], t) for n, t in resumed.heads.state_dict().items())


def test_batch_indices_cover_epochs():
    seen = [i for step in range(5) for i in batch_indices(step, 4, 10, seed=1)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert batch_indices(3, 4, 10, seed=1) == batch_indices(3, 4, 10, seed=1)


@pytest.mark.parametrize("field, value, message", [
    ("divergence", "kl2", "divergence must be one of"),
    ("temperature", 0.0, "temperature must be > 0"),
    ("steps", 0, "steps must be a positive int"),
    ("mixed_precision", "fp8", "mixed_precision"),
])
def test_bad_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_batch_must_split_across_accumulation(model, sequences):
    spec = heads.attach_heads(model, num_heads=2)
    with pytest.raises(ValueError, match="divisible"):
        MedusaTrainer(spec, sequences, TrainConfig(batch_size=5, gradient_accumulation=2), progress=False)


def test_a_kind_with_nothing_to_train_is_refused(model, sequences):
    spec = heads.attach_heads(model, kind="lookup")
    with pytest.raises(ValueError, match="kind 'lookup' has nothing to train"):
        make_trainer(spec, sequences, TrainConfig(steps=1, batch_size=4), progress=False)
