"""Medusa-2 joint training (heads + a LoRA on the backbone) in the generic trainer: the distillation
term pulls a perturbed backbone back to the original while the heads learn, the schedule, exact
resume, bf16, refusals before any work, and ``selfdraft train --joint`` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import heads
from heads import lora
from tests.conftest import VOCAB, build_model, greedy_reference, progression_batch, train_toy_target
from training.cli import main
from training.trainer import TrainConfig, make_trainer

JOINT = dict(joint=True, lora_r=4, lora_alpha=8, lora_targets=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def target():
    return train_toy_target(steps=100, seed=3)


@pytest.fixture(scope="module")
def sequences(target):
    generator = torch.Generator().manual_seed(7)
    return [greedy_reference(target, progression_batch(1, 6, generator), 24)[0] for _ in range(48)]


def _fresh(target):
    """A copy of the toy target (joint training puts a LoRA into the model it trains)."""
    model = type(target)(target.config)
    model.load_state_dict(target.state_dict())
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model.eval()


def test_distillation_keeps_the_tuned_backbone_close(target, sequences):
    spec = heads.attach_heads(_fresh(target), num_heads=3)
    config = TrainConfig(steps=60, batch_size=8, learning_rate=1e-2, warmup_steps=2, validation_fraction=0.25,
                         joint_heads_only_steps=0, joint_lambda_warmup_steps=10, joint_lambda=0.2,
                         lora_learning_rate=1e-2, **JOINT)
    trainer = make_trainer(spec, sequences, config, progress=False)
    with torch.no_grad():  # start the LoRA away from the original, so that the distillation term has work to do
        generator = torch.Generator().manual_seed(0)
        for name, parameter in spec.backbone_lora.peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.15 * torch.randn(parameter.shape, generator=generator))
    batches = [trainer._collate(trainer.validation_sequences[i:i + 4])
               for i in range(0, len(trainer.validation_sequences), 4)]
    before = lora.measure_drift(spec.backbone, spec.backbone_lora, batches)
    accuracy_before = trainer.rank_accuracy()
    result = trainer.train()
    after = spec.backbone_lora.drift
    assert before["kl_per_token"] > 0.05, before
    assert after["kl_per_token"] < 0.25 * before["kl_per_token"], (before, after)
    assert after["top1_agreement"] > before["top1_agreement"]
    assert after["top1_agreement"] > 0.9 and abs(after["perplexity_change"]) < 0.5 * abs(before["perplexity_change"])
    for head in range(3):
        assert result.accuracy[head][0] > accuracy_before[head][0] + 0.1, (accuracy_before, result.accuracy)
    assert after == lora.measure_drift(spec.backbone, spec.backbone_lora, batches)


def test_schedule_heads_first_then_lambda_warms_up(target, sequences):
    spec = heads.attach_heads(_fresh(target), num_heads=2)
    config = TrainConfig(steps=8, batch_size=4, warmup_steps=0, joint_heads_only_steps=3,
                         joint_lambda_warmup_steps=4, joint_lambda=0.4, lora_learning_rate=1e-2, **JOINT)
    trainer = make_trainer(spec, sequences, config, progress=False)
    hook = trainer.hook
    assert [hook.joint_weight(step) for step in range(8)] == pytest.approx([None, None, None, 0.1, 0.2, 0.3, 0.4, 0.4])
    initial = {name: tensor.clone() for name, tensor in spec.backbone_lora.tensors().items()}
    trainer.train(stop_after=3)  # heads alone: the LoRA is untouched
    assert all(torch.equal(initial[name], tensor) for name, tensor in spec.backbone_lora.tensors().items())
    defaults = make_trainer(heads.attach_heads(_fresh(target), num_heads=2), sequences,
                            TrainConfig(steps=40, **JOINT), progress=False).hook
    assert (defaults.heads_only_steps, defaults.lambda_warmup_steps) == (10, 10)
    assert defaults.parameter_groups()[0]["lr"] == pytest.approx(1e-3 / 4)


def test_joint_resume_is_exact_and_bf16_runs(target, sequences, tmp_path):
    config = TrainConfig(steps=6, batch_size=4, warmup_steps=1, checkpoint_every=3, joint_heads_only_steps=1,
                         joint_lambda_warmup_steps=2, lora_learning_rate=1e-2, **JOINT)

    def run(stop_after=None, resume=False, directory=tmp_path / "checkpoints"):
        torch.manual_seed(0)  # the LoRA's A starts random: alike in every run, as `selfdraft train --seed` makes it
        spec = heads.attach_heads(_fresh(target), num_heads=2)
        trainer = make_trainer(spec, sequences, config, progress=False, checkpoint_dir=directory)
        return spec, trainer.train(stop_after=stop_after, resume=resume)

    whole, whole_result = run(directory=tmp_path / "whole")
    run(stop_after=3)
    assert (tmp_path / "checkpoints" / "step-0000003" / "backbone.safetensors").is_file()
    resumed, resumed_result = run(resume=True)
    assert resumed_result.losses == whole_result.losses
    for name, tensor in whole.backbone_lora.tensors().items():
        assert torch.equal(resumed.backbone_lora.tensors()[name], tensor), name
    for name, tensor in whole.heads.state_dict().items():
        assert torch.equal(resumed.heads.state_dict()[name], tensor), name
    spec = heads.attach_heads(_fresh(target), num_heads=2)
    bf16 = TrainConfig(steps=2, batch_size=4, warmup_steps=0, mixed_precision="bf16", joint_heads_only_steps=0,
                       **JOINT)
    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate keeps one precision per process
    try:
        trainer = make_trainer(spec, sequences, bf16, progress=False)
        assert trainer.accelerator.mixed_precision == "bf16"
        result = trainer.train()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert any(bool(tensor.abs().sum() > 0) for name, tensor in spec.backbone_lora.tensors().items()
               if "lora_B" in name)  # the backbone's LoRA trained in bf16 too


def test_refusals_before_any_work(target, sequences):
    model = _fresh(target)
    spec = heads.attach_heads(model, num_heads=2)
    with pytest.raises(ValueError, match=r"LoRA target\(s\) \['q_projj'\] name no module.*q_proj"):
        make_trainer(spec, sequences, TrainConfig(joint=True, lora_targets=("q_projj", "v_proj")), progress=False)
    assert not lora.tuner_layers(model)
    with pytest.raises(ValueError, match="output head"):
        make_trainer(spec, sequences, TrainConfig(joint=True, lora_targets=("lm_head",)), progress=False)
    eagle = heads.attach_heads(_fresh(target), kind="eagle")
    with pytest.raises(ValueError, match="joint training .* is for kind"):
        make_trainer(eagle, sequences, TrainConfig(joint=True), progress=False)
    for bad in (dict(lora_r=0), dict(lora_alpha=-1.0), dict(joint_lambda=0), dict(joint_heads_only_steps=-1),
                dict(lora_targets=("",))):
        with pytest.raises(ValueError):
            TrainConfig(joint=True, **bad)


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[PAD]",
                                   bos_token="[BOS]", eos_token="[EOS]")


def test_selfdraft_train_joint(target, tmp_path, capsys):
    model_dir = tmp_path / "model"
    target.save_pretrained(model_dir)
    _tokenizer().save_pretrained(model_dir)
    generator = torch.Generator().manual_seed(1)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": " ".join(f"t{int(i)}" for i in progression_batch(1, 5, generator)[0])})
                              for _ in range(16)) + "\n")
    common = ["train", "--model", str(model_dir), "--data", str(data), "--steps", "6", "--batch-size", "4",
              "--max-new-tokens", "12", "--max-length", "20", "--eval-prompts", "2",
              "--eval-max-new-tokens", "8", "--no-progress", "--cache-dir", str(tmp_path / "cache")]
    for extra, message in ((["--joint", "--lora-targets", "q_projj"], "--lora-targets: LoRA target"),
                           (["--lora-r", "4"], "--lora-r: joint-training option"),
                           (["--joint", "--kind", "eagle"], "--joint: joint training")):
        assert main([*common, "--out", str(tmp_path / "refused"), *extra]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "cache").exists() and not (tmp_path / "refused").exists()  # no work was done
    out = tmp_path / "adapter"
    assert main([*common, "--out", str(out), "--json", str(tmp_path / "summary.json"), "--num-heads", "2",
                 "--joint", "--lora-r", "4",
                 "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj", "--joint-heads-only-steps", "2"]) == 0
    assert "lossless against the tuned backbone only" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["backbone_drift"]) >= {"kl_per_token", "top1_agreement"}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["training"]["config"]["joint"] and config["backbone_lora"]["path"] == lora.FOLDER_NAME
    assert sorted(path.name for path in (out / lora.FOLDER_NAME).iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    spec = heads.load_heads(build_model_from(model_dir), out)
    prompt = progression_batch(1, 5, generator)
    tuned = spec.backbone
    assert torch.equal(spec.generate(prompt, max_new_tokens=16), greedy_reference(tuned, prompt, 16))
    # a second run may write over the first adapter (its LoRA folder included)
    assert main([*common, "--out", str(out), "--steps", "2", "--joint", "--lora-r", "4"]) == 0


def build_model_from(directory: Path):
    from training.commands.common import load_model

    return load_model(str(directory))[0]
