"""Batched speculative decoding: every row equals ``model.generate`` on the same left-padded
batch and its own batch-1 run; the cache each row sees equals a sequential forward of its tokens."""

from __future__ import annotations

import pytest
import torch

import heads
from heads.backbone import inspect_backbone
from tests.conftest import VOCAB, build_model, left_pad
from tree_attention.decode import PerRowDrafter, SpeculativeDecoder, speculative_generate
from tree_attention.mask import prefill_attention_mask
from tree_attention import cache as cache_ops
from tree_attention.tree import from_choices

LENGTHS = (5, 11, 8, 2)


def padded_batch(lengths=LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts (pad id 0) and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(3, VOCAB, (length,), generator=generator) for length in lengths])


def reference(model, ids, mask, max_new_tokens) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)


def check_rows_alone(spec, ids, mask, output, max_new_tokens) -> None:
    """Each row of a batched run equals that row's own batch-1 run (padding stripped)."""
    pad = spec.pad_token_id
    for row in range(ids.shape[0]):
        prompt = ids[row, mask[row].bool()][None]
        alone = spec.generate(prompt, max_new_tokens=max_new_tokens)[0, prompt.shape[1]:]
        batched = output[row, ids.shape[1]:]
        assert torch.equal(batched[:alone.numel()], alone), f"row {row}"
        assert bool((batched[alone.numel():] == pad).all())


def eos_from_row(model, ids, mask, row: int, step: int) -> int:
    """A token that row ``row`` generates greedily at ``step``: as eos, that row ends early."""
    free = reference(model, ids, mask, step + 1)
    return int(free[row, ids.shape[1] + step])


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2", "gemma2", "gpt_neox", "qwen2"])
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_batched_greedy_parity(name, kind):
    model = build_model(name, seed=1)
    ids, mask = padded_batch(seed=2)
    model.generation_config.eos_token_id = eos_from_row(model, ids, mask, row=1, step=4)
    options = dict(tree=16) if kind == "medusa" else dict(depth=3, top_k=2, total_tokens=6)
    spec = heads.attach_heads(model, kind=kind, **options)
    output = spec.generate(ids, attention_mask=mask, max_new_tokens=20)
    assert torch.equal(output, reference(model, ids, mask, 20)), f"{kind} on {name}"
    assert spec.last_stats.batch_size == 4 and spec.last_stats.row_forwards > spec.last_stats.target_forwards
    check_rows_alone(spec, ids, mask, output, 20)


class NoisyOracle:
    """Knows one row's greedy continuation; puts it at a random rank and breaks it at a random
    depth on some steps, so rows of a batch accept different numbers of tokens."""

    def __init__(self, continuation: list[int], template, seed: int) -> None:
        self.continuation, self.template = continuation, template
        self.generator = torch.Generator().manual_seed(seed)
        self.top_k = template.max_rank + 1

    def reset(self):
        self.position = -1

    def propose(self, features, tokens, root):
        self.position += 1 if self.position < 0 else tokens.shape[1]
        ranks = torch.randint(0, self.top_k, (self.template.max_depth,), generator=self.generator).tolist()
        broken = int(torch.randint(1, self.template.max_depth + 2, (1,), generator=self.generator))
        nodes = [root]
        for path in self.template.paths:
            index = self.position + len(path)
            truth = self.continuation[index] if index < len(self.continuation) else 0
            true_path = all(path[i] == ranks[i] for i in range(len(path))) and len(path) < broken
            nodes.append(truth if true_path else (truth + 1 + path[-1]) % VOCAB)
        return self.template.with_tokens(torch.tensor(nodes))


def oracle_drafter(model, ids, mask, max_new_tokens, template) -> PerRowDrafter:
    expected = reference(model, ids, mask, max_new_tokens + 8)[:, ids.shape[1]:]
    return PerRowDrafter([NoisyOracle(expected[row].tolist(), template, seed=row)
                                   for row in range(ids.shape[0])])


BINARY = [path for depth in range(1, 4) for path in __import__("itertools").product((0, 1), repeat=depth)]


@pytest.mark.parametrize("name", ["llama", "gemma2", "mistral", "gpt2"])
def test_ragged_acceptance_with_holes_stays_identical(name):
    model = build_model(name, seed=3)
    ids, mask = padded_batch((3, 9, 6, 12, 1), seed=4)
    max_new = 40
    model.generation_config.eos_token_id = eos_from_row(model, ids, mask, row=2, step=13)
    target = inspect_backbone(model)
    drafter = oracle_drafter(model, ids, mask, max_new, from_choices(BINARY))
    output, stats = speculative_generate(target, drafter, ids, max_new, {model.generation_config.eos_token_id},
                                         attention_mask=mask, pad_token_id=0)
    assert torch.equal(output, reference(model, ids, mask, max_new))
    assert len(set(stats.accepted_lengths)) >= 3  # ragged: rows accepted 0..3 drafts per step
    assert stats.mean_accepted > 2.0


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_each_rows_visible_cache_equals_its_sequential_cache(name):
    model = build_model(name, seed=5)
    ids, mask = padded_batch((4, 10, 7), seed=6)
    target = inspect_backbone(model)
    drafter = oracle_drafter(model, ids, mask, 30, from_choices(BINARY))
    decoder = SpeculativeDecoder(target, drafter, ids, 30, (), attention_mask=mask, pad_token_id=0)
    decoder.prefill()
    compared = 0
    with torch.no_grad():
        while decoder.rows:
            decoder.step()
            for index, row in enumerate(decoder.rows):
                committed = torch.cat([ids[row, mask[row].bool()], torch.tensor(decoder.outputs[row][:-1])])
                reference_cache = cache_ops.new_cache()
                length = committed.numel()
                target.forward(committed[None], torch.arange(length)[None],
                               prefill_attention_mask(length, target.layout, target.dtype, "cpu"), reference_cache,
                               "last")
                visible = decoder.cache.visible[index]
                order = torch.argsort(decoder.cache.positions[index][visible])
                assert decoder.cache.positions[index][visible][order].tolist() == list(range(length))
                for layer, expected in zip(decoder.cache.cache.layers, reference_cache.layers):
                    keys = layer.keys[index][:, visible][:, order]  # (heads, length, head_dim)
                    torch.testing.assert_close(keys, expected.keys[0], rtol=1e-4, atol=1e-5)
                    torch.testing.assert_close(layer.values[index][:, visible][:, order], expected.values[0],
                                               rtol=1e-4, atol=1e-5)
                compared += 1
    assert compared > 10


