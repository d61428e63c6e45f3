"""selfdraft's public API: attach draft heads to a frozen Hugging Face causal LM.

    spec = heads.attach_heads(model, kind="medusa", num_heads=4)
    ids = spec.generate(input_ids, max_new_tokens=128)     # == model.generate(do_sample=False)
    spec.last_stats.mean_accepted                          # tau: tokens per target forward
"""

from __future__ import annotations

from transformers import PreTrainedModel

from tree_attention.decode import DecodeStats
from tree_attention.tree import InvalidTreeError

from .adapter import AdapterError, TargetMismatchError, load_heads
from .backbone import SUPPORTED_ARCHITECTURES, Backbone, UnsupportedBackboneError, inspect_backbone
from .medusa import MedusaConfig, MedusaHeads
from .model import KINDS as _KINDS, SpeculativeModel, build_spec


__all__ = [
    "attach_heads", "load_heads", "SpeculativeModel", "MedusaConfig", "MedusaHeads", "DecodeStats",
    "Backbone", "inspect_backbone", "SUPPORTED_ARCHITECTURES", "AdapterError", "TargetMismatchError",
    "UnsupportedBackboneError", "InvalidTreeError",
]


def attach_heads(model: PreTrainedModel, kind: str = "medusa", num_heads: int = 4, num_layers: int = 1,
                 share_lm_head: bool = False, tree=None) -> SpeculativeModel:
    """Freeze ``model`` and attach a fresh (untrained) drafter to it.

    Args:
        model: a decoder-only ``PreTrainedModel`` (eager or sdpa attention).
        kind: ``"medusa"`` (``"eagle"`` arrives with the EAGLE drafter).
        num_heads: Medusa heads K; head k predicts the token k + 2 positions ahead.
        num_layers: residual blocks per head.
        share_lm_head: reuse the backbone's frozen output head in every head.
        tree: verification tree: a node count for a default tree, or a list of rank paths.

    The backbone's parameters get ``requires_grad=False``; its outputs are unchanged.
    """
    if kind == "eagle" and kind not in _KINDS:
        raise NotImplementedError("kind='eagle': the EAGLE drafter is a separate capability not available yet")
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {tuple(_KINDS)}; got {kind!r}")
    target = inspect_backbone(model)
    model.requires_grad_(False)
    config = MedusaConfig(num_heads=num_heads, num_layers=num_layers, share_lm_head=share_lm_head, tree=tree)
    return build_spec(target, kind, config)
