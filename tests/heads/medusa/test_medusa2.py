"""Medusa-2 adapters (heads + a backbone LoRA in peft's layout) and peft-wrapped backbones: greedy
parity against peft's own ``generate`` on several families, the LoRA folder in plain peft, the pin
(base checkpoint + LoRA fingerprint), refusals that leave the model untouched."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from peft import LoraConfig, PeftModel, PrefixTuningConfig, get_peft_model

import heads
from heads import lora
from heads.interop import export_adapter
from tests.conftest import build_model, greedy_reference, progression_batch, random_prompt
from training.publish import write_hub_folder
from training.trainer import TrainConfig, make_trainer

TARGETS = {"llama": None, "gpt2": None, "qwen2": None, "gpt_neox": None, "phi3": ["qkv_proj"],
           "gemma2": ["q_proj", "o_proj"]}
"""LoRA targets per family (None: peft's default for it)."""
FAMILIES = tuple(TARGETS)


def random_lora(model, family: str, seed: int = 5) -> PeftModel:
    """``model`` wrapped in a random LoRA with non-zero B, so its outputs differ from the base."""
    torch.manual_seed(seed)
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS[family],
                                               init_lora_weights=False, task_type="CAUSAL_LM"))
    return wrapped.eval()


def peft_reference(model, prompt: torch.Tensor, max_new_tokens: int = 24) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_model_greedy_parity(family):
    prompts = [random_prompt(6, seed) for seed in (1, 2)]
    wrapped = random_lora(build_model(family), family)
    base = build_model(family)
    assert any(not torch.equal(peft_reference(wrapped, p), greedy_reference(base, p, 24)) for p in prompts)
    spec = heads.attach_heads(wrapped, num_heads=3, tree=12)  # through the base model, adapters active
    assert spec.backbone_lora is not None and not spec.backbone_lora.merged
    for prompt in prompts:
        assert torch.equal(spec.generate(prompt, max_new_tokens=24), peft_reference(wrapped, prompt))
    merged = random_lora(build_model(family), family)
    reference = random_lora(build_model(family), family).merge_and_unload()
    spec = heads.attach_heads(merged, num_heads=3, merge_lora=True)  # or merged into the weights
    assert spec.backbone_lora.merged and not lora.tuner_layers(spec.backbone)
    for prompt in prompts:
        assert torch.equal(spec.generate(prompt, max_new_tokens=24), greedy_reference(reference, prompt, 24))


def test_peft_model_pin_and_refusals(tmp_path):
    wrapped = random_lora(build_model("llama"), "llama")
    spec = heads.attach_heads(wrapped, num_heads=2)
    spec.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["format_version"] >= 2 and config["target"]["lora_sha256"] == spec.backbone_lora.sha256()
    assert config["target"]["weights_sha256"] == heads.TargetPin.of(build_model("llama")).recorded["weights_sha256"]
    heads.load_heads(wrapped, tmp_path / "adapter")  # the same PeftModel: accepted
    with pytest.raises(heads.TargetMismatchError, match="backbone LoRA"):  # its base alone is another target
        heads.load_heads(build_model("llama"), tmp_path / "adapter")
    with pytest.raises(heads.TargetMismatchError, match="backbone LoRA"):  # another LoRA on the same base
        heads.load_heads(random_lora(build_model("llama"), "llama", seed=6), tmp_path / "adapter")
    plain = heads.attach_heads(build_model("llama"), num_heads=2)
    plain.save_pretrained(tmp_path / "plain")
    plain_config = json.loads((tmp_path / "plain" / "adapter_config.json").read_text())
    assert "lora_sha256" not in plain_config["target"]  # the format version follows the dtype-tolerant pin (3)
    with pytest.raises(heads.TargetMismatchError, match="model carries one"):  # a plain target's heads on a LoRA
        heads.load_heads(random_lora(build_model("llama"), "llama"), tmp_path / "plain")
    prefix = get_peft_model(build_model("llama"), PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="prompt learning"):
        heads.attach_heads(prefix, num_heads=2)
    with pytest.raises(ValueError, match="merge_lora=True merges a PeftModel"):
        heads.attach_heads(build_model("llama"), num_heads=2, merge_lora=True)
    with pytest.raises(ValueError, match="output head"):
        heads.attach_heads(get_peft_model(build_model("llama"), LoraConfig(r=2, target_modules=["lm_head"])))


