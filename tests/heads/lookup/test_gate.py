"""The hybrid's gate: steps that verify lookup's proposals alone (the trained drafter skipped and
caught up later) keep greedy outputs identical on several families, in batches and for every
trained kind; the counterfactual acceptance counts agree with a naive walk; the decision follows
the measured tokens per second; sampled calls never gate."""

from __future__ import annotations

import itertools

import pytest
import torch

import heads
from heads.lookup import Proposal
from heads.lookup.gate import EXPLORE, HORIZON, MIN_SEEN, POOLED, LookupGate, proposal_accepted, tree_accepted
from heads.lookup.hybrid import HybridDrafter
from tests.conftest import build_model, left_pad
from tests.heads.lookup.test_lookup_kind import reference, repeated_prompt
from tree_attention.tree import Tree, TreeBatch

KINDS = {"medusa": {"num_heads": 2, "tree": 6}, "eagle": {"total_tokens": 4},
         "eagle-chain": {"kind": "eagle", "top_k": 1, "depth": 4, "total_tokens": 4},
         "eagle-parallel": {"kind": "eagle", "parallel": 2, "top_k": 2, "total_tokens": 4}}


def _spec(model, name):
    options = dict(KINDS[name])
    kind = options.pop("kind", name)
    return heads.attach_heads(model, kind=kind, lookup={"budget": 6, "history_tokens": 0}, **options)


def _forced(monkeypatch, pattern):
    """Make every gate decide by ``pattern`` (cycled) wherever lookup found something."""
    decisions = itertools.cycle(pattern)
    calls = []

    def decide(self, keys):
        calls.append(next(decisions))
        return calls[-1]

    monkeypatch.setattr(LookupGate, "lookup_alone", decide)
    return calls


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_skipping_the_trained_drafter_is_lossless(monkeypatch, family, name):
    model = build_model(family, seed=5)
    spec = _spec(model, name)
    calls = _forced(monkeypatch, [True, True, False, True, False, False])
    for seed in (1, 2):
        prompt = repeated_prompt(8, seed)
        assert torch.equal(spec.generate(prompt, max_new_tokens=32),
                           reference(model, prompt, torch.ones_like(prompt), 32))
    assert True in calls and spec._hybrid.gate.lookup_steps > 0 and spec._hybrid.gate.merged_steps > 0


@pytest.mark.parametrize("name", list(KINDS))
def test_skipping_in_a_batch_is_lossless(monkeypatch, name):
    model = build_model("llama", seed=6)
    spec = _spec(model, name)
    _forced(monkeypatch, [True, False, True, True, False])
    prompts = [repeated_prompt(length, seed)[0] for length, seed in ((4, 1), (9, 2), (6, 3), (5, 4))]
    ids, mask = left_pad(prompts)
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=24), reference(model, ids, mask, 24))
    assert spec._hybrid.gate.lookup_steps > 0


def test_the_draft_kind_catches_up_after_skips(monkeypatch):
    model = build_model("llama", seed=7)
    draft = build_model("llama", seed=8)
    spec = heads.attach_heads(model, kind="draft", draft_model=draft, lookup={"budget": 6, "history_tokens": 0})
    _forced(monkeypatch, [True, False, True, True, False])
    prompt = repeated_prompt(8, 3)
    assert torch.equal(spec.generate(prompt, max_new_tokens=32), reference(model, prompt, torch.ones_like(prompt), 32))
    assert spec._hybrid.gate.lookup_steps > 0


def _naive_accepted(tokens, parents, produced):
    best = 0
    for node in range(len(tokens)):
        path, current = [], node
        while current >= 0:
            path.append(tokens[current])
            current = parents[current]
        path.reverse()
        if path == produced[:len(path)]:
            best = max(best, len(path))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_counterfactual_acceptance_matches_a_naive_walk(seed):
    generator = torch.Generator().manual_seed(seed)
    count = int(torch.randint(0, 9, (1,), generator=generator))
    tokens = [int(t) for t in torch.randint(0, 3, (count,), generator=generator)]
    parents = [-1] + [int(torch.randint(-1, node, (1,), generator=generator)) for node in range(1, count)] if count else []
    produced = [int(t) for t in torch.randint(0, 3, (int(torch.randint(1, 6, (1,), generator=generator)),),
                                              generator=generator)]
    assert proposal_accepted(Proposal(tokens, parents, [1.0] * count, 1), produced) == \
        _naive_accepted(tokens, parents, produced)
    tree = Tree.from_parents(torch.tensor([9] + tokens), [-1] + [parent + 1 for parent in parents])
    other = Tree.from_parents(torch.tensor([9, produced[0]]), [-1, 0])
    batch = TreeBatch.from_trees([tree, other])
    assert tree_accepted(batch, [produced, produced[:1]]) == [_naive_accepted(tokens, parents, produced), 1]
    alone = TreeBatch.from_trees([tree])  # one row: walked on the host
    assert tree_accepted(alone, [produced]) == [_naive_accepted(tokens, parents, produced)]


