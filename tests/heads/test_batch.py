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


def test_plain_steps_between_drafted_ones_reach_the_drafter():
    """A planner that alternates plain and drafted steps gives the same tokens, and each drafter call
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
    class EveryThird:  # a planner that drafts every third step and verifies whole trees
        def draft(self, rows):
            return len(decoder.stats.steps) % 3 == 2

        def observe(self, record, trees, paths, lengths):
            pass

    decoder = SpeculativeDecoder(spec.target, drafter, ids, 20, (), None, mask, spec.pad_token_id,
                                 planner=EveryThird())
    with torch.no_grad():
        output, stats = decoder.run()
    assert torch.equal(output, expected)
    assert [step.kind for step in stats.steps[:6]] == ["plain", "plain", "drafted"] * 2
    assert sum(int(lengths[0]) for lengths in seen) <= ids.shape[1] + 20  # nothing fed twice
    assert int(seen[1].min()) >= 3  # two plain steps and the drafted one committed at least a token each


def test_auto_with_a_seed_is_reproducible():
    """Whatever ``auto`` decides from one call to the next (its costs and acceptance change), a
    sampled call with ``seed=`` gives the same text, the fixed tree's."""
    model = build_model("qwen2", seed=11)
    spec = heads.attach_heads(model, tree=4)
    ids, mask = padded_batch((3, 6), seed=12)
    runs = [spec.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, speculate="auto", seed=5)
            for _ in range(3)]
    fixed = spec.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, seed=5)
    assert all(torch.equal(run, fixed) for run in runs)


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
