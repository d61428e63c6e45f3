"""The draft kind's default: chain lengths from the draft's calibrated confidence, plain steps where
drafting does not pay (the draft catches up later), and the calibration an adapter records.

Greedy parity with ``model.generate`` on every family, batch 1 and left-padded batches, with the
decisions left to real timings and with forced patterns (plain steps between drafted ones, long
and short chains); the calibration's bookkeeping checked exactly against what the target accepted;
lossless sampling with confidence-adaptive lengths and plain steps, with two negative controls (a
rule without the residual, and a length rule that reads the drawn token's own probability); the
calibration's round trip through ``save_pretrained``/``load_heads``; the cost model's fit and its
probing schedule.
"""

from __future__ import annotations

import json

import pytest
import torch

import heads
from heads.adapter import AdapterError
from heads.draft import DraftConfig, DraftModelDrafter, bind_rule
from heads.draft.calibration import (
    BINS, CALIBRATION_VERSION, DEPTHS, MAX_PROBE_INTERVAL, ChainCalibration, ChainCosts, check_calibration, dominance,
)
from heads.generation import acceptance_rule
from tests.conftest import ARCHITECTURES, build_model, left_pad, random_prompt
from tests.heads.draft.test_draft_kind import (  # noqa: F401  (toy_pair: a fixture)
    PROMPT, RUNS, SAMPLED, Recorder, exact_joint, noisy_copy, reference, sample_runs, toy_pair,
)
from tests.stats import FALSE_ALARM, chi_square_pvalue
from tree_attention.decode import speculative_generate
from tree_attention.verify import SamplingRule


def force(spec, prices=(0.2, 0.02), plain_every: int | None = 2, jump: float = 0.0):
    """Decisions independent of timings: fixed prices (draft forward, node, and a drafted verify's
    jump over a plain one) in tokens, and every ``plain_every``-th step plain (None: none)."""
    costs, calls = spec.heads.costs, [0]

    def draft_now():
        calls[0] += 1
        return plain_every is None or calls[0] % plain_every != 0

    costs.prices = lambda: prices
    costs.jump_price = lambda: jump
    costs.draft_now = draft_now


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_adaptive_greedy_parity(name):
    model = build_model(name, seed=1)
    prompt = random_prompt(9, seed=0)
    expected = reference(model, prompt, torch.ones_like(prompt), 40)
    for draft in (noisy_copy(model, 0.1), model):
        spec = heads.attach_heads(model, kind="draft", draft_model=draft)
        assert spec.config.adaptive and spec.config.depth == 8
        for _ in range(2):  # the second call starts from what the first learned
            assert torch.equal(spec.generate(prompt, max_new_tokens=40), expected), name
        force(spec, prices=(0.05, 0.01))
        recorder = Recorder(spec.drafter)
        output, _ = speculative_generate(spec.target, recorder, prompt, 40, (), None, None, spec.pad_token_id)
        assert torch.equal(output, expected), name
        assert 1 in recorder.sizes and max(recorder.sizes) > 2, recorder.sizes  # plain steps and chains


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2", "qwen2"])
def test_adaptive_batched_greedy_parity(name):
    """Left-padded rows of different lengths, one ending early at eos while the draft is behind
    (plain steps), ragged chains: equal to ``model.generate`` on the batch."""
    model = build_model(name, seed=1)
    generator = torch.Generator().manual_seed(2)
    ids, mask = left_pad([torch.randint(3, 96, (length,), generator=generator) for length in (5, 11, 8, 2)])
    model.generation_config.eos_token_id = int(reference(model, ids, mask, 5)[1, ids.shape[1] + 4])
    expected = reference(model, ids, mask, 24)
    for every in (None, 2, 3):
        spec = heads.attach_heads(model, kind="draft", draft_model=noisy_copy(model, 0.1))
        force(spec, prices=(0.1, 0.02), plain_every=every)
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=24), expected), (name, every)
        assert sum(spec.last_stats.accepted_lengths) > 0
    spec = heads.attach_heads(model, kind="draft", draft_model=noisy_copy(model, 0.1))  # real timings
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=24), expected), name


