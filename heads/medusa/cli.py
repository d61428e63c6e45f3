"""Medusa's ``selfdraft train`` flags: how they are declared and what they become (``attach_heads``
options and ``TrainConfig`` fields). The train command adds every trainable kind's flags."""

from __future__ import annotations

import argparse

from .. import lora_flags
from ..draft_vocab_flags import DRAFT_VOCAB_FROM, auto_draft_vocab, draft_vocab

LEARNING_RATE = 1e-2
"""``selfdraft train --kind medusa``'s default ``--lr``: high enough that the heads converge within
the few hundred steps a CPU run affords (set by the EAGLE-recipe study,
``benchmarks/studies/eagle_recipe``; figures in CHANGELOG.md, 2026-12-03)."""

DATA_TEMPERATURES = (0.0,)
"""The default recipe's data temperatures for Medusa (``training.recipe.default_recipe``): the
target's greedy continuations only. Head ``k`` predicts the token ``k + 1`` places ahead from one
feature, without the tokens in between; where those were sampled, its target is the continuation
averaged over random intermediate tokens, which ranks the greedy path's tokens lower and teaches
sampled serving nothing a head can use (figures: docs/training.md)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Medusa heads (--kind medusa)")
    group.add_argument("--num-heads", type=int, default=None,
                       help="Medusa heads (head k predicts token t+k+2; default 4)")
    group.add_argument("--num-layers", type=int, default=None, help="residual blocks per Medusa head (default 1)")
    group.add_argument("--share-lm-head", action="store_true",
                       help="Medusa: reuse the frozen output head in every head")
    group.add_argument("--draft-vocab-size", type=draft_vocab, default="auto",
                       help="Medusa: heads score only the most frequent target tokens in the data: a count, full, or "
                            f"auto (default: a quarter of the vocabulary from {DRAFT_VOCAB_FROM} tokens up, all of it "
                            "below; full with --share-lm-head)")
    group.add_argument("--hard-label-weight", type=float, default=0.0,
                       help="weight of plain cross-entropy to the target's tokens, added to the divergence")
    joint = parser.add_argument_group(
        "Medusa-2 joint training (--kind medusa --joint): a LoRA on the backbone, trained with the heads; the "
        "backbone's outputs then differ from the original model's (lossless against the tuned backbone only)")
    joint.add_argument("--joint", action="store_true",
                       help="train a LoRA on the backbone with the heads (self-distilled against the original model)")
    lora_flags.add_arguments(joint)  # --lora-r, --lora-alpha, --lora-targets: shared with the draft kind's --lora
    joint.add_argument("--lora-lr", type=float, default=None, help="LoRA learning rate (default: --lr / 4)")
    joint.add_argument("--joint-heads-only-steps", type=int, default=None,
                       help="steps that train the heads alone before joint training (default: a quarter of --steps)")
    joint.add_argument("--joint-lambda", type=float, default=0.2,
                       help="weight of the heads' loss in the backbone's gradient once warmed up (default 0.2)")
    joint.add_argument("--joint-lambda-warmup", type=int, default=None,
                       help="steps over which that weight rises from 0 (default: a quarter of --steps)")


def options(args: argparse.Namespace) -> dict:
    """The ``attach_heads(kind="medusa", ...)`` options; None where a flag was not given."""
    size = getattr(args, "draft_vocab_size", None)
    return {"num_heads": args.num_heads, "num_layers": args.num_layers, "share_lm_head": args.share_lm_head or None,
            "draft_vocab_size": size if isinstance(size, int) else None}


def target_options(args: argparse.Namespace, vocab_size: int) -> dict:
    """``--draft-vocab-size auto`` resolved for a target of ``vocab_size`` tokens (the whole vocabulary
    with ``--share-lm-head``, whose heads read the output head itself)."""
    if getattr(args, "kind", None) != "medusa" or args.draft_vocab_size != "auto" or args.share_lm_head:
        return {}
    size = auto_draft_vocab(vocab_size)
    return {} if size is None else {"draft_vocab_size": size}


JOINT_FLAGS = ("lora_lr", "joint_heads_only_steps", "joint_lambda", "joint_lambda_warmup")
"""Joint-only flags; the LoRA flags are checked by :func:`heads.lora_flags.check`."""


def train_options(args: argparse.Namespace) -> dict:
    """The ``TrainConfig`` fields Medusa's flags set (ValueError for a joint flag without ``--joint``)."""
    defaults = {"joint_lambda": 0.2}
    given = [name for name in JOINT_FLAGS if getattr(args, name) != defaults.get(name)]
    if given and not args.joint:
        raise ValueError(f"{', '.join('--' + name.replace('_', '-') for name in given)}: joint-training option(s); "
                         "add --joint")
    return {"hard_label_weight": args.hard_label_weight, "joint": args.joint, **lora_flags.train_options(args),
            "lora_learning_rate": args.lora_lr, "joint_heads_only_steps": args.joint_heads_only_steps,
            "joint_lambda": args.joint_lambda, "joint_lambda_warmup_steps": args.joint_lambda_warmup}


ENGINE_FORMATS = {"vllm": ("medusa-vllm",), "sglang": ()}
"""``selfdraft export --format`` layouts of Medusa heads that each serving engine loads (SGLang's
speculative decoding takes EAGLE drafters and draft models, no Medusa heads)."""


def deploy(args: argparse.Namespace, engine: str | None, model_config) -> str:
    """Resolve ``selfdraft train --for`` for Medusa heads: every Medusa configuration exports to
    vLLM's layout, so only ``--for sglang`` is refused (ValueError)."""
    if engine == "sglang":
        raise ValueError("--for sglang: SGLang serves no Medusa heads (its speculative decoding takes EAGLE drafters "
                         "and draft models): use --kind eagle, or --for vllm")
    return engine or "any"


def exports(drafter: dict, model_config) -> dict[str, list[str]]:
    """``{format: reasons it cannot be written}`` (empty: it exports) for a Medusa drafter config
    ``drafter`` on a target of ``model_config``, before training."""
    from ..families import MEDUSA_EXPORT_FAMILIES, medusa_exportable

    family = model_config.get_text_config().model_type
    reasons = []
    if drafter.get("draft_vocab_size") is not None:
        reasons.append("FasterDecoding's MedusaModel scores the full vocabulary (train with --draft-vocab-size full)")
    if not medusa_exportable(family):
        reasons.append(f"FasterDecoding's MedusaModel loads {MEDUSA_EXPORT_FAMILIES} targets; this one is {family!r}")
    if drafter.get("num_layers", 1) > 1:
        reasons.append("FasterDecoding repeats one residual block per head (train with --num-layers 1)")
    return {"medusa-vllm": [], "medusa": reasons}
