"""The draft model as a spec's ``heads``: a frozen separate causal LM, checked against the target.

The draft must speak the target's vocabulary: the same logits width, the same special token ids
where both configs set them, and, when both tokenizers are given, the same token for every id.
A mismatch is a ValueError naming the first difference, never a silent mis-draft (a draft with
other ids would still be lossless, but accept nothing).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from ..backbone import Backbone, inspect_backbone, target_fingerprint
from ..families import lean_decoder_ok
from ..lean import LeanDecoder, LeanOutputHead
from .calibration import ChainCalibration, ChainCosts

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


def check_draft_path(path: str | os.PathLike) -> Path:
    """``path`` as a draft model directory (``config.json`` inside); ValueError naming it otherwise."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"draft_model {str(path)!r}: no such directory (a Hugging Face causal LM directory)")
    if not (directory / "config.json").is_file():
        raise ValueError(f"draft_model {str(path)!r}: no config.json (not a Hugging Face model directory)")
    return directory


def load_draft_model(path: str | os.PathLike, target: Backbone) -> PreTrainedModel:
    """The causal LM in directory ``path``, in ``target``'s dtype and on its device, in eval mode."""
    from transformers import AutoModelForCausalLM

    directory = check_draft_path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=target.dtype)
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"draft_model {str(path)!r}: cannot load it: {first}") from error
    return model.to(target.device).eval()


def model_source(model: PreTrainedModel) -> str | None:
    """Where ``model`` was loaded from: its directory as an absolute path when it is a local
    directory, else its hub id (None: built in memory)."""
    name = str(getattr(model.config, "_name_or_path", "") or "")
    if not name:
        return None
    return str(Path(name).resolve()) if Path(name).is_dir() else name


class DraftModel(nn.Module):
    """The draft model (``spec.heads`` of kind ``draft``), so that ``.to``, ``.eval`` and
    ``state_dict`` reach it; :attr:`backbone` is its :class:`~heads.backbone.Backbone` view
    (public forward with 4D masks, position ids and its own cache).

    Frozen when attached. Distillation (:mod:`heads.draft.loss`) makes it trainable first: every
    weight (:meth:`train_all_weights`) or a peft LoRA injected in place (:meth:`add_lora`, kept
    unmerged in :attr:`lora` until saved). :attr:`base_pin` is the draft's fingerprint before
    training and :attr:`source` where it was loaded from, both recorded when it is saved.
    :attr:`calibration` (recorded too) and :attr:`costs` are what its drafters learn while serving
    (:mod:`heads.draft.calibration`), shared by every drafter built on it.
    """

    def __init__(self, target: Backbone, draft_model: PreTrainedModel) -> None:
        super().__init__()
        if not isinstance(draft_model, PreTrainedModel):
            raise ValueError(f"draft_model must be a transformers PreTrainedModel (a causal LM sharing the target's "
                             f"tokenizer) or its directory; got {type(draft_model).__name__}")
        backbone = inspect_backbone(draft_model)
        check_draft_model(target, backbone)
        draft_model.requires_grad_(False)
        self.model = draft_model
        self.backbone = backbone
        self.source = model_source(draft_model)
        self.base_pin: dict | None = None
        self.lora = None  # heads.lora.BackboneLora while a LoRA is trained on the draft
        self.calibration = ChainCalibration()
        self.costs = ChainCosts()
        base = draft_model.base_model
        self._lean = LeanDecoder(base) if lean_decoder_ok(base) else None
        self._head = LeanOutputHead(backbone)
        self.train(draft_model.training)  # a fresh Module trains: keep the draft's own mode (generate restores it)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The draft's logits ``[B, T, V]`` for right-padded ``input_ids`` ``[B, T]`` (training;
        decoding runs :attr:`backbone` through the drafter)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache,
               logits_rows: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's top-layer features ``[B, T, d]`` and float logits (all rows or the last) for
        ``input_ids`` ``[B, T]`` at ``position_ids`` over ``cache`` (appended to): what the drafter
        runs per tree level. Without gradients and without a LoRA, a family that
        :func:`heads.families.lean_decoder_ok` accepts runs through :class:`heads.lean.LeanDecoder`
        (the same modules' tensors without the decoder's per-call wrappers; equal to float
        rounding, and the target verifies every drafted token) and its output head through
        :class:`heads.lean.LeanOutputHead`, else the draft's public forward."""
        if self._lean is None or self.lora is not None or torch.is_grad_enabled():
            return self.backbone.forward(input_ids, position_ids, attention_mask, cache, logits_rows)
        features = self._lean(self.backbone.input_embeddings(input_ids), position_ids, attention_mask, cache)
        rows = features[:, -1:] if logits_rows == "last" else features
        return features, self._head(rows)

    def train_all_weights(self) -> None:
        """Full fine-tune: every weight of the draft gets gradients (its pin taken first)."""
        self.base_pin = target_fingerprint(self.model)
        self.model.requires_grad_(True)

    def add_lora(self, r: int, alpha: float, targets: Sequence[str] | None) -> None:
        """Inject a fresh LoRA (peft, ``B = 0``: drafts unchanged until trained) into the draft in
        place; only its tensors get gradients. ValueError for targets that name no module."""
        from .. import lora

        if self.lora is not None:
            raise ValueError("the draft model already carries a LoRA")
        self.base_pin = target_fingerprint(self.model)
        self.lora = lora.add_lora(self.model, r, alpha, targets, base_pin=self.base_pin)
