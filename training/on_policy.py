"""On-policy data (DistillSpec): prompts followed by what speculative generation with the
*current* drafter produces at the serving temperature (:func:`generate_on_policy_data`), or, for a
separate draft model, what the draft itself samples (:func:`sample_model_data`); the trainer
re-scores them with the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class OnPolicyData:
    """Sequences from `generate_on_policy_data` and the drafter's tau while producing them."""

    sequences: list[torch.Tensor] = field(default_factory=list)
    """1D LongTensors ``[prompt_len + new_len]``, on the CPU."""
    new_tokens: int = 0
    target_forwards: float = 0
    """Target forwards that produced the tokens (draft-model data: the expected count, see
    :func:`sample_model_data`)."""
    acceptance: float | None = None
    """Draft-model data only: the draft's mean per-token acceptance probability on its samples."""

    @property
    def tau(self) -> float:
        """Tokens committed per target forward (bonus token and prefill included)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0


@torch.no_grad()
def generate_on_policy_data(
    spec: Any,
    prompt_ids: Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    first_index: int = 0,
) -> OnPolicyData:
    """On-policy data: each prompt followed by what ``spec.generate`` produces with its current
    drafter, greedy when ``temperature == 0``, else sampled at ``temperature`` (top_k=0,
    top_p=1.0). The trainer re-scores these sequences with the target, so the drafter learns the
    target's distribution on the contexts it visits when serving at that temperature.

    ``prompt_ids`` are 1D LongTensors ``[prompt_len]``. Prompt ``i`` draws from its own
    ``torch.Generator`` seeded with ``seed`` and ``first_index + i``, so a prompt's sequence does
    not depend on which other prompts are generated with it (e.g. by another process) and the
    global RNG is untouched. A continuation ends at the first eos (kept) or ``max_new_tokens``.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    sampled = temperature > 0
    settings = dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0) if sampled else {}
    data = OnPolicyData()
    for offset, ids in enumerate(prompt_ids):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"prompt_ids[{offset}] must be a non-empty 1D tensor of token ids")
        generator = None
        if sampled:
            generator = torch.Generator(device=spec.target.device)
            generator.manual_seed(seed * 1_000_003 + first_index + offset)
        output = spec.generate(ids[None].long(), max_new_tokens=max_new_tokens, generator=generator, **settings)
        data.sequences.append(output[0].cpu())
        data.new_tokens += spec.last_stats.new_tokens
        data.target_forwards += spec.last_stats.target_forwards
    return data


def chain_tau(alpha: float, depth: int) -> float:
    """Expected tokens per target forward of a chain of ``depth`` drafted tokens, each accepted
    with probability ``alpha`` independently (Leviathan et al. 2023): ``(1 - alpha^(depth+1)) / (1 - alpha)``."""
    if alpha >= 1.0:
        return float(depth + 1)
    return (1.0 - alpha ** (depth + 1)) / (1.0 - alpha)


@torch.no_grad()
def acceptance_rate(target, draft, sequences: Sequence[torch.Tensor], prompt_lengths: Sequence[int],
                    temperature: float) -> float:
    """Mean per-token acceptance probability of ``draft`` against ``target`` over the generated
    positions of ``sequences`` (1D, prompt first): ``sum_v min(p, q)`` at ``temperature`` (the
    probability that a token drawn from q is accepted by the lossless rule), or at 0 whether the
    greedy tokens agree."""
    device = next(target.parameters()).device
    total, count = 0.0, 0
    for sequence, start in zip(sequences, prompt_lengths):
        if sequence.numel() <= start:
            continue
        ids = sequence[None].to(device)
        p = target(input_ids=ids, use_cache=False).logits[0, start - 1:-1].float()  # (new, V)
        q = draft(input_ids=ids, use_cache=False).logits[0, start - 1:-1].float()
        if temperature > 0:
            rates = torch.minimum(torch.softmax(p / temperature, -1), torch.softmax(q / temperature, -1)).sum(-1)
        else:
            rates = (p.argmax(-1) == q.argmax(-1)).float()
        total += float(rates.sum())
        count += rates.numel()
    return total / count if count else 0.0


@torch.no_grad()
def sample_model_data(
    model: Any,
    prompt_ids: Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    first_index: int = 0,
    eos_token_ids: Sequence[int] = (),
    target: Any = None,
    depth: int = 1,
) -> OnPolicyData:
    """On-policy data of a draft model (DistillSpec): each prompt followed by what ``model`` itself
    samples at ``temperature`` (0: its greedy tokens; no top-k/top-p), token by token with its KV
    cache, ending at the first ``eos_token_ids`` token (kept) or ``max_new_tokens``.

    Prompt ``i`` draws from its own generator seeded with ``seed`` and ``first_index + i``, as
    :func:`generate_on_policy_data`. With ``target``, ``tau`` reports the expected tokens per
    target forward of a chain of ``depth`` drafted tokens at the draft's mean acceptance
    probability on these samples (:func:`acceptance_rate`, :func:`chain_tau`): ``target_forwards``
    is then that expected count, not a measured one.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    from tree_attention.cache import cache_keyword

    device = next(model.parameters()).device
    keyword = cache_keyword(model)  # "cache" or "past_key_values", as this transformers takes it
    stops = set(int(token) for token in eos_token_ids)
    was_training = model.training
    model.eval()
    data = OnPolicyData()
    try:
        for offset, ids in enumerate(prompt_ids):
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
                raise ValueError(f"prompt_ids[{offset}] must be a non-empty 1D tensor of token ids")
            generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + first_index + offset)
            tokens = ids[None].long().to(device)
            output = model(input_ids=tokens, use_cache=True)
            new: list[int] = []
            while True:
                logits = output.logits[0, -1].float()
                if temperature > 0:
                    token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
                else:
                    token = int(logits.argmax())
                new.append(token)
                if token in stops or len(new) >= max_new_tokens:
                    break
                cache = output[keyword] if keyword in output else output.past_key_values
                output = model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **{keyword: cache})
            data.sequences.append(torch.cat([ids.long().cpu(), torch.tensor(new, dtype=torch.long)]))
            data.new_tokens += len(new)
            data.target_forwards += len(new)
        if target is not None and data.new_tokens:
            alpha = acceptance_rate(target, model, data.sequences, [ids.numel() for ids in prompt_ids], temperature)
            data.acceptance = alpha
            data.target_forwards = data.new_tokens / chain_tau(alpha, depth)
    finally:
        model.train(was_training)
    return data
