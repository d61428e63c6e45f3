"""Adapter files: round trip, target pinning, corrupt files, atomic writes."""

from __future__ import annotations

import json

import pytest
import torch

import heads
from heads.adapter import files as adapter_module
from tests.conftest import build_model, random_prompt

pytestmark = pytest.mark.fast  # in `make test-fast`


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


def _rewrite_config(directory, change) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(format_version=4), "newer selfdraft.*upgrade selfdraft"),
    (lambda c: c.update(format_version="1"), "format_version must be an int"),
    (lambda c: c.update(extra=1), r"unknown field\(s\) \['extra'\]"),
    (lambda c: c.update(library="medusa"), "library 'medusa'"),
    (lambda c: c["target"].update(weights_sha256="abc"), "target.weights_sha256 must be a 64-digit"),
    (lambda c: c["target"].update(vocab_size=0), "target.vocab_size must be a positive int"),
    (lambda c: c["target"].update(dtype="int3"), "target.dtype 'int3'"),
    (lambda c: c["target"].update(color="red"), r"unknown target field\(s\) \['color'\]"),
    (lambda c: c["target"].pop("model_type"), "target.model_type"),
    (lambda c: c.update(tree_accuracy=[[1.5]]), "tree_accuracy must be"),
    (lambda c: c.update(acceptance={"chat": {"prompts": 3}}), r"acceptance\['chat'\] has no 'tau'"),
    (lambda c: c.update(acceptance={"chat": {"tau": -1}}), r"acceptance\['chat'\].tau must be a non-negative"),
    (lambda c: c.update(acceptance={"chat": [{"tau": 2.0, "acceptance_by_position": [2.0]}]}),
     "acceptance_by_position must be"),
    (lambda c: c.update(training=[1]), "field 'training' must be an object"),
    (lambda c: c.pop("drafter"), "missing field 'drafter'"),
])
def test_every_config_field_is_checked(trained_spec, tmp_path, change, message):
    trained_spec.save_pretrained(tmp_path / "adapter")
    _rewrite_config(tmp_path / "adapter", change)
    with pytest.raises(heads.AdapterError, match=message):
        heads.load_heads(trained_spec.backbone, tmp_path / "adapter")


def test_acceptance_per_temperature_and_revision_are_recorded(trained_spec, tmp_path):
    acceptance = {"chat": [{"tau": 2.5, "temperature": 0.0}, {"tau": 2.1, "temperature": 0.7}]}
    trained_spec.save_pretrained(tmp_path / "adapter", acceptance=acceptance, revision="0123abc")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target"]["revision"] == "0123abc" and config["acceptance"] == acceptance
    assert heads.load_heads(trained_spec.backbone, tmp_path / "adapter").metadata["acceptance"] == acceptance


def test_revision_from_a_hub_cache_snapshot_path(trained_spec):
    from heads.backbone import target_fingerprint

    model = trained_spec.backbone
    commit = "0f" * 20
    previous = model.config._name_or_path
    try:
        model.config._name_or_path = f"/cache/hub/models--org--tiny/snapshots/{commit}"
        assert target_fingerprint(model)["revision"] == commit
        model.config._name_or_path = "/some/local/dir"
        assert target_fingerprint(model)["revision"] is None
    finally:
        model.config._name_or_path = previous