def _taught(gate, key, lookup, merged, seen=MIN_SEEN):
    """``seen`` steps of class ``key`` where lookup's proposal got ``lookup`` drafts accepted and the
    merged tree ``merged`` (None: lookup ran alone)."""
    for _ in range(seen):
        gate.observe([key], [Proposal([5] * lookup + [6], list(range(-1, lookup)), [1.0] * (lookup + 1), 2)],
                     [[5] * lookup + [7]], None if merged is None else [merged])


def test_the_decision_follows_tokens_per_second():
    key = (2, True)
    gate = LookupGate()
    _taught(gate, key, lookup=3, merged=3)
    assert not gate.lookup_alone([key])  # no step timed yet
    gate.timed("base_seconds", 0.004)
    gate.timed("lookup_seconds", 0.0002)
    gate.rest(False, 0.010)
    assert gate.lookup_alone([key])  # as many drafts accepted, without the drafter's 4 ms
    slow = LookupGate()
    _taught(slow, key, lookup=0, merged=3)
    slow.timed("base_seconds", 0.004)
    slow.rest(False, 0.010)
    assert not slow.lookup_alone([key])  # 1 token per 10 ms alone against 4 per 14 ms
    assert not gate.lookup_alone([(4, False)])  # a class never seen: both run
    explore = []
    for _ in range(200):  # the merged tree is verified now and then, less often as its evidence grows
        explore.append(gate.lookup_alone([key]))
        _taught(gate, key, lookup=3, merged=None if explore[-1] else 3, seen=1)
    skipped = [len(run) for run in "".join("a" if alone else "m" for alone in explore).split("m")[1:-1]]
    assert skipped[0] == EXPLORE and skipped == sorted(skipped) and skipped[-1] > 2 * EXPLORE
    assert explore.count(False) < 200 / EXPLORE


def test_the_decision_weighs_time_at_the_loop_rate():
    """A step is worth its tokens less the tokens its time buys at the hybrid's running rate: where
    lookup found nothing, the roots alone (1 token in 4 ms) beat the trained drafter's tree (2.5
    tokens in 10 ms, a better rate of its own) when the loop runs at 0.5 tokens per ms, and lose when
    it runs at 0.2; the plain step's cost is measured once before it is weighed."""
    nothing = (0, False)
    gate = LookupGate()
    _taught(gate, nothing, lookup=0, merged=1.5)
    gate.timed("base_seconds", 0.001)
    gate.timed("lookup_seconds", 0.0)
    gate.rest(False, 0.009)
    assert gate.lookup_alone([nothing])  # the roots' alone cost unknown: one plain step measures it
    gate.rest(None, 0.004)
    assert not gate.lookup_alone([nothing])  # no rate yet: by tokens per second, 0.25 against 0.25 per ms
    for _ in range(100):
        gate.step(5, 0.010)  # the loop at 0.5 tokens per ms
    assert gate.lookup_alone([nothing])
    for _ in range(200):
        gate.step(2, 0.010)  # ... at 0.2
    assert not gate.lookup_alone([nothing])


def _first_run_alone(gate, key, lookup, merged):
    """Steps the gate runs lookup alone for class ``key`` before it verifies the merged tree again
    (whose drafts accepted are ``merged(i)`` at its ``i``-th verification)."""
    run = 0
    while gate.lookup_alone([key]):
        _taught(gate, key, lookup=lookup, merged=None, seen=1)
        run += 1
        assert run < 1000
    return run


