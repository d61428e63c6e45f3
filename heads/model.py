"""``SpeculativeModel``: a frozen backbone plus a drafter, with a ``generate`` that returns exactly
what the backbone's own ``generate`` returns."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from tree_attention.decode import DecodeStats, speculative_generate
from tree_attention.tree import TreeTemplate

from .backbone import Backbone
from .eagle import EagleConfig, EagleDrafter, EagleHeads
from .generation import acceptance_rule
from .medusa import MedusaConfig, MedusaDrafter, MedusaHeads, resolve_tree


@dataclass(frozen=True)
class DrafterKind:
    """How to build one kind of drafter: its config class, its trainable module and the object
    that proposes trees during decoding (``tree_attention.decode.Drafter``)."""

    config_class: type
    build_heads: Callable[[Backbone, object], nn.Module]
    build_drafter: Callable[["SpeculativeModel", object], object]
    target_view: Callable[[Backbone, object], Backbone] | None = None
    """The view of the backbone the decode loop runs (e.g. one returning more layers as features)."""


def _medusa_heads(target: Backbone, config: MedusaConfig) -> nn.Module:
    return MedusaHeads(config, target.hidden_size, target.vocab_size,
                       None if config.share_lm_head else target.output_head)


def _medusa_drafter(spec: "SpeculativeModel", tree) -> MedusaDrafter:
    template = resolve_tree(tree if tree is not None else spec.config.tree, spec.config.num_heads, spec.accuracy)
    return MedusaDrafter(spec.heads, template, spec.shared_logits if spec.config.share_lm_head else None)


def _eagle_heads(target: Backbone, config: EagleConfig) -> nn.Module:
    return EagleHeads(config, target)


def _eagle_drafter(spec: "SpeculativeModel", tree) -> EagleDrafter:
    return EagleDrafter(spec.heads, spec.target, spec.config.with_tree(tree))


def _eagle_view(target: Backbone, config: EagleConfig) -> Backbone:
    return target.with_feature_layers(config.feature_layers)


KINDS: dict[str, DrafterKind] = {
    "medusa": DrafterKind(MedusaConfig, _medusa_heads, _medusa_drafter),
    "eagle": DrafterKind(EagleConfig, _eagle_heads, _eagle_drafter, _eagle_view),
}

logger = logging.getLogger(__name__)


def eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    """The eos ids of ``model.generation_config`` (int, list or tensor) as a set."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return frozenset([eos] if isinstance(eos, int) else [int(token) for token in eos])


@contextmanager
def _evaluation(module: nn.Module):
    """Eval mode inside the block, the previous mode after (no recursion when already in eval)."""
    was_training = module.training
    if was_training:
        module.eval()
    try:
        yield
    finally:
        if was_training:
            module.train()


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

    def __init__(self, target: Backbone, heads: nn.Module, kind: str, config,
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
        """The static tree template (Medusa; EAGLE grows a dynamic tree per step, see ``config``)."""
        if self.kind != "medusa":
            raise AttributeError(f"a {self.kind} drafter has no static tree; its tree shape is in spec.config")
        return self._drafter.template

    @property
    def drafter(self):
        """The object that proposes one tree per step (``tree_attention.decode.Drafter``)."""
        return self._drafter

    def shared_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden)

    def set_tree(self, tree=None) -> None:
        """Choose the verification tree (None: the configured one).

        Medusa: a choice list or a default tree of ``tree`` drafted nodes, built from the accuracies
        measured for these heads when known. EAGLE: a dynamic tree of ``tree`` drafted nodes
        (``total_tokens``), or a mapping of ``depth``/``top_k``/``total_tokens`` overrides.
        """
        self._drafter = KINDS[self.kind].build_drafter(self, tree)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 128, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None, acceptance: str = "auto",
                 posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> torch.Tensor:
        """Speculative generation; ``[1, prompt + new]`` ids, what ``backbone.generate`` returns.

        ``do_sample=False``: token-identical to ``backbone.generate(do_sample=False)``.
        ``do_sample=True``: lossless speculative sampling; the output follows the distribution of
        ``backbone.generate(do_sample=True, temperature=..., top_k=..., top_p=...)`` (unset ``top_k``
        and ``top_p`` resolve as there: the model's generation_config, then 50 and 1.0); draws
        come from ``generator`` (or torch's global RNG). ``acceptance="typical"`` selects Medusa's
        typical acceptance with ``posterior_threshold``/``posterior_alpha``: faster, **lossy**.
        Stops at ``max_new_tokens`` and at the eos tokens of ``backbone.generation_config``.
        """
        check_generate_inputs(input_ids, attention_mask, max_new_tokens)
        rule = acceptance_rule(self.backbone.generation_config, do_sample, temperature, top_k, top_p, generator,
                               acceptance, posterior_threshold, posterior_alpha)
        input_ids = input_ids.to(self.target.device).long()
        with _evaluation(self.backbone), _evaluation(self.heads):
            output, stats = speculative_generate(
                self.target, self._drafter, input_ids, max_new_tokens, eos_token_ids(self.backbone), rule
            )
        self.last_stats = stats
        return output

    def save_pretrained(self, directory: str, **metadata) -> None:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (atomically)."""
        from .adapter import save_adapter

        save_adapter(self, directory, **metadata)


def build_spec(target: Backbone, kind: str, config,
               accuracy: Sequence[Sequence[float]] | None = None) -> SpeculativeModel:
    """A fresh drafter of ``kind`` on ``target``, on the backbone's device and dtype."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {tuple(KINDS)}; got {kind!r}")
    heads = KINDS[kind].build_heads(target, config)
    heads.to(device=target.device, dtype=target.dtype)
    if KINDS[kind].target_view is not None:
        target = KINDS[kind].target_view(target, config)
    return SpeculativeModel(target, heads, kind, config, accuracy)
