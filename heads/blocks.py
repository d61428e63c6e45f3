"""Small trainable blocks that more than one drafter kind builds on."""

from __future__ import annotations

import torch
from torch import nn


class ResidualBlock(nn.Module):
    """``x + SiLU(W x + b)``, zero-initialised so it starts as the identity (Medusa's head block;
    also EAGLE's parallel heads)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., d)
        return x + nn.functional.silu(self.linear(x))
