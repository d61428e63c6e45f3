"""Draft vocabularies: drafters that score only the target's most frequent tokens.

A drafter's output head over the whole vocabulary is the largest tensor it reads per step: on
demo-llama (8192 tokens, width 256) each of Medusa's four heads reads an 8 MB projection, 5 ms of a
19 ms step on this machine's CPU. The tokens a target actually writes are few: a draft vocabulary of
its most frequent training tokens (EAGLE-3 drafts over 32k of Llama 3's 128k) makes every draft
cheaper, and the target verifies every drafted token, so a token left out only costs acceptance
where the target would have written it. Shared by the kinds that offer it (``draft_vocab_size``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .draft_vocab_flags import DRAFT_VOCAB_FROM, DRAFT_VOCAB_SHARE, auto_draft_vocab, draft_vocab  # noqa: F401


def frequent_tokens(sequences: Sequence[torch.Tensor], vocab_size: int, count: int) -> torch.Tensor:
    """The ``count`` most frequent token ids among the predicted tokens (positions >= 1) of
    ``sequences``, most frequent first; ties and unseen ids go by increasing id. ``[count]`` long."""
    if count > vocab_size:
        raise ValueError(f"draft vocabulary of {count} tokens exceeds the vocabulary ({vocab_size})")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sequence in sequences:
        counts += torch.bincount(sequence[1:].long().cpu(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices
    return order[:count].clone()


def vocabulary_swaps(token_map: torch.Tensor, counts: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How a draft vocabulary ``token_map`` ``[V']`` follows traffic whose predicted tokens were counted in
    ``counts`` ``[V]``: ``(positions, token_ids)``, at most ``limit`` of each, ``token_map[positions]`` to be
    replaced by ``token_ids``. The most frequent tokens the vocabulary lacks come in (at least twice seen)
    in place of its least frequent ones, a pair only where the newcomer was seen more often; positions and
    ids are distinct and the ids are not in ``token_map``."""
    token_map = token_map.to(counts.device)
    inside = torch.zeros_like(counts, dtype=torch.bool)
    inside[token_map] = True
    outside_counts = torch.where(inside, torch.full_like(counts, -1), counts)
    incoming = torch.sort(-outside_counts, stable=True).indices[:limit]  # most frequent outside first
    incoming = incoming[counts[incoming] >= 2]
    outgoing = torch.sort(counts[token_map], stable=True).indices[:incoming.numel()]  # rarest inside first
    keep = counts[incoming] > counts[token_map[outgoing]]  # both sorted: a prefix of the pairs
    return outgoing[keep].clone(), incoming[keep].clone()


def check_token_map(token_ids: torch.Tensor, size: int) -> torch.Tensor:
    """``token_ids`` as a long tensor of ``size`` distinct ids (ValueError otherwise)."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    if token_ids.shape != (size,) or token_ids.unique().numel() != token_ids.numel():
        raise ValueError(f"token_map must hold {size} distinct ids; got shape {tuple(token_ids.shape)}")
    return token_ids


def full_vocabulary_logits(logits: torch.Tensor, token_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits ``[..., V']`` (ids ``token_map``) as logits over the whole vocabulary
    ``[..., vocab_size]``, ``-inf`` elsewhere: a distribution with no probability outside the draft
    vocabulary, as the lossless sampling rule needs q. Unchanged without a draft vocabulary."""
    if token_map is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), -torch.inf)
    return full.index_copy_(-1, token_map, logits)
