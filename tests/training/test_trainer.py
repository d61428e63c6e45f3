"""Distillation on a tiny random model: loss falls, agreement and tau rise, resume is exact."""

from __future__ import annotations

import pytest
import torch

import heads
from tests.conftest import greedy_reference, progression_batch
from training.checkpoint import CheckpointError
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


def test_draft_vocabulary_training(model, sequences, tmp_path):
    """Heads over a draft vocabulary: the training data's most frequent tokens, projections restarted
    from the output head's rows of them; loss falls and tau rises as with the whole vocabulary, the
    adapter keeps the token map, decoding stays exact."""
    from heads.draft_vocab import frequent_tokens

    vocab = model.config.vocab_size
    spec = heads.attach_heads(model, num_heads=3, tree=16, draft_vocab_size=vocab // 2)
    generator = torch.Generator().manual_seed(900)
    prompts = [progression_batch(1, 5, generator) for _ in range(4)]
    trainer = MedusaTrainer(spec, sequences, TrainConfig(steps=60, batch_size=8, learning_rate=1e-2, warmup_steps=5,
                                                      validation_fraction=0.25), progress=False)
    tau_before, accuracy_before = _tau(spec, prompts), trainer.rank_accuracy()
    result = trainer.train()
    assert torch.equal(spec.heads.token_map, frequent_tokens(trainer.train_sequences, vocab, vocab // 2))
    assert sum(result.losses[-5:]) < 0.5 * sum(result.losses[:5])
    assert _tau(spec, prompts) > tau_before + 0.5
    assert result.accuracy[0][0] > accuracy_before[0][0] + 0.2, (accuracy_before, result.accuracy)
    spec.save_pretrained(tmp_path / "adapter")
    loaded = heads.load_heads(model, tmp_path / "adapter")
    assert loaded.config.draft_vocab_size == vocab // 2 and torch.equal(loaded.heads.token_map, spec.heads.token_map)
    for prompt in prompts[:2]:
        assert torch.equal(loaded.generate(prompt, max_new_tokens=30), greedy_reference(model, prompt, 30))


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


class _RunsCode:
    """A pickle that creates a file when loaded: what a crafted checkpoint could run."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoints_hold_no_pickle_and_resume_refuses_one(model, sequences, tmp_path):
    """Issue 15 item 1: checkpoints are safetensors + JSON only; a pickle in one is refused, never loaded."""
    import pickle

    config = TrainConfig(steps=4, batch_size=4, warmup_steps=1, checkpoint_every=2)
    MedusaTrainer(heads.attach_heads(model, num_heads=2), sequences, config, checkpoint_dir=tmp_path,
                  progress=False).train(stop_after=2)
    latest = tmp_path / (tmp_path / "latest").read_text().strip()
    names = sorted(path.name for path in latest.iterdir())
    assert names == ["drafter.safetensors", "optimizer.safetensors", "rng-0.safetensors", "trainer_state.json"]
    marker = tmp_path / "code-ran"
    (latest / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(_RunsCode(marker)))
    resumed = MedusaTrainer(heads.attach_heads(model, num_heads=2), sequences, config, checkpoint_dir=tmp_path,
                            progress=False)
    with pytest.raises(CheckpointError, match=r"custom_checkpoint_0.pkl.*pickles .* are refused"):
        resumed.train(resume=True)
    assert not marker.exists()


@pytest.mark.parametrize("change, message", [
    (dict(learning_rate=1e-2), r"learning_rate 0.005 \(now 0.01\)"),
    (dict(batch_size=8), r"batch_size 4 \(now 8\)"),
    (dict(divergence="rkl"), r"divergence 'fkl' \(now 'rkl'\)"),
    (dict(steps=12), r"steps 8 \(now 12\)"),
])
def test_resume_with_another_recipe_is_refused(model, sequences, tmp_path, change, message):
    """Issue 15 item 10: a changed recipe is refused by name (checkpoint_every may change)."""
    config = TrainConfig(steps=8, batch_size=4, learning_rate=5e-3, warmup_steps=2, checkpoint_every=2)
    MedusaTrainer(heads.attach_heads(model, num_heads=2), sequences, config, checkpoint_dir=tmp_path,
                  progress=False).train(stop_after=2)
    changed = TrainConfig(**{**config.__dict__, **change})
    with pytest.raises(CheckpointError, match="written by another recipe: " + message):
        MedusaTrainer(heads.attach_heads(model, num_heads=2), sequences, changed, checkpoint_dir=tmp_path,
                      progress=False).train(resume=True)
    with pytest.raises(CheckpointError, match="training sequences"):
        MedusaTrainer(heads.attach_heads(model, num_heads=2), sequences[1:], config, checkpoint_dir=tmp_path,
                      progress=False).train(resume=True)
    with pytest.raises(CheckpointError, match=r"num_heads"):
        MedusaTrainer(heads.attach_heads(model, num_heads=3), sequences, config, checkpoint_dir=tmp_path,
                      progress=False).train(resume=True)
    other_interval = TrainConfig(**{**config.__dict__, "checkpoint_every": 3})
    MedusaTrainer(heads.attach_heads(model, num_heads=2), sequences, other_interval, checkpoint_dir=tmp_path,
                  progress=False).train(resume=True, stop_after=3)


def test_resume_of_a_finished_run_trains_nothing_and_keeps_the_history(model, sequences, tmp_path):
    """Issue 15 item 10: resuming a run whose last checkpoint is its last step returns its history."""
    config = TrainConfig(steps=4, batch_size=4, warmup_steps=1, checkpoint_every=2)
    finished = heads.attach_heads(model, num_heads=2)
    first = MedusaTrainer(finished, sequences, config, checkpoint_dir=tmp_path, progress=False).train()
    again = heads.attach_heads(model, num_heads=2)
    result = MedusaTrainer(again, sequences, config, checkpoint_dir=tmp_path, progress=False).train(resume=True)
    assert result.losses == first.losses and len(result.losses) == 4
    for name, tensor in finished.heads.state_dict().items():
        assert torch.equal(again.heads.state_dict()[name], tensor), name


def test_batch_indices_cover_epochs():
    seen = [i for step in range(5) for i in batch_indices(step, 4, 10, seed=1)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert batch_indices(3, 4, 10, seed=1) == batch_indices(3, 4, 10, seed=1)


@pytest.mark.parametrize("field, value, message", [
    ("divergence", "kl2", "divergence must be one of"),
    ("temperature", 0.0, "temperature must be > 0"),
    ("steps", 0, "steps must be a positive int"),
    ("mixed_precision", "fp8", "mixed_precision"),
    ("checkpoint_every", -1, "checkpoint_every must be an int >= 0"),  # issue 15 item 9: was every step
    ("learning_rate", 0.0, "learning_rate must be a number > 0"),
    ("warmup_steps", -2, "warmup_steps must be an int >= 0"),
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