class TakingTurns(NoisyOracle):
    """Drafts the true continuation only on every ``turns``-th step (from ``offset``), else a wrong
    first token: rows of a batch take turns accepting a whole chain."""

    def __init__(self, continuation, template, turns: int, offset: int) -> None:
        super().__init__(continuation, template, seed=0)
        self.turns, self.offset, self.steps = turns, offset, 0

    def propose(self, features, tokens, root):
        self.position += 1 if self.position < 0 else tokens.shape[1]
        right = self.steps % self.turns == self.offset
        self.steps += 1
        nodes = [root] + [
            self.continuation[self.position + depth] if right else (self.continuation[self.position + depth] + 1) % VOCAB
            for depth in range(1, self.template.size)
        ]
        return self.template.with_tokens(torch.tensor(nodes))


def test_holes_are_compacted_and_decoding_stays_identical():
    model = build_model("llama", seed=7)
    ids, mask = padded_batch((4, 6, 5), seed=8)
    target = inspect_backbone(model)
    expected = reference(model, ids, mask, 60)
    continuations = expected[:, ids.shape[1]:].tolist()
    template = from_choices([(0,) * depth for depth in range(1, 8)])  # a chain of 7
    drafter = PerRowDrafter([TakingTurns(continuations[row] + [0] * 16, template, 3, row) for row in range(3)])
    decoder = SpeculativeDecoder(target, drafter, ids, 60, (), attention_mask=mask, pad_token_id=0)
    widths = []
    with torch.no_grad():
        decoder.prefill()
        while decoder.rows:
            decoder.step()
            if decoder.rows:
                widths.append(decoder.cache.width)
    assert any(later < earlier for earlier, later in zip(widths, widths[1:]))  # a compaction happened
    assert max(widths) <= 2 * (ids.shape[1] + 60)
    assert torch.equal(decoder.result(), expected)


def test_speculate_auto_records_its_choice_and_stays_identical():
    from heads.policy import PLAIN_STEPS

    model = build_model("llama", seed=9)
    spec = heads.attach_heads(model, tree=8)
    # a trained drafter's exploring calls are judged strictly; lookup's, alone or in a hybrid, leniently
    assert spec.policy.steady and not heads.attach_heads(model, kind="lookup").policy.steady
    hybrid = heads.attach_heads(model, tree=8)
    hybrid.set_lookup()
    assert not hybrid.policy.steady
    # ... and every sampled call strictly, lookup's too (sampled text repeats itself far less)
    from types import SimpleNamespace

    lookup = heads.attach_heads(model, kind="lookup").policy
    probe = torch.ones(1, 8, dtype=torch.long)
    assert not lookup.choose(probe, SimpleNamespace(key="greedy"), 64)["controller"].steady
    assert lookup.choose(probe, SimpleNamespace(key="sample T=0.7 top_k=0 top_p=1"), 64)["controller"].steady
    ids, mask = padded_batch(seed=10)
    expected = reference(model, ids, mask, 20)
    output = spec.generate(ids, attention_mask=mask, max_new_tokens=20, speculate="auto")
    assert torch.equal(output, expected)
    choice = spec.last_stats.speculation
    # the first call in a bucket measures plain steps, then the largest size, on its own tokens
    assert choice["policy"] == "auto" and choice["exploring"] and choice["tree"] == max(spec.policy.sizes)
    assert choice["plain_steps"] >= PLAIN_STEPS and "controller" not in choice
    assert [step[0] for step in spec.last_stats.steps[:PLAIN_STEPS]] == [False] * PLAIN_STEPS
    for _ in range(len(spec.policy.sizes) + 1):  # every size worth measuring gets measured, then it chooses
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=20, speculate="auto")
        assert torch.equal(output, expected)
    choice = spec.last_stats.speculation
    assert not choice.get("reason") and choice["plain_step_ms"] > 0
    predicted, bound = choice["predicted_speedup"], choice["upper_bound"]
    assert all(bound[size] >= predicted[size] for size in predicted)
    if bound:
        best = max(bound, key=bound.get)
        assert choice["tree"] == (best if bound[best] >= spec.policy.margin else 0)
    spec.policy.margin = 1e9  # no prediction beats that: plain decoding steps
    spec.policy.plain_streak.clear()
    output = spec.generate(ids, attention_mask=mask, max_new_tokens=20, speculate="auto")
    assert torch.equal(output, expected)
    assert spec.last_stats.speculation["tree"] == 0 and spec.last_stats.tree_size == 1
    assert spec.last_stats.speculation["delegate"]  # drafting nothing: the backbone's own generate ran it
    assert not any(step[0] for step in spec.last_stats.steps)
    spec.policy.delegate_plain = False  # ... or the loop's plain steps
    spec.policy.plain_streak.clear()  # (plain choices in a row lead to a retry: see the test below)
    output = spec.generate(ids, attention_mask=mask, max_new_tokens=20, speculate="auto")
    assert torch.equal(output, expected)
    assert spec.last_stats.speculation["tree"] == 0 and not spec.last_stats.speculation["delegate"]
    assert spec.last_stats.steps and not any(step[0] for step in spec.last_stats.steps)
    spec.policy.delegate_plain = True
    spec.policy.margin = 1.0
    spec.policy.observed.clear()
    spec.policy.observed.update({(size, "greedy", 4): heads.policy.Observed(tokens=100 * size, row_steps=100)
                                 for size in spec.policy.sizes})  # pretend every size accepts fully
    for cost in list(spec.policy.step_costs):  # ... at the cost of a plain step
        spec.policy.step_costs[cost] = 1.0
    output = spec.generate(ids, attention_mask=mask, max_new_tokens=20, speculate="auto")
    assert torch.equal(output, expected)
    assert spec.last_stats.speculation["tree"] > 0 and spec.last_stats.tree_size > 1


