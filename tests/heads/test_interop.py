"""Other checkpoint layouts: export/import round trips, checkpoints written by hand from the
reference loaders' layouts, and refusals."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from transformers import LlamaConfig, LlamaForCausalLM

import heads
from heads import interop
from heads.medusa import checkpoint as medusa_checkpoint
from tests.conftest import _COMMON, build_model, greedy_reference, random_prompt
from tree_attention.mask import prefill_attention_mask

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
    tensors = load_file(str(out / medusa_checkpoint.MEDUSA_TENSORS))
    # FasterDecoding: medusa_head[h] = Sequential(ResBlock, Linear(d, V, bias=False))
    reference = nn.ModuleList(nn.Sequential(_ResBlock(), nn.Linear(HIDDEN, VOCAB, bias=False)) for _ in range(2))
    reference.load_state_dict(tensors, strict=True)
    pickled = torch.load(str(out / medusa_checkpoint.MEDUSA_PICKLE), weights_only=True)
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


# ----------------------------------------------------------------------------- EAGLE-1 / EAGLE-3

@pytest.fixture(scope="module")
def deep_model():
    """A 4-layer tiny Llama: EAGLE-3 exports need three distinct layers below the top one."""
    torch.manual_seed(11)
    model = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "num_hidden_layers": 4}))
    model.set_attn_implementation("sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def _rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, theta=10000.0):  # rotary embedding at positions 0..T-1 of x (B, H, T, D)
    dim = x.shape[-1]
    angles = torch.arange(x.shape[2]).float()[:, None] / theta ** (torch.arange(0, dim, 2).float() / dim)[None]
    angles = torch.cat([angles, angles], dim=-1)
    return x * angles.cos() + torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], dim=-1) * angles.sin()


def _attention(x, t, prefix, heads_count=4, kv_heads=2):
    """Causal grouped-query self-attention of a Llama layer from its named weights; x (1, T, in)."""
    length = x.shape[1]
    q, k, v = ((x @ t[f"{prefix}{name}_proj.weight"].T).view(1, length, -1, 8).transpose(1, 2) for name in "qkv")
    q, k = _rotate(q), _rotate(k).repeat_interleave(heads_count // kv_heads, 1)
    v = v.repeat_interleave(heads_count // kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + torch.full((length, length), float("-inf")).triu(1)
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, length, -1) @ t[f"{prefix}o_proj.weight"].T


def _mlp(x, t, prefix):
    gate, up = x @ t[f"{prefix}gate_proj.weight"].T, x @ t[f"{prefix}up_proj.weight"].T
    return (nn.functional.silu(gate) * up) @ t[f"{prefix}down_proj.weight"].T


def _eagle1_reference(t, features, embeddings):
    """SafeAILab cnets1 / SGLang LlamaForCausalLMEagle: fc over [emb; feature], layer 0 without
    input layernorm, no final norm."""
    hidden = torch.cat([embeddings, features], dim=-1) @ t["fc.weight"].T + t["fc.bias"]
    hidden = hidden + _attention(hidden, t, "layers.0.self_attn.")
    return hidden + _mlp(_rms(hidden, t["layers.0.post_attention_layernorm.weight"]), t, "layers.0.mlp.")


def _eagle3_reference(t, aux, embeddings):
    """SGLang LlamaForCausalLMEagle3: fc over the aux states, midlayer over [input_layernorm(emb);
    hidden_norm(hidden)]; returns (pre-norm output, draft-vocabulary logits)."""
    hidden = aux @ t["fc.weight"].T
    inputs = torch.cat([_rms(embeddings, t["midlayer.input_layernorm.weight"]),
                        _rms(hidden, t["midlayer.hidden_norm.weight"])], dim=-1)
    hidden = hidden + _attention(inputs, t, "midlayer.self_attn.")
    hidden = hidden + _mlp(_rms(hidden, t["midlayer.post_attention_layernorm.weight"]), t, "midlayer.mlp.")
    return hidden, _rms(hidden, t["norm.weight"]) @ t["lm_head.weight"].T


def _llama_layer_tensors(prefix: str, inputs: int, generator, input_norm: bool) -> dict[str, torch.Tensor]:
    def random(*shape):
        return 0.2 * torch.randn(*shape, generator=generator)

    shapes = {"self_attn.q_proj": (HIDDEN, inputs), "self_attn.k_proj": (16, inputs), "self_attn.v_proj": (16, inputs),
              "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (64, HIDDEN), "mlp.up_proj": (64, HIDDEN),
              "mlp.down_proj": (HIDDEN, 64)}
    tensors = {f"{prefix}{name}.weight": random(*shape) for name, shape in shapes.items()}
    tensors[f"{prefix}post_attention_layernorm.weight"] = 1 + random(HIDDEN)
    if input_norm:
        tensors[f"{prefix}input_layernorm.weight"] = 1 + random(HIDDEN)
    return tensors


def _llama_config(model, **extra) -> dict:
    config = model.config
    return {"model_type": "llama", "hidden_size": HIDDEN, "vocab_size": VOCAB, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": 10000.0, "hidden_act": "silu", "num_hidden_layers": 1, "tie_word_embeddings": False, **extra}


def _eagle1_checkpoint(directory: Path, model, **config) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    tensors = _llama_layer_tensors("layers.0.", HIDDEN, generator, input_norm=False)
    tensors |= {"fc.weight": 0.2 * torch.randn(HIDDEN, 2 * HIDDEN, generator=generator),
                "fc.bias": 0.1 * torch.randn(HIDDEN, generator=generator),
                "embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=generator)}  # ignored, as by the loaders
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(_llama_config(model, architectures=["LlamaForCausalLM"],
                                                                    **config)))
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def _eagle3_checkpoint(directory: Path, model, draft_ids: torch.Tensor, lm_head=None) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(6)
    tensors = _llama_layer_tensors("midlayer.", 2 * HIDDEN, generator, input_norm=True)
    ids = torch.sort(draft_ids).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    tensors |= {"fc.weight": 0.2 * torch.randn(HIDDEN, 3 * HIDDEN, generator=generator),
                "midlayer.hidden_norm.weight": 1 + 0.2 * torch.randn(HIDDEN, generator=generator),
                "norm.weight": 1 + 0.2 * torch.randn(HIDDEN, generator=generator),
                "lm_head.weight": model.lm_head.weight.detach()[ids].clone() if lm_head is None else lm_head,
                "d2t": ids - torch.arange(ids.numel()), "t2d": t2d}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(_llama_config(
        model, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=int(ids.numel()), target_hidden_size=HIDDEN,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True})))
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def _draft_inputs(model, length: int = 9):
    ids = random_prompt(length + 1, seed=21)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True)
    return ids, states, model.get_input_embeddings()(ids[:, 1:])


def test_hand_written_eagle1_checkpoint_computes_as_the_loader_and_drafts(deep_model, tmp_path):
    tensors = _eagle1_checkpoint(tmp_path / "eagle1", deep_model)
    assert interop.detect_format(tmp_path / "eagle1") == "eagle"
    with pytest.warns(UserWarning, match="records no target fingerprint"):
        spec = heads.load_heads(deep_model, tmp_path / "eagle1")
    assert spec.config.layout == "eagle1" and spec.metadata["source_format"] == "eagle"
    ids, states, embeddings = _draft_inputs(deep_model)
    features = spec.target.features(ids[:, :-1], torch.arange(9)[None], None, None)  # post-norm top layer
    with torch.no_grad():
        predicted = spec.heads.step(features, embeddings, torch.arange(9)[None],
                                    prefill_attention_mask(9, None, torch.float32, "cpu"), None)
        expected = _eagle1_reference(tensors, features, embeddings)
        torch.testing.assert_close(predicted, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(spec.target.logits(predicted, spec.heads.draft_rows(spec.target)),
                                   expected @ deep_model.lm_head.weight.T, rtol=1e-4, atol=1e-5)
    for seed in range(2):
        prompt = random_prompt(5 + seed, seed)
        assert torch.equal(spec.generate(prompt, max_new_tokens=12), greedy_reference(deep_model, prompt, 12))


def test_hand_written_eagle3_checkpoint_computes_as_the_loader_and_drafts(deep_model, tmp_path):
    draft_ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:40]
    tensors = _eagle3_checkpoint(tmp_path / "eagle3", deep_model, draft_ids)
    assert interop.detect_format(tmp_path / "eagle3") == "eagle3"
    with pytest.warns(UserWarning, match="records no target fingerprint"):
        spec = heads.load_heads(deep_model, tmp_path / "eagle3")
    config = spec.config
    assert (config.layout, tuple(config.feature_layers), config.draft_vocab_size) == ("eagle3", (1, 2, 3), 40)
    ids, states, embeddings = _draft_inputs(deep_model)
    aux = torch.cat(states.hidden_states[1:4], dim=-1)[:, :-1]  # outputs of decoder layers 0, 1, 2 (SGLang's ids)
    with torch.no_grad():
        features, _ = spec.target.forward(ids[:, :-1], torch.arange(9)[None], None, None, "last")
        torch.testing.assert_close(features, aux, rtol=1e-5, atol=1e-5)
        predicted = spec.heads.step(spec.heads.fuse(features), embeddings, torch.arange(9)[None],
                                    prefill_attention_mask(9, None, torch.float32, "cpu"), None)
        expected, draft_logits = _eagle3_reference(tensors, aux, embeddings)
        torch.testing.assert_close(predicted, expected, rtol=1e-4, atol=1e-5)  # pre-norm, what is fed back
        logits = spec.target.logits(predicted, spec.heads.draft_rows(spec.target))
        torch.testing.assert_close(logits, draft_logits, rtol=1e-4, atol=1e-5)
        sorted_ids = tensors["d2t"] + torch.arange(40)
        assert torch.equal(spec.heads.target_ids(logits.argmax(-1)), sorted_ids[draft_logits.argmax(-1)])
    for seed in range(2):
        prompt = random_prompt(5 + seed, seed)
        assert torch.equal(spec.generate(prompt, max_new_tokens=12), greedy_reference(deep_model, prompt, 12))


def _eagle_adapter(model, tmp_path: Path, **options) -> tuple[heads.SpeculativeModel, Path]:
    spec = _perturbed(heads.attach_heads(model, kind="eagle", depth=4, top_k=2, total_tokens=8, **options))
    if spec.heads.token_map is not None:  # frequency order, not sorted: the export sorts it for d2t
        spec.heads.set_token_map(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:32])
    directory = tmp_path / "adapter"
    spec.save_pretrained(directory, acceptance={"chat": {"tau": 2.0}})
    return spec, directory


def _same_drafts(original, loaded) -> None:
    for seed in range(3):
        prompt = random_prompt(6 + seed, seed)
        expected = original.generate(prompt, max_new_tokens=16)
        assert torch.equal(loaded.generate(prompt, max_new_tokens=16), expected)
        assert torch.equal(expected, greedy_reference(original.backbone, prompt, 16))
        assert loaded.last_stats.accepted_lengths == original.last_stats.accepted_lengths


@pytest.mark.parametrize("fmt, options", [
    ("eagle", dict(layout="eagle1")),
    ("eagle", dict(layout="eagle1", num_layers=2)),
    ("eagle3", dict(layout="eagle3", feature_layers=(1, 2, 3))),
    ("eagle3", dict(layout="eagle3", feature_layers=(3, 1, 2), draft_vocab_size=32)),
])
def test_eagle_round_trip(deep_model, tmp_path, fmt, options):
    spec, adapter = _eagle_adapter(deep_model, tmp_path, **options)
    out = interop.export_adapter(adapter, fmt, tmp_path / fmt, model=deep_model)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", interop.SIDECAR_NAME,
                                                            interop.README_NAME])
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is False
    assert config["num_hidden_layers"] == options.get("num_layers", 1)
    assert not any("embed" in name or "token_map" in name for name in tensors)
    if fmt == "eagle":
        assert config["architectures"] == ["LlamaForCausalLMEagle", "LlamaForCausalLM"]
        assert tensors["fc.weight"].shape == (HIDDEN, 2 * HIDDEN) and tensors["fc.bias"].shape == (HIDDEN,)
        assert "layers.0.input_layernorm.weight" not in tensors and "norm.weight" not in tensors
        assert ("layers.1.input_layernorm.weight" in tensors) == (options.get("num_layers") == 2)
    else:
        vocab = options.get("draft_vocab_size", VOCAB)
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == vocab
        assert "target_hidden_size" not in config  # equal to hidden_size: SafeAILab would skip the embeddings
        layers = sorted(options["feature_layers"])  # every loader concatenates in layer order
        assert config["eagle_aux_hidden_state_layer_ids"] == layers  # vLLM: the stream entering layer id
        assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [index - 1 for index in layers],
                                          "use_aux_hidden_state": True}  # SGLang: the output of layer id
        assert tensors["fc.weight"].shape == (HIDDEN, 3 * HIDDEN) and "fc.bias" not in tensors
        assert tensors["midlayer.self_attn.q_proj.weight"].shape == (HIDDEN, 2 * HIDDEN)
        assert tensors["lm_head.weight"].shape == (vocab, HIDDEN) and tensors["norm.weight"].shape == (HIDDEN,)
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        ids = tensors["d2t"] + torch.arange(vocab)
        assert torch.equal(ids, torch.sort(ids).values) and torch.equal(torch.nonzero(tensors["t2d"])[:, 0], ids)
        expected_ids = torch.arange(VOCAB) if spec.heads.token_map is None else torch.sort(spec.heads.token_map).values
        assert torch.equal(ids, expected_ids)
        assert torch.equal(tensors["lm_head.weight"], deep_model.lm_head.weight.detach()[ids])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = heads.load_heads(deep_model, out)  # selfdraft.json restores the pin: strict, no warning
    assert loaded.metadata["source_format"] == fmt and loaded.metadata["acceptance"] == {"chat": {"tau": 2.0}}
    _same_drafts(spec, loaded)
    (out / interop.SIDECAR_NAME).unlink()  # as another loader would leave it
    with pytest.warns(UserWarning, match="records no target fingerprint"):
        bare = heads.load_heads(deep_model, out)
    _same_drafts(spec, bare)


@pytest.mark.parametrize("fmt, options", [
    ("eagle", dict(layout="eagle1")),
    ("eagle3", dict(layout="eagle3", feature_layers=(1, 2, 3), draft_vocab_size=32)),
])
def test_parallel_heads_stay_behind_and_the_export_drafts_as_the_sequential_drafter(deep_model, tmp_path, fmt,
                                                                                   options):
    """A drafter with parallel heads (``parallel_mode="heads"``) exports its layer alone: the heads
    never train it, so the export drafts exactly what the adapter drafts sequentially."""
    spec, adapter = _eagle_adapter(deep_model, tmp_path, parallel=3, drafting="sequential", **options)
    assert any(name.startswith("parallel_heads.") for name in spec.heads.state_dict())
    out = interop.export_adapter(adapter, fmt, tmp_path / fmt, model=deep_model)
    assert not any("parallel_heads" in name for name in load_file(str(out / "model.safetensors")))
    drafter = json.loads((out / interop.SIDECAR_NAME).read_text())["selfdraft_adapter"]["drafter"]
    assert drafter["parallel"] == 1 and drafter["drafting"] == "sequential"
    assert "parallel heads are not in this export" in (out / interop.README_NAME).read_text()
    assert json.loads((adapter / "adapter_config.json").read_text())["drafter"]["parallel"] == 3  # (unchanged)
    loaded = heads.load_heads(deep_model, out)
    assert loaded.config.parallel == 1 and loaded.heads.parallel_heads is None
    _same_drafts(spec, loaded)


@pytest.mark.parametrize("feature_layers", [(3, 1, 2), (2, 3, 1), (1, 2, 3)])
def test_eagle3_export_computes_as_the_loaders_whatever_the_layer_order(deep_model, tmp_path, feature_layers):
    """Issue 15 items 12-14, against the loaders' own conventions: the exported checkpoint, run as
    SGLang's LlamaForCausalLMEagle3 runs it (aux states concatenated in layer order), predicts what
    the selfdraft drafter predicts; the layer ids name the same layers in vLLM's and SGLang's
    indexing; no target_hidden_size when it equals hidden_size."""
    spec, adapter = _eagle_adapter(deep_model, tmp_path, layout="eagle3", feature_layers=feature_layers)
    out = interop.export_adapter(adapter, "eagle3", tmp_path / "eagle3", model=deep_model)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert "target_hidden_size" not in config and config["hidden_size"] == HIDDEN
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
    sglang_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert vllm_ids == sorted(feature_layers) and sglang_ids == [index - 1 for index in vllm_ids]
    ids, states, embeddings = _draft_inputs(deep_model)
    aux = torch.cat([states.hidden_states[index] for index in vllm_ids], dim=-1)[:, :-1]  # vLLM: input of layer id
    assert torch.equal(aux, torch.cat([states.hidden_states[i + 1] for i in sglang_ids], dim=-1)[:, :-1])  # SGLang
    with torch.no_grad():
        features, _ = spec.target.forward(ids[:, :-1], torch.arange(9)[None], None, None, "last")  # drafter's order
        predicted = spec.heads.step(spec.heads.fuse(features), embeddings, torch.arange(9)[None],
                                    prefill_attention_mask(9, None, torch.float32, "cpu"), None)
        expected, _ = _eagle3_reference(tensors, aux, embeddings)
    torch.testing.assert_close(predicted, expected, rtol=1e-4, atol=1e-5)
    sidecar = json.loads((out / interop.SIDECAR_NAME).read_text())["selfdraft_adapter"]
    assert sidecar["drafter"]["feature_layers"] == vllm_ids  # the sidecar describes the checkpoint beside it


def test_eagle3_import_reads_either_engines_layer_ids(deep_model, tmp_path):
    """Issue 15 item 13: a vLLM-style config (top-level ids only, inputs of layers) imports as the
    SGLang one does; both keys present must name the same layers."""
    draft_ids = torch.arange(10, 42)
    tensors = _eagle3_checkpoint(tmp_path / "sglang", deep_model, draft_ids)  # eagle_config ids [0, 1, 2]
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    (tmp_path / "vllm").mkdir()
    save_file(tensors, str(tmp_path / "vllm" / "model.safetensors"))
    vllm = {key: value for key, value in config.items() if key != "eagle_config"}
    (tmp_path / "vllm" / "config.json").write_text(json.dumps({**vllm, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))
    with pytest.warns(UserWarning, match="records no target fingerprint"):
        loaded = [heads.load_heads(deep_model, tmp_path / name) for name in ("sglang", "vllm")]
    assert [tuple(spec.config.feature_layers) for spec in loaded] == [(1, 2, 3), (1, 2, 3)]
    both = {**config, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}  # SGLang's ids again: one layer off for vLLM
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(both))
    with pytest.raises(heads.AdapterError, match="name different layers; they must differ by exactly one"):
        heads.load_heads(deep_model, tmp_path / "vllm")
    (tmp_path / "vllm" / "config.json").write_text(json.dumps({**vllm, "eagle_aux_hidden_state_layer_ids": [3, 1, 2]}))
    with pytest.raises(heads.AdapterError, match="increasing order"):
        heads.load_heads(deep_model, tmp_path / "vllm")


@pytest.mark.parametrize("fmt, options, message", [
    ("eagle", {}, "layout 'native'.*train with --eagle-layout eagle1"),
    ("eagle3", dict(feature_layers=(1, 2, 3)), "layout 'native'.*train with --eagle-layout eagle3"),
    ("eagle", dict(layout="eagle1", feature_layers=(1, 2)), "top-layer features only"),
    ("eagle", dict(layout="eagle1", draft_vocab_size=32), "full vocabulary"),
    ("eagle3", dict(layout="eagle3", feature_layers=(0, 1, 2)), r"must lie in 1..3"),
    ("eagle3", dict(layout="eagle3", feature_layers=(2, 3, 4)), r"must lie in 1..3"),
])
def test_eagle_export_refuses_with_the_reason(deep_model, tmp_path, fmt, options, message):
    spec = heads.attach_heads(deep_model, kind="eagle", **options)
    spec.save_pretrained(tmp_path / "eagle")
    with pytest.raises(heads.AdapterError, match=message):
        interop.export_adapter(tmp_path / "eagle", fmt, tmp_path / "out", model=deep_model)
    assert not (tmp_path / "out").exists()


def test_eagle_export_needs_the_target(deep_model, tmp_path):
    heads.attach_heads(deep_model, kind="eagle", layout="eagle1").save_pretrained(tmp_path / "eagle")
    with pytest.raises(heads.AdapterError, match="pass --model TARGET_DIR"):
        interop.export_adapter(tmp_path / "eagle", "eagle", tmp_path / "a")
    with pytest.raises(heads.TargetMismatchError, match="--model is not this adapter's target"):
        interop.export_adapter(tmp_path / "eagle", "eagle", tmp_path / "b", model=build_model("llama", seed=4))
    qwen = build_model("qwen2")
    heads.attach_heads(qwen, kind="eagle", layout="eagle1").save_pretrained(tmp_path / "qwen")
    with pytest.raises(heads.AdapterError, match="Llama decoder layers; the target is 'qwen2'"):
        interop.export_adapter(tmp_path / "qwen", "eagle", tmp_path / "c", model=qwen)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_eagle_import_refusals(deep_model, tmp_path):
    draft_ids = torch.arange(10, 42)
    _eagle3_checkpoint(tmp_path / "own-head", deep_model, draft_ids, lm_head=torch.zeros(32, HIDDEN))
    with pytest.raises(heads.AdapterError, match="separately trained lm_head"):
        heads.load_heads(deep_model, tmp_path / "own-head")
    tensors = _eagle3_checkpoint(tmp_path / "t2d", deep_model, draft_ids)
    save_file({**tensors, "t2d": torch.ones(VOCAB, dtype=torch.bool)}, str(tmp_path / "t2d" / "model.safetensors"))
    with pytest.raises(heads.AdapterError, match="t2d and d2t disagree"):
        heads.load_heads(deep_model, tmp_path / "t2d")
    _eagle1_checkpoint(tmp_path / "wide-mlp", deep_model, intermediate_size=128)
    with pytest.raises(heads.AdapterError, match=r"must match the checkpoint's.*intermediate_size 128 \(target 64\)"):
        heads.load_heads(deep_model, tmp_path / "wide-mlp")
    with pytest.raises(heads.AdapterError, match="target 'qwen2'"):
        heads.load_heads(build_model("qwen2"), tmp_path / "t2d")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(_llama_config(deep_model, architectures=["EagleLlamaForCausalLM"])))
    torch.save({"fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}, str(pickled / "pytorch_model.bin"))
    with pytest.raises(heads.AdapterError, match="must be converted to safetensors"):
        heads.load_heads(deep_model, pickled)


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
    reduced = heads.attach_heads(model, num_heads=2, draft_vocab_size=20)
    reduced.save_pretrained(tmp_path / "reduced")
    with pytest.raises(heads.AdapterError, match="draft vocabulary of 20 tokens.*--format medusa-vllm"):
        interop.export_adapter(tmp_path / "reduced", "medusa", tmp_path / "f")
    assert not any((tmp_path / name).exists() for name in "abcdef")


def test_medusa_draft_vocabulary_round_trip_through_vllm(model, tmp_path):
    """A draft vocabulary exports as vLLM's truncated vocabulary (``truncated_vocab_size``, a
    ``token_map`` of target ids, lm_heads of that many rows) and imports back, with or without the
    sidecar; vLLM's full-size lm_heads are sliced by the token map as vLLM slices them."""
    spec = _perturbed(heads.attach_heads(model, num_heads=2, tree=8, draft_vocab_size=20))
    spec.heads.set_token_map(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:20])
    spec.save_pretrained(tmp_path / "adapter")
    out = interop.export_adapter(tmp_path / "adapter", "medusa-vllm", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["truncated_vocab_size"] == 20 and config["vocab_size"] == VOCAB
    assert torch.equal(tensors["token_map"], spec.heads.token_map) and tensors["lm_heads.0.weight"].shape[0] == 20
    for directory in (out, tmp_path / "bare"):
        if directory != out:  # vLLM's own files only, the full lm_heads vLLM also accepts
            directory.mkdir()
            (directory / "config.json").write_text(json.dumps(config))
            full = dict(tensors)
            for head in range(2):
                rows = torch.zeros(VOCAB, HIDDEN)
                rows[spec.heads.token_map] = tensors[f"lm_heads.{head}.weight"]
                full[f"lm_heads.{head}.weight"] = rows
            save_file(full, str(directory / "model.safetensors"))
        loaded = heads.load_heads(model, directory)
        assert loaded.config.draft_vocab_size == 20 and torch.equal(loaded.heads.token_map, spec.heads.token_map)
        _same_drafter(spec, loaded)
        prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
        assert torch.equal(loaded.generate(prompt, max_new_tokens=12), spec.generate(prompt, max_new_tokens=12))
    broken = dict(tensors)
    del broken["token_map"]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps(config))
    save_file(broken, str(tmp_path / "broken" / "model.safetensors"))
    with pytest.raises(heads.AdapterError, match="truncated_vocab_size 20 needs a token_map"):
        heads.load_heads(model, tmp_path / "broken")


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
    with pytest.raises(heads.AdapterError, match="tensors do not match its config: missing"):
        heads.load_heads(model, truncated)  # a truncated vocabulary imports (see the round trip), not without heads
    (truncated / "config.json").write_text(json.dumps(_vllm_config(truncated_vocab_size=VOCAB + 5)))
    with pytest.raises(heads.AdapterError, match="truncated_vocab_size must be an int in 1..vocab_size"):
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
              str(heads_count / medusa_checkpoint.MEDUSA_TENSORS))
    with pytest.raises(heads.AdapterError, match="heads 0..1 but config.json says medusa_num_heads 1"):
        heads.load_heads(model, heads_count)


def test_import_of_another_size_is_a_target_mismatch(model, tmp_path):
    directory = tmp_path / "wide"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": 1}))
    save_file({"0.0.linear.weight": torch.zeros(64, 64), "0.0.linear.bias": torch.zeros(64),
               "0.1.weight": torch.zeros(VOCAB, 64)}, str(directory / medusa_checkpoint.MEDUSA_TENSORS))
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
