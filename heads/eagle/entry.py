"""The eagle kind's registry entry, ``KIND``, and its public names. :mod:`heads.eagle` (whose
docstring describes the kind) hands them out on first use, so that its command-line options
(``heads.eagle.cli``) import without torch."""

from __future__ import annotations

from typing import Mapping

from tree_attention.gumbel import GumbelRule
from tree_attention.verify import GreedyRule, SamplingRule

from ..adapter import AdapterError
from ..kind import DrafterKind, refuse_options
from . import cli
from .checkpoint import FORMATS
from .config import (
    DEFAULT_BLOCK_TOP_K, DEFAULT_BLOCK_TOTAL_TOKENS, DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS, LAYOUTS,
    EagleConfig,
)
from .block import BlockDrafter
from .drafter import EagleDrafter
from .loss import EagleLoss
from .modules import Eagle3Midlayer, EagleHeads, parallel_attention_mask, unrolled_attention_mask
from .parallel import ParallelEagleDrafter, parallel_template
from .switch import DraftingChoice, SwitchingEagleDrafter

__all__ = ["KIND", "EagleConfig", "EagleDrafter", "BlockDrafter", "EagleHeads", "Eagle3Midlayer", "unrolled_attention_mask",
           "ParallelEagleDrafter", "parallel_attention_mask", "parallel_template", "SwitchingEagleDrafter",
           "DraftingChoice", "DEFAULT_DEPTH", "DEFAULT_TOP_K",
           "DEFAULT_TOTAL_TOKENS", "LAYOUTS"]

OPTIONS = ("num_layers", "depth", "top_k", "total_tokens", "feature_layers", "draft_vocab_size", "layout", "parallel",
           "sample", "confidence", "min_acceptance", "drafting", "parallel_tokens", "siblings", "parallel_mode",
           "head_input")


def make_config(num_layers: int | None = None, depth: int | None = None, top_k: int | None = None,
                total_tokens: int | None = None, feature_layers=None, draft_vocab_size: int | None = None,
                layout: str | None = None, parallel: int | None = None, sample: str | None = None,
                confidence: float | None = None, min_acceptance: float | None = None, drafting: str | None = None,
                parallel_tokens: int | None = None, siblings: int | None = None, parallel_mode: str | None = None,
                head_input: str | None = None, **others) -> EagleConfig:
    """The config ``attach_heads(kind="eagle", ...)`` builds; a lone ``total_tokens`` lowers the
    default depth to fit it; ``parallel_mode`` defaults to ``heads``
    and ``head_input`` to ``prediction``. A block drafter (``parallel_mode="block"``) defaults to
    its static tree (:data:`DEFAULT_BLOCK_TOP_K`, :data:`DEFAULT_BLOCK_TOTAL_TOKENS`, ``parallel``
    deep) and to top-k candidates under sampling (``sample="never"``: drawing the tree's children
    costs it more than their extra acceptance earns; ``sample="auto"`` draws them)."""
    refuse_options("eagle", OPTIONS, others)
    shape = {name: value for name, value in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens))
             if value is not None}
    if parallel_mode == "block" and parallel is not None and parallel > 1 and not shape:  # a tree over the block
        shape = {"depth": parallel, "top_k": DEFAULT_BLOCK_TOP_K, "total_tokens": DEFAULT_BLOCK_TOTAL_TOKENS}
    return EagleConfig(num_layers=1 if num_layers is None else num_layers, feature_layers=feature_layers,
                       draft_vocab_size=draft_vocab_size, layout=layout or "native",
                       parallel=1 if parallel is None else parallel,
                       sample=sample or ("never" if parallel_mode == "block" else "auto"),
                       confidence=0.0 if confidence is None else confidence,
                       min_acceptance=EagleConfig.min_acceptance if min_acceptance is None else min_acceptance,
                       drafting=drafting,
                       parallel_tokens=EagleConfig.parallel_tokens if parallel_tokens is None else parallel_tokens,
                       siblings=EagleConfig.siblings if siblings is None else siblings,
                       parallel_mode=parallel_mode or "heads", head_input=head_input or "prediction",
                       **EagleConfig().with_tree(shape).tree)


def build_heads(target, config: EagleConfig) -> EagleHeads:
    return EagleHeads(config, target)


def build_drafter(spec, tree) -> EagleDrafter | ParallelEagleDrafter | SwitchingEagleDrafter:
    config = spec.config.with_tree(tree)
    if config.drafting == "parallel" and config.parallel_mode == "block":
        return BlockDrafter(spec.heads, spec.target, config, spec.accuracy)
    if config.drafting == "parallel":
        return ParallelEagleDrafter(spec.heads, spec.target, config, spec.accuracy)
    if config.drafting == "auto":
        return SwitchingEagleDrafter(spec.heads, spec.target, config, spec.accuracy)
    return EagleDrafter(spec.heads, spec.target, config)


def bind_rule(drafter, rule):
    """``drafter`` set up for the serving ``rule``: sampled candidates (drawn from the drafter's
    distribution under the rule's own warp and generator) when the rule samples losslessly and the
    config's ``sample`` mode allows it; top-k candidates otherwise (greedy, typical, ``never``)."""
    lossless_sampling = isinstance(rule, SamplingRule) and rule.lossless
    if isinstance(drafter, SwitchingEagleDrafter):  # which mode drafts never changes a greedy output
        drafter.choosing = isinstance(rule, GreedyRule)
        drafter.bind_sampling(rule.key if lossless_sampling else None)  # a sampled call: one mode throughout
    elif not isinstance(drafter, EagleDrafter):
        return drafter
    sampled = lossless_sampling and drafter.sample != "never"
    drafter.sample_with(rule.warp if sampled else None, rule.generator if sampled else None)
    if hasattr(drafter, "couple_with"):  # seeded sampling: children ranked with the target's noise (coupled)
        drafter.couple_with(rule if isinstance(rule, GumbelRule) and rule.keys is not None else None)
    return drafter


def target_view(target, config: EagleConfig):
    return target.with_feature_layers(config.feature_layers)


def policy_sizes(spec) -> tuple[int, ...]:
    configured = spec.config.total_tokens
    return tuple(sorted({size for size in (2, 4, 8) if size < configured} | {configured} - {0}))


def check_drafter(drafter: Mapping, where: str) -> None:
    """An EAGLE drafter's ``layout`` (absent in adapters written before layouts existed: ``native``)."""
    layout = drafter.get("layout", "native")
    if layout not in LAYOUTS:
        raise AdapterError(f"{where}: drafter.layout {layout!r} is not one of {list(LAYOUTS)}")


KIND = DrafterKind(
    name="eagle", config_class=EagleConfig, make_config=make_config, build_heads=build_heads,
    build_drafter=build_drafter, options=OPTIONS, target_view=target_view, policy_sizes=policy_sizes,
    check_drafter=check_drafter, formats=FORMATS,
    sidecar_keys=("num_layers", "layout", "feature_layers", "draft_vocab_size"), bind_rule=bind_rule, loss=EagleLoss,
    cli=cli,
)
