"""The one module that knows model families: which families are tested, which decoder layers
are Llama-style, how a family's decoder stack is copied for a drafter, its rotary calling
convention, and the config keys that checkpoint exports need. Drafter kinds ask here; they never
test ``model_type`` themselves.

Functions take the :class:`~heads.backbone.Backbone` view (duck-typed: ``model``, ``base``,
``model_type``) so that this module does not import it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox", "phi3", "gemma2")
"""Families covered by the parity tests. Other decoder-only causal LMs are accepted when they pass
the construction probe, with a log message that they are untested."""


class UnsupportedBackboneError(TypeError):
    """The model cannot serve as a target: wrong kind of model, attention kernel or behaviour."""


EAGLE_LAYOUT_FAMILIES: dict[str, tuple[str, ...] | None] = {
    "native": None,  # any family that passes the probe
    "eagle1": ("llama", "mistral", "qwen2"),
    "eagle3": ("llama",),
}
"""EAGLE drafter layouts and the model families each supports (None: every family). ``eagle1``
and ``eagle3`` need a Llama-style decoder layer (``input_layernorm``, ``self_attn`` with separate
``q/k/v/o_proj``, ``post_attention_layernorm``, ``mlp``) and a base model with ``norm``."""


def check_eagle_layout(backbone, layout: str) -> None:
    """Raise ValueError unless ``backbone``'s family supports the EAGLE drafter ``layout``
    (see :data:`EAGLE_LAYOUT_FAMILIES`), naming the family and the layouts it supports."""
    if layout not in EAGLE_LAYOUT_FAMILIES:
        raise ValueError(f"EAGLE layout must be one of {tuple(EAGLE_LAYOUT_FAMILIES)}; got {layout!r}")
    families = EAGLE_LAYOUT_FAMILIES[layout]
    if families is None:
        return
    family = backbone.model_type
    layer = _first_layer(backbone.base)
    llama_style = (layer is not None and isinstance(getattr(backbone.base, "norm", None), nn.Module)
                   and all(isinstance(getattr(layer, name, None), nn.Module)
                           for name in ("input_layernorm", "post_attention_layernorm", "mlp"))
                   and all(isinstance(getattr(getattr(layer, "self_attn", None), name, None), nn.Linear)
                           for name in ("q_proj", "k_proj", "v_proj", "o_proj")))
    if family not in families or not llama_style:
        supported = [name for name, allowed in EAGLE_LAYOUT_FAMILIES.items() if allowed is None or family in allowed]
        raise ValueError(
            f"EAGLE layout {layout!r} builds Llama-style decoder layers and supports the families "
            f"{list(families)}; this backbone is {family!r}, which supports the layouts {supported}"
        )


LEAN_DECODER_FAMILIES = ("llama", "mistral", "qwen2")
"""Families whose decoder layer is exactly the computation :class:`heads.lean.LeanDecoder` writes
out: pre-norm residual attention (separate ``q/k/v/o_proj``, half-split rotary, no query/key norms,
no attention soft-capping, ``scaling`` as the softmax scale) and a pre-norm residual MLP."""


def _rms_norm_or_identity(module: nn.Module) -> bool:
    """An identity, or an RMS norm that scales by ``weight`` (not ``1 + weight``) after
    normalising in float32 with ``variance_epsilon``: the Llama, Mistral and Qwen2 norms."""
    if isinstance(module, nn.Identity):
        return True
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float) and not list(module.children()))


def lean_decoder_ok(decoder: nn.Module) -> bool:
    """True when a drafter's decoder copy may run through :class:`heads.lean.LeanDecoder`: a family
    of :data:`LEAN_DECODER_FAMILIES` with exactly the expected modules in every layer."""
    if not _lean_family(decoder):
        return False
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return False
    if not all(isinstance(getattr(decoder, name, None), nn.Module) for name in ("norm", "rotary_emb")):
        return False
    if not _rms_norm_or_identity(decoder.norm):
        return False
    return all(_lean_layer_ok(getattr(layer, "self_attn", None), layer,
                              ("input_layernorm", "post_attention_layernorm")) for layer in layers)


def lean_midlayer_ok(midlayer: nn.Module) -> bool:
    """True when an EAGLE-3 midlayer (:class:`heads.eagle.modules.Eagle3Midlayer`) may run through
    :class:`heads.lean.LeanMidlayer`: a family of :data:`LEAN_DECODER_FAMILIES` whose attention, MLP
    and three norms are exactly the expected modules."""
    if not _lean_family(midlayer) or not isinstance(getattr(midlayer, "rotary_emb", None), nn.Module):
        return False
    return _lean_layer_ok(getattr(midlayer, "self_attn", None), midlayer,
                          ("input_layernorm", "hidden_norm", "post_attention_layernorm"))


def _lean_family(module: nn.Module) -> bool:
    """``module``'s config names a family of :data:`LEAN_DECODER_FAMILIES` without attention
    soft-capping."""
    config = getattr(module, "config", None)
    return (getattr(config, "model_type", None) in LEAN_DECODER_FAMILIES
            and getattr(config, "attn_logit_softcapping", None) is None)


def _lean_layer_ok(attention: nn.Module | None, owner: nn.Module, norms: tuple[str, ...]) -> bool:
    """The attention (separate ``q/k/v/o_proj`` linears, no query/key norms, an int ``head_dim`` and
    a float ``scaling``), the MLP (``gate/up/down_proj`` and ``act_fn`` only) and the ``norms`` of
    ``owner`` (RMS norms or identities) that the lean layer body writes out."""
    if not all(isinstance(getattr(owner, name, None), nn.Module) for name in (*norms, "mlp")):
        return False
    if not all(isinstance(getattr(attention, name, None), nn.Linear) for name in ("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj")):
        return False
    if any(hasattr(attention, name) for name in ("q_norm", "k_norm")):
        return False
    mlp = owner.mlp
    if not all(isinstance(getattr(mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj")):
        return False
    if not callable(getattr(mlp, "act_fn", None)) or set(name for name, _ in mlp.named_children()) - {
            "gate_proj", "up_proj", "down_proj", "act_fn"}:
        return False
    if not all(_rms_norm_or_identity(getattr(owner, name)) for name in norms):
        return False
    return isinstance(getattr(attention, "head_dim", None), int) and isinstance(getattr(attention, "scaling", None),
                                                                                 float)


def position_limit(backbone) -> int | None:
    """The number of positions a family with a learned position table (GPT-2's ``wpe``: an
    ``nn.Embedding`` of ``max_position_embeddings`` rows on the base model) can embed; position
    ids must stay below it. None for rotary and other families without a hard limit."""
    limit = getattr(backbone.model.config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    inputs = backbone.model.get_input_embeddings()
    for module in backbone.base.children():
        if isinstance(module, nn.Embedding) and module is not inputs and module.num_embeddings == limit:
            return limit
    return None


def _first_layer(base: nn.Module) -> nn.Module | None:
    layers = getattr(base, "layers", None)
    return layers[0] if isinstance(layers, nn.ModuleList) and len(layers) else None


def decoder_copy(backbone, num_layers: int = 1, layout: str = "native") -> nn.Module:
    """A fresh, randomly initialised ``num_layers``-layer copy of the backbone's base model, of its
    family and width, with its token-embedding table removed (feed it ``inputs_embeds``).

    The config is copied with ``num_hidden_layers`` (and ``layer_types``) cut to ``num_layers`` and
    every dropout rate set to 0. What stays (position embeddings of absolute-position families, the
    final norm, rotary tables) belongs to the copy. Runs through the family's public forward with
    ``inputs_embeds``, ``position_ids``, a 4D mask and a ``Cache``.

    ``layout="eagle1"``: the EAGLE-1 decoder, i.e. the first layer's input layernorm and the final
    norm replaced by identities (the output is the residual stream of the last layer); ValueError
    for a family :func:`check_eagle_layout` refuses.
    """
    if layout not in ("native", "eagle1"):
        raise ValueError(f"decoder_copy builds the 'native' or 'eagle1' layout; got {layout!r}")
    check_eagle_layout(backbone, layout)
    config = copy.deepcopy(backbone.model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    decoder = type(backbone.base)(config)
    embeddings = decoder.get_input_embeddings()
    for name, child in list(decoder.named_children()):
        if child is embeddings:
            setattr(decoder, name, None)
    if any(module is embeddings for module in decoder.modules()):
        raise UnsupportedBackboneError(
            f"{type(backbone.base).__name__}: could not remove the token embeddings from the drafter's decoder copy"
        )
    if layout == "eagle1":
        decoder.layers[0].input_layernorm = nn.Identity()
        decoder.norm = nn.Identity()
    return decoder


def eagle3_parts(backbone) -> dict[str, object]:
    """Fresh modules of the backbone's family for an EAGLE-3 midlayer (one decoder layer wide):
    ``self_attn`` (the family's attention with ``q/k/v_proj`` taking ``2d`` inputs),
    ``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``, ``mlp``, ``norm`` and
    ``rotary_emb``, plus the decoder copy's ``config``. ValueError for a family other than Llama."""
    check_eagle_layout(backbone, "eagle3")
    decoder = decoder_copy(backbone, 1)
    layer = decoder.layers[0]
    attention = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        linear = getattr(attention, name)
        setattr(attention, name, nn.Linear(2 * linear.in_features, linear.out_features, bias=linear.bias is not None))
    return {"self_attn": attention, "input_layernorm": layer.input_layernorm,
            "hidden_norm": copy.deepcopy(layer.input_layernorm),
            "post_attention_layernorm": layer.post_attention_layernorm, "mlp": layer.mlp,
            "norm": decoder.norm, "rotary_emb": decoder.rotary_emb, "config": decoder.config}


LLAMA_EXPORT_FAMILIES = ("llama",)
"""Families whose checkpoints other projects' EAGLE loaders (Llama decoder layers) can serve."""

MEDUSA_EXPORT_FAMILIES = ("llama", "mistral")
"""Families FasterDecoding's ``MedusaModel.from_pretrained`` supports."""

_LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias", "mlp_bias", "vocab_size",
               "bos_token_id", "eos_token_id", "pad_token_id")
