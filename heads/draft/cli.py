"""The draft kind's ``selfdraft train`` flags (DistillSpec): the draft model to distil, its tree
shape, and full fine-tuning or a LoRA (the LoRA flags are shared: :mod:`heads.lora_flags`). The
train command adds every trainable kind's flags."""

from __future__ import annotations

import argparse

from .. import lora_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("draft model (--kind draft: DistillSpec, the draft model itself is trained)")
    group.add_argument("--draft", default=None, metavar="DIR",
                       help="the draft model to distil: a Hugging Face causal LM directory that shares the target's "
                            "tokenizer (required with --kind draft)")
    group.add_argument("--depth", type=int, default=None, help="deepest level of the dynamic draft tree")
    group.add_argument("--top-k", type=int, default=None, help="children per expanded node of the dynamic tree")
    group.add_argument("--total-tokens", type=int, default=None, help="drafted nodes verified per step")
    group.add_argument("--confidence", type=float, default=None,
                       help="chains (--top-k 1) stop below a node whose drafter gives its top token less than this "
                            "probability (default 0: never)")
    group.add_argument("--lora", action="store_true",
                       help="train a LoRA on the draft model (peft; shaped by --lora-r, --lora-alpha, --lora-targets) "
                            "instead of all its weights")
    lora_flags.add_arguments(group)


def options(args: argparse.Namespace) -> dict:
    """The ``attach_heads(kind="draft", ...)`` options; None where a flag was not given."""
    return {"draft_model": args.draft, "depth": args.depth, "top_k": args.top_k, "total_tokens": args.total_tokens,
            "confidence": args.confidence}


def train_options(args: argparse.Namespace) -> dict:
    """The ``TrainConfig`` fields the draft kind's flags set; ValueError for ``--kind draft``
    without ``--draft`` or with ``--position-decay``, or ``--lora`` with another kind."""
    if args.kind == "draft" and args.draft is None:
        raise ValueError("--kind draft needs --draft DIR: the draft model to distil")
    if args.kind == "draft" and getattr(args, "position_decay", None) is not None:
        raise ValueError("--position-decay weighs drafting depths (Medusa heads, EAGLE steps); --kind draft trains one "
                         "next-token distribution per position")
    if args.lora and args.kind != "draft":
        raise ValueError(f"--lora trains a LoRA on a draft model (--kind draft), not --kind {args.kind} (Medusa-2's "
                         "backbone LoRA: --kind medusa --joint)")
    return {"draft_lora": args.lora, **lora_flags.train_options(args)}