def test_the_calibration_counts_what_the_target_accepted():
    """Batch 1, greedy: every drafted token the target kept is counted accepted at its depth, and
    every node whose parent was kept is counted seen (all but the last step, which nobody observes)."""
    model = build_model("llama", seed=2)
    prompt = random_prompt(9, seed=3)
    for draft, all_kept in ((model, True), (noisy_copy(model, 0.15), False)):
        spec = heads.attach_heads(model, kind="draft", draft_model=draft)
        force(spec, prices=(0.0, 0.0), plain_every=None)  # whole chains of 8: every depth is seen
        recorder = Recorder(spec.drafter)
        output, stats = speculative_generate(spec.target, recorder, prompt, 60, (), None, None, spec.pad_token_id)
        assert torch.equal(output, reference(model, prompt, torch.ones_like(prompt), 60))
        calibration = spec.heads.calibration
        accepted, seen = calibration.accepted["greedy"], calibration.seen["greedy"]
        steps = list(zip(stats.accepted_lengths, recorder.sizes))[:-1]
        assert int(accepted.sum()) == sum(kept for kept, _ in steps)
        assert int(seen.sum()) == sum(min(kept + 1, size - 1) for kept, size in steps)
        assert int(seen[0].sum()) == len(steps)  # every step's first node, in its confidence bin
        assert torch.equal(accepted, seen) == all_kept
        assert int(calibration.seen["sampled"].sum()) == 0
        if all_kept:
            rates = calibration.rates("greedy")
            assert bool((rates[seen > 0] > ChainCalibration().rates("greedy")[seen > 0]).all())


# ------------------------------------------------------------------------------ lossless sampling


def adaptive_sampled_chain(toy_pair, settings, prices=(0.03, 0.005), calibration=None, least=0.4, runs=RUNS,
                           jump=0.0):
    """Through the decode loop with the bound drafter: adaptive chains (up to 4) of tokens drawn from
    the draft's q, one step in four plain (the draft catches up at the next drafted step)."""
    target, draft = toy_pair
    spec = heads.attach_heads(target, kind="draft", draft_model=draft, depth=4, total_tokens=4)
    force(spec, prices=prices, plain_every=4, jump=jump)
    if calibration is not None:
        spec.heads.calibration = ChainCalibration(calibration)

    def run(ids, mask, generator):
        rule = acceptance_rule(target.generation_config, True, generator=generator, **settings)
        drafter = bind_rule(spec.drafter_for(None), rule)
        assert drafter.sampling and drafter.config.adaptive
        recorder.drafter = drafter
        return speculative_generate(spec.target, recorder, ids, SAMPLED + 1, (), rule, mask, spec.pad_token_id)

    recorder = Recorder(None)
    samples = sample_runs(run, runs, least)
    assert int(spec.heads.calibration.seen["sampled"].sum()) > 0
    return samples, set(recorder.sizes)


SETTINGS = dict(temperature=1.0, top_k=0, top_p=None)
# recorded rates that keep no node whose confidence is under 0.1 (the toy draft's largest
# probability, and so its dominance, is always above it, the probability of the token it draws often is not)
CAUTIOUS = {"version": CALIBRATION_VERSION, "bins": BINS, "depths": DEPTHS, "modes": {"sampled": {
    "acceptance": [[0.0] + [0.9] * (BINS - 1)] * DEPTHS, "following": [[0.0] + [0.9] * (BINS - 1)] * DEPTHS}}}


CONTROL_RUNS = 8 * RUNS  # the length rule's control is a subtler bias than a missing residual


@pytest.mark.parametrize("calibration, runs", [(None, RUNS), (CAUTIOUS, CONTROL_RUNS)])
def test_adaptive_sampled_chains_match_the_target(toy_pair, calibration, runs):
    samples, sizes = adaptive_sampled_chain(toy_pair, SETTINGS, (0.3, 0.05), calibration, least=0.2, runs=runs)
    assert {1, 2, 3} <= sizes, sorted(sizes)  # plain steps, chains of 1 and 2
    assert chi_square_pvalue(samples, exact_joint(toy_pair[0], **SETTINGS)) > FALSE_ALARM


