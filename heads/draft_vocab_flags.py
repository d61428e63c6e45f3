"""The ``--draft-vocab-size`` flag shared by the kinds that offer a draft vocabulary
(:mod:`heads.draft_vocab`): its argparse type and what ``auto`` resolves to. No torch, so that the
command line's flags import without it."""

from __future__ import annotations

import argparse

DRAFT_VOCAB_SHARE = 4
DRAFT_VOCAB_FROM = 8192
"""``--draft-vocab-size auto`` (the default): targets with at least :data:`DRAFT_VOCAB_FROM` tokens draft
over their ``1 / DRAFT_VOCAB_SHARE`` most frequent training tokens, smaller vocabularies over all of them."""


def draft_vocab(text: str):
    """``"auto"``, ``"full"`` or a positive count (an argparse type)."""
    if text in ("auto", "full"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected auto, full or a positive token count; got {text!r}")
    return value


def auto_draft_vocab(vocab_size: int) -> int | None:
    """The draft vocabulary ``--draft-vocab-size auto`` gives a target of ``vocab_size`` tokens (None: all)."""
    return vocab_size // DRAFT_VOCAB_SHARE if vocab_size >= DRAFT_VOCAB_FROM else None
