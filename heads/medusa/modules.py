"""Medusa heads: ``K`` extra next-next-token predictors on the backbone's top-layer features.

Head ``k`` (0-based) reads the feature at position ``t`` and predicts the token at ``t + k + 2``
(the backbone's own head predicts ``t + 1``). Each head is ``num_layers`` residual blocks
``x + SiLU(W x + b)`` followed by a vocabulary projection. The blocks start at zero and the
projection starts as a copy of the backbone's output head, so an untrained head predicts what the
backbone predicts for the next token. With ``share_lm_head=True`` the heads use the backbone's
frozen output head instead of ``K`` trainable copies (``K x V x d`` fewer parameters). With
``draft_vocab_size`` ``V'`` the projections score only the ``V'`` tokens of ``token_map`` (a buffer
that travels in the adapter), started from those rows of the output head (:mod:`heads.draft_vocab`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..blocks import ResidualBlock
from ..draft_vocab import check_token_map, full_vocabulary_logits
from .config import MedusaConfig


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
        draft = config.draft_vocab_size
        if draft is not None and draft > vocab_size:
            raise ValueError(f"MedusaConfig.draft_vocab_size ({draft}) exceeds the backbone's vocabulary ({vocab_size})")
        if draft is not None:
            self.register_buffer("token_map", torch.arange(draft))
        else:
            self.token_map = None
        if config.share_lm_head:
            self.projections = None
        else:
            self.projections = nn.ModuleList(
                nn.Linear(hidden_size, draft or vocab_size, bias=False) for _ in range(config.num_heads)
            )
            if output_head is not None:
                self.copy_output_rows(output_head)

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the heads score (the whole vocabulary without a draft vocabulary)."""
        return self.vocab_size if self.token_map is None else int(self.token_map.numel())

    @torch.no_grad()
    def copy_output_rows(self, output_head: nn.Module) -> None:
        """Start every projection as the output head's rows of the tokens the heads score."""
        rows = output_head.weight if self.token_map is None else output_head.weight[self.token_map]
        for projection in self.projections:
            projection.weight.copy_(rows)

    def set_token_map(self, token_ids: torch.Tensor, output_head: nn.Module | None = None) -> None:
        """Score the tokens ``token_ids`` ``[V']`` (distinct target ids); with ``output_head``, the
        projections restart from its rows of those tokens (before training)."""
        if self.token_map is None:
            raise ValueError("set_token_map: these Medusa heads have no draft vocabulary (draft_vocab_size=None)")
        self.token_map.copy_(check_token_map(token_ids, self.draft_vocab_size))
        if output_head is not None and self.projections is not None:
            self.copy_output_rows(output_head)

    @torch.no_grad()
    def replace_tokens(self, positions: torch.Tensor, token_ids: torch.Tensor, output_head: nn.Module) -> None:
        """Score ``token_ids`` ``[n]`` (target ids not in ``token_map``) at draft ids ``positions`` ``[n]``
        instead of the tokens there; their projection rows restart from the output head's rows, as a
        fresh head's do (online learning's vocabulary that follows traffic, ``heads.draft_vocab``)."""
        if self.token_map is None:
            raise ValueError("replace_tokens: these Medusa heads have no draft vocabulary (draft_vocab_size=None)")
        self.token_map[positions] = token_ids.to(self.token_map.device)
        check_token_map(self.token_map, self.draft_vocab_size)
        for projection in self.projections or ():
            projection.weight[positions] = output_head.weight[token_ids].to(projection.weight.dtype)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids (the identity without a draft vocabulary)."""
        return draft_ids if self.token_map is None else self.token_map[draft_ids]

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V']`` over the whole vocabulary ``[..., V]``, ``-inf`` outside the draft
        vocabulary (a distribution with no probability there); unchanged without one."""
        return full_vocabulary_logits(logits, self.token_map, self.vocab_size)

    def forward(self, features: torch.Tensor,
                shared_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
                count: int | None = None) -> torch.Tensor:
        """Logits ``[K, ..., V']`` from features ``[..., d]`` (only the first ``count`` heads if given;
        ``V'``: the draft vocabulary, ids in ``token_map``).

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
