"""vLLM speculators' layout of an EAGLE-3 drafter (``selfdraft export --format speculators``).

A speculators checkpoint wraps the EAGLE-3 layer in its own config and names; this module
translates between it and the ``eagle3`` layout of :mod:`heads.eagle.checkpoint`, which does the
rest (refusals, layer order, draft vocabulary, checks against the target).

Matched against vllm-project/speculators at c05b95b (release v0.7.0), source read there:

* ``src/speculators/config.py``: ``SpeculatorModelConfig`` (``speculators_model_type``,
  ``speculators_version``, ``speculators_config``; PretrainedConfig's ``model_type`` is stripped on
  save), ``SpeculatorsConfig`` (``algorithm``, ``proposal_methods``, ``default_proposal_method``,
  ``verifier``) and ``VerifierConfig`` (``name_or_path``, ``architectures``);
* ``src/speculators/proposals/greedy.py``: ``{"proposal_type": "greedy", "speculative_tokens",
  "verifier_accept_k", "accept_tolerance"}`` (a chain of ``speculative_tokens`` drafts);
* ``src/speculators/models/eagle3/config.py``: ``Eagle3SpeculatorConfig`` (``architectures``
  ``["Eagle3Speculator"]``, ``transformer_layer_config`` (the layer's Llama config, target
  vocabulary), ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``, ``norm_before_fc``, ``fc_norm``, ``norm_output``,
  ``embed_requires_grad``);
* ``src/speculators/models/eagle3/core.py`` and ``src/speculators/model.py``: tensors ``fc.weight``
  (no bias), ``layers.0.*`` (the first layer: ``hidden_norm``, q/k/v over ``2h`` inputs),
  ``norm.weight``, ``lm_head.weight`` ``[draft_vocab_size, h]``, buffers ``d2t`` (int64) and
  ``t2d`` (bool) only when ``draft_vocab_size`` differs from the verifier's vocabulary;
  ``embed_tokens.weight`` ``[V, h]``: the loader copies the verifier's embeddings only when the
  tensor it pre-fills with NaN still holds NaN after loading, which transformers' meta-device
  loading does not guarantee, and speculators' own checkpoints always carry it; exports write the
  target's input embeddings. The aux layer ids default to ``[2, n // 2, n - 3]``
  (``models/utils.py`` ``resolve_target_layer_ids``).

vLLM (``transformers_utils/configs/speculators/algos.py`` ``update_eagle3``) reads the same keys but
defaults ``norm_before_residual`` to true when it is absent, so exports always write it (false:
the residual is the pre-norm state, as in SGLang's midlayer and selfdraft's). The aux layer ids
are vLLM's (the stream entering layer ``id``): selfdraft's ``feature_layers`` as they are.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..adapter import AdapterError
from ..families import is_llama
from ..kind import ExportOptions

logger = logging.getLogger(__name__)

SPECULATORS = "speculators"
SPECULATORS_VERSION = "0.7.0"  # the release whose config classes this layout was matched against
ARCHITECTURES = ["Eagle3Speculator"]
_FLAGS_OFF = ("norm_before_fc", "fc_norm", "norm_output")  # variants selfdraft's midlayer does not have
_DROPPED = ("verifier_norm.weight", "verifier_lm_head.weight")  # training-only copies of the verifier's


def detect(config: dict, architectures: list[str], names) -> bool:
    """A speculators checkpoint: its config names the speculators model type."""
    return "speculators_model_type" in config


def speculators_files(eagle3: dict, tensors: dict[str, torch.Tensor], adapter_config: dict,
                      model, options: ExportOptions) -> tuple[dict, dict[str, torch.Tensor]]:
    """The speculators ``config.json`` payload and tensors of the drafter whose ``eagle3`` export is
    ``(eagle3, tensors)`` (config and tensors as :func:`heads.eagle.checkpoint.export_files` builds them).
    The verifier is recorded as ``options.verifier`` (a hub id; default: the target as the adapter
    names it); the greedy proposal drafts ``options.num_speculative_tokens``."""
    vocab = int(model.config.vocab_size)
    draft_vocab = int(eagle3["draft_vocab_size"])
    layer = {key: value for key, value in eagle3.items()
             if key not in ("architectures", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "eagle_config",
                            "target_hidden_size")}
    ours = {("layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name): tensor
            for name, tensor in tensors.items()}
    if draft_vocab == vocab:  # the buffers exist only for a reduced draft vocabulary
        ours.pop("d2t", None)
        ours.pop("t2d", None)
    ours["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().to("cpu").contiguous()  # [V, h]
    pin = adapter_config["target"]
    verifier = {"name_or_path": options.verifier or pin.get("name_or_path") or None,
                "architectures": list(getattr(model.config, "architectures", None) or [type(model).__name__])}
    payload = {
        "architectures": ARCHITECTURES, "speculators_model_type": "eagle3", "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy", "verifier": verifier,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": options.num_speculative_tokens,
                                  "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
        },
        "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "norm_before_residual": False,
        "target_hidden_size": eagle3.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": list(eagle3["eagle_aux_hidden_state_layer_ids"]),
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
        "torch_dtype": eagle3.get("torch_dtype"),
    }
    return payload, ours


def _speculative_tokens(config: dict, where: Path) -> int:
    block = config.get("speculators_config")
    methods = block.get("proposal_methods") if isinstance(block, dict) else None
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        raise AdapterError(f"{where}: speculators_config.proposal_methods must be a non-empty list of proposal "
                           f"configs; got {methods!r}")
    tokens = methods[0].get("speculative_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise AdapterError(f"{where}: speculators_config.proposal_methods[0].speculative_tokens must be an int >= 1; "
                           f"got {tokens!r}")
    return tokens


def eagle3_view(config: dict, tensors: dict[str, torch.Tensor], model,
                where: Path) -> tuple[dict, dict[str, torch.Tensor], int]:
    """A speculators EAGLE-3 checkpoint as the ``eagle3`` layout's ``(config.json, tensors)``, with
    its proposal's ``speculative_tokens`` (the draft depth); :class:`AdapterError` naming the field
    for what selfdraft's EAGLE-3 drafter cannot compute."""
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise AdapterError(f"{where}: speculators_model_type {kind!r}: selfdraft imports speculators' 'eagle3' "
                           "checkpoints only")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict) or not is_llama(layer.get("model_type")):
        found = layer.get("model_type") if isinstance(layer, dict) else layer
        raise AdapterError(f"{where}: transformer_layer_config must be a Llama layer config (model_type llama); "
                           f"got {found!r}")
    if config.get("norm_before_residual") is not False:
        raise AdapterError(f"{where}: norm_before_residual is {config.get('norm_before_residual')!r}; selfdraft's "
                           "EAGLE-3 midlayer keeps the pre-norm residual (false; when the key is absent vLLM assumes "
                           "true and speculators false, so it must be written)")
    on = [flag for flag in _FLAGS_OFF if config.get(flag)]
    if on:
        raise AdapterError(f"{where}: {', '.join(on)} true: variants selfdraft's EAGLE-3 midlayer does not have")
    depth = _speculative_tokens(config, where)
    layers = config.get("eagle_aux_hidden_state_layer_ids")
    if layers is None:  # speculators and vLLM capture these by default
        count = int(model.config.num_hidden_layers)
        layers = [2, count // 2, count - 3]
        logger.warning("%s: no eagle_aux_hidden_state_layer_ids; using the loaders' default %s", where, layers)
    view = {**layer, "num_hidden_layers": layer.get("num_hidden_layers", 1),
            "draft_vocab_size": config.get("draft_vocab_size"), "eagle_aux_hidden_state_layer_ids": layers,
            "base_model_name_or_path": (config["speculators_config"].get("verifier") or {}).get("name_or_path")}
    if config.get("target_hidden_size") is not None:
        view["target_hidden_size"] = config["target_hidden_size"]
    tensors = {name: tensor for name, tensor in tensors.items() if name not in _DROPPED}
    embeddings = tensors.pop("embed_tokens.weight", None)
    own = model.get_input_embeddings().weight.detach().to("cpu")
    if embeddings is not None and not torch.equal(embeddings.to(own.dtype), own):
        raise AdapterError(f"{where}: embed_tokens.weight differs from the target's embeddings; selfdraft's EAGLE-3 "
                           "drafter reads the frozen target embeddings")
    ours = {("midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name): tensor
            for name, tensor in tensors.items()}
    vocab = int(model.config.vocab_size)
    if "d2t" not in ours and view["draft_vocab_size"] == vocab:  # no buffers: the draft vocabulary is the target's
        ours["d2t"] = torch.zeros(vocab, dtype=torch.long)
    return view, ours, depth
