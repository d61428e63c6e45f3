"""Limits of the model and of the tree (issue 15 item 7): the position limit of an
absolute-position family (GPT-2's n_positions) with EAGLE and with ``speculate="auto"``, Medusa
with six or more heads, tree ranks beyond the vocabulary."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import heads
from tests.conftest import VOCAB, build_model, greedy_reference, random_prompt
from tree_attention.tree import PRIOR_ACCURACY, default_tree, prior_accuracy

POSITIONS = 64


@pytest.fixture(scope="module")
def short_gpt2():
    """A tiny GPT-2 with 64 learned positions: position ids >= 64 raise IndexError."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=POSITIONS))
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _perturbed(spec, seed: int = 1):
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in spec.heads.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return spec


@pytest.mark.parametrize("prompt_length, new_tokens", [(20, 44), (56, 8), (62, 2)])
@pytest.mark.parametrize("options", [dict(), dict(depth=6, top_k=2, total_tokens=12)], ids=["chain", "tree"])
def test_eagle_reaches_the_last_position(short_gpt2, prompt_length, new_tokens, options):
    """prompt + new == n_positions raised IndexError in the drafter's expansions past the limit."""
    spec = _perturbed(heads.attach_heads(short_gpt2, kind="eagle", **options))
    prompt = random_prompt(prompt_length, seed=prompt_length)
    expected = greedy_reference(short_gpt2, prompt, new_tokens)
    assert torch.equal(spec.generate(prompt, max_new_tokens=new_tokens), expected)
    assert expected.shape[1] == POSITIONS


@pytest.mark.parametrize("prompt_length", [40, 56, 60, 63])
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_auto_speculation_calibrates_inside_the_position_limit(short_gpt2, kind, prompt_length):
    """Calibration ran seven steps past the prompt whatever the limit: IndexError in the policy."""
    spec = _perturbed(heads.attach_heads(short_gpt2, kind=kind))
    prompt = random_prompt(prompt_length, seed=prompt_length)
    new_tokens = min(4, POSITIONS - prompt_length)
    output = spec.generate(prompt, max_new_tokens=new_tokens, speculate="auto")
    assert torch.equal(output, greedy_reference(short_gpt2, prompt, new_tokens))
    assert spec.last_stats.speculation["auto"] is True


def test_auto_generates_nothing_beyond_the_call(short_gpt2, monkeypatch):
    """``speculate="auto"`` measures inside the call's own steps: it never runs the backbone's
    ``generate`` on the side (which once went past max_new_tokens and the position limit); every
    target forward is one of the call's steps."""
    spec = _perturbed(heads.attach_heads(short_gpt2, kind="medusa", num_heads=3))
    prompt = random_prompt(10, seed=3)
    expected = {count: greedy_reference(short_gpt2, prompt, count) for count in (1, 3, 9, POSITIONS - 10)}
    original, calls = short_gpt2.generate, []

    def counted(*args, **kwargs):
        calls.append(kwargs["generation_config"].max_new_tokens)
        return original(*args, **kwargs)

    monkeypatch.setattr(short_gpt2, "generate", counted)
    for count in (1, 3, 9, 9, POSITIONS - 10):
        calls.clear()
        output = spec.generate(prompt, max_new_tokens=count, speculate="auto")
        assert torch.equal(output, expected[count]), count
        stats = spec.last_stats
        assert not calls
        assert stats.target_forwards == len(stats.steps) + 1  # the prefill, then the call's own steps
        if count == 1:
            assert not stats.steps  # the prefill's token is the whole call



@pytest.mark.parametrize("num_heads", [6, 8])
def test_medusa_with_six_or_more_heads(num_heads):
    """The prior accuracy table covered 5 depths: attach_heads(num_heads=6) raised InvalidTreeError."""
    model = build_model("llama", seed=1)
    spec = _perturbed(heads.attach_heads(model, num_heads=num_heads, tree=32))
    assert spec.tree.max_depth <= num_heads and spec.tree.size == 33
    prompt = random_prompt(7, seed=4)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), greedy_reference(model, prompt, 12))


def test_prior_accuracy_extends_geometrically():
    assert prior_accuracy(5) == PRIOR_ACCURACY
    table = prior_accuracy(9)
    top1 = [row[0] for row in table]
    assert top1[:5] == [row[0] for row in PRIOR_ACCURACY]
    assert all(later < earlier for earlier, later in zip(top1, top1[1:]))
    assert top1[5] == pytest.approx(0.2 * 0.8) and top1[8] == pytest.approx(0.2 * 0.8 ** 4)
    assert default_tree(64, 12).max_depth <= 12


def test_a_tree_rank_beyond_the_vocabulary_is_refused_up_front():
    """A rank >= vocab was accepted and failed later inside generate (topk out of range)."""
    model = build_model("llama", seed=1)
    with pytest.raises(heads.InvalidTreeError, match=f"tree rank {VOCAB} needs the top {VOCAB + 1} candidates"):
        heads.attach_heads(model, num_heads=2, tree=[[0], [VOCAB]])
    spec = heads.attach_heads(model, num_heads=2, tree=[[0], [VOCAB - 1]])  # the last rank is fine
    with pytest.raises(heads.InvalidTreeError, match="the vocabulary has 96 tokens"):
        spec.set_tree([[0], [0, 200]])
    assert spec.tree.max_rank == VOCAB - 1  # unchanged by the refused set_tree
