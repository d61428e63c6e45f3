"""Medusa's ``selfdraft train`` flags: how they are declared and what they become (``attach_heads``
options and ``TrainConfig`` fields). The train command adds every trainable kind's flags."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Medusa heads (--kind medusa)")
    group.add_argument("--num-heads", type=int, default=None,
                       help="Medusa heads (head k predicts token t+k+2; default 4)")
    group.add_argument("--num-layers", type=int, default=1, help="residual blocks per Medusa head")
    group.add_argument("--share-lm-head", action="store_true",
                       help="Medusa: reuse the frozen output head in every head")
    group.add_argument("--hard-label-weight", type=float, default=0.0,
                       help="weight of plain cross-entropy to the target's tokens, added to the divergence")


def options(args: argparse.Namespace) -> dict:
    """The ``attach_heads(kind="medusa", ...)`` options; None where a flag was not given."""
    return {"num_heads": args.num_heads, "num_layers": args.num_layers, "share_lm_head": args.share_lm_head or None}


def train_options(args: argparse.Namespace) -> dict:
    """The ``TrainConfig`` fields Medusa's flags set."""
    return {"hard_label_weight": args.hard_label_weight}
