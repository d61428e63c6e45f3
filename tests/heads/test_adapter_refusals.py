"""Adapter files refused by name: non-floating tensors, links out of the adapter directory, JSON
values of the wrong type for a config field (issue 36, items 12, 14 and 15)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import heads
from heads import kinds
from heads.adapter import AdapterError, check_fields
from heads.adapter.fields import field_types, matches
from tests.conftest import build_model

pytestmark = pytest.mark.fast  # in `make test-fast`


@pytest.fixture()
def saved(tmp_path) -> Path:
    model = build_model("llama", seed=3)
    heads.attach_heads(model, num_heads=2).save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def _rewrite_config(directory: Path, change) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def test_integer_tensor_is_refused_by_name(saved):
    path = saved / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].round().to(torch.int64)
    save_file(tensors, str(path))
    with pytest.raises(AdapterError, match=rf"tensor {name} is stored as int64; the drafter expects a floating"):
        heads.load_heads(build_model("llama", seed=3), saved)


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_config.json"])
def test_link_outside_the_directory_is_refused(saved, tmp_path, name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(saved / name, elsewhere / name)
    os.symlink(elsewhere / name, saved / name)
    with pytest.raises(AdapterError, match=f"{name} is a symbolic link to .*outside the adapter directory"):
        heads.load_heads(build_model("llama", seed=3), saved)


def test_links_inside_the_directory_and_the_hub_cache_load(saved, tmp_path):
    inner = saved / "weights-v1.safetensors"
    shutil.move(saved / "adapter_model.safetensors", inner)
    os.symlink(inner.name, saved / "adapter_model.safetensors")  # relative link inside the directory
    heads.load_heads(build_model("llama", seed=3), saved)
    # the Hugging Face cache: snapshots/<revision>/<file> are links to ../../blobs/<hash>
    repository = tmp_path / "models--owner--adapter"
    snapshot, blobs = repository / "snapshots" / ("0" * 40), repository / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for index, name in enumerate(("adapter_config.json", "adapter_model.safetensors")):
        shutil.copyfile(saved / name, blobs / f"blob{index}")
        os.symlink(f"../../blobs/blob{index}", snapshot / name)
    heads.load_heads(build_model("llama", seed=3), snapshot)


@pytest.mark.parametrize("field, value, message", [
    ("tree", "abc", r"drafter\.tree must be an int, a list of lists of ints or null; got 'abc' \(str\)"),
    ("tree", [["a"]], r"drafter\.tree must be an int, a list of lists of ints or null"),
    ("share_lm_head", "no", r"drafter\.share_lm_head must be true or false; got 'no' \(str\)"),
    ("num_heads", 2.0, r"drafter\.num_heads must be an int; got 2\.0 \(float\)"),
    ("num_heads", True, r"drafter\.num_heads must be an int; got True \(bool\)"),
])
def test_config_type_errors_name_the_field(saved, field, value, message):
    _rewrite_config(saved, lambda config: config["drafter"].update({field: value}))
    with pytest.raises(AdapterError, match=message):
        heads.load_heads(build_model("llama", seed=3), saved)


def _checked_fields():
    for name, kind in sorted(kinds.registry().items()):
        if not dataclasses.is_dataclass(kind.config_class):
            continue
        for field, annotation in field_types(kind.config_class).items():
            if annotation is not object:
                yield pytest.param(kind.config_class, field, id=f"{name}.{field}")


@pytest.mark.parametrize("config_class, field", list(_checked_fields()))
def test_every_kind_field_is_type_checked(config_class, field):
    """A JSON object (a string for a field that takes objects) is the wrong type for every typed
    field of every kind's config; its own default value is the right one."""
    wrong = {"wrong": 1} if not matches({"wrong": 1}, field_types(config_class)[field]) else "wrong"
    with pytest.raises(AdapterError, match=rf"x: drafter\.{field} must be "):
        check_fields(config_class, {field: wrong}, "x", "drafter")
    default = next(f for f in dataclasses.fields(config_class) if f.name == field).default
    if default is not dataclasses.MISSING:
        check_fields(config_class, {field: json.loads(json.dumps(default))}, "x", "drafter")