def test_a_wrong_residual_is_caught_with_adaptive_chains(toy_pair, monkeypatch):
    original = SamplingRule.__init__

    def no_residual(self, warp, generator=None, use_residual=True):
        original(self, warp, generator, use_residual=False)

    monkeypatch.setattr(SamplingRule, "__init__", no_residual)
    samples, _ = adaptive_sampled_chain(toy_pair, SETTINGS, (0.3, 0.05))
    pvalue = chi_square_pvalue(samples, exact_joint(toy_pair[0], **SETTINGS))
    assert pvalue < FALSE_ALARM, pvalue


def test_a_length_rule_that_reads_the_drawn_token_is_caught(toy_pair, monkeypatch):
    """Keeping a node by its own token's probability (instead of its distribution's dominance) drops
    unlikely draws after they were drawn: no longer lossless, and the test sees it."""
    original = DraftModelDrafter._next

    def own_probability(self, logits):
        tokens, confidence, signal, q = original(self, logits)
        if q is not None:
            signal = q.gather(1, tokens[:, None])[:, 0]
        return tokens, confidence, signal, q

    monkeypatch.setattr(DraftModelDrafter, "_next", own_probability)
    samples, _ = adaptive_sampled_chain(toy_pair, SETTINGS, (0.3, 0.05), CAUTIOUS, least=0.2, runs=CONTROL_RUNS)
    pvalue = chi_square_pvalue(samples, exact_joint(toy_pair[0], **SETTINGS))
    assert pvalue < FALSE_ALARM, pvalue


# ------------------------------------------------------------------------------ the adapter's record


def test_the_calibration_round_trips_through_the_adapter(tmp_path):
    model = build_model("llama", seed=4)
    prompt = random_prompt(9, seed=5)
    spec = heads.attach_heads(model, kind="draft", draft_model=noisy_copy(model, 0.15))
    force(spec, prices=(0.0, 0.0), plain_every=None)
    spec.generate(prompt, max_new_tokens=40)
    spec.generate(prompt, max_new_tokens=20, do_sample=True, temperature=0.8, top_k=0)
    calibration = spec.heads.calibration
    assert int(calibration.seen["greedy"].sum()) > 0 and int(calibration.seen["sampled"].sum()) > 0
    spec.save_pretrained(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    recorded = config["drafter"]["calibration"]
    assert recorded == calibration.to_dict() and config["drafter"]["adaptive"] is True
    loaded = heads.load_heads(model, tmp_path / "adapter")
    for mode in ("greedy", "sampled"):
        assert torch.allclose(loaded.heads.calibration.rates(mode), calibration.rates(mode), atol=1e-4)
        assert torch.allclose(loaded.heads.calibration.next_rates(mode), calibration.next_rates(mode), atol=1e-4)
        assert not torch.allclose(loaded.heads.calibration.rates(mode), ChainCalibration().rates(mode))
    assert torch.equal(loaded.generate(prompt, max_new_tokens=20), reference(model, prompt, torch.ones_like(prompt), 20))
    # a table of another shape is refused by name; an adapter without one starts from the confidence
    config["drafter"]["calibration"]["bins"] = 5
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="calibration"):
        heads.load_heads(model, tmp_path / "adapter")
    del config["drafter"]["calibration"], config["drafter"]["adaptive"]
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    old = heads.load_heads(model, tmp_path / "adapter")
    assert old.config.adaptive and torch.equal(old.heads.calibration.rates("greedy"), ChainCalibration().rates("greedy"))


def test_dominance_is_the_top_tokens_share_of_the_collision_mass():
    probabilities = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [0.2, 0.2, 0.6]])
    # 0.25 / (0.25 + 0.0625 + 0.0625); a point mass; 0.36 / (0.04 + 0.04 + 0.36)
    assert torch.allclose(dominance(probabilities), torch.tensor([2 / 3, 1.0, 9 / 11]))
    # a flat tail lowers the largest probability, not the dominance of a top token that stands out
    tail = torch.full((1000,), 0.8 / 1000)
    flat = torch.cat([torch.tensor([0.2]), tail])
    assert flat.max() == 0.2 and dominance(flat) > 0.98


def test_a_table_of_the_first_version_loads_as_no_table():
    """Version 1 binned the largest probability, not the dominance: its rates would be read against
    the wrong bins, so it is accepted (old adapters load) and not used."""
    old = ChainCalibration().to_dict() | {"version": 1}
    old["modes"]["greedy"]["acceptance"] = [[0.0] * BINS] * DEPTHS
    check_calibration(old)
    assert torch.equal(ChainCalibration(old).rates("greedy"), ChainCalibration().rates("greedy"))
    current = old | {"version": CALIBRATION_VERSION}
    assert not torch.equal(ChainCalibration(current).rates("greedy"), ChainCalibration().rates("greedy"))


