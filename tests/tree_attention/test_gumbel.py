"""The counter-based Gumbel stream and the Gumbel-max rule (tree_attention/gumbel.py), on crafted logits.

Exactness of a Gumbel-max draw is checked by a chi-square test over many positions of one row; the
rule's walk is checked against a sequential reference that follows the drafted tree token by token.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from tests.stats import FALSE_ALARM, chi_square_pvalue
from tree_attention import gumbel
from tree_attention.gumbel import GumbelRule, gumbel_noise, mix, perturbed_argmax, perturbed_top_k, row_keys
from tree_attention.tree import TreeBatch, from_choices

DRAWS = 20000


def _signed(value: int) -> int:
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def test_mix_is_splitmix64():
    """splitmix64's first outputs from state 0 (its published reference values)."""
    golden = 0x9E3779B97F4A7C15
    states = torch.tensor([_signed(golden * step) for step in (1, 2, 3)])
    assert [word % (1 << 64) for word in mix(states).tolist()] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                                                                     0x06C45D188009454F]


def test_noise_is_standard_gumbel_and_independent_across_positions():
    keys = torch.full((DRAWS,), 12345, dtype=torch.long)
    positions = torch.arange(DRAWS)
    noise = gumbel_noise(keys, positions, torch.arange(3))  # (DRAWS, 3)
    for column in range(3):
        assert stats.kstest(noise[:, column].numpy(), stats.gumbel_r.cdf).pvalue > FALSE_ALARM
    # neighbouring positions and tokens are uncorrelated (|r| ~ 1/sqrt(DRAWS) ~ 0.007)
    assert abs(float(torch.corrcoef(torch.stack([noise[1:, 0], noise[:-1, 0]]))[0, 1])) < 0.04
    assert abs(float(torch.corrcoef(noise[:, :2].T)[0, 1])) < 0.04


def test_noise_depends_on_key_position_and_token_only():
    keys = torch.tensor([5, 5, 6])
    positions = torch.tensor([9, 9, 9])
    tokens = torch.arange(40)
    noise = gumbel_noise(keys, positions, tokens)
    assert torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], noise[2])
    # the same entries computed alone, or for a subset of tokens, are the same numbers
    assert torch.equal(gumbel_noise(keys[2:], positions[2:], tokens[7:9])[0], noise[2, 7:9])
    assert not torch.equal(gumbel_noise(keys[:1], positions[:1] + 1, tokens)[0], noise[0])


@pytest.mark.parametrize("top_k", [0, 3])
def test_perturbed_argmax_is_an_exact_draw(top_k):
    """One row's Gumbel-max draws over many positions follow softmax(warped)."""
    logits = torch.tensor([1.5, 0.2, -0.3, 0.9, 0.0, -2.0])
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -math.inf)
    probs = torch.softmax(logits, -1)
    draws = perturbed_argmax(logits.expand(DRAWS, -1), torch.full((DRAWS,), 77), torch.arange(DRAWS))
    pvalue = chi_square_pvalue(draws.tolist(), {token: float(p) for token, p in enumerate(probs)})
    assert pvalue > FALSE_ALARM, pvalue


def test_a_wrong_coupling_is_caught():
    """The control for the test above: noise at half scale (a common slip: uniform noise, or Gumbel
    without its scale) sharpens the distribution, and the same chi-square test rejects it."""
    logits = torch.tensor([1.5, 0.2, -0.3, 0.9, 0.0, -2.0])
    probs = torch.softmax(logits, -1)
    noise = gumbel_noise(torch.full((DRAWS,), 77), torch.arange(DRAWS), torch.arange(6))
    draws = (logits + 0.5 * noise).argmax(-1)
    assert chi_square_pvalue(draws.tolist(), {token: float(p) for token, p in enumerate(probs)}) < FALSE_ALARM


def test_support_only_noise_gives_the_full_computation():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 200, generator=generator)
    warped = logits.masked_fill(logits < logits.topk(5, dim=-1).values[:, -1:], -math.inf)  # top-5 rows
    keys, positions = torch.randint(-1 << 62, 1 << 62, (64,), generator=generator), torch.arange(64) + 3
    full = (warped.double() + gumbel_noise(keys, positions, torch.arange(200))).argmax(-1)
    assert torch.equal(perturbed_argmax(warped, keys, positions), full)
    # and each row alone gives its row of the batch
    assert all(int(perturbed_argmax(warped[row:row + 1], keys[row:row + 1], positions[row:row + 1])) == int(full[row])
               for row in range(0, 64, 7))


