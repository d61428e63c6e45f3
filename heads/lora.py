"""peft adapters on the backbone: the one module that knows peft.

Two uses:

* **Medusa-2** (joint training): a LoRA added to the backbone (:func:`add_lora`) is trained with
  the heads and saved beside them in peft's own layout (:func:`write_folder`, loadable by plain
  ``PeftModel.from_pretrained(base, folder)``); :func:`apply_folder` puts it back on a base model,
  merged (default) or not.
* **peft-wrapped backbones**: ``attach_heads``/``load_heads`` take a ``PeftModel``
  (:func:`unwrap`): the drafter runs its underlying model, where peft's layers sit in place with
  the adapters active, or merges them into the weights first.

A model carrying adapters is identified as its base checkpoint (:func:`base_state_dict`: the
adapter tensors left out, peft's ``base_layer`` names folded back) plus the fingerprint of its
active adapters (:func:`adapter_fingerprint`: their tensors and the config fields that change
outputs, computed alike from a live model and from a saved folder). :class:`BackboneLora` is
what a :class:`~heads.model.SpeculativeModel` keeps about the adapters of its backbone.

peft is imported only when a model might carry adapters (``peft`` already imported) or when one
is added or loaded, so plain use does not pay its import.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from .fingerprint import state_fingerprint

logger = logging.getLogger(__name__)

FOLDER_NAME = "backbone_lora"
"""The subfolder of an adapter directory holding the backbone's LoRA in peft's layout."""
PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
_SAVED_PREFIX = "base_model.model."
FINGERPRINT_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "bias",
                      "lora_bias", "rank_pattern", "alpha_pattern", "target_modules", "exclude_modules",
                      "layers_to_transform", "layers_pattern", "modules_to_save")
"""Config fields that change an adapter's outputs (with its tensors: its fingerprint)."""


class LoraTargetError(ValueError):
    """LoRA target modules that name no module of the model (or one LoRA cannot be put on here)."""


def _peft_loaded() -> bool:
    return "peft" in sys.modules


def is_peft_model(model: object) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (without importing peft when nothing did)."""
    if not _peft_loaded():
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def tuner_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of the peft tuner layers (LoRA, ...) injected into ``module``."""
    if not _peft_loaded():
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(name, layer) for name, layer in module.named_modules() if isinstance(layer, BaseTunerLayer)]


def underlying_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (``model`` itself otherwise)."""
    return model.get_base_model() if is_peft_model(model) else model


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as its base checkpoint's: adapter tensors left out and peft's
    ``<layer>.base_layer.<name>`` keys folded back to ``<layer>.<name>`` (a plain model: its own
    state dict). Adapters merged into the weights (``merge_adapter``) are part of the weights."""
    model = underlying_model(model)
    state = model.state_dict()
    layers = [name for name, _ in tuner_layers(model)]
    if not layers:
        return state
    layers.sort(key=len, reverse=True)  # the innermost wrapper first
    folded = {}
    for key, tensor in state.items():
        for layer in layers:
            if key.startswith(layer + "."):
                rest = key[len(layer) + 1:]
                if not rest.startswith("base_layer."):
                    key = None  # an adapter tensor
                    break
                key = f"{layer}.{rest[len('base_layer.'):]}"
        if key is not None:
            folded[key] = tensor
    return folded


def _config_fields(config) -> dict:
    """The :data:`FINGERPRINT_FIELDS` of a peft config, sets as sorted lists, enums as strings."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    fields = {}
    for name in FINGERPRINT_FIELDS:
        value = data.get(name)
        if isinstance(value, (set, frozenset)):
            value = sorted(value)
        fields[name] = value
    return json.loads(json.dumps(fields, sort_keys=True, default=str))


def _normalise(name: str, adapter: str | None = None) -> str:
    name = name[len(_SAVED_PREFIX):] if name.startswith(_SAVED_PREFIX) else name
    return name.replace(f".{adapter}.", ".") if adapter else name


def fingerprint(config, tensors: dict[str, torch.Tensor]) -> str:
    """The fingerprint of one adapter: its output-changing config fields and its tensors (keys as
    peft saves them, with or without the ``base_model.model.`` prefix)."""
    fields = json.dumps(_config_fields(config), sort_keys=True).encode()
    return state_fingerprint({_normalise(name): tensor for name, tensor in tensors.items()}, prefix=fields)


def active_adapters(model: nn.Module) -> list[str]:
    """Names of the adapters active in ``model``'s tuner layers (none when disabled or absent)."""
    for _, layer in tuner_layers(underlying_model(model)):
        if layer.disable_adapters:
            return []
        return sorted(layer.active_adapters)
    return []


