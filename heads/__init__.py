"""selfdraft's public API: attach draft heads to a frozen Hugging Face causal LM.

    spec = heads.attach_heads(model, kind="medusa", num_heads=4)   # or kind="eagle", depth=5, ...
    ids = spec.generate(input_ids, max_new_tokens=128)     # == model.generate(do_sample=False)
    spec.last_stats.mean_accepted                          # tau: tokens per target forward
"""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedModel

from tree_attention.decode import DecodeStats
from tree_attention.tree import InvalidTreeError

from .adapter import AdapterError, TargetMismatchError, load_heads
from .backbone import SUPPORTED_ARCHITECTURES, Backbone, UnsupportedBackboneError, inspect_backbone
from .eagle import EagleConfig, EagleHeads
from .medusa import MedusaConfig, MedusaHeads
from .model import KINDS as _KINDS, SpeculativeModel, build_spec


__all__ = [
    "attach_heads", "load_heads", "SpeculativeModel", "MedusaConfig", "MedusaHeads", "EagleConfig", "EagleHeads",
    "DecodeStats",
    "Backbone", "inspect_backbone", "SUPPORTED_ARCHITECTURES", "AdapterError", "TargetMismatchError",
    "UnsupportedBackboneError", "InvalidTreeError",
]


def _refuse_options(kind: str, **options) -> None:
    given = [name for name, value in options.items() if value is not None]
    if given:
        other = "eagle" if kind == "medusa" else "medusa"
        raise ValueError(f"{', '.join(given)}: option(s) of kind={other!r}, not of kind={kind!r}")


def attach_heads(model: PreTrainedModel, kind: str = "medusa", num_heads: int | None = None, num_layers: int = 1,
                 share_lm_head: bool | None = None, tree=None, *, depth: int | None = None,
                 top_k: int | None = None, total_tokens: int | None = None,
                 feature_layers: Sequence[int] | None = None,
                 draft_vocab_size: int | None = None, layout: str | None = None) -> SpeculativeModel:
    """Freeze ``model`` and attach a fresh (untrained) drafter to it.

    Args:
        model: a decoder-only ``PreTrainedModel`` (eager or sdpa attention).
        kind: ``"medusa"`` (K heads on the top-layer features) or ``"eagle"`` (an autoregressive
            drafter in feature space with a dynamic tree).
        num_heads: Medusa heads K (default 4); head k predicts the token k + 2 positions ahead.
        num_layers: residual blocks per Medusa head; decoder layers of the EAGLE drafter.
        share_lm_head: Medusa: reuse the backbone's frozen output head in every head.
        tree: Medusa verification tree: a node count for a default tree, or a list of rank paths.
        depth: EAGLE: deepest level of the dynamic tree (default ``EagleConfig.depth``).
        top_k: EAGLE: children per expanded node and nodes expanded per level.
        total_tokens: EAGLE: drafted nodes verified per step (>= depth; given without ``depth``, it
            lowers the default depth to fit; 0: no drafting).
        feature_layers: EAGLE-3: backbone hidden states to fuse as input (0: embeddings,
            ``num_hidden_layers``: top layer); None: the top-layer features.
        draft_vocab_size: EAGLE-3: reduced draft vocabulary (set from data by the trainer).
        layout: EAGLE drafter architecture: ``"native"`` (default), ``"eagle1"`` or ``"eagle3"``
            (the EAGLE-1 layer / EAGLE-3 midlayer, exportable to those checkpoint layouts).

    The backbone's parameters get ``requires_grad=False``; its outputs are unchanged.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {tuple(_KINDS)}; got {kind!r}")
    if kind == "medusa":
        _refuse_options(kind, depth=depth, top_k=top_k, total_tokens=total_tokens,
                        feature_layers=feature_layers, draft_vocab_size=draft_vocab_size, layout=layout)
        config = MedusaConfig(num_heads=4 if num_heads is None else num_heads, num_layers=num_layers,
                              share_lm_head=bool(share_lm_head), tree=tree)
    else:
        _refuse_options(kind, num_heads=num_heads, share_lm_head=share_lm_head, tree=tree)
        shape = {name: value for name, value in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens))
                 if value is not None}
        config = EagleConfig(num_layers=num_layers, feature_layers=feature_layers,  # a lone total_tokens lowers depth
                             draft_vocab_size=draft_vocab_size, layout=layout or "native",
                             **EagleConfig().with_tree(shape).tree)
    target = inspect_backbone(model)
    model.requires_grad_(False)
    return build_spec(target, kind, config)
