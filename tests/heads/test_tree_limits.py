"""Tree sizes beyond ``MAX_TREE_NODES`` (issue 36 item 10): ``set_tree(10**6)`` built an 11,111-node
Medusa tree (15 s, then 154 s and 1.5 GB for 6 tokens), and an adapter config with a tree of 1e9 loaded
the same way. Every place a size enters refuses it by name, before anything is built."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import heads
from heads.adapter import AdapterError
from heads.draft.config import DraftConfig
from heads.eagle.config import EagleConfig
from heads.loading import drafter_config
from heads.lookup import LookupConfig
from heads.medusa.config import MedusaConfig
from tests.conftest import build_model, greedy_reference, random_prompt
from tree_attention.tree import DEFAULT_TREE_SIZES, MAX_TREE_NODES, InvalidTreeError

BIG = 10 ** 6
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _options(kind: str) -> dict:
    return {"draft_model": build_model("llama", seed=3)} if kind == "draft" else {}


@pytest.mark.parametrize("kind", ["medusa", "eagle", "lookup", "draft"])
def test_tree_sizes_beyond_the_bound_are_refused_by_name(kind):
    model = build_model("llama", seed=2)
    spec = heads.attach_heads(model, kind=kind, **_options(kind))
    drafter = spec.drafter
    with pytest.raises(InvalidTreeError, match="MAX_TREE_NODES"):
        spec.set_tree(BIG)
    assert spec.drafter is drafter
    option = "total_tokens" if kind in ("eagle", "draft") else "tree"
    with pytest.raises(InvalidTreeError, match="MAX_TREE_NODES"):
        heads.attach_heads(model, kind=kind, **{option: BIG}, **_options(kind))
    if kind in ("eagle", "draft"):
        with pytest.raises(InvalidTreeError, match="top_k"):
            spec.set_tree({"top_k": BIG})
    if kind == "medusa":  # an explicit choice list
        with pytest.raises(InvalidTreeError, match="MAX_TREE_NODES"):
            spec.set_tree([(rank,) for rank in range(MAX_TREE_NODES + 1)])
    spec.set_tree(MAX_TREE_NODES if kind != "lookup" else 64)
    prompt = random_prompt(6, seed=1)
    assert torch.equal(spec.generate(prompt, max_new_tokens=3), greedy_reference(model, prompt, 3))


@pytest.mark.parametrize("field", ["parallel_tokens", "siblings", "depth"])
def test_every_eagle_size_field_is_bounded(field):
    with pytest.raises(InvalidTreeError, match=f"EagleConfig.{field}={BIG} asks for more"):
        EagleConfig(**{field: BIG})


def test_a_hybrid_lookup_budget_beyond_the_bound_is_refused():
    spec = heads.attach_heads(build_model("llama", seed=2), kind="medusa")
    with pytest.raises(InvalidTreeError, match="LookupConfig.budget"):
        spec.set_lookup(budget=BIG)
    with pytest.raises(InvalidTreeError, match="extend"):
        spec.set_lookup(budget=1000, extend=4, max_depth=10)  # an adaptive row's deepest step: 1030 nodes


@pytest.mark.parametrize("kind, field", [("medusa", "tree"), ("eagle", "total_tokens")])
def test_an_adapter_with_a_huge_tree_is_refused_by_name(tmp_path, kind, field):
    model = build_model("llama", seed=2)
    heads.attach_heads(model, kind=kind).save_pretrained(tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_config.json"
    text = json.loads(path.read_text())
    text["drafter"][field] = 10 ** 9
    path.write_text(json.dumps(text))
    with pytest.raises(AdapterError, match=f"{field}=1000000000 asks for more drafted nodes than MAX_TREE_NODES"):
        heads.load_heads(model, tmp_path / "adapter")


def test_every_shipped_default_fits_the_tree_bound_with_room():
    for config in (MedusaConfig(), EagleConfig(), DraftConfig(), LookupConfig()):
        assert config  # constructed: within the bound
    assert max(DEFAULT_TREE_SIZES) * 8 <= MAX_TREE_NODES
    lookup = LookupConfig()
    assert (lookup.budget + (lookup.extend - 1) * lookup.max_depth) * 8 <= MAX_TREE_NODES
    adapters = sorted((ROOT / "benchmarks" / "adapters").glob("*/adapter_config.json"))
    assert adapters
    for path in adapters:
        drafter_config(json.loads(path.read_text()), path.parent)