def _joint_adapter(family: str, directory, seed: int = 0):
    """A Medusa-2 adapter on ``family``'s tiny model: a few joint steps (no heads-only phase, a high
    LoRA rate so that the backbone moves); returns the trained spec."""
    model = build_model(family, seed=seed)
    generator = torch.Generator().manual_seed(3)
    sequences = [greedy_reference(model, progression_batch(1, 4, generator), 12)[0] for _ in range(12)]
    spec = heads.attach_heads(model, num_heads=2, tree=8)
    config = TrainConfig(steps=4, batch_size=4, warmup_steps=0, validation_fraction=0.2, joint=True, lora_r=4,
                         lora_alpha=16, lora_targets=TARGETS[family], joint_heads_only_steps=0,
                         joint_lambda_warmup_steps=1, joint_lambda=1.0, lora_learning_rate=0.05)
    make_trainer(spec, sequences, config, progress=False).train()
    spec.save_pretrained(directory)
    return spec


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_joint_adapter_parity_with_peft(family, tmp_path, caplog):
    trained = _joint_adapter(family, tmp_path / "adapter")
    folder = tmp_path / "adapter" / lora.FOLDER_NAME
    prompts = [random_prompt(6, seed) for seed in (4, 5)]
    # plain peft loads the folder and gives the trained backbone's outputs
    peft_model = PeftModel.from_pretrained(build_model(family), str(folder)).eval()
    ids = prompts[0]
    with torch.no_grad():
        assert torch.allclose(peft_model(ids).logits, trained.backbone(ids).logits, atol=1e-5)
    assert any(not torch.equal(peft_reference(peft_model, p), greedy_reference(build_model(family), p, 24))
               for p in prompts)  # the LoRA changed the outputs
    with caplog.at_level(logging.WARNING, logger="heads.loading"):
        spec = heads.load_heads(build_model(family), tmp_path / "adapter")  # merged by default
    assert "outputs now differ from the original model's" in caplog.text
    assert spec.metadata["backbone"]["modified"] and spec.metadata["backbone"]["merged"]
    assert set(spec.metadata["backbone"]["drift"]) >= {"kl_per_token", "top1_agreement", "perplexity_change"}
    merged = PeftModel.from_pretrained(build_model(family), str(folder)).merge_and_unload()
    unmerged = heads.load_heads(build_model(family), tmp_path / "adapter", merge_lora=False)
    assert not unmerged.backbone_lora.merged and lora.tuner_layers(unmerged.backbone)
    for prompt in prompts:
        assert torch.equal(spec.generate(prompt, max_new_tokens=24), greedy_reference(merged, prompt, 24))
        assert torch.equal(unmerged.generate(prompt, max_new_tokens=24), peft_reference(peft_model, prompt))
    # saved again from the loaded spec (merged): the same pin and the same LoRA
    spec.save_pretrained(tmp_path / "again")
    first, second = (json.loads((tmp_path / name / "adapter_config.json").read_text()) for name in ("adapter", "again"))
    assert first["target"] == second["target"]
    assert lora.folder_fingerprint(tmp_path / "again" / lora.FOLDER_NAME) == first["target"]["lora_sha256"]


def test_joint_adapter_refused_on_another_base_and_tampered_folder(tmp_path):
    _joint_adapter("llama", tmp_path / "adapter")
    other = build_model("llama", seed=1)
    before = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    with pytest.raises(heads.TargetMismatchError, match="weights"):
        heads.load_heads(other, tmp_path / "adapter")
    assert not lora.tuner_layers(other)  # refused before anything was applied
    assert all(torch.equal(before[name], tensor) for name, tensor in other.state_dict().items())
    with pytest.raises(heads.AdapterError, match="cannot be exported"):  # the heads alone expect the tuned backbone
        export_adapter(tmp_path / "adapter", "medusa", tmp_path / "export")
    write_hub_folder(tmp_path / "adapter", tmp_path / "hub")  # the LoRA travels with the heads, the card says so
    assert (tmp_path / "hub" / lora.FOLDER_NAME / lora.PEFT_WEIGHTS_NAME).is_file()
    assert "not** against the original" in (tmp_path / "hub" / "README.md").read_text()
    weights = tmp_path / "adapter" / lora.FOLDER_NAME / lora.PEFT_WEIGHTS_NAME
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(weights))
    with pytest.raises(heads.AdapterError, match="not the LoRA these heads were trained with"):
        heads.load_heads(build_model("llama"), tmp_path / "adapter")
