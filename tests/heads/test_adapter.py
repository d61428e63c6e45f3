"""Adapter files: round trip, target pinning, corrupt files, atomic writes."""

from __future__ import annotations

import json

import pytest
import torch

import heads
from heads import adapter as adapter_module
from tests.conftest import build_model, random_prompt


@pytest.fixture()
def trained_spec():
    model = build_model("qwen2", seed=3)
    spec = heads.attach_heads(model, num_heads=3, num_layers=2, tree=8)
    torch.manual_seed(1)
    with torch.no_grad():  # stand-in for training: non-trivial head weights
        for parameter in spec.heads.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    spec.accuracy = [[0.5, 0.2], [0.3, 0.1], [0.2, 0.05]]
    spec.set_tree(8)
    return spec


def test_round_trip_same_tokens_and_stats(trained_spec, tmp_path):
    trained_spec.save_pretrained(tmp_path / "adapter")
    loaded = heads.load_heads(trained_spec.backbone, tmp_path / "adapter")
    assert loaded.tree.paths == trained_spec.tree.paths
    for seed in range(3):
        prompt = random_prompt(6 + seed, seed)
        assert torch.equal(loaded.generate(prompt, max_new_tokens=20), trained_spec.generate(prompt, max_new_tokens=20))
        assert loaded.last_stats.accepted_lengths == trained_spec.last_stats.accepted_lengths
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["kind"] == "medusa" and config["drafter"]["num_layers"] == 2
    assert config["target"]["vocab_size"] == trained_spec.backbone.config.vocab_size
    assert set(config["target"]) >= {"config_sha256", "weights_sha256", "hidden_size", "dtype", "name_or_path"}


def test_safetensors_holds_only_head_tensors(trained_spec, tmp_path):
    from safetensors.torch import load_file

    trained_spec.save_pretrained(tmp_path / "a")
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert set(tensors) == set(trained_spec.heads.state_dict())


def test_other_target_is_refused_loudly(trained_spec, tmp_path):
    trained_spec.save_pretrained(tmp_path / "adapter")
    other = build_model("qwen2", seed=4)  # same config, other weights
    with pytest.raises(heads.TargetMismatchError, match="weights"):
        heads.load_heads(other, tmp_path / "adapter")
    with pytest.warns(UserWarning, match="selfdraft check"):
        spec = heads.load_heads(other, tmp_path / "adapter", strict=False)
    prompt = random_prompt(5, 0)
    with torch.no_grad():
        expected = other.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=10)
    assert torch.equal(spec.generate(prompt, max_new_tokens=10), expected)  # still correct, only slower


def test_other_architecture_config_is_named(trained_spec, tmp_path):
    trained_spec.save_pretrained(tmp_path / "adapter")
    with pytest.raises(heads.TargetMismatchError, match="config"):
        heads.load_heads(build_model("llama", seed=3), tmp_path / "adapter")


def test_truncated_weights_file(trained_spec, tmp_path):
    trained_spec.save_pretrained(tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(heads.AdapterError, match="corrupted or truncated"):
        heads.load_heads(trained_spec.backbone, tmp_path / "adapter")


def test_shape_mismatch(trained_spec, tmp_path):
    trained_spec.save_pretrained(tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["drafter"]["num_layers"] = 1
    config_path.write_text(json.dumps(config))
    with pytest.raises(heads.AdapterError, match="unexpected"):
        heads.load_heads(trained_spec.backbone, tmp_path / "adapter")


def test_missing_and_invalid_config(trained_spec, tmp_path):
    with pytest.raises(heads.AdapterError, match="not found"):
        heads.load_heads(trained_spec.backbone, tmp_path / "nothing")
    trained_spec.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_config.json").write_text("{not json")
    with pytest.raises(heads.AdapterError, match="not valid JSON"):
        heads.load_heads(trained_spec.backbone, tmp_path / "adapter")


def test_interrupted_save_keeps_the_old_adapter(trained_spec, tmp_path, monkeypatch):
    trained_spec.save_pretrained(tmp_path / "adapter")
    before = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()

    def failing_save(*args, **kwargs):
        raise KeyboardInterrupt  # the process is stopped in the middle of writing

    monkeypatch.setattr(adapter_module, "save_file", failing_save)
    with torch.no_grad():
        next(trained_spec.heads.parameters()).add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        trained_spec.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no staging left behind