@pytest.mark.parametrize("kind", ["medusa", "eagle", "lookup"])
def test_auto_stops_drafting_within_a_call_that_loses(kind):
    """Once drafting has realised less than plain decoding over SWITCH_STEPS drafted steps, the call
    goes on with plain steps; outputs stay identical, and the drafter saw every committed token up
    to then (plain steps between drafted ones keep theirs for its next call)."""
    from heads.policy import SWITCH_STEPS

    model = build_model("qwen2", seed=3)
    spec = heads.attach_heads(model, kind=kind)
    ids, mask = padded_batch((6, 9), seed=4)
    expected = reference(model, ids, mask, 30)
    key = spec.policy.key(ids)
    spec.policy.record_cost(key, 0, 1e-9)  # plain steps "cost nothing": drafting cannot pay
    for size in spec.policy.sizes:
        spec.policy.record_cost(key, size, 1e-9)
        spec.policy.observed[(size, "greedy", 2)] = heads.policy.Observed(tokens=400, row_steps=100)
    output = spec.generate(ids, attention_mask=mask, max_new_tokens=30, speculate="auto")
    assert torch.equal(output, expected)
    choice, steps = spec.last_stats.speculation, spec.last_stats.steps
    assert choice["tree"] > 0 and choice["stopped_drafting_after"] == SWITCH_STEPS
    # steps 1 and 2 refresh the bucket's plain cost (it has a single sample); drafting until it stops
    # (lookup may propose nothing at some steps, None: asked to draft, counted by the call's verdict)
    flags = [step[0] for step in steps]
    stop = max(index for index, flag in enumerate(flags) if flag is not False) + 1
    assert flags[0] is not False and flags[1:3] == [False, False]
    assert all(flag is not False for flag in flags[3:stop]) and not any(flag is not False for flag in flags[stop:])
    assert stop - 2 == SWITCH_STEPS
    assert kind == "lookup" or None not in flags
    assert choice["realized_speedup"] < 1e-3


def test_plain_steps_between_drafted_ones_reach_the_drafter():
    """A schedule that alternates plain and drafted steps gives the same tokens, and each drafter call
    sees every token committed since its last one (the plain steps' ones included)."""
    model = build_model("llama", seed=5)
    spec = heads.attach_heads(model, kind="eagle")
    ids, mask = padded_batch((4, 7, 10), seed=6)
    expected = reference(model, ids, mask, 20)
    seen = []
    drafter = spec._drafter
    propose = drafter.propose

    def recording(batch):
        seen.append(batch.lengths.clone())
        return propose(batch)

    drafter.propose = recording
    decoder = SpeculativeDecoder(spec.target, drafter, ids, 20, (), None, mask, spec.pad_token_id,
                                 schedule=lambda dec: len(dec.stats.steps) % 3 == 2)
    with torch.no_grad():
        output, stats = decoder.run()
    assert torch.equal(output, expected)
    assert [step[0] for step in stats.steps[:6]] == [False, False, True, False, False, True]
    assert sum(int(lengths[0]) for lengths in seen) <= ids.shape[1] + 20  # nothing fed twice
    assert int(seen[1].min()) >= 3  # two plain steps and the drafted one committed at least a token each


def test_plain_decoding_under_auto_is_reproducible_with_a_seeded_generator():
    model = build_model("qwen2", seed=11)
    spec = heads.attach_heads(model, tree=4)
    spec.policy.margin = 1e9  # never speculate
    ids, mask = padded_batch((3, 6), seed=12)
    for size in (0, *spec.policy.sizes):  # every size measured: nothing left to explore
        spec.policy.record_cost(spec.policy.key(ids), size, 1.0)
    runs = [spec.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, speculate="auto",
                          generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and spec.last_stats.speculation["tree"] == 0


@pytest.mark.parametrize("mask, message", [
    (torch.ones(2, 5, dtype=torch.long), "shape of input_ids"),
    (torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), "right padding"),
    (torch.tensor([[0, 1, 0, 1], [1, 1, 1, 1]]), "right padding"),
    (torch.zeros(2, 4, dtype=torch.long), r"rows \[0, 1\] are all padding"),
    (torch.tensor([[0, 2, 1, 1], [1, 1, 1, 1]]), "only 0"),
])
def test_bad_batches(mask, message):
    spec = heads.attach_heads(build_model("llama"), tree=4)
    with pytest.raises(ValueError, match=message):
        spec.generate(torch.full((2, 4), 5), attention_mask=mask, max_new_tokens=3)


def test_bad_speculate_and_empty_batch():
    spec = heads.attach_heads(build_model("llama"), tree=4)
    with pytest.raises(ValueError, match="speculate"):
        spec.generate(torch.full((1, 4), 5), max_new_tokens=3, speculate="always")
    with pytest.raises(ValueError, match="no rows"):
        spec.generate(torch.zeros(0, 4, dtype=torch.long), max_new_tokens=3)


def test_mask_inferred_from_pad_tokens_as_generate_does():
    model = build_model("llama", seed=13)
    spec = heads.attach_heads(model, tree=8)
    ids, mask = padded_batch((3, 7), seed=14)  # pad id 0 is the model's pad_token_id
    with torch.no_grad():
        expected = model.generate(ids, do_sample=False, max_new_tokens=10)
    assert torch.equal(spec.generate(ids, max_new_tokens=10), expected)


def test_auto_tries_a_size_its_calibration_underrated():
    """A size seen for only a few steps that drafted nothing (tau 1) is tried on real traffic while
    its evidence is thin (the upper confidence bound), and chosen from then on once its real tau
    shows; sizes well evidenced as no faster than plain decoding are not tried; a larger nested
    tree is credited with a smaller one's tau; one stalled measurement does not move the median."""
    from types import SimpleNamespace

    from heads.policy import Observed, SpeculationPolicy

    ids, _ = padded_batch(seed=10)
    policy = SpeculationPolicy((2, 8))
    key, rule = policy.key(ids), SimpleNamespace(key="greedy")
    for size, cost in ((0, 1.0), (2, 1.2), (8, 1.5)):
        policy.record_cost(key, size, cost)

    def choose(tau2, steps2, tau8, steps8):
        policy.observed[(2, "greedy", 4)] = Observed(tokens=round(tau2 * steps2), row_steps=steps2)
        policy.observed[(8, "greedy", 4)] = Observed(tokens=round(tau8 * steps8), row_steps=steps8)
        return policy.choose(ids, rule, max_new_tokens=12)

    assert choose(1, 6, 1, 6)["tree"] == 0  # predicted 0.83 / 0.67: below the margin even optimistically
    choice = choose(2, 2, 1, 6)  # size 2 drafted twice in two steps
    assert choice["tau"] == {2: 2.0, 8: 2.0}  # size 8 credited with size 2's tau
    assert choice["tree"] == 2 and choice["exploring"] is False  # predicted 1.67
    choice = choose(1.15, 6, 1.15, 6)  # both thin: predicted 0.96 / 0.77, bounds 1.15 / 0.92
    assert choice["tree"] == 2 and choice["exploring"] is True
    assert choose(1.15, 1000, 1.15, 6)["tree"] == 0  # size 2 well seen at 0.96: no more trying
    assert choose(1, 1000, 4, 1000)["tree"] == 8
    for seconds in (1.5, 1.5, 50.0):
        policy.record_cost(key, 8, seconds)
    assert policy.step_costs[(key, 8)] == 1.5