def test_row_keys_ignore_padding_and_batch_place():
    prompt = torch.tensor([4, 8, 15, 16])
    other = torch.tensor([23, 42])
    alone = row_keys([3], prompt[None])
    ids = torch.tensor([[0, 0, 23, 42], [4, 8, 15, 16], [0, 0, 0, 4]])
    mask = (torch.arange(4)[None, :] >= torch.tensor([[2], [0], [3]])).long()
    keys = row_keys([3, 3, 3], ids, mask)
    assert int(keys[1]) == int(alone[0])
    assert int(keys[0]) == int(row_keys([3], other[None])[0])
    assert int(row_keys([4], prompt[None])[0]) != int(alone[0])  # another seed
    assert int(row_keys([3], prompt.flip(0)[None])[0]) != int(alone[0])  # the same tokens in another order
    assert int(row_keys([3], prompt[None, :3])[0]) != int(alone[0])
    with pytest.raises(ValueError, match="one seed per row"):
        row_keys([1, 2], prompt[None])


def _sequential(choose, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """The reference walk: from the root, follow the child whose token is the target's choice at
    the current node (``choose(node)``) while there is one; the path and the bonus token."""
    node, path = 0, [0]
    while True:
        choice = choose(node)
        child = next((c for c in range(1, len(tokens)) if parents[c] == node and tokens[c] == choice), None)
        if child is None:
            return path, choice
        path.append(child)
        node = child


@pytest.mark.parametrize("lazy", [False, True], ids=["all-nodes", "walk"])
@pytest.mark.parametrize("rows", [1, 3])
def test_rule_keeps_the_path_a_sequential_sampler_takes(rows, lazy, monkeypatch):
    """On trees whose tokens often agree with the draws, the rule keeps exactly the nodes a
    sequential Gumbel sampler walks through, and its bonus token is that sampler's next draw
    (draws at every node, or only where the walk goes)."""
    monkeypatch.setattr(gumbel, "LAZY_ELEMENTS", 0 if lazy else 1 << 30)
    vocab, temperature = 6, 0.8
    template = from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    generator = torch.Generator().manual_seed(1)
    rule = GumbelRule(lambda logits: logits / temperature, seeds=[7, 8, 9][:rows]).for_prompts(
        torch.tensor([[5, 4, 3]] * rows), None)
    accepted_any = 0
    for trial in range(60):
        logits = torch.randn(rows, template.size, vocab, generator=generator) * 2
        logits[..., :2] += 3  # the draws are mostly tokens 0 and 1, which the trees hold
        lengths = torch.randint(3, 30, (rows,), generator=generator)
        positions = lengths[:, None] + template.depths[None, :]  # (R, N) query positions
        # tokens 0 / 1, distinct among siblings (ranks 0 / 1, flipped per parent at random): often the draws
        flip = torch.randint(0, 2, (rows, template.size), generator=generator)
        tokens = (template.ranks[None, :] + flip[:, template.parents.clamp(min=0)]) % 2
        trees = TreeBatch.from_trees([template.with_tokens(tokens[row]) for row in range(rows)])
        batch_rows = list(range(rows))[::-1] if rows > 1 else [0]  # logits rows are batch rows 2, 1, 0
        result = rule.accept_batch(trees, logits, batch_rows, positions)
        for row in range(rows):
            key = rule.keys[batch_rows[row]]

            def choose(node, row=row, key=key):
                noise = gumbel_noise(key[None], positions[row, node][None] + 1, torch.arange(vocab))[0]
                return int((logits[row, node].double() / temperature + noise).argmax())

            path, bonus = _sequential(choose, trees.tokens[row].tolist(), trees.parents[row].tolist())
            assert result.paths[row, :int(result.lengths[row])].tolist() == path
            assert int(result.next_tokens[row]) == bonus
            accepted_any += len(path) - 1
    assert accepted_any > 20, "trees were rarely accepted: the walk was not exercised"


def test_rule_needs_rows_and_positions():
    rule = GumbelRule(lambda logits: logits, seeds=1)
    with pytest.raises(ValueError, match="for_prompts"):
        rule.first_tokens(torch.zeros(1, 4), [0], torch.tensor([2]))
    bound = rule.for_prompts(torch.tensor([[1, 2]]), None)
    with pytest.raises(ValueError, match="batch_rows and positions"):
        bound.first_tokens(torch.zeros(1, 4))


def test_coupled_candidates_hold_the_targets_draw_more_often_than_independent_ones():
    """Gumbel-top-k of a nearby draft distribution with the target's noise contains the target's
    draw far more often than the same number of tokens drawn independently from the draft."""
    generator = torch.Generator().manual_seed(3)
    target = torch.randn(DRAWS, 50, generator=generator)
    draft = target + 0.5 * torch.randn(DRAWS, 50, generator=generator)
    keys, positions = torch.full((DRAWS,), 5), torch.arange(DRAWS)
    draws = perturbed_argmax(target, keys, positions)
    coupled = perturbed_top_k(draft, keys, positions, 2)
    assert torch.equal(coupled[:, 0], perturbed_argmax(draft, keys, positions))
    independent = torch.multinomial(torch.softmax(draft, -1), 2, generator=generator)
    hit = lambda candidates: float((candidates == draws[:, None]).any(-1).float().mean())
    assert hit(coupled) > hit(independent) + 0.2, (hit(coupled), hit(independent))
    # the candidates are a draw without replacement: the first alone follows softmax(draft)
    row = draft[:1].expand(DRAWS, -1)
    first = perturbed_top_k(row, keys, positions, 3)[:, 0]
    probs = torch.softmax(draft[0], -1)
    assert chi_square_pvalue(first.tolist(), {token: float(p) for token, p in enumerate(probs)}) > FALSE_ALARM


def test_the_walk_equals_draws_at_every_node_with_repeated_sibling_tokens(monkeypatch):
    """Siblings may hold one token (merged trees): the walk follows every one of them and keeps the
    same deepest path as the rule with draws at every node."""
    template = from_choices([(0,), (1,), (2,), (0, 0), (1, 0), (1, 1), (2, 0), (1, 0, 0), (2, 0, 0)])
    generator = torch.Generator().manual_seed(4)
    rule = GumbelRule(lambda logits: logits, seeds=[1, 2]).for_prompts(torch.tensor([[3, 4], [5, 6]]), None)
    for _ in range(40):
        logits = torch.randn(2, template.size, 4, generator=generator)
        logits[..., :2] += 2
        tokens = torch.randint(0, 2, (2, template.size), generator=generator)
        trees = TreeBatch.from_trees([template.with_tokens(tokens[row]) for row in range(2)])
        positions = torch.tensor([[5], [9]]) + template.depths[None, :]
        results = []
        for lazy in (False, True):
            monkeypatch.setattr(gumbel, "LAZY_ELEMENTS", 0 if lazy else 1 << 30)
            results.append(rule.accept_batch(trees, logits, [1, 0], positions))
        eager, walked = results
        assert torch.equal(eager.lengths, walked.lengths) and torch.equal(eager.next_tokens, walked.next_tokens)
        for row in range(2):
            length = int(eager.lengths[row])
            assert eager.paths[row, :length].tolist() == walked.paths[row, :length].tolist()


def test_coupled_candidates_of_the_targets_own_logits_start_with_its_draw():
    rule = GumbelRule(lambda logits: logits / 0.7, seeds=[3, 4]).for_prompts(torch.tensor([[5, 6], [7, 8]]), None)
    logits = torch.randn(2, 5, 30, generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[4], [11]]) + torch.arange(5)[None, :]  # query positions
    draws = rule.choices(logits, [1, 0], positions)
    candidates = rule.coupled_candidates(logits, [1, 0], positions + 1, 3)  # the drawn tokens' positions
    assert candidates.shape == (2, 5, 3)
    assert torch.equal(candidates[..., 0], draws)


