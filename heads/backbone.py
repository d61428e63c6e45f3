"""The :class:`Backbone` view of a Hugging Face causal LM: what drafters and the loop need from
it, found through the public API (family-specific knowledge lives in :mod:`heads.families`).

:class:`Backbone` wraps an unmodified ``PreTrainedModel`` and exposes what drafters and the
decode loop need: input embeddings, output head, final norm, hidden and vocab sizes, the
top-layer features (the hidden state that feeds the output head, i.e. after the final norm),
the attention layout (sliding windows, per-layer-type masks) and a fingerprint of the weights.
It runs the model through its public forward only: ``input_ids``, a 4D ``attention_mask``,
``position_ids`` and a ``Cache``.

Drafters that read more than the top layer (EAGLE-3 feature fusion) get a *view* of the backbone
with ``feature_layers`` set (:meth:`Backbone.with_feature_layers`): its ``forward`` then returns
the concatenation of those layers' hidden states as the features, so the decode loop hands them
to the drafter without knowing what they are.

At construction it *probes* the model on a few tokens: the logits it rebuilds from the features
must equal the model's own, and a 4D mask that hides a token must really hide it. A model that
fails either is refused with :class:`UnsupportedBackboneError` instead of decoding wrongly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from tree_attention import cache as cache_ops
from tree_attention.mask import AttentionMask, MaskLayout, additive_mask, prefill_attention_mask

from . import lora
from .families import SUPPORTED_ARCHITECTURES, UnsupportedBackboneError
from .fingerprint import state_fingerprint, strided_sample, weight_sample

logger = logging.getLogger(__name__)

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f", "final_norm")
_PROBE_TOLERANCE = 1e-4


def _causal_lm_class_names() -> set[str]:
    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(value if isinstance(value, (tuple, list)) else (value,))
    return names


def check_causal_lm(model: object) -> None:
    """Raise :class:`UnsupportedBackboneError` unless ``model`` is a decoder-only causal LM."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedBackboneError(
            f"{type(model).__name__} is not a transformers PreTrainedModel; selfdraft drafts for decoder-only "
            f"causal LMs loaded with AutoModelForCausalLM (tested: {supported})"
        )
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedBackboneError(
            f"{type(model).__name__} is an encoder-decoder (seq2seq) model; selfdraft supports decoder-only "
            f"causal LMs (tested: {supported})"
        )
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or type(model).__name__ not in _causal_lm_class_names():
        raise UnsupportedBackboneError(
            f"{type(model).__name__} (model_type {config.model_type!r}) is not a decoder-only causal LM; "
            f"load a model with AutoModelForCausalLM (tested: {supported})"
        )


