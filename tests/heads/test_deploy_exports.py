"""Exports give engine users what they need (issue 36, item 3): the speculators export carries the
target's embeddings, the verifier id and an engine-sized speculative-token count; every export
writes (and the command prints) the vLLM / SGLang commands that load it; EAGLE-1's fc.bias is
either written with a note on which engines drop it or left out exactly; FasterDecoding's
five-head loader is described; a kind/format mismatch is refused before any model is loaded."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from safetensors.torch import load_file

import heads
from heads import interop
from heads.kind import ExportOptions
from heads.medusa.checkpoint import fasterdecoding_heads_note
from tests.heads.test_interop import _eagle_adapter, deep_model  # noqa: F401 (deep_model is a fixture)


def _speculative_config(command: str) -> dict:
    words = shlex.split(command)
    return json.loads(words[words.index("--speculative-config") + 1])


def test_speculators_export_writes_embeddings_verifier_and_tokens(deep_model, tmp_path):
    _, adapter = _eagle_adapter(deep_model, tmp_path, layout="eagle3", feature_layers=(1, 2, 3))
    options = ExportOptions(out=str(tmp_path / "out"), target="owner/target", verifier="owner/target",
                            num_speculative_tokens=2)
    out = interop.export_adapter(adapter, "speculators", tmp_path / "out", model=deep_model, options=options)
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["embed_tokens.weight"], deep_model.get_input_embeddings().weight.detach())
    config = json.loads((out / "config.json").read_text())["speculators_config"]
    assert config["verifier"]["name_or_path"] == "owner/target"
    assert config["proposal_methods"][0]["speculative_tokens"] == 2
    readme = (out / interop.README_NAME).read_text()
    vllm = next(line for line in readme.splitlines() if line.startswith("vllm serve owner/target"))
    assert _speculative_config(vllm) == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 2}
    assert f"vllm serve {out}" in readme and "SGLang" in readme and "heads.load_heads" in readme
    heads.load_heads(deep_model, out)  # still imports: the embeddings are the target's


def test_default_export_options_are_engine_sized(deep_model, tmp_path):
    _, adapter = _eagle_adapter(deep_model, tmp_path, layout="eagle3", feature_layers=(1, 2, 3))
    out = interop.export_adapter(adapter, "eagle3", tmp_path / "out", model=deep_model)
    readme = (out / interop.README_NAME).read_text()
    sglang = next(line for line in readme.splitlines() if line.startswith("python -m sglang.launch_server"))
    words = shlex.split(sglang)
    assert words[words.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert words[words.index("--speculative-draft-model-path") + 1] == str(out)
    assert (words[words.index("--speculative-num-steps") + 1], words[words.index("--speculative-eagle-topk") + 1],
            words[words.index("--speculative-num-draft-tokens") + 1]) == ("3", "1", "4")


def test_eagle1_bias_note_and_bias_free_variant(deep_model, tmp_path):
    spec, adapter = _eagle_adapter(deep_model, tmp_path, layout="eagle1")
    served = interop.serving(json.loads((adapter / "adapter_config.json").read_text()), "eagle", ExportOptions())
    assert any("vLLM's EAGLE-1 model" in note and "drops fc.bias" in note for note in served["notes"])
    with pytest.raises(heads.AdapterError, match="--no-fc-bias: this drafter's fc.bias is not zero"):
        interop.export_adapter(adapter, "eagle", tmp_path / "out", model=deep_model,
                               options=ExportOptions(fc_bias=False))
    with torch.no_grad():
        spec.heads.projection.bias.zero_()
    spec.save_pretrained(adapter)
    out = interop.export_adapter(adapter, "eagle", tmp_path / "out", model=deep_model,
                                 options=ExportOptions(out=str(tmp_path / "out"), fc_bias=False))
    assert "fc.bias" not in load_file(str(out / "model.safetensors"))
    assert "drops fc.bias" not in (out / interop.README_NAME).read_text()
    loaded = heads.load_heads(deep_model, out)  # a bias-free fc imports as a zero bias: the same drafter
    assert torch.equal(loaded.heads.projection.bias, torch.zeros_like(loaded.heads.projection.bias))


@pytest.mark.parametrize("count, expected", [
    (4, "heads 0-3, head 4 stays as transformers initialises missing weights"),
    (2, "depths 3-4 draft from untrained heads"),
    (6, "heads 5-5 of this adapter are dropped without an error"),
])
def test_fasterdecoding_note_says_what_the_loader_does(count, expected):
    note = fasterdecoding_heads_note(count)
    assert "builds 5 heads" in note and "strict=False" in note and expected in note
    assert fasterdecoding_heads_note(5) is None


def test_medusa_exports_name_the_engines(tmp_path):
    config = {"kind": "medusa", "drafter": {"num_heads": 2, "num_layers": 1}, "target": {"name_or_path": "t"}}
    served = interop.serving(config, "medusa-vllm", ExportOptions(out="OUT", target="t", num_speculative_tokens=3))
    assert _speculative_config(served["commands"]["vLLM"]) == {"method": "medusa", "model": "OUT",
                                                               "num_speculative_tokens": 2}
    assert served["commands"]["SGLang"].startswith("not supported")
    assert interop.serving(config, "medusa", ExportOptions())["commands"]["vLLM"].startswith("not this layout")


def test_kind_format_mismatch_is_refused_from_the_config(tmp_path):
    from tests.conftest import build_model

    heads.attach_heads(build_model("llama"), num_heads=2).save_pretrained(tmp_path / "medusa")
    with pytest.raises(heads.AdapterError, match="format 'eagle' holds eagle drafters; this adapter is kind 'medusa'"):
        interop.check_export(tmp_path / "medusa", "eagle")


def test_saved_adapter_files_are_readable_like_their_folder(tmp_path):
    import os
    import stat

    from tests.conftest import build_model

    previous = os.umask(0o022)
    try:
        heads.attach_heads(build_model("llama"), num_heads=2).save_pretrained(tmp_path / "adapter")
    finally:
        os.umask(previous)
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "adapter").iterdir()} == {
        "adapter_config.json": 0o644, "adapter_model.safetensors": 0o644}