def test_host_noise_is_the_tensor_paths_to_one_unit_in_the_last_place():
    """On the host the words are hashed in numpy (one draw's stream in Python integers) and their
    logarithms taken in numpy; the words must be the tensor path's (the one a GPU runs) bit for bit,
    so a seeded call draws the same tokens on either (a different word moves the noise by far more
    than the logarithms' last-place rounding)."""
    from tree_attention import gumbel

    cases = [(torch.tensor([[123456789, -5, 2**62 + 7], [0, -(2**63), 99]]), torch.tensor([[17, 40, 0], [3, 2**40, 5]])),
             (torch.tensor([-(2**63) + 3]), torch.tensor([2**40 + 1])),  # one draw: the Python-integer stream
             (torch.tensor([[-7]]), torch.tensor([[0]]))]
    for keys, positions in cases:
        for tokens in (torch.arange(600), torch.randint(0, 50_000, (*keys.shape, 9))):
            stream = gumbel.mix(keys ^ gumbel.mix(positions + gumbel._POSITION))[..., None]
            words = gumbel.mix(stream + (tokens + 1) * gumbel.GOLDEN)
            expected = gumbel._shift(words, 11).double().add_(0.5).mul_(2.0 ** -53).log_().neg_().log_().neg_()
            noise = gumbel_noise(keys, positions, tokens)
            assert noise.shape == expected.shape and noise.dtype == torch.float64
            assert torch.allclose(noise, expected, rtol=1e-14, atol=1e-14)


