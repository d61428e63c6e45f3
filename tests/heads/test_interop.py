"""Other checkpoint layouts: export/import round trips, checkpoints written by hand from the
reference loaders' layouts, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import heads
from heads import interop
from tests.conftest import build_model, random_prompt

HIDDEN, VOCAB = 32, 96  # sizes of tests.conftest models


def _perturbed(spec, seed: int = 1):
    torch.manual_seed(seed)
    with torch.no_grad():  # stand-in for training: non-trivial head weights
        for parameter in spec.heads.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return spec


@pytest.fixture(scope="module")
def model():
    return build_model("llama", seed=3)


def _medusa(model, tmp_path: Path, **options) -> tuple[heads.SpeculativeModel, Path]:
    spec = _perturbed(heads.attach_heads(model, tree=8, **options))
    directory = tmp_path / "adapter"
    spec.save_pretrained(directory, acceptance={"chat": {"tau": 2.5, "prompts": 4, "max_new_tokens": 16}})
    return spec, directory


def _same_drafter(original, loaded) -> None:
    features = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = original.heads(features, original.shared_logits)
        got = loaded.heads(features, loaded.shared_logits)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for seed in range(2):
        prompt = random_prompt(6 + seed, seed)
        assert torch.equal(loaded.generate(prompt, max_new_tokens=16), original.generate(prompt, max_new_tokens=16))
        assert loaded.last_stats.accepted_lengths == original.last_stats.accepted_lengths


@pytest.mark.parametrize("fmt, options", [
    ("medusa", {"num_heads": 3}),
    ("medusa", {"num_heads": 2, "share_lm_head": True}),
    ("medusa-vllm", {"num_heads": 3, "num_layers": 2}),
    ("medusa-vllm", {"num_heads": 2, "share_lm_head": True}),
])
def test_medusa_round_trip(model, tmp_path, fmt, options):
    spec, adapter = _medusa(model, tmp_path, **options)
    out = interop.export_adapter(adapter, fmt, tmp_path / fmt, model=model if options.get("share_lm_head") else None)
    assert interop.detect_format(out) == fmt
    loaded = heads.load_heads(model, out)
    _same_drafter(spec, loaded)
    assert loaded.config.to_dict() == spec.config.to_dict()
    assert loaded.metadata["acceptance"]["chat"]["tau"] == 2.5  # selfdraft.json restores the recipe and pin
    with pytest.raises(heads.TargetMismatchError, match="weights"):
        heads.load_heads(build_model("llama", seed=4), out)


def test_fasterdecoding_files_match_its_state_dict(model, tmp_path):
    spec, adapter = _medusa(model, tmp_path, num_heads=2)
    out = interop.export_adapter(adapter, "medusa", tmp_path / "medusa")
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["medusa_num_layers"] == 1 and "model_type" not in config
    tensors = load_file(str(out / interop.MEDUSA_TENSORS))
    # FasterDecoding: medusa_head[h] = Sequential(ResBlock, Linear(d, V, bias=False))
    reference = nn.ModuleList(nn.Sequential(_ResBlock(), nn.Linear(HIDDEN, VOCAB, bias=False)) for _ in range(2))
    reference.load_state_dict(tensors, strict=True)
    pickled = torch.load(str(out / interop.MEDUSA_PICKLE), weights_only=True)
    assert all(torch.equal(pickled[name], tensor) for name, tensor in tensors.items()) and set(pickled) == set(tensors)
    features = torch.randn(3, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(torch.stack([head(features) for head in reference]), spec.heads(features))


class _ResBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


def _hand_reference(blocks: list[list[tuple[torch.Tensor, torch.Tensor | None]]], projections, features):
    """Medusa head outputs computed from raw tensors: x + silu(W x + b) per block, then W_vocab."""
    outputs = []
    for head, layers in enumerate(blocks):
        x = features
        for weight, bias in layers:
            x = x + nn.functional.silu(x @ weight.T + (0 if bias is None else bias))
        outputs.append(x @ projections[head].T)
    return torch.stack(outputs)


def _random(*shape, seed):
    return 0.1 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("weights_file", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_load_fasterdecoding_checkpoint_written_by_hand(model, tmp_path, weights_file):
    directory = tmp_path / "medusa-vicuna"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    blocks = [[(_random(HIDDEN, HIDDEN, seed=h), _random(HIDDEN, seed=10 + h))] for h in range(2)]
    projections = [_random(VOCAB, HIDDEN, seed=20 + h) for h in range(2)]
    tensors = {}
    for h in range(2):
        tensors[f"{h}.0.linear.weight"], tensors[f"{h}.0.linear.bias"] = blocks[h][0]
        tensors[f"{h}.1.weight"] = projections[h]
    if weights_file.endswith(".pt"):
        torch.save(tensors, str(directory / weights_file))
    else:
        save_file(tensors, str(directory / weights_file))
    with pytest.warns(UserWarning, match="records no target fingerprint"):
        spec = heads.load_heads(model, directory)
    features = torch.randn(4, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(spec.heads(features), _hand_reference(blocks, projections, features))
    assert spec.metadata["target"]["name_or_path"] == "lmsys/vicuna-7b-v1.3"
    prompt = random_prompt(5, 0)
    with torch.no_grad():
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), expected)


def _vllm_config(**overrides) -> dict:
    return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": HIDDEN, "vocab_size": VOCAB,
            "num_heads": 2, "num_hidden_layers": 2, "truncated_vocab_size": VOCAB, **overrides}


def test_load_vllm_checkpoint_written_by_hand(model, tmp_path):
    directory = tmp_path / "vllm-medusa"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(_vllm_config()))  # medusa_fc_bias absent: vLLM's False
    blocks = [[(_random(HIDDEN, HIDDEN, seed=3 * h + layer), None) for layer in range(2)] for h in range(2)]
    projections = [_random(VOCAB, HIDDEN, seed=40 + h) for h in range(2)]
    tensors = {f"medusa_heads.blocks.{h}.layers.{layer}.weight": blocks[h][layer][0]
               for h in range(2) for layer in range(2)}
    tensors.update({f"medusa_heads.lm_heads.{h}.weight": projections[h] for h in range(2)})
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.warns(UserWarning, match="records no target fingerprint"):
        spec = heads.load_heads(model, directory)
    features = torch.randn(4, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(spec.heads(features), _hand_reference(blocks, projections, features))


def test_load_vllm_original_lm_head_written_by_hand(model, tmp_path):
    directory = tmp_path / "vllm-shared"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(_vllm_config(num_hidden_layers=1, original_lm_head=True,
                                                                   medusa_fc_bias=True)))
    blocks = [[(_random(HIDDEN, HIDDEN, seed=h), _random(HIDDEN, seed=5 + h))] for h in range(2)]
    shared = _random(VOCAB, HIDDEN, seed=9)
    tensors = {"lm_heads.0.weight": shared}
    for h in range(2):
        tensors[f"blocks.{h}.layers.0.weight"], tensors[f"blocks.{h}.layers.0.bias"] = blocks[h][0]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.warns(UserWarning):
        spec = heads.load_heads(model, directory)
    features = torch.randn(4, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(spec.heads(features), _hand_reference(blocks, [shared, shared], features))


def _eagle1_checkpoint(directory: Path) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "vocab_size": VOCAB,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1}))
    tensors = {"fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN), "fc.bias": torch.zeros(HIDDEN),
               "layers.0.post_attention_layernorm.weight": torch.ones(HIDDEN)}
    for name, shape in (("q_proj", (HIDDEN, HIDDEN)), ("k_proj", (16, HIDDEN)), ("v_proj", (16, HIDDEN)),
                        ("o_proj", (HIDDEN, HIDDEN))):
        tensors[f"layers.0.self_attn.{name}.weight"] = torch.zeros(shape)
    for name, shape in (("gate_proj", (64, HIDDEN)), ("up_proj", (64, HIDDEN)), ("down_proj", (HIDDEN, 64))):
        tensors[f"layers.0.mlp.{name}.weight"] = torch.zeros(shape)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _eagle3_checkpoint(directory: Path, draft_vocab: int = 32) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
        "vocab_size": VOCAB, "draft_vocab_size": draft_vocab, "target_hidden_size": HIDDEN, "num_hidden_layers": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1], "use_aux_hidden_state": True}}))
    tensors = {"fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN), "norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": torch.zeros(draft_vocab, HIDDEN), "d2t": torch.zeros(draft_vocab, dtype=torch.long),
               "t2d": torch.zeros(VOCAB, dtype=torch.bool),
               "midlayer.self_attn.q_proj.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}
    for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        tensors[f"midlayer.{name}.weight"] = torch.ones(HIDDEN)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_eagle_checkpoints_are_recognised_and_refused(model, tmp_path):
    eagle1 = _eagle1_checkpoint(tmp_path / "eagle1")
    eagle3 = _eagle3_checkpoint(tmp_path / "eagle3")
    assert interop.detect_format(eagle1) == "eagle" and interop.detect_format(eagle3) == "eagle3"
    with pytest.raises(heads.AdapterError, match="EAGLE-1 checkpoint.*input layernorm"):
        heads.load_heads(model, eagle1)
    with pytest.raises(heads.AdapterError, match="EAGLE-3 checkpoint"):
        heads.load_heads(model, eagle3)


@pytest.mark.parametrize("fmt, options, message", [
    ("eagle", {}, "no input layernorm.*no final norm"),
    ("eagle", {"feature_layers": [0, 1, 2]}, "top-layer features only"),
    ("eagle3", {"feature_layers": [0, 1, 2], "draft_vocab_size": 32}, "no exact mapping"),
    ("eagle3", {}, "exactly three target layers"),
])
def test_eagle_export_refuses_with_the_reason(model, tmp_path, fmt, options, message):
    spec = heads.attach_heads(model, kind="eagle", **options)
    spec.save_pretrained(tmp_path / "eagle")
    with pytest.raises(heads.AdapterError, match=message):
        interop.export_adapter(tmp_path / "eagle", fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_eagle_export_refuses_non_llama(tmp_path):
    spec = heads.attach_heads(build_model("qwen2"), kind="eagle")
    spec.save_pretrained(tmp_path / "eagle")
    with pytest.raises(heads.AdapterError, match="Llama decoder layers; the target is 'qwen2'"):
        interop.export_adapter(tmp_path / "eagle", "eagle", tmp_path / "out")


def test_medusa_export_refusals(model, tmp_path):
    _, adapter = _medusa(model, tmp_path, num_heads=2, num_layers=2)
    with pytest.raises(heads.AdapterError, match=r"\[ResBlock\(d\)\] \* n.*--num-layers 1"):
        interop.export_adapter(adapter, "medusa", tmp_path / "a")
    with pytest.raises(heads.AdapterError, match="holds eagle drafters.*medusa or medusa-vllm"):
        interop.export_adapter(adapter, "eagle", tmp_path / "b")
    _, shared = _medusa(model, tmp_path / "shared", num_heads=2, share_lm_head=True)
    with pytest.raises(heads.AdapterError, match="pass --model TARGET_DIR.*without --share-lm-head"):
        interop.export_adapter(shared, "medusa-vllm", tmp_path / "c")
    with pytest.raises(heads.TargetMismatchError, match="--model is not this adapter's target"):
        interop.export_adapter(shared, "medusa-vllm", tmp_path / "d", model=build_model("llama", seed=4))
    qwen = heads.attach_heads(build_model("qwen2"), num_heads=2)
    qwen.save_pretrained(tmp_path / "qwen")
    with pytest.raises(heads.AdapterError, match="llama.*mistral.*export --format medusa-vllm"):
        interop.export_adapter(tmp_path / "qwen", "medusa", tmp_path / "e")
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_export_never_replaces_a_foreign_directory(model, tmp_path):
    _, adapter = _medusa(model, tmp_path, num_heads=2)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    with pytest.raises(heads.AdapterError, match="already holds other files.*notes.txt"):
        interop.export_adapter(adapter, "medusa-vllm", tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"
    interop.export_adapter(adapter, "medusa-vllm", tmp_path / "twice")
    interop.export_adapter(adapter, "medusa-vllm", tmp_path / "twice")  # a previous export is replaced


def test_import_refusals(model, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(heads.AdapterError, match="not a recognised adapter directory.*medusa_num_heads.*midlayer"
                                                 ".*Found: \\['pytorch_model.bin'\\]"):
        heads.load_heads(model, tmp_path / "empty")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text(json.dumps(_vllm_config(truncated_vocab_size=32)))
    save_file({"token_map": torch.arange(32)}, str(truncated / "model.safetensors"))
    with pytest.raises(heads.AdapterError, match="truncated draft vocabulary"):
        heads.load_heads(model, truncated)
    biased = tmp_path / "biased"
    biased.mkdir()
    (biased / "config.json").write_text(json.dumps(_vllm_config(num_heads=1, num_hidden_layers=1)))
    save_file({"blocks.0.layers.0.weight": torch.zeros(HIDDEN, HIDDEN), "blocks.0.layers.0.bias": torch.zeros(HIDDEN),
               "lm_heads.0.weight": torch.zeros(VOCAB, HIDDEN)}, str(biased / "model.safetensors"))
    with pytest.raises(heads.AdapterError, match="medusa_fc_bias is false"):
        heads.load_heads(model, biased)
    heads_count = tmp_path / "heads-count"
    heads_count.mkdir()
    (heads_count / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    save_file({f"{h}.0.linear.{p}": torch.zeros(HIDDEN, HIDDEN) if p == "weight" else torch.zeros(HIDDEN)
               for h in range(2) for p in ("weight", "bias")} | {f"{h}.1.weight": torch.zeros(VOCAB, HIDDEN)
                                                                for h in range(2)},
              str(heads_count / interop.MEDUSA_TENSORS))
    with pytest.raises(heads.AdapterError, match="heads 0..1 but config.json says medusa_num_heads 1"):
        heads.load_heads(model, heads_count)


def test_import_of_another_size_is_a_target_mismatch(model, tmp_path):
    directory = tmp_path / "wide"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": 1}))
    save_file({"0.0.linear.weight": torch.zeros(64, 64), "0.0.linear.bias": torch.zeros(64),
               "0.1.weight": torch.zeros(VOCAB, 64)}, str(directory / interop.MEDUSA_TENSORS))
    with pytest.raises(heads.TargetMismatchError, match="hidden size: adapter has 64, model has 32"):
        heads.load_heads(model, directory)


def test_sidecar_must_describe_the_checkpoint(model, tmp_path):
    _, adapter = _medusa(model, tmp_path, num_heads=2)
    out = interop.export_adapter(adapter, "medusa-vllm", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    config["num_heads"] = 1
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(heads.AdapterError, match="unexpected"):
        heads.load_heads(model, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".1." not in k}, str(out / "model.safetensors"))
    with pytest.raises(heads.AdapterError, match="selfdraft.json does not describe.*num_heads"):
        heads.load_heads(model, out)