def test_auto_measures_only_sizes_that_could_pay():
    """A size not yet measured is tried when it could beat plain decoding: judged from the next
    larger measured size's tau (a nested smaller tree accepts no more) over a cost interpolated
    down to plain decoding's; sizes above every measured one, or any size before plain decoding is
    measured, are tried (the largest first); under a sampling setting with no tau seen, a size is
    judged on n + 1 (every node accepted)."""
    from types import SimpleNamespace

    from heads.policy import Observed, SpeculationPolicy

    ids, _ = padded_batch(seed=10)
    rule = SimpleNamespace(key="greedy")
    policy = SpeculationPolicy((2, 8, 16))
    key = policy.key(ids)
    first = policy.choose(ids, rule, 64)
    assert first["tree"] == 16 and first["exploring"] and first["controller"].plain_first > 0
    policy.record_cost(key, 0, 1.0)
    policy.record_cost(key, 16, 3.0)
    policy.observed[(16, "greedy", 4)] = Observed(tokens=150, row_steps=100)  # tau 1.5 at 3x the cost
    # size 8: optimistic 1.5 / (1 + 2 * 8/16) = 0.75; size 2: 1.5 / 1.25 = 1.2 >= 1.1: measure size 2
    choice = policy.choose(ids, rule, 64)
    assert choice["tree"] == 2 and choice["exploring"] and list(choice["controller"].refresh_steps) == [1, 2]  # refresh
    assert choice["controller"].prior_tau == 1.5  # size 16's tau bounds it: judged by the strict rule
    policy.record_cost(key, 2, 1.3)
    policy.observed[(2, "greedy", 4)] = Observed(tokens=110, row_steps=100)  # 1.1 / 1.3: no
    choice = policy.choose(ids, rule, 64)
    assert choice["tree"] == 0 and set(choice["predicted_speedup"]) == {2, 16}  # 8 never measured
    # another sampling setting has seen no tau: the largest size whose every node accepted (n + 1) could pay
    sampled = SimpleNamespace(key="sample T=0.7")
    choice = policy.choose(ids, sampled, 20)
    assert choice["tree"] == 16 and choice["exploring"]  # 17 x 1.0 / 3.0
    for _ in range(3):
        policy.record_cost(key, 16, 20.0)  # ... unless even that could not (median 20: 17 / 20); then 2 (3 / 1.3)
    assert policy.choose(ids, sampled, 20)["tree"] == 2
    for _ in range(2):
        policy.record_cost(key, 2, 5.0)  # median 5.0: 3 / 5 and 17 / 20, nothing could pay
    assert policy.choose(ids, sampled, 20)["tree"] == 0


def test_auto_borrows_costs_for_a_nearby_prompt_length():
    """A new prompt-length bucket within a factor 4 of a measured one (same batch bucket) starts from
    its costs; a far one, or another batch size, measures its own (plain steps first)."""
    from types import SimpleNamespace

    from heads.policy import Observed, SpeculationPolicy

    policy = SpeculationPolicy((2,))
    policy.observed[(2, "greedy", 1)] = Observed(tokens=300, row_steps=100)
    for size, cost in ((0, 1.0), (2, 1.2)):
        policy.record_cost((1, 8), size, cost)
    rule = SimpleNamespace(key="greedy")
    near = torch.ones(1, 30, dtype=torch.long)  # bucket 32: within 4x of 8
    choice = policy.choose(near, rule, max_new_tokens=4)
    assert choice["step_ms"] == {2: 1200.0} and choice["tree"] == 2
    far = torch.ones(1, 60, dtype=torch.long)  # bucket 64: 8x from 8, but 2x from 32
    assert policy.choose(far, rule, max_new_tokens=4)["tree"] == 2
    batch = torch.ones(2, 8, dtype=torch.long)  # another batch bucket
    other = policy.choose(batch, rule, max_new_tokens=64)
    assert other["exploring"] and other["plain_step_ms"] is None and other["controller"].plain_first > 0


def test_auto_learns_costs_and_tau_from_the_call_steps():
    """After a call, the bucket's plain cost is the median of its plain steps, the size's cost the
    median of its drafted steps but the first (which also feeds the drafter the prompt), and tau is
    the slowest row's tokens per drafted step, weighted by the drafted steps; the controller's
    verdict is recorded."""
    from heads.policy import CallController, Observed, SpeculationPolicy
    from tree_attention.decode import DecodeStats

    policy = SpeculationPolicy((4,))
    steps = [(False, 3.0, 2, 2), (False, 1.0, 2, 2), (False, 1.2, 2, 2),  # the first step (dearer) is left out
             (True, 9.0, 6, 2), (True, 2.0, 6, 2), (True, 2.2, 4, 2), (True, 2.4, 8, 2)]
    stats = DecodeStats(steps=steps, row_drafted=[[14, 4], [10, 4]], batch_size=2)
    choice = {"policy": "auto", "tree": 4, "rule": "greedy", "batch_bucket": 2, "length_bucket": 8,
              "controller": CallController(None, 4)}
    policy.observe(choice, stats)
    assert policy.step_costs[((2, 8), 0)] == 1.1 and policy.step_costs[((2, 8), 4)] == 2.2
    assert policy.observed[(4, "greedy", 2)] == Observed(tokens=10.0, row_steps=4)  # the slower row: 2.5
    assert choice["plain_steps"] == 3 and choice["drafted_steps"] == 4 and "controller" not in choice
    assert choice["slowest_row_tau"] == 2.5 and policy.taus("greedy", 2) == {4: 2.5}
    assert policy.taus("greedy", 1) == {4: 1.0}  # another batch bucket has seen nothing


