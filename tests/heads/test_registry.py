"""The registry plugs every kind in (each kind's package named explicitly, the hybrid built through
it) and drafters declare their optional capabilities as Protocols."""

from __future__ import annotations

from pathlib import Path

import torch

import heads
from heads import kinds
from tests.conftest import build_model, random_prompt
from tree_attention.capabilities import ComposedDrafter, StatelessDrafter

HEADS = Path(heads.__file__).parent


def test_every_kind_folder_is_registered_under_its_name():
    """A folder ``heads/<name>/`` whose package defines ``KIND`` is registered as ``name`` (the
    structure check's notion of a kind), and ``KIND.name`` is its folder's name."""
    folders = sorted(path.parent.name for path in HEADS.glob("*/__init__.py") if "KIND" in path.read_text())
    assert sorted(kinds.PACKAGES) == folders
    assert all(kinds.get(name).name == name for name in folders)


def test_one_kind_joins_any_other_kinds_trees():
    joining = kinds.hybrid()
    assert [kind.name for kind in kinds.registry().values() if kind.hybrid is not None] == [joining.name]
    model = build_model("llama", seed=3)
    spec = heads.attach_heads(model, kind="medusa", num_heads=2, tree=6)
    spec.set_lookup(budget=5)
    assert isinstance(spec.lookup, joining.config_class) and spec.lookup.budget == 5
    assert isinstance(spec._drafter, ComposedDrafter)
    same = spec.lookup
    spec.set_lookup(same)  # a config object is taken as it is
    assert spec.lookup is same
    spec.set_lookup(False)
    assert spec.lookup is None and not isinstance(spec._drafter, ComposedDrafter)


def test_capabilities_are_declared_and_the_hybrid_binds_its_trained_part():
    model = build_model("llama", seed=3)
    medusa = heads.attach_heads(model, kind="medusa", num_heads=2, tree=6, lookup=True)
    eagle = heads.attach_heads(model, kind="eagle", total_tokens=4, lookup=True)
    assert isinstance(medusa._drafter.base, StatelessDrafter) and medusa._drafter._base_stateless
    assert not isinstance(eagle._drafter.base, StatelessDrafter) and not eagle._drafter._base_stateless
    bound = []
    hybrid = medusa._drafter
    assert hybrid.bind_parts("rule", lambda drafter, rule: bound.append((drafter, rule)) or drafter) is hybrid
    assert bound == [(hybrid.base, "rule")] and not hybrid.gating  # the gate decides under a greedy rule only
    prompt = random_prompt(6, seed=1)
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(medusa.generate(prompt, max_new_tokens=12), expected)
    assert hybrid.gating  # bound to the greedy rule