def test_a_settled_decision_explores_less():
    """Where even the merged tree's upper confidence bound loses to lookup alone (its drafts accepted
    never vary), the merged tree is not verified again until that bound, widening as the evidence
    ages, reaches lookup alone's value (here HORIZON steps: 2 tokens of gap, a spread of one draft
    over two steps); where the bound still wins (the same mean, widely spread) it is explored at the
    plain interval: the estimate that could change the decision is the one worth paying for."""
    runs = {}
    for name, values in (("steady", [3, 3]), ("spread", [0, 6])):
        gate = LookupGate()
        key = (2, True)
        for value in values:
            _taught(gate, key, lookup=3, merged=value, seen=1)
        gate.timed("base_seconds", 0.004)
        gate.timed("lookup_seconds", 0.0002)
        gate.rest(False, 0.010)
        gate.rest(True, 0.010)
        for _ in range(100):
            gate.step(5, 0.010)  # 0.5 tokens per ms: the drafter's 4 ms are worth 2 tokens, the mean gap
        runs[name] = _first_run_alone(gate, key, 3, None)
    assert runs["spread"] == EXPLORE
    assert HORIZON - 2 <= runs["steady"] <= HORIZON + 2 and runs["steady"] >= 4 * EXPLORE


def test_a_new_class_borrows_what_the_drafter_adds_elsewhere():
    """A class where lookup found something but whose merged tree was never verified is judged by
    lookup's drafts in it plus what the trained drafter added over lookup's in other classes, once
    POOLED such steps exist; a class where lookup found nothing has no lookup drafts to add to."""
    def timed(gate):
        gate.timed("base_seconds", 0.004)
        gate.timed("lookup_seconds", 0.0002)
        gate.rest(False, 0.010)
        gate.rest(True, 0.010)
        gate.rest(None, 0.005)
        for _ in range(100):
            gate.step(5, 0.010)

    fresh, nothing = (3, True), (0, False)
    borrowing = LookupGate()
    timed(borrowing)
    for key in ((1, True), (2, True)):  # the drafter added nothing over lookup's 2 drafts, steadily
        _taught(borrowing, key, lookup=2, merged=2, seen=POOLED // 2)
    _taught(borrowing, fresh, lookup=4, merged=None, seen=MIN_SEEN)
    _taught(borrowing, nothing, lookup=0, merged=None, seen=MIN_SEEN)
    assert borrowing.lookup_alone([fresh])  # 4 + 0 drafts either way: the drafter's 4 ms are not paid
    assert not borrowing.lookup_alone([nothing])  # no merged evidence of its own: verified
    alone = LookupGate()
    timed(alone)
    _taught(alone, (1, True), lookup=2, merged=2, seen=POOLED - 1)
    _taught(alone, fresh, lookup=4, merged=None, seen=MIN_SEEN)
    assert not alone.lookup_alone([fresh])  # too little evidence elsewhere: its merged tree is verified
    generous = LookupGate()
    timed(generous)
    _taught(generous, (1, True), lookup=0, merged=6, seen=POOLED)  # the drafter added 6 drafts a step
    _taught(generous, fresh, lookup=4, merged=None, seen=MIN_SEEN)
    assert not generous.lookup_alone([fresh])


def test_sampled_calls_never_gate(monkeypatch):
    model = build_model("llama", seed=5)
    spec = _spec(model, "medusa")
    calls = _forced(monkeypatch, [True])
    prompt = repeated_prompt(8, 1)
    spec.generate(prompt, max_new_tokens=24, do_sample=True, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert not calls and spec._hybrid.gate.lookup_steps == 0
    assert isinstance(spec.drafter, HybridDrafter)


def test_gate_off_always_merges(monkeypatch):
    model = build_model("llama", seed=5)
    spec = heads.attach_heads(model, kind="medusa", num_heads=2, tree=6,
                              lookup={"budget": 6, "history_tokens": 0, "gate": False})
    calls = _forced(monkeypatch, [True])
    prompt = repeated_prompt(8, 1)
    assert torch.equal(spec.generate(prompt, max_new_tokens=24), reference(model, prompt, torch.ones_like(prompt), 24))
    assert not calls and spec._hybrid.gate is None
    with pytest.raises(ValueError, match="gate"):
        heads.attach_heads(model, kind="medusa", num_heads=2, lookup={"gate": "yes"})