def test_call_controller_switches_on_realised_speed():
    """Plain steps first while the plain cost is unknown; drafting goes on while it realises at
    least SWITCH_BELOW of plain decoding's speed (slowest row, over the call's drafted steps), and
    stops for good when it does not; a prior estimate keeps a few unlucky steps from ending it."""
    from types import SimpleNamespace

    from heads.policy import PLAIN_STEPS, PRIOR_STEPS, SWITCH_BELOW, SWITCH_STEPS, CallController
    from tree_attention.decode import DecodeStats

    def run(cost, fast, slow, prior=None, steps=SWITCH_STEPS + 3, steady=False):
        controller = CallController(None, 8, prior, steady=steady)
        decoder = SimpleNamespace(stats=DecodeStats(row_drafted=[[0, 0], [0, 0]], batch_size=2), drafting=True,
                                  rows=[0, 1], outputs=[[], []], max_new_tokens=10_000)  # rows far from done
        decisions = []
        for _ in range(PLAIN_STEPS + steps):
            draft = decoder.drafting and controller(decoder)
            decisions.append(draft)
            decoder.stats.steps.append((True, cost, fast + slow, 2) if draft else (False, 1.0, 2, 2))
            if draft:
                for row, tokens in enumerate((fast, slow)):
                    decoder.stats.row_drafted[row][0] += tokens
                    decoder.stats.row_drafted[row][1] += 1
        return decisions, controller, decoder

    decisions, controller, decoder = run(1.5, 3, 2)  # the slow row: tau 2 at 1.5x the cost, 1.33x
    assert decisions == [False] * PLAIN_STEPS + [True] * (SWITCH_STEPS + 3) and decoder.drafting
    assert abs(controller.realized - 2 / 1.5) < 1e-9
    mild, _, decoder = run(1.5, 3, 1.35)  # 0.9x with the size's tau unknown: go on (acceptance may grow) ...
    assert decoder.drafting and all(mild[PLAIN_STEPS:])
    early, controller, decoder = run(1.5, 3, 1.0, steps=2 * SWITCH_STEPS + 2)  # 0.67x unknown: judged again ...
    assert early[PLAIN_STEPS:] == [True] * 2 * SWITCH_STEPS + [False] * 2  # ... after twice the steps (0.8x)
    assert controller.switched_at == 2 * SWITCH_STEPS
    mild, _, decoder = run(1.5, 3, 1.35, prior=1.35)  # ... and with it known (every reply starts unrepeated)
    assert decoder.drafting
    steady, controller, decoder = run(1.5, 3, 1.35, steady=True)  # ... and for a drafter whose acceptance
    assert not decoder.drafting and controller.switched_at == SWITCH_STEPS  # does not grow through a reply
    assert steady[PLAIN_STEPS:] == [True] * SWITCH_STEPS + [False] * 3
    decisions, controller, decoder = run(1.5, 3, 0.6)  # the mean row does 1.8, the slow one 0.6: 0.4x, at once
    assert decisions == [False] * PLAIN_STEPS + [True] * SWITCH_STEPS + [False] * 3
    assert not decoder.drafting and controller.switched_at == SWITCH_STEPS
    decisions, controller, decoder = run(1.5, 3, 1.4, prior=1.4, steady=True)  # the slow row at 1.4: 0.93x, stop ...
    assert not decoder.drafting
    decisions, controller, decoder = run(1.5, 3, 1.4, prior=3.0, steady=True)  # ... unless known good: blended, it pays
    drafted = SWITCH_STEPS + 2  # at the last decision
    expected = (3.0 * PRIOR_STEPS + 1.4 * drafted) / (PRIOR_STEPS + drafted) / 1.5
    assert expected > SWITCH_BELOW
    assert decoder.drafting and abs(controller.realized - expected) < 1e-9


def test_auto_refreshes_a_thin_or_stale_plain_cost():
    """A drafting call takes its second and third steps plain (its first costs more than later
    ones) while the bucket's plain cost has fewer than REFRESH_SAMPLES samples, or none from the last
    REFRESH_PLAIN calls; otherwise it drafts throughout. A bucket without a plain cost opens with
    PLAIN_STEPS plain steps."""
    from types import SimpleNamespace

    from heads.policy import PLAIN_STEPS, REFRESH_PLAIN, REFRESH_SAMPLES, Observed, SpeculationPolicy
    from tree_attention.decode import DecodeStats

    ids = torch.ones(1, 8, dtype=torch.long)
    policy, rule = SpeculationPolicy((4,)), SimpleNamespace(key="greedy")
    key = policy.key(ids)
    policy.record_cost(key, 4, 1.0)
    policy.observed[(4, "greedy", 1)] = Observed(tokens=300, row_steps=100)
    opened = []
    for call in range(REFRESH_SAMPLES + 2 * REFRESH_PLAIN + 3):
        choice = policy.choose(ids, rule, 64)
        assert choice["tree"] == 4
        controller = choice["controller"]
        plain_first, refresh = controller.plain_first, list(controller.refresh_steps)
        opened.append(plain_first or len(refresh))
        if plain_first:
            steps = [(False, 0.9, 1, 1)] + [(False, 0.5, 1, 1)] * (plain_first - 1) + [(True, 1.0, 3, 1)] * 4
        else:  # the first step drafts; the refresh steps are plain
            steps = [(index not in refresh, 0.5 if index in refresh else 1.0, 1, 1) for index in range(6)]
        assert [not controller(SimpleNamespace(stats=DecodeStats(steps=steps[:index]), drafting=True))
                for index in range(len(steps))] == [not step[0] for step in steps]
        policy.observe(choice, DecodeStats(steps=steps, row_drafted=[[12, 4]]))
        assert policy.step_costs[(key, 0)] == 0.5  # a call's first step is left out of the plain cost
    # no plain cost: PLAIN_STEPS; calls 1..2 fill the samples; REFRESH_PLAIN calls draft at once; one
    # refreshes; and so on
    assert opened == ([PLAIN_STEPS] + [2] * (REFRESH_SAMPLES - 1) + [0] * REFRESH_PLAIN + [2]
                      + [0] * REFRESH_PLAIN + [2, 0])


