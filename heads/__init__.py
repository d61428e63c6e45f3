"""selfdraft's public API: attach draft heads to a frozen Hugging Face causal LM.

    spec = heads.attach_heads(model, kind="medusa", num_heads=4)   # or kind="eagle", depth=5, ...
    ids = spec.generate(input_ids, max_new_tokens=128)     # == model.generate(do_sample=False)
    spec.last_stats.mean_accepted                          # tau: tokens per target forward
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import kinds  # the drafter registry: kinds' names and command-line flags, without torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .model import SpeculativeModel


__all__ = [
    "attach_heads", "load_heads", "SpeculativeModel", "MedusaConfig", "MedusaHeads", "EagleConfig", "EagleHeads",
    "DecodeStats", "kinds",
    "Backbone", "inspect_backbone", "SUPPORTED_ARCHITECTURES", "AdapterError", "TargetMismatchError", "TargetPin",
    "UnsupportedBackboneError", "InvalidTreeError",
]


def _refuse_foreign_options(entry, options: dict) -> None:
    """ValueError for options ``entry`` does not take, naming the kinds that do."""
    foreign = [name for name, value in options.items() if value is not None and name not in entry.options]
    if not foreign:
        return
    owners = [other.name for other in kinds.registry().values() if any(name in other.options for name in foreign)]
    if len(owners) == 1:
        whose = f"option(s) of kind={owners[0]!r}"
    else:
        whose = ("option(s) of kinds " + ", ".join(repr(owner) for owner in owners)) if owners else \
            "not an option of any kind"
    raise ValueError(f"{', '.join(foreign)}: {whose}, not of kind={entry.name!r} (its options: {list(entry.options)})")


def attach_heads(model: PreTrainedModel, kind: str = "medusa", lookup=None, merge_lora: bool = False,
                 learn=None, **options) -> SpeculativeModel:
    """Freeze ``model`` and attach a fresh (untrained) drafter of ``kind`` to it.

    Args:
        model: a decoder-only ``PreTrainedModel`` (eager or sdpa attention), or a peft ``PeftModel``
            of one: the drafter then runs its underlying model with the adapters active, and greedy
            output equals the ``PeftModel``'s own ``generate`` (its adapters are pinned with the base
            model when the drafter is saved).
        kind: a registered drafter kind (:func:`heads.kinds.names`): ``"medusa"`` (K heads on the
            top-layer features) or ``"eagle"`` (an autoregressive drafter in feature space with a
            dynamic tree), ...
        options: the kind's own options (``heads.kinds.get(kind).options``), e.g. Medusa's
            ``num_heads``, ``num_layers``, ``share_lm_head``, ``tree``; EAGLE's ``num_layers``,
            ``depth``, ``top_k``, ``total_tokens``, ``feature_layers``, ``draft_vocab_size``,
            ``layout`` (see :class:`MedusaConfig` and :class:`EagleConfig`). An option the kind
            does not take is a ValueError naming it.

        lookup: add lookup drafting to the kind's trees (a hybrid, see
            :meth:`SpeculativeModel.set_lookup`): True, a dict of lookup options or a ``LookupConfig``.
        merge_lora: with a ``PeftModel``, merge its adapters into the weights first (peft's
            ``merge_and_unload``, in place; the ``PeftModel`` then holds the merged model).
        learn: a learner's settings (e.g. ``training.online.OnlineConfig(budget=0.25)``): the drafter
            learns online from the calls it serves (:meth:`SpeculativeModel.learn`).

    The backbone's parameters get ``requires_grad=False``; its outputs are unchanged.
    """
    from .backbone import inspect_backbone
    from .loading import attach_backbone
    from .model import build_spec, check_learner_settings

    entry = kinds.get(kind)
    _refuse_foreign_options(entry, options)
    check_learner_settings(learn)
    config = entry.make_config(**options)
    model, backbone_lora = attach_backbone(model, merge_lora=merge_lora)
    target = inspect_backbone(model)
    model.requires_grad_(False)
    spec = build_spec(target, kind, config)
    spec.backbone_lora = backbone_lora
    if lookup:
        spec.set_lookup(lookup)
    spec.learn(learn)  # None / False: no learner
    return spec


def __getattr__(name: str):
    """The rest of the public API (:data:`__all__`; the submodules it imports become attributes
    too), imported with torch and transformers on first use: ``import heads`` alone costs nothing
    (``selfdraft --help``). Any other name is an AttributeError, as the import system expects of a
    submodule not imported yet."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from tree_attention.decode import DecodeStats
    from tree_attention.tree import InvalidTreeError

    from .adapter import AdapterError, TargetMismatchError, TargetPin
    from .backbone import SUPPORTED_ARCHITECTURES, Backbone, UnsupportedBackboneError, inspect_backbone
    from .eagle import EagleConfig, EagleHeads
    from .loading import load_heads
    from .medusa import MedusaConfig, MedusaHeads
    from .model import SpeculativeModel

    public = {"DecodeStats": DecodeStats, "InvalidTreeError": InvalidTreeError, "AdapterError": AdapterError,
              "TargetMismatchError": TargetMismatchError, "TargetPin": TargetPin,
              "SUPPORTED_ARCHITECTURES": SUPPORTED_ARCHITECTURES, "Backbone": Backbone,
              "UnsupportedBackboneError": UnsupportedBackboneError, "inspect_backbone": inspect_backbone,
              "EagleConfig": EagleConfig, "EagleHeads": EagleHeads, "load_heads": load_heads,
              "MedusaConfig": MedusaConfig, "MedusaHeads": MedusaHeads, "SpeculativeModel": SpeculativeModel}
    globals().update(public)  # later lookups find them without this function
    return public[name]
