"""vLLM speculators' layout of EAGLE-3 drafters: the exported config carries speculators' field names
and types, the tensors compute what the drafter computes, and export -> detect -> import gives the
same drafts and greedy output; imports refuse what the drafter cannot compute, naming the field."""

from __future__ import annotations

import json
import warnings
from types import NoneType

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

import heads
from heads import interop
from tests.heads.test_interop import (  # noqa: F401 (deep_model is a fixture)
    HIDDEN, VOCAB, _draft_inputs, _eagle3_reference, _eagle_adapter, _same_drafts, deep_model,
)
from tree_attention.mask import prefill_attention_mask

# Field names and types from vllm-project/speculators at c05b95b (release v0.7.0):
# src/speculators/config.py, SpeculatorModelConfig (model fields; PretrainedConfig's model_type is stripped on save)
MODEL_FIELDS = {"speculators_model_type": str, "speculators_version": str, "speculators_config": dict}
# src/speculators/config.py, SpeculatorsConfig
SPECULATORS_CONFIG_FIELDS = {"algorithm": str, "proposal_methods": list, "default_proposal_method": str,
                             "verifier": dict}
# src/speculators/config.py, VerifierConfig
VERIFIER_FIELDS = {"name_or_path": (str, NoneType), "architectures": list}
# src/speculators/proposals/greedy.py, GreedyTokenProposalConfig (speculative_tokens >= 1, verifier_accept_k >= 1,
# accept_tolerance >= 0)
GREEDY_FIELDS = {"proposal_type": str, "speculative_tokens": int, "verifier_accept_k": int, "accept_tolerance": float}
# src/speculators/models/eagle3/config.py, Eagle3SpeculatorConfig
EAGLE3_FIELDS = {"architectures": list, "transformer_layer_config": dict, "draft_vocab_size": int,
                 "norm_before_residual": bool, "target_hidden_size": (int, NoneType),
                 "eagle_aux_hidden_state_layer_ids": (list, NoneType), "norm_before_fc": bool, "fc_norm": bool,
                 "norm_output": bool, "embed_requires_grad": bool}
# src/speculators/models/eagle3/core.py (Eagle3DraftModel) and src/speculators/model.py (DraftVocabMixin):
# saved tensors; d2t/t2d only for a reduced draft vocabulary; embed_tokens comes from the verifier
LAYER_TENSORS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm")
TENSORS = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight"} | {
    f"layers.0.{name}.weight" for name in LAYER_TENSORS}
EXTRA_KEYS = {"torch_dtype"}  # PretrainedConfig writes it too


def _typed(block: dict, fields: dict, where: str) -> None:
    assert set(fields) <= set(block), f"{where}: missing {sorted(set(fields) - set(block))}"
    for name, kind in fields.items():
        assert isinstance(block[name], kind) and not (kind is int and isinstance(block[name], bool)), (where, name)


def _export(model, tmp_path, **options):
    spec, adapter = _eagle_adapter(model, tmp_path, **options)
    out = interop.export_adapter(adapter, "speculators", tmp_path / "speculators", model=model)
    return spec, out, json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("options", [dict(feature_layers=(1, 2, 3)),
                                     dict(feature_layers=(3, 1, 2), draft_vocab_size=32)])
def test_config_and_tensors_have_speculators_names_and_types(deep_model, tmp_path, options):
    spec, out, config, tensors = _export(deep_model, tmp_path, layout="eagle3", **options)
    assert "speculators" in interop.format_names()
    _typed(config, MODEL_FIELDS | EAGLE3_FIELDS, "config.json")
    assert set(config) == set(MODEL_FIELDS) | set(EAGLE3_FIELDS) | EXTRA_KEYS
    speculators = config["speculators_config"]
    _typed(speculators, SPECULATORS_CONFIG_FIELDS, "speculators_config")
    _typed(speculators["verifier"], VERIFIER_FIELDS, "verifier")
    assert speculators["verifier"]["architectures"] == ["LlamaForCausalLM"]
    (proposal,) = speculators["proposal_methods"]
    _typed(proposal, GREEDY_FIELDS, "proposal_methods[0]")
    assert proposal["proposal_type"] == speculators["default_proposal_method"] == "greedy"
    assert proposal["speculative_tokens"] == 3 and proposal["verifier_accept_k"] >= 1  # the engine-sized default
    assert (config["speculators_model_type"], speculators["algorithm"]) == ("eagle3", "eagle3")
    assert config["architectures"] == ["Eagle3Speculator"] and config["norm_before_residual"] is False
    assert not (config["norm_before_fc"] or config["fc_norm"] or config["norm_output"])
    layer = LlamaConfig(**config["transformer_layer_config"])  # the layer config speculators builds
    assert (layer.model_type, layer.num_hidden_layers, layer.vocab_size, layer.hidden_size) == ("llama", 1, VOCAB,
                                                                                                 HIDDEN)
    assert config["eagle_aux_hidden_state_layer_ids"] == sorted(options["feature_layers"])  # vLLM's ids
    vocab = options.get("draft_vocab_size", VOCAB)
    assert config["draft_vocab_size"] == vocab
    reduced = vocab != VOCAB
    assert set(tensors) == TENSORS | ({"d2t", "t2d"} if reduced else set())
    assert tensors["fc.weight"].shape == (HIDDEN, 3 * HIDDEN) and tensors["lm_head.weight"].shape == (vocab, HIDDEN)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * HIDDEN
    if reduced:
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        assert tensors["d2t"].shape == (vocab,) and tensors["t2d"].shape == (VOCAB,)
        ids = tensors["d2t"] + torch.arange(vocab)
        assert torch.equal(ids, torch.sort(spec.heads.token_map).values)
        assert torch.equal(tensors["lm_head.weight"], deep_model.lm_head.weight.detach()[ids])
    # the verifier's embeddings are written: speculators 0.7.0 copies them only when a NaN pre-fill survives loading
    assert torch.equal(tensors["embed_tokens.weight"], deep_model.get_input_embeddings().weight.detach())