def test_fingerprint_reads_samples_only_whatever_the_layout():
    """Non-contiguous tensors give the fingerprint of their contiguous copy, and no whole-tensor
    copy is made (every new storage the ops allocate is sample-sized)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from heads.backbone import weights_fingerprint

    class Storages(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            output = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for tensor in torch.utils._pytree.tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                    Storages.largest = max(Storages.largest, tensor.untyped_storage().nbytes())
            return output

    model = build_model("llama", seed=5)
    contiguous = weights_fingerprint(model, samples_per_tensor=64)
    with torch.no_grad():
        for module in (model.lm_head, model.model.layers[0].mlp.up_proj):
            module.weight = torch.nn.Parameter(module.weight.detach().t().contiguous().t())
    assert not model.lm_head.weight.is_contiguous()
    with Storages():
        assert weights_fingerprint(model, samples_per_tensor=64) == contiguous
    # the largest new storage: int64 indices of 64 samples in 2 dimensions; a flattened copy of
    # lm_head would be 96 x 32 x 4 bytes
    assert 0 < Storages.largest <= 64 * 8 * 2 < model.lm_head.weight.numel() * 4, Storages.largest


@pytest.mark.parametrize("name, options", [("qwen2", dict(layout="eagle1")),
                                           ("llama", dict(layout="eagle3", feature_layers=(0, 1, 2)))])
def test_eagle_layout_round_trip_and_checks(name, options, tmp_path):
    model = build_model(name, seed=3)
    spec = heads.attach_heads(model, kind="eagle", **options)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in spec.heads.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    spec.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["drafter"]["layout"] == options["layout"]
    loaded = heads.load_heads(model, tmp_path / "adapter")
    assert loaded.config.layout == options["layout"]
    prompt = random_prompt(7, seed=2)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=12), spec.generate(prompt, max_new_tokens=12))
    assert loaded.last_stats.accepted_lengths == spec.last_stats.accepted_lengths
    _rewrite_config(tmp_path / "adapter", lambda c: c["drafter"].update(layout="eagle7"))
    with pytest.raises(heads.AdapterError, match="drafter.layout 'eagle7' is not one of"):
        heads.load_heads(model, tmp_path / "adapter")
    _rewrite_config(tmp_path / "adapter", lambda c: c["drafter"].pop("layout"))  # older adapters: native
    with pytest.raises(heads.AdapterError, match="tensors do not match the drafter: missing"):
        heads.load_heads(model, tmp_path / "adapter")


@pytest.mark.parametrize("kind, change, message", [
    ("medusa", {"num_heads": 20000}, "declares more tensors than the 9 in its weights file"),
    ("medusa", {"num_layers": 20000}, "declares more tensors than the 9 in its weights file"),
    ("medusa", {"num_heads": 2}, r"unexpected \['blocks.2.0.linear.bias'"),
    ("eagle", {"num_layers": 20000}, "declares more tensors than the"),
    ("eagle", {"num_layers": 2}, r"missing \['decoder.layers.1."),
])
def test_declared_sizes_are_checked_against_the_header_before_building(tmp_path, monkeypatch, kind, change, message):
    """Issue 15 item 2: a config declaring 20000 heads on a 3-head file allocated ~500 MB for 13-18 s
    before failing; now the header decides before anything is built, in milliseconds."""
    import time

    from heads import loading

    model = build_model("llama", seed=3)
    heads.attach_heads(model, kind=kind, **({"num_heads": 3} if kind == "medusa" else {})).save_pretrained(
        tmp_path / "adapter")
    _rewrite_config(tmp_path / "adapter", lambda c: c["drafter"].update(change))

    def never(*args, **kwargs):
        raise AssertionError("the drafter was built before its sizes were checked")

    monkeypatch.setattr(loading, "build_spec", never)
    start = time.perf_counter()
    with pytest.raises(heads.AdapterError, match=message):
        heads.load_heads(model, tmp_path / "adapter")
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("change, message", [
    (lambda c: c["drafter"].update(tree=[[0], [0, 0], [0, 0, 0, 0]]), "has depth 4 but at most 3 is possible"),
    (lambda c: c["drafter"].update(tree=[[0], [1, 0]]), r"\(1,\) is missing from choices"),
    (lambda c: c.update(tree_accuracy=[[0.5]]), "accuracy table covers 1 depths, 3 needed"),
])
def test_a_bad_tree_in_the_config_is_an_adapter_error(trained_spec, tmp_path, change, message):
    """Issue 15 item 11: these raised InvalidTreeError, so `selfdraft check` printed a traceback."""
    trained_spec.save_pretrained(tmp_path / "adapter")
    _rewrite_config(tmp_path / "adapter", change)
    with pytest.raises(heads.AdapterError, match=message):
        heads.load_heads(trained_spec.backbone, tmp_path / "adapter")


def test_load_heads_without_a_model_is_a_clear_type_error(trained_spec, tmp_path):
    """Issue 15 item 11: load_heads(None, dir) raised AttributeError."""
    trained_spec.save_pretrained(tmp_path / "adapter")
    with pytest.raises(TypeError, match="model must be the target, a transformers PreTrainedModel; got NoneType"):
        heads.load_heads(None, tmp_path / "adapter")
