"""The LoRA flags of ``selfdraft train`` (``--lora-r``, ``--lora-alpha``, ``--lora-targets``),
declared and parsed here once for every kind that trains a peft LoRA: Medusa-2's ``--joint`` (a
LoRA on the backbone) and the draft kind's ``--lora`` (a LoRA on the draft model).

A kind opts in through the registry: ``KIND.extra["lora_switch"]`` names the flag (its argparse
dest) that turns its LoRA on; a kind with ``extra["joint_training"]`` uses ``--joint``. The flags
given without the switch of ``--kind`` are refused by name (:func:`check`, which the train command
calls with every registered kind's switch: the kinds' ``cli`` modules import this module, so it
does not import the registry).
"""

from __future__ import annotations

import argparse
from typing import Mapping

DEFAULTS = {"lora_r": 16, "lora_alpha": 32.0, "lora_targets": None}
"""The flags' dests and defaults (also ``TrainConfig``'s)."""


def add_arguments(parser) -> None:
    """Declare the three flags (a kind's ``cli.add_arguments`` calls this; the train command
    shares a flag that two kinds declare alike)."""
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha (default 32)")
    parser.add_argument("--lora-targets", default=None,
                        help="comma-separated module names for the LoRA, e.g. q_proj,v_proj (default: "
                             "peft's default for the model family)")


def switch(kind) -> str | None:
    """The dest of the flag that turns the LoRA of ``kind`` (a ``DrafterKind``) on (None: the kind trains none)."""
    extra = kind.extra
    return extra.get("lora_switch") or ("joint" if extra.get("joint_training") else None)


def given(args: argparse.Namespace) -> list[str]:
    """The LoRA flags given (at a value other than the default), as ``--lora-r`` etc."""
    return ["--" + name.replace("_", "-") for name, default in DEFAULTS.items() if getattr(args, name) != default]


def check(args: argparse.Namespace, switches: Mapping[str, str | None]) -> None:
    """ValueError for LoRA flags given while ``--kind``'s LoRA is off; ``switches``: ``{kind name:
    :func:`switch` of the kind}`` over the registered kinds, in their order."""
    flags = given(args)
    if not flags:
        return
    own = switches.get(args.kind)
    if own is None:
        owners = [f"--kind {name} --{dest.replace('_', '-')}" for name, dest in switches.items() if dest]
        raise ValueError(f"{', '.join(flags)}: LoRA option(s), for {' or '.join(owners)}; --kind {args.kind} "
                         "trains no LoRA")
    if not getattr(args, own, False):
        label = "joint-training" if own == "joint" else "LoRA"
        raise ValueError(f"{', '.join(flags)}: {label} option(s); add --{own.replace('_', '-')}")


def train_options(args: argparse.Namespace) -> dict:
    """``TrainConfig``'s ``lora_r``, ``lora_alpha``, ``lora_targets`` (the flags checked by :func:`check`)."""
    targets = args.lora_targets
    return {"lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
            "lora_targets": tuple(part.strip() for part in targets.split(",")) if targets is not None else None}