def test_exported_tensors_compute_what_the_drafter_computes(deep_model, tmp_path):
    """The first layer run as speculators' Eagle3 layer with norm_before_residual false (the
    pre-norm residual, as SGLang's midlayer: the hand reference of test_interop) on the layers that
    eagle_aux_hidden_state_layer_ids name, in vLLM's convention (the stream entering layer id)."""
    spec, out, config, tensors = _export(deep_model, tmp_path, layout="eagle3", feature_layers=(3, 1, 2))
    as_midlayer = {name.replace("layers.0.", "midlayer."): tensor for name, tensor in tensors.items()}
    ids, states, embeddings = _draft_inputs(deep_model)
    aux = torch.cat([states.hidden_states[index] for index in config["eagle_aux_hidden_state_layer_ids"]],
                    dim=-1)[:, :-1]
    with torch.no_grad():
        features, _ = spec.target.forward(ids[:, :-1], torch.arange(9)[None], None, None, "last")
        predicted = spec.heads.step(spec.heads.fuse(features), embeddings, torch.arange(9)[None],
                                    prefill_attention_mask(9, None, torch.float32, "cpu"), None)
        expected, _ = _eagle3_reference(as_midlayer, aux, embeddings)
    torch.testing.assert_close(predicted, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [dict(feature_layers=(1, 2, 3)),
                                     dict(feature_layers=(2, 3, 1), draft_vocab_size=32)])
def test_round_trip_gives_the_same_drafts(deep_model, tmp_path, options):
    spec, out, config, _ = _export(deep_model, tmp_path, layout="eagle3", **options)
    assert interop.detect_format(out) == "speculators"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = heads.load_heads(deep_model, out)  # the sidecar restores the pin: strict, no warning
    assert loaded.metadata["source_format"] == "speculators"
    _same_drafts(spec, loaded)
    (out / interop.SIDECAR_NAME).unlink()  # as speculators or vLLM would leave the folder
    with pytest.warns(UserWarning, match="records no target fingerprint"):
        bare = heads.load_heads(deep_model, out)
    assert bare.config.feature_layers == tuple(sorted(options["feature_layers"]))
    assert (bare.config.depth, bare.config.top_k) == (config["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"], 1)  # the greedy proposal: a chain
    bare.set_tree({"depth": spec.config.depth, "top_k": spec.config.top_k, "total_tokens": spec.config.total_tokens})
    _same_drafts(spec, bare)


def _rewrite(out, tensors=None, **changes):
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(out / "model.safetensors"))


@pytest.mark.parametrize("changes, message", [
    (dict(norm_before_residual=True), "norm_before_residual is True"),
    (dict(norm_before_residual=None), "norm_before_residual is None"),
    (dict(fc_norm=True), "fc_norm true"),
    (dict(speculators_model_type="eagle"), "speculators_model_type 'eagle'"),
    (dict(transformer_layer_config={"model_type": "qwen3"}), "transformer_layer_config must be a Llama"),
    (dict(speculators_config={"proposal_methods": [], "verifier": {}}), "proposal_methods must be a non-empty"),
])
def test_import_refuses_what_the_drafter_cannot_compute(deep_model, tmp_path, changes, message):
    _, out, _, _ = _export(deep_model, tmp_path, layout="eagle3", feature_layers=(1, 2, 3))
    (out / interop.SIDECAR_NAME).unlink()
    _rewrite(out, **changes)
    assert interop.detect_format(out) == "speculators"
    with pytest.raises(heads.AdapterError, match=message):
        heads.load_heads(deep_model, out)


def test_import_refuses_trained_embeddings_and_accepts_the_targets(deep_model, tmp_path):
    _, out, _, tensors = _export(deep_model, tmp_path, layout="eagle3", feature_layers=(1, 2, 3))
    (out / interop.SIDECAR_NAME).unlink()
    own = deep_model.get_input_embeddings().weight.detach().clone()
    _rewrite(out, tensors={**tensors, "embed_tokens.weight": own})
    with pytest.warns(UserWarning, match="records no target fingerprint"):
        heads.load_heads(deep_model, out)
    _rewrite(out, tensors={**tensors, "embed_tokens.weight": own + 1})
    with pytest.raises(heads.AdapterError, match="embed_tokens.weight differs"):
        heads.load_heads(deep_model, out)


def test_export_refuses_a_drafter_the_layout_cannot_hold(deep_model, tmp_path):
    _, adapter = _eagle_adapter(deep_model, tmp_path, feature_layers=(1, 2, 3))  # native layout
    with pytest.raises(heads.AdapterError, match="as 'speculators'.*train with --eagle-layout eagle3"):
        interop.export_adapter(adapter, "speculators", tmp_path / "out", model=deep_model)