def test_a_short_call_neither_explores_nor_teaches():
    """A call too short to judge a tree size on (its trees are cut to its last few tokens) runs plain
    steps while nothing is measured, may use a measured size, and records no tau either way."""
    from types import SimpleNamespace

    from heads.policy import GROWING_LEARN_TOKENS, MIN_LEARN_TOKENS, Observed, SpeculationPolicy
    from tree_attention.decode import DecodeStats

    ids = torch.ones(1, 8, dtype=torch.long)
    rule = SimpleNamespace(key="greedy")
    # a trained drafter alone (steady): MIN_LEARN_TOKENS; with lookup, whose acceptance grows through
    # a reply, GROWING_LEARN_TOKENS (a short call's tau is its reply's start, not the reply)
    for steady, least in ((True, MIN_LEARN_TOKENS), (False, GROWING_LEARN_TOKENS)):
        policy = SpeculationPolicy((4,), steady=steady)
        short = policy.choose(ids, rule, least - 1)
        assert short["tree"] == 0 and "too few" in short["reason"] and f"at least {least}" in short["reason"]
        assert policy.choose(ids, rule, least)["tree"] == 4  # a long one explores
    assert GROWING_LEARN_TOKENS > 2 * MIN_LEARN_TOKENS
    key = policy.key(ids)
    policy.record_cost(key, 0, 1.0)
    policy.record_cost(key, 4, 1.2)
    policy.observed[(4, "greedy", 1)] = Observed(tokens=300, row_steps=100)
    choice = policy.choose(ids, rule, 4)
    assert choice["tree"] == 4 and not choice["learns"]  # measured and good: a short call may draft ...
    policy.observe(choice, DecodeStats(steps=[(True, 1.0, 1, 1)] * 3, row_drafted=[[3, 3]]))
    assert policy.observed[(4, "greedy", 1)] == Observed(tokens=300, row_steps=100)  # ... but teaches nothing


def test_a_size_that_lost_at_a_smaller_batch_is_not_explored_at_a_larger_one():
    """Drafting only gets dearer per row as the batch grows: a size well measured at batch bucket 1
    as no faster than plain decoding by the margin (as ``choose`` would judge it there) is not
    explored at batch 8 (same prompt lengths), while one that paid there is; with every size ruled
    out, a new bucket runs plain steps."""
    from types import SimpleNamespace

    from heads.policy import Observed, SpeculationPolicy

    policy, rule = SpeculationPolicy((4, 16)), SimpleNamespace(key="greedy")
    small = policy.key(torch.ones(1, 20, dtype=torch.long))
    for size, cost in ((0, 1.0), (4, 1.4), (16, 2.5)):
        policy.record_cost(small, size, cost)
    policy.observed[(4, "greedy", 1)] = Observed(tokens=200, row_steps=100)  # 2.0 / 1.4: pays
    policy.observed[(16, "greedy", 1)] = Observed(tokens=220, row_steps=100)  # 2.2 / 2.5: loses
    batch = torch.ones(8, 20, dtype=torch.long)
    choice = policy.choose(batch, rule, 48)
    assert choice["tree"] == 4 and choice["exploring"]
    policy.observed[(4, "greedy", 1)] = Observed(tokens=150, row_steps=100)  # 1.5 / 1.4: 1.07x, under the margin
    choice = policy.choose(batch, rule, 48)
    assert choice["tree"] == 0 and "smaller batch" in choice["reason"]
    far = torch.ones(8, 200, dtype=torch.long)  # prompt lengths 16x apart: nothing carries over
    assert policy.choose(far, rule, 48)["tree"] == 16


def test_a_size_that_could_not_pay_at_a_smaller_batch_is_not_explored_at_a_larger_one():
    """A size never measured at batch bucket 4, because even its optimistic estimate there (the
    larger measured size's tau, its cost interpolated with drafting kept whole) could not beat plain
    decoding by the margin, is not explored at batch 8 either; with cheap drafting it could have
    paid at batch 4, and is explored at batch 8."""
    from types import SimpleNamespace

    from heads.policy import Observed, SpeculationPolicy

    rule = SimpleNamespace(key="greedy")
    four, eight = torch.ones(4, 20, dtype=torch.long), torch.ones(8, 20, dtype=torch.long)
    for drafting, expected in ((1.5, 0), (0.0, 4)):
        policy = SpeculationPolicy((2, 4, 8))
        small = policy.key(four)
        policy.record_cost(small, 0, 1.0)
        policy.record_cost(small, 8, 2.8)
        policy.record_draft_cost(small, 8, drafting)
        policy.observed[(8, "greedy", 4)] = Observed(tokens=250, row_steps=100)  # 2.5 / 2.8: loses
        # drafting 1.5: size 4 at best 2.5 / (1 + 1.5 + 0.3 x 4 / 8) = 0.94x, size 2 0.97x: neither tried;
        # drafting 0: size 4 at best 2.5 / 1.9 = 1.32x, tried at batch 4 (and at batch 8 until measured)
        assert policy.choose(four, rule, 48)["tree"] == expected
        choice = policy.choose(eight, rule, 48)
        assert choice["tree"] == expected
        if not expected:
            assert "smaller batch" in choice["reason"]


def test_auto_measures_the_best_size_again_after_plain_choices_in_a_row():
    """A size written off by one call's few unlucky steps is measured again after RETRY_AFTER plain
    choices in a row, then after twice as many, and so on; a drafting choice resets the interval."""
    from types import SimpleNamespace

    from heads.policy import MIN_LEARN_TOKENS, RETRY_AFTER, Observed, SpeculationPolicy

    ids = torch.ones(1, 8, dtype=torch.long)
    policy, rule = SpeculationPolicy((4,)), SimpleNamespace(key="greedy")
    key = policy.key(ids)
    policy.record_cost(key, 0, 1.0)
    policy.record_cost(key, 4, 3.0)  # tau 1.3 at three times a plain step: a clear loss
    policy.observed[(4, "greedy", 1)] = Observed(tokens=130, row_steps=100)
    choices = [policy.choose(ids, rule, 64) for _ in range(3 * RETRY_AFTER + 4)]
    trees = [choice["tree"] for choice in choices]
    retries = [index for index, tree in enumerate(trees) if tree]
    retried = choices[retries[0]]  # judged afresh: exploring, no prior tau (the lenient thresholds)
    assert retried["exploring"] and retried["controller"].prior_tau is None and "again" in retried["reason"]
    assert retries == [RETRY_AFTER - 1, 3 * RETRY_AFTER - 1]  # after 2, then 4 plain choices
    assert policy.choose(ids, rule, MIN_LEARN_TOKENS - 1)["tree"] == 0  # a short call neither counts nor retries
    policy.observed[(4, "greedy", 1)] = Observed(tokens=400, row_steps=100)  # it pays now: chosen, interval reset
    assert policy.choose(ids, rule, 64)["tree"] == 4 and (key[0], "greedy") not in policy.retry_interval