LLAMA_CHECKED_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "hidden_act", "rms_norm_eps", "vocab_size", "attention_bias", "mlp_bias", "rope_theta")


def is_llama(model_type: str | None) -> bool:
    """Whether ``model_type`` is the Llama family itself (what EAGLE checkpoint loaders build)."""
    return model_type in LLAMA_EXPORT_FAMILIES


def medusa_exportable(model_type: str | None) -> bool:
    """Whether FasterDecoding's Medusa loader supports ``model_type``."""
    return model_type in MEDUSA_EXPORT_FAMILIES


def rope_theta(config) -> float | None:
    """The rotary base of a config (``rope_parameters`` in transformers 5, ``rope_theta`` before)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(config, "rope_theta", None))


def llama_config(model, num_layers: int, architectures: list[str], dtype: str) -> dict:
    """The Llama ``config.json`` of a ``num_layers``-layer drafter on ``model``'s width."""
    source = model.config
    data = {key: getattr(source, key) for key in _LLAMA_KEYS if getattr(source, key, None) is not None}
    parameters = dict(getattr(source, "rope_parameters", None) or {})
    data.update(architectures=architectures, model_type="llama", num_hidden_layers=num_layers,
                tie_word_embeddings=False, torch_dtype=dtype, rope_theta=rope_theta(source))
    if parameters.get("rope_type", "default") != "default":  # older loaders read rope_scaling
        data["rope_scaling"] = {key: value for key, value in parameters.items() if key != "rope_theta"}
    if parameters:
        data["rope_parameters"] = parameters
    return data


