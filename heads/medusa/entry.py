"""The medusa kind's registry entry, ``KIND``, and its public names. :mod:`heads.medusa` (whose
docstring describes the kind) hands them out on first use, so that its command-line options
(``heads.medusa.cli``) import without torch."""

from __future__ import annotations

from tree_attention.gumbel import GumbelRule
from tree_attention.verify import SamplingRule

from ..kind import DrafterKind, refuse_options
from . import cli
from .checkpoint import FORMATS, restore_sidecar
from .config import MedusaConfig
from .drafter import MedusaDrafter, resolve_tree
from .loss import MedusaLoss
from .modules import MedusaHeads, ResidualBlock

__all__ = ["KIND", "MedusaConfig", "MedusaDrafter", "MedusaHeads", "ResidualBlock", "resolve_tree", "bind_rule"]

OPTIONS = ("num_heads", "num_layers", "share_lm_head", "tree", "sample", "draft_vocab_size")


def make_config(num_heads: int | None = None, num_layers: int | None = None, share_lm_head: bool | None = None,
                tree=None, sample: str | None = None, draft_vocab_size: int | None = None, **others) -> MedusaConfig:
    """The config ``attach_heads(kind="medusa", ...)`` builds (defaults: 4 heads of 1 block over the
    whole vocabulary)."""
    refuse_options("medusa", OPTIONS, others)
    return MedusaConfig(num_heads=4 if num_heads is None else num_heads,
                        num_layers=1 if num_layers is None else num_layers,
                        share_lm_head=bool(share_lm_head), tree=tree, sample=sample or "auto",
                        draft_vocab_size=draft_vocab_size)


def build_heads(target, config: MedusaConfig) -> MedusaHeads:
    return MedusaHeads(config, target.hidden_size, target.vocab_size,
                       None if config.share_lm_head else target.output_head)


def build_drafter(spec, tree) -> MedusaDrafter:
    tree = tree if tree is not None else spec.config.tree
    template = resolve_tree(tree, spec.config.num_heads, spec.accuracy)
    drafter = MedusaDrafter(spec.heads, template, spec.shared_logits if spec.config.share_lm_head else None,
                            spec.config.sample)
    drafter.shapes = lambda size: resolve_tree(size, spec.config.num_heads, spec.accuracy)
    return drafter


def bind_rule(drafter, rule):
    """``drafter`` set up for the serving ``rule``: candidates drawn from the heads' distributions
    under the rule's own warp and generator when the rule samples losslessly and the config's
    ``sample`` mode allows it; for seeded sampling, the candidates the rule's own noise ranks first
    (coupled); the heads' top-k tokens otherwise (greedy, typical, ``never``)."""
    if not isinstance(drafter, MedusaDrafter):
        return drafter
    sampled = isinstance(rule, SamplingRule) and rule.lossless and drafter.sample != "never"
    drafter.sample_with(rule.warp if sampled else None, rule.generator if sampled else None)
    # seeded sampling: candidates ranked with the noise the target draws with (coupled)
    drafter.couple_with(rule if isinstance(rule, GumbelRule) and rule.keys is not None else None)
    return drafter


KIND = DrafterKind(
    name="medusa", config_class=MedusaConfig, make_config=make_config, build_heads=build_heads,
    build_drafter=build_drafter, options=OPTIONS, static_tree=True, formats=FORMATS,
    sidecar_keys=("num_heads", "num_layers"), restore_sidecar=restore_sidecar, bind_rule=bind_rule,
    loss=MedusaLoss, cli=cli,
    extra={"joint_training": True},  # Medusa-2: TrainConfig.joint trains a LoRA on the backbone too
)
