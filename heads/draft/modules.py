"""The draft model as a spec's ``heads``: a frozen separate causal LM, checked against the target.

The draft must speak the target's vocabulary: the same logits width, the same special token ids
where both configs set them, and, when both tokenizers are given, the same token for every id.
A mismatch is a ValueError naming the first difference, never a silent mis-draft (a draft with
other ids would still be lossless, but accept nothing).
"""

from __future__ import annotations

from typing import Mapping

from torch import nn
from transformers import PreTrainedModel

from ..backbone import Backbone, inspect_backbone

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _ids(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value,)
    return tuple(int(item) for item in value)


def check_special_ids(target_config, draft_config) -> None:
    """ValueError when a special token id set in both configs differs."""
    for name in SPECIAL_IDS:
        ours, theirs = _ids(getattr(target_config, name, None)), _ids(getattr(draft_config, name, None))
        if ours is not None and theirs is not None and set(ours) != set(theirs):
            raise ValueError(f"draft model config {name}={list(theirs)} differs from the target's {list(ours)}: "
                             "the draft must use the target's tokenizer")


def check_tokenizers(tokenizer, draft_tokenizer) -> None:
    """ValueError naming the first id whose token differs between the two vocabularies."""
    if (tokenizer is None) != (draft_tokenizer is None):
        given, missing = ("tokenizer", "draft_tokenizer") if draft_tokenizer is None else ("draft_tokenizer",
                                                                                           "tokenizer")
        raise ValueError(f"{given} given without {missing}: pass both (the target's and the draft's) to "
                         "compare their vocabularies, or neither")
    if tokenizer is None:
        return
    ours = _by_id(tokenizer.get_vocab())
    theirs = _by_id(draft_tokenizer.get_vocab())
    for token_id in sorted(set(ours) | set(theirs)):
        if ours.get(token_id) != theirs.get(token_id):
            raise ValueError(f"tokenizers differ at id {token_id}: the target's is {ours.get(token_id)!r}, the "
                             f"draft's {theirs.get(token_id)!r} (target vocabulary {len(ours)} tokens, draft "
                             f"{len(theirs)}); the draft must use the target's tokenizer")


def _by_id(vocabulary: Mapping[str, int]) -> dict[int, str]:
    return {int(token_id): token for token, token_id in vocabulary.items()}


def check_draft_model(target: Backbone, draft: Backbone) -> None:
    """ValueError unless ``draft`` can draft for ``target``: same logits width, same special ids."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft.vocab_size} tokens, the target's "
                         f"{target.vocab_size}: the draft must use the target's tokenizer and vocabulary size")
    check_special_ids(target.model.config, draft.model.config)


class DraftModel(nn.Module):
    """The frozen draft model (``spec.heads`` of kind ``draft``), so that ``.to``, ``.eval`` and
    ``state_dict`` reach it; :attr:`backbone` is its :class:`~heads.backbone.Backbone` view
    (public forward with 4D masks, position ids and its own cache)."""

    def __init__(self, target: Backbone, draft_model: PreTrainedModel) -> None:
        super().__init__()
        if not isinstance(draft_model, PreTrainedModel):
            raise ValueError(f"draft_model must be a transformers PreTrainedModel (a causal LM sharing the target's "
                             f"tokenizer); got {type(draft_model).__name__}")
        backbone = inspect_backbone(draft_model)
        check_draft_model(target, backbone)
        draft_model.requires_grad_(False)
        self.model = draft_model
        self.backbone = backbone
        self.train(draft_model.training)  # a fresh Module trains: keep the draft's own mode (generate restores it)

    def forward(self, *args, **kwargs):
        raise TypeError("DraftModel is driven by its drafter (heads.draft.DraftModelDrafter); call "
                        "spec.heads.model for the draft model itself")
