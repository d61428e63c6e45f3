"""The online learner's memo of backbone outputs (training/replay.py BackboneMemo): what a hook reads
through it equals a fresh backbone forward, whatever rows it already held, and it stays bounded."""

from __future__ import annotations

import pytest
import torch

import heads
from tests.conftest import build_model
from training.online import learn
from training.replay import BackboneMemo
from training.sequences import collate


def _sequences(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (int(length),), generator=generator)
            for length in torch.randint(4, 20, (count,), generator=generator)]


def test_memo_outputs_equal_a_fresh_forward_whatever_it_held():
    calls = []

    def compute(input_ids, attention_mask):  # a per-row function of the unpadded tokens, as a causal backbone
        calls.append(input_ids.shape)
        values = (input_ids.float().cumsum(-1) * attention_mask)[..., None].repeat(1, 1, 3)
        return values, input_ids[..., None] * 2

    sequences = _sequences(6)
    memo = BackboneMemo(2 ** 20)
    ids, mask = collate(sequences[:4], 0)
    first = memo.outputs([0, 1, 2, 3], ids, mask, compute)
    assert calls == [ids.shape] and memo.misses == 4
    ids, mask = collate([sequences[index] for index in (5, 2, 4, 0)], 0)
    second = memo.outputs([5, 2, 4, 0], ids, mask, compute)
    longest = max(sequences[5].numel(), sequences[4].numel())
    assert calls[1] == (2, longest) and memo.hits == 2  # only the rows it lacked, padded to their own longest
    fresh = compute(ids, mask)
    for got, want in zip(second, fresh):
        assert got.shape == want.shape
        assert torch.equal(got * mask[..., None].to(got.dtype), want * mask[..., None].to(want.dtype))
    length = sequences[0].numel()
    assert torch.equal(first[0][0, :length], fresh[0][3, :length])


def test_memo_is_bounded_and_drops_what_the_buffer_dropped():
    def compute(input_ids, attention_mask):
        return (torch.ones(*input_ids.shape, 8),)  # 32 bytes a token

    memo = BackboneMemo(max_bytes=32 * 40)
    sequences = [torch.arange(3, 13)] * 6  # 10 tokens: 320 bytes each
    for key, sequence in enumerate(sequences):
        ids, mask = collate([sequence], 0)
        memo.outputs([key], ids, mask, compute)
        assert memo.bytes <= memo.max_bytes
    assert list(memo.rows) == [2, 3, 4, 5]  # the oldest dropped first
    memo.retain([3, 5, 9])
    assert list(memo.rows) == [3, 5] and memo.bytes == 640
    with pytest.raises(ValueError, match="max_bytes"):
        BackboneMemo(-1)


@pytest.mark.parametrize("kind, options", [
    ("medusa", {"num_heads": 2, "tree": 8}),
    ("eagle", {"total_tokens": 8, "depth": 3, "top_k": 2, "feature_layers": (0, 1, 2), "draft_vocab_size": 64}),
])
def test_hook_losses_and_accuracy_through_the_memo_equal_fresh_ones(kind, options):
    model = build_model("llama", eos=5)
    spec = heads.attach_heads(model, kind=kind, **options)
    learner = learn(spec, budget=0.0)
    for sequence in _sequences(12, seed=1):
        learner.buffer.add(sequence)
    batch = learner.buffer.sample(4, torch.Generator().manual_seed(0))
    keys, sequences = [key for key, _ in batch], [sequence for _, sequence in batch]
    ids, mask = learner._collate(sequences)
    hook, memo = learner.hook, learner.memo
    torch.manual_seed(0)
    with torch.no_grad():
        cold, _ = hook.micro_loss(spec.heads, ids, mask, keys, 0)  # fills the memo
        warm, _ = hook.micro_loss(spec.heads, ids, mask, keys, 0)  # reads it
        object.__setattr__(hook.context, "backbone_memo", None)
        fresh, _ = hook.micro_loss(spec.heads, ids, mask, keys, 0)
        object.__setattr__(hook.context, "backbone_memo", memo)
    assert memo.hits >= len(keys)
    torch.testing.assert_close(warm, fresh)
    torch.testing.assert_close(cold, fresh)
    learner._held_view[:] = learner.buffer.held_sequences()
    learner._held_keys[:] = [key for key, _ in learner.buffer.held]
    through_memo = hook.rank_accuracy(4)
    object.__setattr__(hook.context, "backbone_memo", None)
    torch.testing.assert_close(torch.tensor(through_memo), torch.tensor(hook.rank_accuracy(4)))