def llama_config_differences(config: dict, model) -> list[str]:
    """Where a checkpoint's Llama ``config`` and ``model``'s differ in the keys a layer's shape
    depends on; a non-Llama ``model`` is itself a difference."""
    ours = {key: getattr(model.config, key, None) for key in LLAMA_CHECKED_KEYS}
    ours["rope_theta"] = rope_theta(model.config)
    theirs = dict(config)
    theirs.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    differences = [f"{key} {theirs[key]!r} (target {ours[key]!r})" for key in LLAMA_CHECKED_KEYS
                   if theirs.get(key) is not None and ours[key] is not None and theirs[key] != ours[key]]
    if not is_llama(model.config.model_type):
        differences.insert(0, f"target family {model.config.model_type!r} (not Llama)")
    return differences


def rotary_attention(attention: nn.Module, rotary: nn.Module, inputs: torch.Tensor, position_ids: torch.Tensor,
                     attention_mask, cache_keyword: str, cache) -> torch.Tensor:
    """Call a Llama-style attention module the way its decoder layer does: rotary tables computed
    by the model's ``rotary_emb`` from ``position_ids`` and passed as ``position_embeddings``.
    ``inputs`` ``[B, T, *]`` → attention output ``[B, T, d]``."""
    position_embeddings = rotary(inputs, position_ids)
    attended, _ = attention(hidden_states=inputs, position_embeddings=position_embeddings,
                            attention_mask=attention_mask, **{cache_keyword: cache})
    return attended