def test_config_checks():
    with pytest.raises(ValueError, match="adaptive"):
        DraftConfig(adaptive="yes")
    with pytest.raises(ValueError, match="calibration"):
        DraftConfig(calibration={"version": 1, "bins": 10, "depths": 4, "modes": {"greedy": {"acceptance": [[2.0]]}}})
    table = ChainCalibration().to_dict()
    assert DraftConfig(calibration=table).calibration == table
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="DraftConfig.siblings must be an int >= 0"):
            DraftConfig(siblings=bad)
    assert DraftConfig().to_dict()["siblings"] == 3


# ------------------------------------------------------------------------------ the cost model


def test_the_verify_line_and_the_probes():
    costs = ChainCosts()
    assert costs.prices() == pytest.approx((0.15, 0.04))  # priors, in target steps, until measured
    for nodes in (1, 3, 5, 9, 2, 7) * 4:  # verify seconds 10 ms + 1 ms a node
        costs.add_step(nodes, 0.010 + 0.001 * (nodes - 1), 0.012 + 0.001 * (nodes - 1), 1.5)
    intercept, slope = costs.verify_line()
    assert intercept == pytest.approx(0.010, rel=0.05) and slope == pytest.approx(0.001, rel=0.1)
    costs.add_draft(0.002)
    draft_price, node_price = costs.prices()
    rate = costs.tokens / costs.step_seconds
    assert draft_price == pytest.approx(0.002 * rate) and node_price == pytest.approx(slope * rate)
    # drafting that gains nothing: plain steps, with a probe after 1, 2, 4, ... plain steps
    pattern = []
    for _ in range(60):
        drafted = costs.draft_now()
        pattern.append(drafted)
        if drafted:
            costs.add_drafted(0.0, 0.005, 5)
    gaps = [len(run) for run in "".join("d" if d else "." for d in pattern).split("d")[1:-1] if run]
    assert gaps[:4] == [1, 2, 4, 8] and max(gaps) == MAX_PROBE_INTERVAL, gaps
    costs.add_drafted(3.0, 0.005, 5)  # a probe that paid, twice: drafting at every step again
    costs.add_drafted(3.0, 0.005, 5)
    assert costs.pays() and all(costs.draft_now() for _ in range(5))



def test_the_second_query_jump_is_priced_to_drafting_not_to_nodes():
    """On a CPU a forward of two queries costs far more than one, and each query after that little
    (here: plain steps 7.5 ms, drafted steps 9.5 ms + 0.15 ms a node). A verified node is priced at
    the drafted steps' slope; the jump counts once, in what drafting at all costs against a plain step."""
    costs = ChainCosts()
    for nodes in (1, 2, 4, 6, 9) * 8:
        costs.add_step(nodes, 0.0075 if nodes == 1 else 0.0095 + 0.00015 * (nodes - 1), 0.011, 1.6)
    intercept, slope = costs.verify_line()
    assert intercept == pytest.approx(0.0095, rel=0.02) and slope == pytest.approx(0.00015, rel=0.1)
    assert costs.plain_seconds() == pytest.approx(0.0075)
    costs.add_draft(0.001)
    for _ in range(40):  # steps of 4 nodes beyond the root, proposed in 1 ms, that keep 0.4 tokens
        costs.add_drafted(0.4, 0.001, 5)
    # beyond a plain step: 1 ms + (9.5 + 4 x 0.15 - 7.5) ms = 3.6 ms, i.e. 0.48 plain steps
    assert costs.draft_step == pytest.approx(0.0036, rel=0.05)
    assert not costs.pays()
    for _ in range(40):
        costs.add_drafted(0.6, 0.001, 5)
    assert costs.pays()