def live_tensors(model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """Adapter ``adapter``'s tensors as peft saves them (``get_peft_model_state_dict``; keys start
    with ``base_model.model.`` when ``model`` is the ``PeftModel``, as in a saved folder)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=adapter)


def adapter_fingerprint(model: nn.Module) -> str | None:
    """Fingerprint of the adapters active in ``model`` (None: it carries none). Several active
    adapters are fingerprinted together, in name order."""
    model = underlying_model(model)
    names = active_adapters(model)
    if not names:
        return None
    configs = getattr(model, "peft_config", {})
    parts = [fingerprint(configs[name], live_tensors(model, name)) for name in names]
    return parts[0] if len(parts) == 1 else state_fingerprint({}, prefix=json.dumps(parts).encode())


def _check_placement(model: nn.Module, names: Sequence[str], where: str) -> None:
    """LoraTargetError for adapters on the output head or the input embeddings: the drafter reads
    those modules directly, so an adapter there would be bypassed."""
    reserved = {module: label for module, label in ((model.get_output_embeddings(), "output head"),
                                                    (model.get_input_embeddings(), "input embeddings"))}
    modules = dict(model.named_modules())
    for name in names:
        label = reserved.get(modules.get(name))
        if label is not None:
            raise LoraTargetError(f"{where}: an adapter on {name!r} (the {label}) is not supported: drafters read "
                                  "that module directly; put LoRA on the decoder layers only")


def check_targets(model: nn.Module, targets: Sequence[str] | None) -> list[str]:
    """The names of the modules ``targets`` select in ``model``, as peft matches them (a module
    whose name is a target or ends with ``.target``); LoraTargetError naming each target that
    selects nothing (with the model's linear layer names), or one that selects the output head or
    the embeddings. ``targets`` None: peft's default for the model family (an error when it has none)."""
    model = underlying_model(model)
    if targets is None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        model_type = model.config.model_type
        if model_type not in DEFAULTS:
            raise LoraTargetError(f"peft has no default LoRA targets for model_type {model_type!r}: give them "
                                  f"(--lora-targets; its linear layers: {', '.join(linear_names(model))})")
        targets = DEFAULTS[model_type]
    if isinstance(targets, str):
        targets = [part for part in targets.split(",") if part]
    targets = [str(target).strip() for target in targets]
    if not targets or not all(targets):
        raise LoraTargetError(f"LoRA targets must be non-empty module names; got {list(targets)!r}")
    names = [name for name, _ in model.named_modules()]
    chosen, missing = [], []
    for target in targets:
        hits = [name for name in names if name == target or name.endswith("." + target)]
        (chosen.extend(hits) if hits else missing.append(target))
    if missing:
        raise LoraTargetError(f"LoRA target(s) {missing} name no module of this {type(model).__name__} (its linear "
                              f"layers: {', '.join(linear_names(model))})")
    _check_placement(model, chosen, "LoRA targets")
    return chosen


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last name parts of ``model``'s linear (and GPT-2 Conv1D) layers."""
    inside = tuple(f"{name}." for name, _ in tuner_layers(model))  # peft's own sublayers are not targets
    found = dict.fromkeys(name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                          if (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")
                          and not name.startswith(inside or ("\0",)))
    return list(found)


@dataclass
class BackboneLora:
    """The adapters on a spec's backbone, and what selfdraft records about them.

    ``base_pin``: the base checkpoint's target fingerprint (no adapters), taken before anything was
    merged. ``peft_model``: the live ``PeftModel`` while the adapters sit unmerged in their own
    layers (None once merged into the weights: ``state``/``config`` then keep their tensors and
    config). ``shipped``: saved with the heads as :data:`FOLDER_NAME` (Medusa-2; False for a
    user's own ``PeftModel``, which the adapter only pins). ``drift``: how far the adapted backbone's
    outputs are from the base model's, as measured after training.
    """

    base_pin: dict
    peft_model: object | None = None
    config: object | None = None
    state: dict | None = None
    shipped: bool = False
    drift: dict = field(default_factory=dict)
    adapter: str = "default"

    @property
    def merged(self) -> bool:
        return self.peft_model is None

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.peft_model is not None:
            return {name: tensor.detach().to("cpu").contiguous().clone()
                    for name, tensor in live_tensors(self.peft_model, self.adapter).items()}
        return self.state

    def peft_config(self):
        return self.peft_model.peft_config[self.adapter] if self.peft_model is not None else self.config

    def sha256(self) -> str:
        return fingerprint(self.peft_config(), self.tensors())

    def pin(self, revision: str | None = None) -> dict:
        """The target block of an adapter trained on this backbone: the base checkpoint and the LoRA."""
        return {**self.base_pin, "revision": revision or self.base_pin.get("revision"), "lora_sha256": self.sha256()}

    def disabled(self):
        """A context in which the backbone runs as its base model (peft's ``disable_adapter``)."""
        if self.peft_model is None:
            raise RuntimeError("the backbone's LoRA is merged into its weights; the base model is gone")
        return self.peft_model.disable_adapter()

    def merge(self) -> nn.Module:
        """Merge the adapters into the weights (peft's ``merge_and_unload``); the plain model."""
        if self.peft_model is None:
            raise RuntimeError("already merged")
        self.config, self.state = self.peft_config(), self.tensors()
        model = self.peft_model.merge_and_unload()
        self.peft_model = None
        return model

    def parameters(self) -> list[nn.Parameter]:
        """The trainable adapter parameters (live, unmerged adapters only)."""
        if self.peft_model is None:
            return []
        return [p for name, p in self.peft_model.named_parameters() if p.requires_grad and f".{self.adapter}." in name]

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put saved adapter tensors (as :meth:`tensors` returns them) back into the live adapter."""
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.peft_model, tensors, adapter_name=self.adapter)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ValueError(f"tensors that are not this LoRA's: {unexpected[:5]}")

    def describe(self) -> dict:
        """What ``spec.metadata["backbone"]`` says about the adapted backbone."""
        return {"modified": True, "lora_sha256": self.sha256(), "merged": self.merged, "shipped": self.shipped,
                "base": self.base_pin.get("name_or_path"), "drift": dict(self.drift),
                "note": "the backbone's outputs differ from the original model's: generation is lossless against "
                        "the adapted backbone, not against the original"}


def add_lora(model: nn.Module, r: int, alpha: float, targets: Sequence[str] | None, base_pin: dict) -> BackboneLora:
    """Inject a fresh LoRA (B = 0: outputs unchanged until trained) into ``model`` in place, for
    joint training; its parameters are the only ones with ``requires_grad``."""
    from peft import LoraConfig, get_peft_model

    if tuner_layers(model):
        raise ValueError("the backbone already carries peft adapters; joint training puts its own LoRA on the "
                         "plain base model")
    chosen = check_targets(model, targets)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=sorted({name.rsplit(".", 1)[-1] for name in chosen}) if targets is None
                        else [str(target).strip() for target in targets])
    peft_model = get_peft_model(model, config)
    logger.info("LoRA r=%d alpha=%g on %d modules (%s) of the backbone", r, alpha, len(chosen),
                ", ".join(sorted(config.target_modules)))
    return BackboneLora(base_pin=base_pin, peft_model=peft_model, shipped=True)


def write_folder(backbone_lora: BackboneLora, path: Path) -> None:
    """Write the LoRA into the directory ``path`` in peft's layout (``adapter_config.json`` +
    ``adapter_model.safetensors``), as ``PeftModel.save_pretrained`` writes it."""
    from safetensors.torch import save_file

    path.mkdir()
    config = copy.copy(backbone_lora.peft_config())
    config.inference_mode = True
    config.save_pretrained(str(path))  # peft's own adapter_config.json
    save_file(backbone_lora.tensors(), str(path / PEFT_WEIGHTS_NAME), metadata={"format": "pt"})


def read_folder(path: Path) -> tuple[object, dict[str, torch.Tensor]]:
    """``(peft config, tensors)`` of a LoRA folder; ValueError when it is not one."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    if not (path / PEFT_CONFIG_NAME).is_file() or not (path / PEFT_WEIGHTS_NAME).is_file():
        raise ValueError(f"{path}: a LoRA folder holds {PEFT_CONFIG_NAME} and {PEFT_WEIGHTS_NAME}")
    try:
        return PeftConfig.from_pretrained(str(path)), load_file(str(path / PEFT_WEIGHTS_NAME))
    except Exception as error:  # peft and safetensors raise many types for a bad file
        raise ValueError(f"{path}: not a readable peft adapter ({type(error).__name__}: {error})") from error


def folder_fingerprint(path: Path) -> str:
    """:func:`fingerprint` of a saved LoRA folder (equal to the live adapter's it was saved from)."""
    config, tensors = read_folder(path)
    return fingerprint(config, tensors)


def apply_folder(model: nn.Module, path: Path, base_pin: dict, merge: bool = True) -> tuple[nn.Module, BackboneLora]:
    """Load the LoRA folder ``path`` onto ``model`` **in place** (``PeftModel.from_pretrained``) and
    merge it into the weights (``merge``) or keep it in its own layers; ``(the model to run, its
    BackboneLora)``."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(model, str(path))
    peft_model.eval()
    backbone_lora = BackboneLora(base_pin=base_pin, peft_model=peft_model, shipped=True)
    _check_placement(model, [name for name, _ in tuner_layers(model)], str(path))
    if merge:
        model = backbone_lora.merge()
    return model, backbone_lora


def unwrap(model: nn.Module, base_pin: dict, merge: bool = False) -> tuple[nn.Module, BackboneLora | None]:
    """The transformers model a drafter runs for ``model`` and what to record about its adapters:
    a ``PeftModel`` gives its underlying model with the adapters active in place (``merge``:
    merged into the weights by ``merge_and_unload``, in place); a plain model itself and None.
    Prompt-learning methods (prefix or prompt tuning) are refused: they change the cache and the
    input, which tree verification builds itself."""
    if not is_peft_model(model):
        if merge and tuner_layers(model):
            raise ValueError("merge_lora=True needs the PeftModel (the model carries peft layers without it)")
        if merge:
            raise ValueError("merge_lora=True merges a PeftModel's adapters; this model carries none")
        return model, None
    configs = model.peft_config
    prompt_learning = [name for name, config in configs.items() if getattr(config, "is_prompt_learning", False)]
    if prompt_learning:
        raise ValueError(f"peft adapter(s) {prompt_learning} use prompt learning ({configs[prompt_learning[0]].peft_type}),"
                         " which prepends virtual tokens to the cache; only adapters that sit in the layers "
                         "(LoRA, ...) can be verified with tree attention")
    names = active_adapters(model)
    if len(names) != 1:
        raise ValueError(f"the PeftModel has {len(names)} active adapters ({names}); activate exactly one "
                         "(set_adapter) before attaching a drafter")
    underlying = model.get_base_model()
    _check_placement(underlying, [name for name, _ in tuner_layers(underlying)], "the PeftModel")
    backbone_lora = BackboneLora(base_pin=base_pin, peft_model=model, adapter=names[0])
    if merge:
        underlying = backbone_lora.merge()
    return underlying, backbone_lora


def drift_terms(adapted: torch.Tensor, original: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> dict[str, float]:
    """Sums over one batch: ``kl`` (KL(original || adapted) over every real position), ``agree``
    (positions where the two greedy tokens agree), ``positions``, and the negative
    log-likelihoods of the batch's next tokens under each (``nll_adapted``, ``nll_original``) over
    ``tokens`` predictions. Logits ``[B, T, V]``, ids and mask ``[B, T]``."""
    valid = attention_mask.bool()
    log_p, log_q = original.float().log_softmax(-1), adapted.float().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, T)
    agree = adapted.argmax(-1) == original.argmax(-1)
    following = valid[:, 1:] & valid[:, :-1]
    next_ids = input_ids[:, 1:, None]
    nll_adapted = -log_q[:, :-1].gather(-1, next_ids).squeeze(-1)
    nll_original = -log_p[:, :-1].gather(-1, next_ids).squeeze(-1)
    return {"kl": float(kl[valid].sum()), "agree": float(agree[valid].sum()), "positions": float(valid.sum()),
            "nll_adapted": float(nll_adapted[following].sum()), "nll_original": float(nll_original[following].sum()),
            "tokens": float(following.sum())}


def summarise_drift(totals: dict[str, float]) -> dict:
    """Per-token figures from summed :func:`drift_terms`: mean KL, greedy agreement, the perplexity
    of each model and its relative change."""
    import math

    positions, tokens = max(1.0, totals["positions"]), max(1.0, totals["tokens"])
    original, adapted = math.exp(totals["nll_original"] / tokens), math.exp(totals["nll_adapted"] / tokens)
    return {"kl_per_token": totals["kl"] / positions, "top1_agreement": totals["agree"] / positions,
            "perplexity_original": original, "perplexity_adapted": adapted,
            "perplexity_change": adapted / original - 1.0, "positions": int(totals["positions"])}


@torch.no_grad()
def measure_drift(model: nn.Module, backbone_lora: BackboneLora, batches) -> dict:
    """How far ``model`` with its (unmerged) LoRA is from the same model with the LoRA disabled, on
    ``batches`` of ``(input_ids, attention_mask)``: :func:`summarise_drift` of the summed terms."""
    totals: dict[str, float] = {}
    was_training = model.training
    model.eval()
    try:
        for input_ids, attention_mask in batches:
            adapted = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            with backbone_lora.disabled():
                original = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            for key, value in drift_terms(adapted, original, input_ids, attention_mask).items():
                totals[key] = totals.get(key, 0.0) + value
    finally:
        model.train(was_training)
    return summarise_drift(totals) if totals else {}
