"""Lookup drafting (prompt lookup decoding, Saxena 2023; SuffixDecoding, Oliaro et al. 2024): no
training, no adapter; trees of continuations matched in the prompt, the output so far, an optional
corpus and earlier requests. Registered as ``KIND`` (see :mod:`heads.kinds`)."""

from __future__ import annotations

from ..kind import DrafterKind, refuse_options
from .config import LookupConfig
from .corpus import CorpusIndex
from .drafter import LookupDrafter, LookupMemory
from .gate import LookupGate
from .hybrid import Hybrid, HybridDrafter, merge_proposal
from .index import Proposal, SuffixIndex, pad_proposals, propose

__all__ = ["KIND", "LookupConfig", "CorpusIndex", "LookupDrafter", "LookupMemory", "SuffixIndex", "Proposal",
           "propose", "pad_proposals", "encode_corpus", "Hybrid", "HybridDrafter", "LookupGate", "merge_proposal",
           "make_config"]

OPTIONS = ("tree", "budget", "adaptive", "extend", "gate", "max_depth", "max_ngram", "min_match", "max_occurrences", "history_tokens",
           "corpus_tokens", "history_confidence", "remember", "corpus", "tokenizer")


def encode_corpus(corpus, tokenizer=None) -> list:
    """Token-id sequences from ``corpus``: texts (encoded with ``tokenizer``, no special tokens) or ids."""
    sequences = []
    for number, item in enumerate(corpus or ()):
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError(f"corpus[{number}] is text: pass tokenizer= (the target's) to encode it, or token ids")
            sequences.append(list(tokenizer(item, add_special_tokens=False)["input_ids"]))
        else:
            sequences.append(item)  # token ids, checked by LookupConfig
    return sequences


def make_config(tree: int | None = None, budget: int | None = None, corpus=None, tokenizer=None,
                **options) -> LookupConfig:
    """The config ``attach_heads(kind="lookup", ...)`` builds; ``tree`` is the node budget."""
    refuse_options("lookup", OPTIONS, options)
    if tree is not None and budget is not None and tree != budget:
        raise ValueError(f"tree ({tree}) and budget ({budget}) both set the lookup node budget; give one")
    settings = {name: value for name, value in options.items() if value is not None}
    if tree is not None or budget is not None:
        settings["budget"] = tree if tree is not None else budget
    return LookupConfig(corpus=encode_corpus(corpus, tokenizer), **settings)


def build_drafter(spec, tree) -> LookupDrafter:
    return LookupDrafter(spec.config.with_tree(tree), spec.heads)


def policy_sizes(spec) -> tuple[int, ...]:
    return tuple(sorted({size for size in (2, 4, 8) if size < spec.config.budget} | {spec.config.budget} - {0}))


KIND = DrafterKind(
    name="lookup", config_class=LookupConfig, make_config=make_config,
    build_heads=lambda target, config: LookupMemory(config), build_drafter=build_drafter,
    options=OPTIONS, policy_sizes=policy_sizes, trainable=False, hybrid=Hybrid,
)