def _final_norm(base: nn.Module) -> nn.Module | None:
    for name in _FINAL_NORM_NAMES:
        module = getattr(base, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def attention_layout(config) -> MaskLayout:
    """Which masks the model's forward expects (see ``tree_attention.mask.MaskLayout``)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = dict.fromkeys(layer_types)
        unknown = set(kinds) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedBackboneError(
                f"{config.model_type}: layer types {sorted(unknown)} are not supported "
                "(only full_attention and sliding_attention layers can take a tree mask)"
            )
        return {kind: (window if kind == "sliding_attention" else None) for kind in kinds}
    if window is not None and getattr(config, "use_sliding_window", True):
        return int(window)
    return None


class OutputRows(NamedTuple):
    """Output-head rows for :meth:`Backbone.logits`: weight ``[V', d]``, bias ``[V']`` or None, and
    an optional norm applied to the features first (a drafter's own final norm, EAGLE-3)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    norm: nn.Module | None = None


@dataclass
class Backbone:
    """A frozen causal LM seen through its public API. Implements ``tree_attention.decode.Target``."""

    model: PreTrainedModel
    base: nn.Module
    input_embeddings: nn.Embedding
    output_head: nn.Linear
    final_norm: nn.Module | None
    hidden_size: int
    vocab_size: int
    layout: MaskLayout
    feature_layers: tuple[int, ...] | None = None
    """Hidden-state indices whose concatenation ``forward`` returns as features (None: the top
    layer). Index 0 is the embedding output, ``i`` the output of decoder layer ``i`` and
    ``num_layers`` the top-layer features (after the final norm)."""
    _post: tuple | None = field(default=None, init=False, repr=False, compare=False)
    """The output head's post-processing from the config (soft-cap, scale, divisor), read on first use."""

    @property
    def dtype(self) -> torch.dtype:
        return self.output_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.output_head.weight.device

    @property
    def model_type(self) -> str:
        return self.model.config.model_type

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def output_rows(self, token_ids: torch.Tensor | None, norm: nn.Module | None = None) -> OutputRows:
        """Rows of the output head for ``token_ids`` ``[V']`` (None: all rows, no copy): weight
        ``[V', d]`` and bias ``[V']`` (None when the head has none), for :meth:`logits` over a
        reduced vocabulary; ``norm`` is applied to the features before the head."""
        weight, bias = self.output_head.weight, self.output_head.bias
        if token_ids is not None:
            weight = weight.index_select(0, token_ids)
            bias = None if bias is None else bias.index_select(0, token_ids)
        return OutputRows(weight, bias, norm)

    def logits(self, features: torch.Tensor, rows: OutputRows | None = None) -> torch.Tensor:
        """Output head on top-layer features ``[..., d]`` → ``[..., V]``, with the family's own
        post-processing (logit soft-capping, logit scaling) applied as the model does.

        With ``rows`` (from :meth:`output_rows`) only those vocabulary rows: ``[..., V']``, after
        ``rows.norm`` when it has one.
        """
        if rows is None:
            logits = self.output_head(features)
        else:
            if rows.norm is not None:
                features = rows.norm(features)
            logits = nn.functional.linear(features, rows.weight, rows.bias)
        return self.postprocess(logits)

    def postprocess(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's own post-processing of output-head logits (soft-capping, scaling), as
        :meth:`logits` applies it; for logits a drafter computed from its own output rows."""
        if self._post is None:  # read once: a config attribute read costs microseconds, and this runs per level
            config = self.model.config
            scale = getattr(config, "logit_scale", None)  # Cohere multiplies
            self._post = (getattr(config, "final_logit_softcapping", None),
                          scale if scale is not None and config.model_type.startswith("cohere") else None,
                          getattr(config, "logits_scaling", None))  # Granite divides
        softcap, scale, divisor = self._post
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if scale is not None:
            logits = logits * scale
        if divisor is not None:
            logits = logits / divisor
        return logits

    def features(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: AttentionMask,
                 cache) -> torch.Tensor:
        """Top-layer features ``[B, T, d]`` (after the final norm); appends ``T`` positions to ``cache``."""
        keyword = cache_ops.cache_keyword(self.base)
        outputs = self.base(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            use_cache=cache is not None, **{keyword: cache},
        )
        return outputs.last_hidden_state

    def hidden_features(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                        attention_mask: AttentionMask | None, cache,
                        layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-layer features ``[B, T, d]`` and the concatenated hidden states of ``layers``
        ``[B, T, len(layers) * d]`` (indices as in :attr:`feature_layers`), from one forward."""
        keyword = cache_ops.cache_keyword(self.base)
        outputs = self.base(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            use_cache=cache is not None, output_hidden_states=True, **{keyword: cache},
        )
        states = outputs.hidden_states
        if states is None or len(states) != self.num_layers + 1:
            raise UnsupportedBackboneError(
                f"{type(self.model).__name__}: expected {self.num_layers + 1} hidden states with "
                f"output_hidden_states=True, got {None if states is None else len(states)}"
            )
        top = outputs.last_hidden_state
        chosen = [top if index == self.num_layers else states[index] for index in layers]
        return top, torch.cat(chosen, dim=-1)

    def with_feature_layers(self, layers: Sequence[int] | None) -> "Backbone":
        """A view whose ``forward`` returns the concatenated hidden states of ``layers`` as features
        (None: the top-layer features). Raises ValueError for an index outside ``0..num_layers``."""
        if layers is not None:
            layers = tuple(int(index) for index in layers)
            bad = [index for index in layers if not 0 <= index <= self.num_layers]
            if bad or not layers:
                raise ValueError(
                    f"feature_layers {list(layers)}: indices must lie in 0..{self.num_layers} for this "
                    f"{self.num_layers}-layer {self.model_type} (0: embeddings, {self.num_layers}: top layer)"
                )
        return dataclasses.replace(self, feature_layers=layers)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: AttentionMask,
                cache, logits_rows: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[B, T, F]`` (top layer, or :attr:`feature_layers` concatenated) and float
        logits of all rows or the last one."""
        if self.feature_layers is None:
            top = features = self.features(input_ids, position_ids, attention_mask, cache)
        else:
            top, features = self.hidden_features(input_ids, position_ids, attention_mask, cache,
                                                 self.feature_layers)
        rows = top[:, -1:] if logits_rows == "last" else top
        return features, self.logits(rows).float()

    def fingerprint(self) -> dict:
        return target_fingerprint(self.model)


def inspect_backbone(model: PreTrainedModel, probe: bool = True) -> Backbone:
    """Find the parts of ``model`` that drafting needs and check that tree verification is exact.

    Raises:
        UnsupportedBackboneError: not a decoder-only causal LM, an attention implementation other
            than eager or sdpa, no cache support, or a probe failure.
    """
    check_causal_lm(model)
    config = model.config
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise UnsupportedBackboneError(
            f"attn_implementation {implementation!r} is not supported: tree verification passes a 4D attention "
            f"mask, which only {ATTENTION_IMPLEMENTATIONS} honour; load the model with attn_implementation='sdpa'"
        )
    base = model.base_model
    output_head = model.get_output_embeddings()
    input_embeddings = model.get_input_embeddings()
    if base is model or not isinstance(output_head, nn.Linear) or input_embeddings is None:
        raise UnsupportedBackboneError(
            f"{type(model).__name__}: could not find a base model, a linear output head and input embeddings"
        )
    cache_ops.cache_keyword(base)  # raises when the forward takes no Cache
    backbone = Backbone(
        model=model, base=base, input_embeddings=input_embeddings, output_head=output_head,
        final_norm=_final_norm(base), hidden_size=int(output_head.in_features),
        vocab_size=int(output_head.out_features), layout=attention_layout(config),
    )
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        logger.info("model_type %r is not among the tested architectures %s; relying on the probe",
                    config.model_type, SUPPORTED_ARCHITECTURES)
    if probe:
        probe_backbone(backbone)
    return backbone


@torch.no_grad()
def probe_backbone(backbone: Backbone, length: int = 6) -> None:
    """Check on ``length`` tokens that (1) logits rebuilt from features equal the model's own and
    (2) a 4D mask is honoured: a sequence whose second token is masked out must give the same
    last-position logits as the sequence without that token."""
    model = backbone.model
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, backbone.vocab_size, (1, length), generator=generator).to(backbone.device)
    positions = torch.arange(length, device=backbone.device).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        reference = model(input_ids=ids, use_cache=False).logits.float()
        mask = prefill_attention_mask(length, backbone.layout, backbone.dtype, backbone.device)
        features, logits = backbone.forward(ids, positions, mask, None, "all")
        error = (logits - reference).abs().max().item()
        if not error <= _PROBE_TOLERANCE * max(1.0, reference.abs().max().item()):
            raise UnsupportedBackboneError(
                f"{type(model).__name__}: logits rebuilt from the top-layer features differ from the model's own "
                f"by {error:.3g}; this family's output head is not understood (please report it)"
            )
        # Hide token 1 from everything after it, keep positions: must equal the sequence without token 1.
        visible = torch.ones(length, length, dtype=torch.bool, device=backbone.device).tril_()
        visible[2:, 1] = False
        hidden_mask = additive_mask(visible.unsqueeze(0), backbone.dtype)
        if isinstance(backbone.layout, dict):
            hidden_mask = {kind: hidden_mask for kind in backbone.layout}
        _, masked = backbone.forward(ids, positions, hidden_mask, None, "last")
        kept = [0] + list(range(2, length))
        _, dropped = backbone.forward(ids[:, kept], positions[:, kept],
                                      prefill_attention_mask(length - 1, None, backbone.dtype, backbone.device),
                                      None, "last")
        error = (masked - dropped).abs().max().item()
        if not error <= _PROBE_TOLERANCE * max(1.0, dropped.abs().max().item()):
            raise UnsupportedBackboneError(
                f"{type(model).__name__} with attn_implementation "
                f"{model.config._attn_implementation!r} does not honour a custom 4D attention mask "
                f"(difference {error:.3g}); tree verification would be wrong"
            )
    finally:
        model.train(was_training)


_IDENTITY_IGNORED_KEYS = {
    "_name_or_path", "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "torch_dtype", "dtype", "transformers_version", "use_cache", "output_hidden_states", "output_attentions",
    "return_dict", "_commit_hash", "architectures",
}


def config_hash(config) -> str:
    """sha256 of the config's architecture-defining fields (load-time settings such as dtype,
    attention kernel or path are left out)."""
    data = {k: v for k, v in config.to_dict().items() if k not in _IDENTITY_IGNORED_KEYS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


_strided_sample = strided_sample  # the name benchmarks/studies/adapter_costs times


def weights_fingerprint(model: nn.Module, samples_per_tensor: int = 1024) -> str:
    """sha256 over a fixed strided sample of every parameter and buffer, rounded to bfloat16
    (:func:`heads.fingerprint.state_fingerprint`).

    Cost is ``O(samples_per_tensor)`` elements per tensor whatever its size or memory layout, so
    it is cheap on large models. Exact identity: fp32 and bf16 copies of one checkpoint agree, an
    fp16 copy may not (the pin's ``weights_sample``, :func:`weights_sample`, is the dtype-tolerant
    check). A model carrying peft adapters (LoRA) is fingerprinted as its base model
    (:func:`heads.lora.base_state_dict`); the adapters have their own fingerprint
    (:func:`heads.lora.adapter_fingerprint`).
    """
    return state_fingerprint(lora.base_state_dict(model), samples_per_tensor)


def weights_sample(model: nn.Module) -> dict:
    """A few float32 values of every base-model tensor (:func:`heads.fingerprint.weight_sample`),
    compared with a rounding tolerance so that fp32, fp16 and bf16 copies of one checkpoint match."""
    return weight_sample(lora.base_state_dict(model))


_HUB_SNAPSHOT = re.compile(r"(?:^|[\\/])snapshots[\\/]([0-9a-f]{40})[\\/]?$")


def model_revision(model: PreTrainedModel) -> str | None:
    """The commit of the checkpoint when it is known: the config's ``_commit_hash`` (set by
    transformers before 5.x) or the commit directory of a Hugging Face cache snapshot path."""
    config = model.config
    commit = getattr(config, "_commit_hash", None)
    if commit:
        return str(commit)
    match = _HUB_SNAPSHOT.search(str(getattr(config, "_name_or_path", "") or ""))
    return match.group(1) if match else None


def target_fingerprint(model: PreTrainedModel, revision: str | None = None) -> dict:
    """The identity an adapter records about its target (``revision``: the checkpoint's commit
    when the caller knows it, else :func:`model_revision`). A model carrying peft adapters (a
    ``PeftModel`` or a model with LoRA layers injected) is its base checkpoint plus
    ``lora_sha256``, the fingerprint of its active adapters (:func:`heads.lora.adapter_fingerprint`)."""
    model = lora.underlying_model(model)
    config = model.config
    output_head = model.get_output_embeddings()
    adapters = lora.adapter_fingerprint(model)
    return {**({"lora_sha256": adapters} if adapters is not None else {}),
        "name_or_path": getattr(config, "_name_or_path", "") or "",
        "revision": revision or model_revision(model),
        "model_type": config.model_type,
        "config_sha256": config_hash(config),
        "weights_sha256": weights_fingerprint(model),
        "weights_sample": weights_sample(model),
        "vocab_size": int(output_head.out_features),
        "hidden_size": int(output_head.in_features),
        "dtype": str(output_head.weight.dtype).replace("torch.", ""),
    }
