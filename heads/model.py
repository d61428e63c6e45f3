"""``SpeculativeModel``: a frozen backbone plus a drafter, with a ``generate`` that returns exactly
what the backbone's own ``generate`` returns."""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from tree_attention.decode import DecodeStats, speculative_generate
from tree_attention.tree import TreeTemplate

from .backbone import Backbone
from .medusa import MedusaConfig, MedusaDrafter, MedusaHeads, resolve_tree

logger = logging.getLogger(__name__)


def _eos_ids(model: PreTrainedModel) -> frozenset[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return frozenset([eos] if isinstance(eos, int) else [int(token) for token in eos])


def check_generate_inputs(input_ids, attention_mask, max_new_tokens) -> None:
    """Reject what ``generate`` cannot serve, naming the argument."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor; got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, length]; got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
        raise TypeError(f"input_ids must hold integer token ids; got dtype {input_ids.dtype}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if input_ids.shape[0] != 1:
        raise NotImplementedError(
            f"input_ids has batch size {input_ids.shape[0]}; batched speculative decoding (batch > 1 with "
            "ragged acceptance) is a separate capability that is not available yet: pass one sequence at a time"
        )
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}; got {shape}")
        if not bool(attention_mask.bool().all()):
            raise NotImplementedError(
                "attention_mask has padding; padded prompts arrive with batched speculative decoding: "
                "strip the padding of a single sequence"
            )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int; got {max_new_tokens!r}")


class SpeculativeModel:
    """A frozen causal LM (``backbone``) that drafts for itself with ``heads``.

    Attributes:
        backbone: the unmodified ``PreTrainedModel`` (frozen).
        heads: the drafter, the only trainable parameters.
        target: the :class:`~heads.backbone.Backbone` view of ``backbone`` the loop runs.
        last_stats: :class:`~tree_attention.decode.DecodeStats` of the last ``generate``.
    """

    def __init__(self, target: Backbone, heads: nn.Module, kind: str, config: MedusaConfig,
                 accuracy: Sequence[Sequence[float]] | None = None) -> None:
        self.target = target
        self.backbone = target.model
        self.heads = heads
        self.kind = kind
        self.config = config
        self.accuracy = [list(row) for row in accuracy] if accuracy is not None else None
        self.last_stats: DecodeStats | None = None
        self.metadata: dict = {}
        self.set_tree(config.tree)

    @property
    def tree(self) -> TreeTemplate:
        return self._drafter.template

    def shared_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden)

    def set_tree(self, tree: Sequence[Sequence[int]] | int | None) -> None:
        """Use a choice list or a default tree of ``tree`` drafted nodes (None: the configured one).

        Default trees are built from the accuracies measured for these heads when known.
        """
        template = resolve_tree(tree if tree is not None else self.config.tree, self.config.num_heads, self.accuracy)
        self._drafter = MedusaDrafter(self.heads, template,
                                      self.shared_logits if self.config.share_lm_head else None)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 128, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
        """Speculative generation; ``[1, prompt + new]`` ids, what ``backbone.generate`` returns.

        Stops at ``max_new_tokens`` and at the eos tokens of ``backbone.generation_config``.
        """
        check_generate_inputs(input_ids, attention_mask, max_new_tokens)
        if do_sample:
            raise NotImplementedError(
                "do_sample=True: lossless speculative sampling is a separate capability that is not available "
                "yet; use do_sample=False (greedy, token-identical to the backbone)"
            )
        input_ids = input_ids.to(self.target.device).long()
        training = self.backbone.training, self.heads.training
        self.backbone.eval()
        self.heads.eval()
        try:
            output, stats = speculative_generate(
                self.target, self._drafter, input_ids, max_new_tokens, _eos_ids(self.backbone)
            )
        finally:
            self.backbone.train(training[0])
            self.heads.train(training[1])
        self.last_stats = stats
        return output

    def save_pretrained(self, directory: str, **metadata) -> None:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (atomically)."""
        from .adapter import save_adapter

        save_adapter(self, directory, **metadata)


def build_medusa(model: PreTrainedModel, target: Backbone, config: MedusaConfig,
                 accuracy: Sequence[Sequence[float]] | None = None) -> SpeculativeModel:
    heads = MedusaHeads(config, target.hidden_size, target.vocab_size,
                        None if config.share_lm_head else target.output_head)
    heads.to(device=target.device, dtype=target.dtype)
    return SpeculativeModel(target, heads, "medusa", config, accuracy)