def test_auto_retries_count_plain_choices_across_prompt_lengths():
    """What a retry measures again (a size's tau) is kept per batch bucket and rule, so plain choices
    count towards one retry whatever the prompts' lengths: prompts alternating between two length
    buckets retry a losing size once every RETRY_AFTER plain calls, not once per bucket (keyed by
    length too, a sampled demo-code mix retried size 16 in both buckets back to back, each at 0.8x)."""
    from types import SimpleNamespace

    from heads.policy import RETRY_AFTER, Observed, SpeculationPolicy

    policy, rule = SpeculationPolicy((4,)), SimpleNamespace(key="sample T=0.7")
    lengths = [40, 100]  # buckets 64 and 128
    for length in lengths:
        key = policy.key(torch.ones(1, length, dtype=torch.long))
        policy.record_cost(key, 0, 1.0)
        policy.record_cost(key, 4, 3.0)
    policy.observed[(4, rule.key, 1)] = Observed(tokens=130, row_steps=100)  # a clear loss in both
    trees = [policy.choose(torch.ones(1, lengths[index % 2], dtype=torch.long), rule, 40)["tree"]
             for index in range(3 * RETRY_AFTER + 2)]
    assert [index for index, tree in enumerate(trees) if tree] == [RETRY_AFTER - 1, 3 * RETRY_AFTER - 1]


def test_auto_tries_another_size_only_if_it_could_beat_the_winner():
    """Once a measured size beats plain decoding, a smaller one is tried only if it could beat that
    size's predicted speedup by IMPROVE, with the drafting part of the larger size's cost kept whole
    (only verification shrinks with the tree)."""
    from types import SimpleNamespace

    from heads.policy import IMPROVE, Observed, SpeculationPolicy

    ids, _ = padded_batch(seed=10)
    rule = SimpleNamespace(key="sample T=0.7")
    policy = SpeculationPolicy((4, 8))
    key = policy.key(ids)
    policy.record_cost(key, 0, 3.3)
    policy.record_cost(key, 8, 4.5)
    policy.observed[(8, rule.key, 4)] = Observed(tokens=200, row_steps=100)  # tau 2: predicted 1.47x
    # no drafting cost known: size 4 interpolated to 3.9 (1.69x > 1.47 x 1.1): tried
    assert policy.choose(ids, rule, 64)["tree"] == 4
    # drafting costs 0.6 of size 8's 4.5: size 4 at most 3.3 + 0.6 + 0.3 = 4.2 (1.57x < 1.62x): not tried
    policy.record_draft_cost(key, 8, 0.6)
    choice = policy.choose(ids, rule, 64)
    assert choice["tree"] == 8 and not choice["exploring"]
    assert 1.57 < 1.47 * (1 + IMPROVE)
    # when no measured size beats plain decoding, any size that could is tried
    policy.record_cost(key, 8, 6.5)
    policy.record_cost(key, 8, 6.5)  # median 6.5: size 8 predicted 1.02x; size 4 at most 5.2 (1.27x)
    assert policy.choose(ids, rule, 64)["tree"] == 4


def _sizes_4_and_10(cost_4: float, cost_10: float):
    """A greedy policy over sizes 4 and 10 for a padded batch, a plain step costing 1.0 and each size
    the cost given: ``(ids, rule, policy, bucket key)``."""
    from types import SimpleNamespace

    from heads.policy import SpeculationPolicy

    ids, _ = padded_batch(seed=10)
    policy = SpeculationPolicy((4, 10))
    key = policy.key(ids)
    for size, cost in ((0, 1.0), (4, cost_4), (10, cost_10)):
        policy.record_cost(key, size, cost)
    return ids, SimpleNamespace(key="greedy"), policy, key


def test_the_most_measured_size_keeps_its_place_unless_another_is_clearly_faster():
    """Sizes measured on different calls saw different text: a size explored on easy prompts does not
    displace the size seen drafting most for a lead under IMPROVE; a clear lead does."""
    from heads.policy import IMPROVE, Observed

    ids, rule, policy, key = _sizes_4_and_10(1.55, 1.6)
    policy.observed[(10, "greedy", 4)] = Observed(tokens=300, row_steps=100)  # tau 3.0: predicted 1.875x
    policy.observed[(4, "greedy", 4)] = Observed(tokens=3.0 * 25, row_steps=25)  # tau 3.0 too: predicted 1.94x
    choice = policy.choose(ids, rule, 64)
    predicted, bound = choice["predicted_speedup"], choice["upper_bound"]
    assert predicted[4] > predicted[10] and bound[4] < bound[10] * (1 + IMPROVE)
    assert choice["tree"] == 10  # the most measured size keeps its place
    for _ in range(2):
        policy.record_cost(key, 10, 2.5)  # size 10 measured dearer (median 2.5): predicted 1.2x against 1.94x
    choice = policy.choose(ids, rule, 64)
    assert choice["upper_bound"][4] > choice["upper_bound"][10] * (1 + IMPROVE) and choice["tree"] == 4


def test_a_size_seen_for_too_few_steps_is_not_kept_behind_the_incumbent():
    """The incumbent's IMPROVE margin guards against sizes measured on other text, not against a size
    seen for fewer steps than a call's verdict needs (a 16-token call's 5 drafted steps at the start of
    a reply): where its upper bound leads, it is measured on a call; once seen for SWITCH_STEPS steps or
    more, the margin applies again."""
    from heads.policy import IMPROVE, SWITCH_STEPS, Observed

    ids, rule, policy, _ = _sizes_4_and_10(1.3, 1.45)
    policy.observed[(4, "greedy", 4)] = Observed(tokens=3.2 * 500, row_steps=500)  # predicted 2.46x
    policy.observed[(10, "greedy", 4)] = Observed(tokens=2.0 * (SWITCH_STEPS - 1), row_steps=SWITCH_STEPS - 1)
    choice = policy.choose(ids, rule, 64)
    bound = choice["upper_bound"]
    assert bound[4] < bound[10] < bound[4] * (1 + IMPROVE)
    assert choice["tree"] == 10  # not judged yet: measured
    policy.observed[(10, "greedy", 4)] = Observed(tokens=2.0 * SWITCH_STEPS, row_steps=SWITCH_STEPS)
    choice = policy.choose(ids, rule, 64)
    bound = choice["upper_bound"]
    assert bound[4] < bound[10] < bound[4] * (1 + IMPROVE) and choice["tree"] == 4  # judged: the margin holds