def test_coupled_pool_reads_the_noise_of_a_few_tokens_and_keeps_the_targets_draw():
    """Among a row's pool of best warped draft tokens: with the target's own logits as the draft's,
    the first candidate is the target's draw whenever the pool holds it (here always: the draw is
    near the top of a peaked distribution); ids map through ``token_ids``."""
    rule = GumbelRule(lambda logits: logits / 0.7, seeds=[3, 4]).for_prompts(torch.tensor([[5, 6], [7, 8]]), None)
    logits = 4 * torch.randn(2, 5, 300, generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[4], [11]]) + torch.arange(5)[None, :]
    draws = rule.choices(logits, [1, 0], positions)
    candidates = rule.coupled_pool(logits, [1, 0], positions + 1, 3, pool=32)
    assert candidates.shape == (2, 5, 3) and torch.equal(candidates[..., 0], draws)
    assert torch.equal(candidates, rule.coupled_candidates(logits, [1, 0], positions + 1, 3))
    # a draft vocabulary: column c is target token ids[c]
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(1))
    draft = torch.empty_like(logits)
    draft[..., torch.argsort(ids)] = logits  # draft column c holds the target logit of token ids[c]
    mapped = rule.coupled_pool(draft, [1, 0], positions + 1, 3, pool=32, token_ids=ids)  # draft columns
    assert torch.equal(ids[mapped], candidates)


def test_noise_blocks_give_each_draws_own_noise_bit_for_bit():
    """A small vocabulary's noise is computed a block of positions at a time and kept: whatever order
    keys and positions are asked in (rows interleaved, positions repeated, going back, past a block),
    each entry is :func:`gumbel_noise`'s own."""
    blocks = gumbel.NoiseBlocks(40)
    generator = torch.Generator().manual_seed(2)
    keys = torch.tensor([11, -(2**62), 5])
    asked = [(torch.tensor([0]), torch.tensor([7])), (torch.tensor([0, 0, 0]), torch.tensor([8, 8, 9])),
             (torch.tensor([[0, 1], [2, 0]]), torch.tensor([[3, 900], [1, 7 + blocks.span]]))]
    asked += [(torch.randint(0, 3, (4, 5), generator=generator), torch.randint(0, 3 * blocks.span, (4, 5), generator=generator))
              for _ in range(20)]
    for rows, positions in asked:
        expected = gumbel_noise(keys[rows], positions, torch.arange(40)).reshape(-1, 40)
        assert torch.equal(torch.from_numpy(blocks.noise(keys[rows], positions)), expected)


@pytest.mark.parametrize("count", [1, 3])
def test_a_rule_reading_noise_blocks_draws_what_one_draw_at_a_time_draws(count, monkeypatch):
    """The rule over a small vocabulary reads blocks; with blocks off (each draw's noise alone) every
    draw and coupled candidate is the same, -inf entries (top-k) never drawn."""
    logits = 3 * torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(4))
    logits[1, :, 10:] = -math.inf  # a truncated row
    positions = torch.tensor([[4], [11], [2]]) + torch.arange(4)[None, :]

    def draws():
        rule = GumbelRule(lambda logits: logits / 0.9, seeds=[3, 4, 5]).for_prompts(torch.tensor([[5, 6], [7, 8], [1, 2]]), None)
        return [rule.choices(logits, [2, 0, 1], positions + shift) for shift in (0, 1, 5, 1)] + [
            rule.coupled_candidates(logits, [2, 0, 1], positions + 1, count)]

    with_blocks = draws()
    assert gumbel.NOISE_BLOCK // 50 >= 2
    monkeypatch.setattr(gumbel, "NOISE_BLOCK", 1)
    without = draws()
    assert all(torch.equal(a, b) for a, b in zip(with_blocks, without))
    assert (with_blocks[0][1] < 10).all()
