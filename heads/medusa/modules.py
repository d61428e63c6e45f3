"""Medusa heads: ``K`` extra next-next-token predictors on the backbone's top-layer features.

Head ``k`` (0-based) reads the feature at position ``t`` and predicts the token at ``t + k + 2``
(the backbone's own head predicts ``t + 1``). Each head is ``num_layers`` residual blocks
``x + SiLU(W x + b)`` followed by a vocabulary projection. The blocks start at zero and the
projection starts as a copy of the backbone's output head, so an untrained head predicts what the
backbone predicts for the next token. With ``share_lm_head=True`` the heads use the backbone's
frozen output head instead of ``K`` trainable copies (``K x V x d`` fewer parameters).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import MedusaConfig


class ResidualBlock(nn.Module):
    """``x + SiLU(W x + b)``, zero-initialised so it starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., d)
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """The trainable drafter: ``K`` heads mapping features ``[..., d]`` to logits ``[K, ..., V]``."""

    def __init__(self, config: MedusaConfig, hidden_size: int, vocab_size: int,
                 output_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResidualBlock(hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        if config.share_lm_head:
            self.projections = None
        else:
            self.projections = nn.ModuleList(
                nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(config.num_heads)
            )
            if output_head is not None:
                with torch.no_grad():
                    for projection in self.projections:
                        projection.weight.copy_(output_head.weight)

    def forward(self, features: torch.Tensor,
                shared_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
                count: int | None = None) -> torch.Tensor:
        """Logits ``[K, ..., V]`` from features ``[..., d]`` (only the first ``count`` heads if given).

        ``shared_logits`` maps a head's hidden state to logits when ``share_lm_head`` is set (the
        backbone's own output head, with its post-processing); it is required then.
        """
        outputs = []
        for index, block in enumerate(self.blocks[:count]):
            hidden = block(features)
            if self.projections is not None:
                outputs.append(self.projections[index](hidden))
            else:
                if shared_logits is None:
                    raise ValueError("share_lm_head=True: pass the backbone's output head as shared_logits")
                outputs.append(shared_logits(hidden))
        return torch.stack(outputs)