def test_a_step_whose_nodes_do_not_pay_for_the_jump_verifies_the_roots_alone():
    """Where a drafted verify's jump over a plain one costs more than a step's nodes are expected to
    add, the drafted step verifies its root alone (output unchanged), and its chain still teaches
    the calibration the depth-1 verdict (greedy knows the target's token there)."""
    model = build_model("llama", seed=2)
    prompt = random_prompt(9, seed=3)
    expected = reference(model, prompt, torch.ones_like(prompt), 30)
    for jump, chains in ((1e9, False), (0.0, True)):
        spec = heads.attach_heads(model, kind="draft", draft_model=noisy_copy(model, 0.1))
        force(spec, prices=(0.0, 0.0), plain_every=None, jump=jump)
        recorder = Recorder(spec.drafter)
        output, stats = speculative_generate(spec.target, recorder, prompt, 30, (), None, None, spec.pad_token_id)
        assert torch.equal(output, expected)
        assert (max(recorder.sizes) > 1) == chains, recorder.sizes
        assert int(spec.heads.calibration.seen["greedy"][0].sum()) >= len(recorder.sizes) - 1


@pytest.mark.parametrize("rule, jump", [("depth-1 nodes", 0.6), ("whole chains", 1.9)])
def test_the_sampled_jump_decision_reads_the_depth_one_nodes_alone(toy_pair, monkeypatch, rule, jump):
    """Under sampling, whether a step's nodes pay for a drafted verify's jump is decided from its
    depth-1 nodes alone (their distributions are known before any token is drawn), so steps whose
    depth-1 confidence bins agree get the same decision. Deciding from whole chains reads deeper
    nodes' distributions, which follow the drawn tokens: that wrong rule (lossy) breaks the
    invariance, a bias too small on this toy pair for a chi-square of a test's size to see."""
    target, draft = toy_pair
    spec = heads.attach_heads(target, kind="draft", draft_model=draft, depth=4, total_tokens=4)
    # jump 0.6: depth-1 nodes of bin 2 (0.3 tokens) do not pay for it, those of bins 3-4 (0.9) do;
    # 1.9: no depth-1 node pays for it alone, so the whole-chain rule keeps chains by their deeper nodes
    force(spec, prices=(0.3, 0.05), plain_every=None, jump=jump)
    # fixed rates: bins 0-2 accept little or nothing, the rest 0.9 (the toy draft's bins are 2-4)
    acceptance = [[0.0, 0.0, 0.3] + [0.9] * (BINS - 3)] + [[0.0, 0.0, 0.0] + [0.9] * (BINS - 3)] * (DEPTHS - 1)
    following = [[0.0] + [0.9] * (BINS - 1)] * DEPTHS
    spec.heads.calibration.rate_lists = lambda mode: (acceptance, following)
    if rule == "whole chains":
        monkeypatch.setattr(DraftModelDrafter, "_jump_evidence", lambda self, chains, first: chains)
    decisions: dict[int, set[bool]] = {}
    original = DraftModelDrafter._adaptive_chain

    def recorded(self, roots, logits):
        trees = original(self, roots, logits)
        first_bin = self.chains[2][0][0]  # batch 1: the depth-1 node's confidence bin
        decisions.setdefault(first_bin, set()).add(trees.width == 1)
        return trees

    monkeypatch.setattr(DraftModelDrafter, "_adaptive_chain", recorded)
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        spec.generate(PROMPT, max_new_tokens=6, do_sample=True, temperature=1.0, top_k=0, generator=generator)
    mixed = [index for index, seen in decisions.items() if len(seen) > 1]
    if rule == "depth-1 nodes":
        assert not mixed and {True, False} <= set().union(*decisions.values()), decisions
    else:
        assert mixed, decisions


def test_replayed_plain_steps_price_one_token_chains():
    """A replayed plain step is a one-token chain: its gain comes with its own seconds (a steady
    feeding forward and one node), not weighed against the seconds of the long chain drafted last.
    Plain steps of 10 ms after a chain of 8 that cost 30 ms and kept one token: replays that keep
    0.8 tokens at about 1.4 ms a step bring drafting back."""
    costs = ChainCosts()
    for _ in range(20):
        costs.add_step(1, 0.010, 0.010, 1.0)
    costs.add_draft(0.001)
    costs.add_drafted(1.0, 0.030, 9)
    assert not costs.pays()
    for _ in range(30):
        costs.add_replayed(0.8)
    assert costs.pays() and costs.draft_step < 0.004, costs.draft_step


