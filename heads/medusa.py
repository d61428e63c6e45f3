"""Medusa heads: ``K`` extra next-next-token predictors on the backbone's top-layer features.

Head ``k`` (0-based) reads the feature at position ``t`` and predicts the token at ``t + k + 2``
(the backbone's own head predicts ``t + 1``). Each head is ``num_layers`` residual blocks
``x + SiLU(W x + b)`` followed by a vocabulary projection. The blocks start at zero and the
projection starts as a copy of the backbone's output head, so an untrained head predicts what the
backbone predicts for the next token. With ``share_lm_head=True`` the heads use the backbone's
frozen output head instead of ``K`` trainable copies (``K x V x d`` fewer parameters).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from tree_attention.tree import Tree, TreeTemplate, default_tree, from_choices


@dataclass
class MedusaConfig:
    """Hyper-parameters of a set of Medusa heads."""

    num_heads: int = 4
    """Number of heads K; head k predicts the token k + 2 positions ahead."""
    num_layers: int = 1
    """Residual blocks per head."""
    share_lm_head: bool = False
    """Use the backbone's frozen output head instead of one trainable projection per head."""
    tree: Sequence[Sequence[int]] | int | None = None
    """Verification tree: a choice list of rank paths, or a node count for a default tree (None: 16)."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MedusaConfig.{name} must be a positive int; got {value!r}")
        if self.tree is not None and not isinstance(self.tree, int):
            self.tree = [list(path) for path in self.tree]

    def to_dict(self) -> dict:
        return asdict(self)


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


def resolve_tree(tree: Sequence[Sequence[int]] | int | None, num_heads: int,
                 accuracy: Sequence[Sequence[float]] | None = None) -> TreeTemplate:
    """A tree template from a choice list, or a default tree of ``tree`` drafted nodes."""
    if tree is None:
        tree = 16
    if isinstance(tree, bool) or not isinstance(tree, (int, list, tuple)):
        raise ValueError(f"tree must be a node count or a list of rank paths; got {tree!r}")
    if isinstance(tree, int):
        if tree < 0:
            raise ValueError(f"tree size must be >= 0; got {tree}")
        return default_tree(tree, num_heads, accuracy)
    return from_choices(tree, max_depth=num_heads)


class MedusaDrafter:
    """Fills a static tree with the heads' ranked candidates (``tree_attention.decode.Drafter``).

    The node at depth ``d`` with rank ``r`` takes head ``d - 1``'s ``r``-th most likely token.
    """

    def __init__(self, heads: MedusaHeads, template: TreeTemplate,
                 shared_logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.heads = heads
        self.shared_logits = shared_logits
        self.set_template(template)

    def set_template(self, template: TreeTemplate) -> None:
        device = next(self.heads.parameters()).device
        self.template = template.to(device)
        self.top_k = template.max_rank + 1
        # flat index into the (K, top_k) candidate table for every non-root node
        nodes = self.template.depths[1:]
        self._candidate_index = (nodes - 1) * self.top_k + self.template.ranks[1:]

    def reset(self, batch_size: int) -> None:
        """Medusa heads keep no state between steps."""

    @torch.no_grad()
    def propose(self, rows, features, tokens, roots) -> list[Tree]:
        """One tree per row from the heads applied to each row's last feature (one batched pass)."""
        template = self.template
        root_tensor = torch.tensor(list(roots), dtype=torch.long, device=template.parents.device)[:, None]  # (R, 1)
        if template.size == 1:
            return [template.with_tokens(root) for root in root_tensor]
        last = torch.cat([row_features[0, -1:] for row_features in features])  # (R, d)
        logits = self.heads(last, self.shared_logits, count=template.max_depth)  # (depth, R, V)
        candidates = torch.topk(logits, self.top_k, dim=-1).indices.transpose(0, 1)  # (R, depth, top_k)
        drafted = candidates.reshape(len(roots), -1)[:, self._candidate_index]  # (R, N - 1)
        return [template.with_tokens(row) for row in torch.cat([root_tensor, drafted], dim=1)]
