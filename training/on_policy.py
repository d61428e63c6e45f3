"""On-policy data (DistillSpec): prompts followed by what speculative generation with the
*current* drafter produces at the serving temperature; the trainer re-scores them with the target.
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
    target_forwards: int = 0

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