class Clock:
    """A controlled ``time`` for the drafter: seconds pass only in forwards, priced by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Timed:
    """``inner`` (a target or a draft backbone) whose ``forward`` advances ``clock`` by
    ``seconds(input_ids)``; everything else is ``inner``'s."""

    def __init__(self, inner, clock: Clock, seconds) -> None:
        self.inner, self.clock, self.seconds = inner, clock, seconds

    def forward(self, input_ids, *args, **kwargs):
        self.clock.now += self.seconds(input_ids)
        return self.inner.forward(input_ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_slow_first_step_does_not_stop_drafting(monkeypatch):
    """A call's first drafted step feeds the draft the whole prompt (here 60 ms against 1 ms for
    any other draft forward; a verify step costs 10 ms + 0.2 ms a node): drafting pays at every
    later step, and the drafter keeps drafting, in the first call and in the next ones. (It once
    priced every drafted step at that first one, never counted the probes after plain steps that
    could have corrected it, and weighed one-token replays against long chains: plain for good.)"""
    import heads.draft.drafter as drafter_module

    clock = Clock()
    monkeypatch.setattr(drafter_module, "time", clock)
    model = build_model("llama", seed=1)
    prompt = random_prompt(24, seed=0)
    expected = reference(model, prompt, torch.ones_like(prompt), 48)
    spec = heads.attach_heads(model, kind="draft", draft_model=model)
    drafter = spec.drafter
    drafter.draft = Timed(drafter.draft, clock, lambda ids: 0.060 if not drafter.started else 0.001)
    target = Timed(spec.target, clock, lambda ids: 0.010 + 0.0002 * ids.shape[1])
    for call in range(3):
        recorder = Recorder(drafter)
        output, _ = speculative_generate(target, recorder, prompt, 48, (), None, None, spec.pad_token_id)
        assert torch.equal(output, expected)
        plain = recorder.sizes.count(1)
        assert plain <= 2, (call, recorder.sizes)  # at most a step or two while the costs are first measured
    costs = spec.heads.costs  # a steady drafted step: at most 8 draft forwards and 8 nodes, ~10 ms
    assert costs.pays() and costs.draft_step < 0.015, costs.draft_step


class TreeRecorder(Recorder):
    """A drafter that records the first row of every tree it proposes."""

    def __init__(self, drafter) -> None:
        super().__init__(drafter)
        self.trees = []

    def propose(self, batch):
        trees = super().propose(batch)
        self.trees.append(trees.row(0))
        return trees


def test_alternatives_beside_the_chain_are_verified_and_counted():
    """Greedy: the draft's next-best tokens ride beside a short chain as leaves; the output stays
    ``model.generate``'s, some alternatives are accepted, and the alternatives' calibration counts
    exactly those whose parent the target kept (seen) and those that were the target's token
    (accepted), recomputed here from the recorded trees and the reference output (with free
    nodes every alternative is verified)."""
    model = build_model("llama", seed=2)
    prompt = random_prompt(9, seed=3)
    expected = reference(model, prompt, torch.ones_like(prompt), 60)[0].tolist()
    spec = heads.attach_heads(model, kind="draft", draft_model=noisy_copy(model, 0.3), depth=2, total_tokens=8)
    assert spec.config.siblings == 3
    force(spec, prices=(0.0, 0.0), plain_every=None)  # every alternative pays
    recorder = TreeRecorder(spec.drafter)
    output, stats = speculative_generate(spec.target, recorder, prompt, 60, (), None, None, spec.pad_token_id)
    assert output[0].tolist() == expected
    root, seen, accepted, ended_on_alternative = prompt.shape[1], 0, 0, 0
    for tree, kept in list(zip(recorder.trees, stats.accepted_lengths))[:-1]:
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        chain = 1
        while chain < len(parents) and parents[chain] == chain - 1 and chain <= 2:
            chain += 1
        depth = [0] * len(parents)
        on_path = [True] + [False] * (len(parents) - 1)  # the node is the target's token and so are its ancestors
        for node in range(1, len(parents)):
            depth[node] = depth[parents[node]] + 1
            on_path[node] = on_path[parents[node]] and tokens[node] == expected[root + depth[node]]
            if node >= chain and on_path[parents[node]]:
                seen += 1
                accepted += on_path[node]
        ended_on_alternative += any(on_path[chain:])
        assert kept == max(depth[node] for node in range(len(parents)) if on_path[node])
        assert len(parents) <= 1 + 8
        root += kept + 1
    alternatives = spec.heads.calibration.alternatives
    assert (sum(alternatives["seen"]), sum(alternatives["accepted"])) == (seen, accepted)
    assert seen > 0 and ended_on_alternative > 0
    assert 0 < sum(alternatives["mass"]) < seen
    assert spec.heads.calibration.alternative_scales()[0] != ChainCalibration().alternative_scales()[0] == 1.0


def test_no_alternatives_without_siblings_or_under_sampling(toy_pair):
    """``siblings=0`` drafts plain chains; sampled chains never carry alternatives."""
    model = build_model("llama", seed=2)
    prompt = random_prompt(9, seed=3)
    spec = heads.attach_heads(model, kind="draft", draft_model=noisy_copy(model, 0.3), depth=2, total_tokens=8,
                              siblings=0)
    force(spec, prices=(0.0, 0.0), plain_every=None)
    recorder = TreeRecorder(spec.drafter)
    speculative_generate(spec.target, recorder, prompt, 30, (), None, None, spec.pad_token_id)
    assert max(recorder.sizes) <= 3 and sum(spec.heads.calibration.alternatives["seen"]) == 0
    target, draft = toy_pair
    spec = heads.attach_heads(target, kind="draft", draft_model=draft, depth=2, total_tokens=8)
    force(spec, prices=(0.0, 0.0), plain_every=None)
    rule = acceptance_rule(target.generation_config, True, generator=torch.Generator().manual_seed(0), **SETTINGS)
    drafter = bind_rule(spec.drafter_for(None), rule)
    assert drafter.sampling
    recorder = TreeRecorder(drafter)
    speculative_generate(spec.target, recorder, PROMPT, 30, (), rule, None, spec.pad_token_id)
    assert max(recorder.sizes) == 3 and sum(spec.heads.calibration.alternatives["seen"]) == 0


def test_a_planner_decides_whether_a_step_drafts():
    """Resized by a planner (``speculate="auto"``), the drafter drafts every step it is asked to: its
    own whether-to-draft rule (which here never pays) would otherwise turn the planner's drafted
    steps into empty ones. Released (resized to None), the rule decides again. Greedy parity both ways."""
    model = build_model("llama", seed=1)
    prompt = random_prompt(9, seed=0)
    expected = reference(model, prompt, torch.ones_like(prompt), 24)
    spec = heads.attach_heads(model, kind="draft", draft_model=model)
    force(spec, prices=(0.0, 0.0))
    spec.heads.costs.draft_now = lambda: False  # drafting never pays by the kind's own rule
    for planned in (None, 4):
        spec.drafter.resize(planned)
        recorder = Recorder(spec.drafter)
        output, _ = speculative_generate(spec.target, recorder, prompt, 24, (), None, None, spec.pad_token_id)
        assert torch.equal(output, expected), planned
        drafted = sum(size > 1 for size in recorder.sizes)
        assert drafted == (len(recorder.sizes) if planned else 0), (planned, recorder.sizes)
    spec.drafter.resize(None)


def test_auto_leaves_an_adaptive_chain_its_own_length():
    """An adaptive chain sizes itself per row and step, so ``auto`` offers its configured size alone
    and decides only whether a step drafts (every drafted step is resized to it, never smaller); a
    fixed chain offers ``auto`` sizes from one node to its own. Greedy parity under ``auto``."""
    model = build_model("llama", seed=1)
    prompt = random_prompt(9, seed=0)
    expected = reference(model, prompt, torch.ones_like(prompt), 24)
    spec = heads.attach_heads(model, kind="draft", draft_model=model)
    assert spec.adaptive.sizes == (spec.config.total_tokens,)
    output = spec.generate(prompt, max_new_tokens=24, speculate="auto")
    assert torch.equal(output, expected)
    options = spec.last_stats.speculation["options"]
    assert set(options) <= {str(spec.config.total_tokens)}, options
    fixed = heads.attach_heads(model, kind="draft", draft_model=model, adaptive=False, depth=4, total_tokens=4)
    assert fixed.adaptive.sizes == (1, 2, 4)