def test_drain_seconds_prices_each_step_by_the_rows_still_decoding():
    """Rows needing 2, 5 and 5 more steps: 2 steps of 3 rows, then 3 of 2; costs linear between
    measured row counts, the nearest one's beyond them."""
    from heads.controller import drain_seconds, rows_cost

    cost = {1: 1.0, 3: 2.0}.get
    assert drain_seconds([5.0, 2.0, 5.0], lambda rows: cost(rows, 1.5)) == 2 * 2.0 + 3 * 1.5
    assert drain_seconds([], lambda rows: 1.0) == 0.0
    anchors = {1: 1.0, 3: 2.0, 8: 4.0}
    assert rows_cost(anchors, 2) == 1.5 and rows_cost(anchors, 3) == 2.0 and rows_cost(anchors, 16) == 4.0
    assert abs(rows_cost(anchors, 5) - 2.8) < 1e-12 and rows_cost({4: 2.0}, 1) == 2.0


def _verdict(controller, rates, remaining, drafted_cost, plain_cost=1.0):
    """Run ``controller`` over a batch call's plain first step and 6 drafted steps at full rows, after
    which row i has committed ``rates[i]`` tokens per drafted step and has ``remaining[i]`` tokens
    to go; its decision for the next step."""
    from types import SimpleNamespace

    from tree_attention.decode import DecodeStats

    batch = len(rates)
    stats = DecodeStats(row_drafted=[[0.0, 0] for _ in rates], batch_size=batch)
    decoder = SimpleNamespace(stats=stats, drafting=True, rows=list(range(batch)), max_new_tokens=100,
                              outputs=[[0] * int(100 - left) for left in remaining])
    stats.steps.append((False, plain_cost, batch, batch))
    for _ in range(6):
        assert controller(decoder)
        stats.steps.append((True, drafted_cost, sum(rates), batch))
        for record, rate in zip(stats.row_drafted, rates):
            record[0] += rate
            record[1] += 1
    return controller(decoder)


def test_a_batch_call_is_judged_with_rows_leaving_as_they_finish():
    """Rows that accept at different rates finish at different steps, and the steps after that decode
    fewer rows and cost less (measured at fewer rows: ``fewer_rows``); plain steps keep the rows
    together. The verdict prices both remainders that way: a call judged a loss on its first steps
    (slowest row's tau x plain / the full batch's step) goes on where the rest of it pays. Without
    costs at fewer rows it is the old verdict."""
    from heads.controller import SWITCH_BELOW, CallController

    rates, remaining = [2.0, 3.0, 4.0, 5.0], [60.0, 60.0, 60.0, 60.0]
    controller = CallController(1.0, 8, steady=True)
    old = min(rates) * 1.0 / 2.2  # 0.91x: the old verdict stopped this call
    assert _verdict(controller, rates, remaining, 2.2) is False
    assert abs(controller.realized - old) < 1e-9 and old < SWITCH_BELOW
    # measured: a drafted step over 1 row costs 0.8, over 2 rows 1.2; a plain step 0.6 / 0.7
    controller = CallController(1.0, 8, steady=True, fewer_rows={1: (0.6, 0.8), 2: (0.7, 1.2)})
    assert _verdict(controller, rates, remaining, 2.2) is True
    finish = sorted(60 / rate for rate in rates)  # 12, 15, 20, 30 steps
    drafted = (finish[0] * 2.2 + (finish[1] - finish[0]) * 1.7 + (finish[2] - finish[1]) * 1.2
               + (finish[3] - finish[2]) * 0.8)
    assert abs(controller.realized - 60 * 1.0 / drafted) < 1e-9 and controller.realized > SWITCH_BELOW
    # the call's projected seconds per drafted step of its last row: the 5 counted ones and the rest
    assert abs(controller.effective - (5 * 2.2 + drafted) / (5 + 30)) < 1e-9
    # rows with less left to go finish sooner: the slowest row by time to finish, not by rate, counts
    controller = CallController(1.0, 8, steady=True)
    _verdict(controller, [2.0, 4.0], [10.0, 60.0], 1.0)
    assert abs(controller.realized - 60 / 15) < 1e-9


def test_auto_learns_costs_by_rows_and_the_projected_cost_of_a_stopped_call():
    """A call's steps are recorded by the rows they decoded (plain and the drafted size), the plain
    cost from steps of every row only (rows leave the loop as they finish; the backbone's generate
    keeps them), a drafted size's cost as seconds per drafted step of the call's last row (each row
    count's median, weighted), or the controller's projection where the call stopped drafting; and
    the next call's controller gets the costs at fewer rows."""
    from types import SimpleNamespace

    from heads.policy import CallController, SpeculationPolicy
    from tree_attention.decode import DecodeStats

    policy = SpeculationPolicy((4,))
    steps = [(False, 3.0, 4, 4), (False, 1.0, 4, 4), (False, 1.2, 4, 4), (True, 9.0, 8, 4),
             (True, 2.0, 8, 4), (True, 2.2, 8, 4), (True, 1.5, 6, 3), (True, 1.0, 4, 2), (True, 1.1, 4, 2),
             (False, 0.4, 2, 2)]  # a plain step after drafting stopped, over 2 rows: not the plain cost
    stats = DecodeStats(steps=steps, row_drafted=[[20, 6], [14, 6], [12, 5], [10, 5]], batch_size=4)
    choice = {"policy": "auto", "tree": 4, "rule": "greedy", "batch_bucket": 4, "length_bucket": 8,
              "controller": CallController(None, 4)}
    policy.observe(choice, stats)
    assert policy.step_costs[((4, 8), 0)] == 1.1
    assert abs(policy.step_costs[((4, 8), 4)] - (2 * 2.1 + 1.5 + 2 * 1.05) / 5) < 1e-12
    assert policy.row_costs == {(8, 0, 4): 1.1, (8, 0, 2): 0.4, (8, 4, 4): 2.1, (8, 4, 3): 1.5, (8, 4, 2): 1.05}
    stopped = CallController(1.0, 4)
    stopped.switched_at, stopped.effective = 6, 1.7
    policy.observe({**choice, "controller": stopped}, stats)
    assert policy.cost_samples[((4, 8), 4)][-1] == 1.7
    ids = torch.ones(4, 8, dtype=torch.long)
    controller = policy.choose(ids, SimpleNamespace(key="greedy"), 64)["controller"]
    assert controller.fewer_rows == {2: (0.4, 1.05), 3: (None, 1.5)}
