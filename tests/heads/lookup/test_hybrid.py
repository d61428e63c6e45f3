"""Hybrid trees: a trained kind's tree with lookup continuations merged in. Lossless greedy on every
family, batches, the sampling law (with a wrong-rule control), the trie merge against a naive one,
and the hybrid recorded in the adapter."""

from __future__ import annotations

import pytest
import torch

import heads
from heads.lookup import Proposal, merge_proposal
from tests.conftest import ARCHITECTURES, build_model, left_pad, random_prompt
from tests.heads.lookup.test_lookup_kind import (
    SAMPLED, SAMPLING_PROMPT, exact_joint, reference, repeated_prompt, sample_runs, toy_model,  # noqa: F401
)
from tests.stats import FALSE_ALARM, chi_square_pvalue
from tree_attention.tree import Tree
from tree_attention.verify import SamplingRule

KINDS = {"medusa": {"num_heads": 2, "tree": 6}, "eagle": {"total_tokens": 4}}


def _hybrid(model, kind, budget=6):
    spec = heads.attach_heads(model, kind=kind, lookup={"budget": budget, "history_tokens": 0}, **KINDS[kind])
    assert spec.lookup is not None
    return spec


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_hybrid_greedy_parity_every_architecture(name, kind):
    model = build_model(name, seed=2)
    spec = _hybrid(model, kind)
    for seed in (1, 2):
        prompt = repeated_prompt(8, seed)
        ones = torch.ones_like(prompt)
        assert torch.equal(spec.generate(prompt, max_new_tokens=32), reference(model, prompt, ones, 32))
        merged_lookup = spec.last_stats.tree_size > sum(KINDS[kind].values()) - 1
        assert merged_lookup or spec._hybrid.gate.lookup_steps > 0 or kind == "eagle"


@pytest.mark.parametrize("kind", list(KINDS))
def test_hybrid_batched_parity(kind):
    model = build_model("llama", seed=4)
    spec = _hybrid(model, kind)
    prompts = [repeated_prompt(length, seed)[0] for length, seed in ((4, 1), (9, 2), (6, 3))]
    ids, mask = left_pad(prompts)
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20),
                       reference(model, ids, mask, 20))


def naive_merge(tree: Tree, proposal: Proposal) -> set[tuple[int, ...]]:
    """Every root path of ``tree`` and ``proposal``, as token tuples."""
    def paths(tokens, parents):
        result = set()
        for node in range(len(tokens)):
            path, current = [], node
            while current >= 0:
                path.append(tokens[current])
                current = parents[current]
            result.add(tuple(reversed(path)))
        return result

    base = paths(tree.tokens.tolist(), tree.parents.tolist())
    root = tree.tokens[0].item()
    extra = paths([root] + proposal.tokens, [-1] + [parent + 1 for parent in proposal.parents])
    return base | extra


@pytest.mark.parametrize("seed", range(20))
def test_merge_is_the_union_of_paths(seed):
    generator = torch.Generator().manual_seed(seed)
    def random_proposal(count):
        return Proposal([int(t) for t in torch.randint(0, 3, (count,), generator=generator)],
                        [-1] + [int(torch.randint(-1, node, (1,), generator=generator)) for node in range(1, count)]
                        if count else [], [1.0] * count)

    root = Tree.from_parents(torch.tensor([7]), [-1])
    tree = merge_proposal(root, random_proposal(int(torch.randint(0, 8, (1,), generator=generator))))
    size = tree.size
    count = int(torch.randint(0, 8, (1,), generator=generator))
    proposal = random_proposal(count)
    merged = merge_proposal(tree, proposal)
    assert torch.equal(merged.tokens[:size], tree.tokens) and torch.equal(merged.parents[:size], tree.parents)
    assert naive_merge(merged, Proposal()) == naive_merge(tree, proposal)
    paths = naive_merge(merged, Proposal())
    assert len(paths) == merged.size  # no duplicate path: every merged node is a distinct path


def test_hybrid_sampling_follows_the_target(toy_model):
    settings = dict(temperature=1.0, top_k=0)
    spec = heads.attach_heads(toy_model, kind="medusa", num_heads=2, tree=3, lookup={"budget": 8})
    samples = sample_runs(spec, runs=1000, rows=8, **settings)
    pvalue = chi_square_pvalue(samples, exact_joint(toy_model, SAMPLING_PROMPT, SAMPLED, **settings))
    assert pvalue > FALSE_ALARM, pvalue


def test_hybrid_sampling_wrong_rule_is_caught(toy_model, monkeypatch):
    settings = dict(temperature=1.0, top_k=0)
    original = SamplingRule.__init__
    monkeypatch.setattr(SamplingRule, "__init__",
                        lambda self, warp, generator=None, use_residual=True: original(self, warp, generator, False))
    spec = heads.attach_heads(toy_model, kind="medusa", num_heads=2, tree=3, lookup={"budget": 8})
    samples = sample_runs(spec, runs=1000, rows=8, **settings)
    pvalue = chi_square_pvalue(samples, exact_joint(toy_model, SAMPLING_PROMPT, SAMPLED, **settings))
    assert pvalue < FALSE_ALARM, pvalue


def test_the_hybrid_is_recorded_in_the_adapter(tmp_path):
    model = build_model("qwen2", seed=3)
    spec = _hybrid(model, "medusa", budget=5)
    spec.save_pretrained(tmp_path / "hybrid")
    loaded = heads.load_heads(model, tmp_path / "hybrid")
    assert loaded.lookup is not None and loaded.lookup.to_dict() == spec.lookup.to_dict()
    prompt = repeated_prompt(7, 4)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=16), spec.generate(prompt, max_new_tokens=16))
    plain = heads.attach_heads(model, num_heads=2)
    plain.save_pretrained(tmp_path / "plain")
    assert "lookup" not in (tmp_path / "plain" / "adapter_config.json").read_text()
    assert heads.load_heads(model, tmp_path / "plain").lookup is None
    spec.set_lookup(None)
    assert spec.lookup is None and type(spec.drafter).__name__ == "MedusaDrafter"


@pytest.mark.parametrize("rows", [1, 2])
def test_skipped_steps_join_as_chained_batches(rows):
    """What a stateful drafter is handed after skipped steps: the steps' entries joined at once equal
    them chained step by step (``DraftBatch.then``), in one concatenation for a batch of one row."""
    from heads.lookup.hybrid import joined
    from tree_attention.draft_batch import DraftBatch

    generator = torch.Generator().manual_seed(rows)
    batches = []
    for step in range(4):
        lengths = torch.randint(1, 4, (rows,), generator=generator) if rows > 1 else torch.tensor([step % 3 + 1])
        width = int(lengths.max())
        batches.append(DraftBatch(torch.randn(rows, width, 3, generator=generator),
                                  torch.randint(1, 50, (rows, width), generator=generator), lengths,
                                  torch.randint(1, 50, (rows,), generator=generator)))
    chained = batches[0]
    for batch in batches[1:]:
        chained = chained.then(batch)
    together = joined(batches)
    assert torch.equal(together.lengths, chained.lengths) and torch.equal(together.roots, batches[-1].roots)
    for row, length in enumerate(together.lengths.tolist()):
        assert torch.equal(together.tokens[row, :length], chained.tokens[row, :length])
        assert torch.equal(together.features[row, :length], chained.features[row, :length])
    assert joined(batches[:1]) is batches[0]
