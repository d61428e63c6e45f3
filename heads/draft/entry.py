"""The draft kind's registry entry, ``KIND``, and its public names. :mod:`heads.draft` (whose
docstring describes the kind) hands them out on first use, so that its command-line options
(``heads.draft.cli``) import without torch."""

from __future__ import annotations

import os

from tree_attention.verify import SamplingRule

from ..kind import DrafterKind, refuse_options
from . import cli
from .adapter import ADAPTER_FILES, check_drafter, load_adapter, save_adapter
from .calibration import ChainCalibration
from .config import DEFAULT_DEPTH, DEFAULT_SIBLINGS, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS, SAMPLE_MODES, DraftConfig
from .drafter import DraftModelDrafter
from .loss import DraftLoss
from .modules import (
    DraftModel, check_draft_model, check_draft_path, check_special_ids, check_tokenizers, load_draft_model,
)

__all__ = ["KIND", "DraftConfig", "DraftModel", "DraftModelDrafter", "DraftLoss", "make_config", "bind_rule",
           "check_draft_model", "check_special_ids", "check_tokenizers", "load_draft_model",
           "DEFAULT_DEPTH", "DEFAULT_TOP_K", "DEFAULT_TOTAL_TOKENS", "SAMPLE_MODES"]

OPTIONS = ("draft_model", "depth", "top_k", "total_tokens", "sample", "confidence", "adaptive", "siblings",
           "tokenizer", "draft_tokenizer")


def make_config(draft_model=None, depth: int | None = None, top_k: int | None = None,
                total_tokens: int | None = None, sample: str | None = None, confidence: float | None = None,
                adaptive: bool | None = None, siblings: int | None = None, tokenizer=None, draft_tokenizer=None,
                **others) -> DraftConfig:
    """The config ``attach_heads(kind="draft", ...)`` builds; ``draft_model`` is required (a
    ``PreTrainedModel`` or the directory of one, loaded when the spec is built), a lone
    ``total_tokens`` lowers the default depth to fit it, and ``tokenizer``/``draft_tokenizer``
    (both or neither) are compared id by id."""
    refuse_options("draft", OPTIONS, others)
    if draft_model is None:
        raise ValueError("kind='draft' needs draft_model=: a small causal LM (PreTrainedModel, or its directory) "
                         "that shares the target's tokenizer")
    if isinstance(draft_model, (str, os.PathLike)):
        draft_model = str(check_draft_path(draft_model))
    check_tokenizers(tokenizer, draft_tokenizer)
    shape = {name: value for name, value in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens))
             if value is not None}
    return DraftConfig(sample=sample or "auto", confidence=0.0 if confidence is None else confidence,
                       adaptive=True if adaptive is None else adaptive, draft_model=draft_model,
                       siblings=DEFAULT_SIBLINGS if siblings is None else siblings,
                       **DraftConfig().with_tree(shape).tree)


def build_heads(target, config: DraftConfig) -> DraftModel:
    if config.draft_model is None:
        raise ValueError("a draft spec is built from a live draft model: attach it with "
                         "heads.attach_heads(model, kind='draft', draft_model=...)")
    draft = config.draft_model
    if isinstance(draft, (str, os.PathLike)):
        draft = load_draft_model(draft, target)
    heads = DraftModel(target, draft)
    heads.calibration = ChainCalibration(config.calibration)
    return heads


def build_drafter(spec, tree) -> DraftModelDrafter:
    return DraftModelDrafter(spec.heads, spec.config.with_tree(tree))


def bind_rule(drafter, rule):
    """``drafter`` set up for the serving ``rule``: sampled chain candidates (drawn from the draft's
    distribution under the rule's own warp and generator) when the rule samples losslessly, the
    config's ``sample`` mode allows it and the tree is a chain; top-k candidates otherwise.

    ``SpeculativeModel.generate`` calls this (``KIND.bind_rule``) on the drafter it runs, after
    building the rule (inside a hybrid, on its trained part)."""
    if not isinstance(drafter, DraftModelDrafter):
        return drafter
    sampled = isinstance(rule, SamplingRule) and rule.lossless and drafter.top_k == 1
    if sampled and drafter.config.sample != "never":
        drafter.sample_with(rule.warp, rule.generator)
    else:
        drafter.sample_with(None, None)
    return drafter


def policy_sizes(spec) -> tuple[int, ...]:
    """An adaptive chain sizes itself per row and step from calibrated acceptance and measured costs
    (``docs/draft.md``): ``auto`` gets its configured size alone and decides only whether a step drafts.
    Fixed chains and dynamic trees: sizes up to the configured one."""
    config = spec.config
    configured = config.total_tokens
    if config.adaptive and config.top_k == 1 and configured:
        return (configured,)
    return tuple(sorted({size for size in (2, 4, 8) if size < configured} | {configured} - {0}))


KIND = DrafterKind(
    name="draft", config_class=DraftConfig, make_config=make_config, build_heads=build_heads,
    build_drafter=build_drafter, options=OPTIONS, policy_sizes=policy_sizes, bind_rule=bind_rule,
    check_drafter=check_drafter, loss=DraftLoss, cli=cli, save=save_adapter, load=load_adapter,
    adapter_files=ADAPTER_FILES, extra={"lora_switch": "lora"},
)
