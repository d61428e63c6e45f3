"""Medusa heads (Cai et al. 2024): ``K`` extra next-next-token predictors on the backbone's
top-layer features, verified as a static tree. Registered as ``KIND`` (see :mod:`heads.kinds`)."""

from __future__ import annotations

from ..kind import DrafterKind, refuse_options
from . import cli
from .checkpoint import FORMATS, restore_sidecar
from .config import MedusaConfig
from .drafter import MedusaDrafter, resolve_tree
from .loss import MedusaLoss
from .modules import MedusaHeads, ResidualBlock

__all__ = ["KIND", "MedusaConfig", "MedusaDrafter", "MedusaHeads", "ResidualBlock", "resolve_tree"]

OPTIONS = ("num_heads", "num_layers", "share_lm_head", "tree")


def make_config(num_heads: int | None = None, num_layers: int | None = None, share_lm_head: bool | None = None,
                tree=None, **others) -> MedusaConfig:
    """The config ``attach_heads(kind="medusa", ...)`` builds (defaults: 4 heads of 1 block)."""
    refuse_options("medusa", OPTIONS, others)
    return MedusaConfig(num_heads=4 if num_heads is None else num_heads,
                        num_layers=1 if num_layers is None else num_layers,
                        share_lm_head=bool(share_lm_head), tree=tree)


def build_heads(target, config: MedusaConfig) -> MedusaHeads:
    return MedusaHeads(config, target.hidden_size, target.vocab_size,
                       None if config.share_lm_head else target.output_head)


def build_drafter(spec, tree) -> MedusaDrafter:
    template = resolve_tree(tree if tree is not None else spec.config.tree, spec.config.num_heads, spec.accuracy)
    return MedusaDrafter(spec.heads, template, spec.shared_logits if spec.config.share_lm_head else None)


KIND = DrafterKind(
    name="medusa", config_class=MedusaConfig, make_config=make_config, build_heads=build_heads,
    build_drafter=build_drafter, options=OPTIONS, static_tree=True, formats=FORMATS,
    sidecar_keys=("num_heads", "num_layers"), restore_sidecar=restore_sidecar, loss=MedusaLoss, cli=cli,
    extra={"joint_training": True},  # Medusa-2: TrainConfig.joint trains a LoRA on the backbone too
)
