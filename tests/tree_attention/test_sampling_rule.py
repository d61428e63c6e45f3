"""Lossless multi-candidate speculative sampling on crafted distributions (no model)."""

from __future__ import annotations

import pytest
import torch

from tests.stats import FALSE_ALARM, chi_square_pvalue
from tree_attention.tree import Tree, from_choices
from tree_attention.verify import sample_accept, typical_accept

V = 6
TRIALS = 6000


def _distribution(*values) -> torch.Tensor:
    probs = torch.tensor(values, dtype=torch.float32)
    return probs / probs.sum()


# target distributions per node of the tree root -> {(0,), (1,), (0, 0)}; node tokens below
P = torch.stack([
    _distribution(0.40, 0.25, 0.15, 0.10, 0.06, 0.04),  # root
    _distribution(0.05, 0.50, 0.20, 0.10, 0.10, 0.05),  # node (0,) = token 0
    _distribution(0.30, 0.30, 0.10, 0.10, 0.10, 0.10),  # node (1,) = token 1
    _distribution(0.10, 0.10, 0.10, 0.10, 0.10, 0.50),  # node (0, 0) = token 1 after 0
])
TEMPLATE = from_choices([(0,), (1,), (0, 0)])
TOKENS = torch.tensor([3, 0, 1, 1])
NODE_OF_FIRST = {0: 1, 1: 2}  # first emitted token -> the node it reaches


def _emitted(tree: Tree, acceptance) -> list[int]:
    return tree.tokens[acceptance.path][1:].tolist() + [acceptance.next_token]


def _check(samples_first, samples_second_by_first, alpha=FALSE_ALARM) -> list[float]:
    pvalues = [chi_square_pvalue(samples_first, {t: float(P[0, t]) for t in range(V)})]
    for first, seconds in samples_second_by_first.items():
        node = NODE_OF_FIRST[first]
        pvalues.append(chi_square_pvalue(seconds, {t: float(P[node, t]) for t in range(V)}))
    return pvalues


def _run(use_residual=True, draft=False, trials=TRIALS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    first, second = [], {0: [], 1: []}
    q = _distribution(0.5, 0.3, 0.05, 0.05, 0.05, 0.05)
    for _ in range(trials):
        if draft:  # children sampled i.i.d. from q: a chain of two drafted tokens below the root
            tokens = [3] + torch.multinomial(q, 2, replacement=True, generator=generator).tolist()
            tree = Tree.from_parents(torch.tensor(tokens), [-1, 0, 1])
            probs = torch.stack([P[0], P[1], P[3]])  # only the first emitted token is checked here
            tree = Tree(tree.tokens, tree.parents, tree.depths, tree.ancestors, q.expand(3, V).clone())
        else:
            tree, probs = TEMPLATE.with_tokens(TOKENS), P
        acceptance = sample_accept(tree, probs, generator, tree.draft_probs, use_residual)
        emitted = _emitted(tree, acceptance)
        first.append(emitted[0])
        if emitted[0] in second and len(emitted) > 1:
            second[emitted[0]].append(emitted[1])
    return first, second


def test_deterministic_candidates_follow_the_target():
    first, second = _run()
    assert min(_check(first, second)) > FALSE_ALARM
    assert len(second[0]) > 1000 and len(second[1]) > 500  # both branches exercised


def test_sampled_candidates_follow_the_target():
    first, _ = _run(draft=True)
    assert chi_square_pvalue(first, {t: float(P[0, t]) for t in range(V)}) > FALSE_ALARM


@pytest.mark.parametrize("draft", [False, True])
def test_skipping_the_residual_is_caught(draft):
    first, second = _run(use_residual=False, draft=draft)
    assert chi_square_pvalue(first, {t: float(P[0, t]) for t in range(V)}) < FALSE_ALARM


def test_seeded_determinism():
    assert _run(trials=200, seed=5) == _run(trials=200, seed=5)


def test_typical_threshold_zero_accepts_the_draft_argmax_path():
    template = from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    tree = template.with_tokens(torch.tensor([0, 1, 2, 3, 4, 5]))
    probs = torch.full((6, V), 1.0 / V)
    acceptance = typical_accept(tree, probs, posterior_threshold=0.0, posterior_alpha=0.3)
    assert acceptance.path.tolist() == [0, 1, 3, 5]  # ranks (0,), (0, 0), (0, 0, 0)


def test_typical_huge_threshold_is_plain_sampling():
    generator = torch.Generator().manual_seed(3)
    tree = TEMPLATE.with_tokens(TOKENS)
    first = []
    for _ in range(3000):
        acceptance = typical_accept(tree, P, posterior_threshold=1e9, posterior_alpha=1e9, generator=generator)
        assert acceptance.path.tolist() == [0]
        first.append(acceptance.next_token)
    assert chi_square_pvalue(first, {t: float(P[0, t]) for t in range(V)}) > FALSE_ALARM


@pytest.mark.parametrize("drafted", [False, True])
def test_lazy_node_distributions_decide_as_the_whole_batch_does(drafted):
    """A step with large logits computes the target's distribution only at the nodes the rule visits;
    with the same draws it accepts exactly what the rule on all nodes' distributions accepts."""
    depths = set()
    for seed in range(40):
        eager, lazy = _lazy_case(drafted, seed)
        assert torch.equal(eager.paths, lazy.paths) and torch.equal(eager.lengths, lazy.lengths)
        assert torch.equal(eager.next_tokens, lazy.next_tokens)
        assert eager.chunks == lazy.chunks
        tokens = _lazy_trees(seed)[0]
        for row, (path, length) in enumerate(zip(eager.paths.tolist(), eager.lengths.tolist())):
            # each row's host chunk: the kept path's tokens, root first, then the bonus token
            assert eager.chunks[row] == tokens[row][path[:length]].tolist() + [int(eager.next_tokens[row])]
        depths.update(eager.lengths.tolist())
    assert len(depths) > 1  # some drafts were accepted, some rejected


def _lazy_trees(seed: int):
    generator = torch.Generator().manual_seed(seed)
    rows, vocab = 3, 40
    template = from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    logits = torch.randn(rows, template.size, vocab, generator=generator) * 2
    tokens = torch.randint(0, 4, (rows, template.size), generator=generator)  # small ids: often accepted
    return tokens, logits, template, generator


def _lazy_case(drafted: bool, seed: int):
    from tree_attention.tree import TreeBatch
    from tree_attention.verify import SamplingRule, sample_accept_batch

    tokens, logits, template, generator = _lazy_trees(seed)
    rows, vocab = logits.shape[0], logits.shape[-1]
    trees = TreeBatch.from_template(template.to("cpu"), tokens)
    if drafted:
        q = torch.softmax(torch.randn(rows, template.size, vocab, generator=generator), dim=-1)
        trees = TreeBatch(trees.tokens, trees.parents, trees.depths, trees.visibility, trees.sizes, q,
                          uniform=True, depth=trees.depth)
    rule = SamplingRule(lambda values: values / 0.7)
    probs = rule.probabilities(logits.reshape(-1, vocab)).view(logits.shape)
    eager = sample_accept_batch(trees, probs, torch.Generator().manual_seed(seed), trees.draft_probs)
    lazy = sample_accept_batch(trees, logits, torch.Generator().manual_seed(seed), trees.draft_probs,
                               probabilities=rule.probabilities)
    return eager, lazy
