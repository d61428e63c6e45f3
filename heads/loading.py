"""Assembling a :class:`~heads.model.SpeculativeModel` from files: a selfdraft adapter or another
project's checkpoint (detected from its files, never guessed; see :mod:`heads.interop`).

Nothing is allocated before the files are known to describe the drafter: the sizes a config
declares (``num_heads``, ``num_layers``, ...) are checked against the tensor names and shapes in
the safetensors header (read without loading the tensors) by building the drafter the config
describes on the ``meta`` device, where modules hold shapes but no memory, and comparing its
state dict with the header. That build is stopped as soon as it registers more tensors than the
file holds, so a config declaring 20000 heads fails in milliseconds. All of this is generic over
kinds: each kind's own ``build_heads`` defines what its tensors are.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Mapping

import torch
from torch.nn.modules import module as module_hooks
from transformers import PreTrainedModel

from . import interop, kinds, lora
from .adapter import (
    WEIGHTS_NAME, AdapterError, TargetPin, check_fields, check_tensor_dtypes, read_config, read_header, read_weights,
)
from .backbone import inspect_backbone
from .model import SpeculativeModel, build_spec, check_learner_settings

logger = logging.getLogger(__name__)

REGISTRATION_MARGIN = 64
"""Tensors a drafter's construction may register beyond the ones it keeps (e.g. a decoder copy's
token embeddings, removed after construction)."""


class _TooManyTensors(Exception):
    pass


@contextmanager
def _registration_budget(limit: int):
    """Raise :class:`_TooManyTensors` inside the block once modules built in this thread have
    registered more than ``limit`` parameters and buffers."""
    thread, count = threading.get_ident(), [0]

    def hook(module, name, value):
        if threading.get_ident() == thread and value is not None:
            count[0] += 1
            if count[0] > limit:
                raise _TooManyTensors
    handles = [module_hooks.register_module_parameter_registration_hook(hook),
               module_hooks.register_module_buffer_registration_hook(hook)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def expected_shapes(target, kind: str, settings, limit: int | None = None) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of the state dict of a ``kind`` drafter with ``settings`` on ``target``,
    built on the meta device (no memory). None when building registers more than ``limit``
    tensors (the config declares more than the file holds)."""
    entry = kinds.get(kind)
    budget = _registration_budget(limit) if limit is not None else nullcontext()
    try:
        with budget, torch.device("meta"):
            module = entry.build_heads(target, settings)
    except _TooManyTensors:
        return None
    if module is None:
        return {}
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


def check_tensor_shapes(directory, found: Mapping[str, tuple[int, ...]],
                        expected: Mapping[str, tuple[int, ...]] | None, config: Mapping) -> None:
    """AdapterError unless the file's tensors (``found``: name -> shape) are exactly the ones the
    drafter config describes (``expected``; None: it declares more tensors than the file holds)."""
    declared = {key: value for key, value in config.get("drafter", {}).items() if isinstance(value, (int, list))}
    if expected is None:
        raise AdapterError(f"{directory}: the drafter config ({declared}) declares more tensors than the "
                           f"{len(found)} in its weights file; the config and the weights do not belong together")
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise AdapterError(f"{directory}: tensors do not match the drafter: missing {missing[:8]}"
                           f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                           f"{' ...' if len(unexpected) > 8 else ''} (its config: {declared})")
    for name, shape in found.items():
        if tuple(shape) != tuple(expected[name]):
            raise AdapterError(f"{directory}: tensor {name} has shape {tuple(shape)}, the drafter expects "
                               f"{tuple(expected[name])}")


def drafter_config(config: dict, directory) -> object:
    """The kind's config object from an adapter config's ``kind`` and ``drafter`` blocks."""
    try:
        kind = kinds.get(config["kind"])
    except ValueError:
        raise AdapterError(f"{directory}: kind {config['kind']!r} is not supported (known: {kinds.names()})") from None
    check_fields(kind.config_class, config["drafter"], str(directory), "drafter")  # JSON types by field name
    if kind.check_drafter is not None:
        kind.check_drafter(config["drafter"], str(directory))
    try:
        return kind.config_class(**config["drafter"])
    except (TypeError, ValueError) as error:
        raise AdapterError(f"{directory}: bad drafter hyper-parameters: {error}") from error


def base_pin(model) -> dict:
    """The target fingerprint of ``model``'s base checkpoint (its adapters, if any, left out)."""
    pin = dict(TargetPin.of(model).recorded)
    pin.pop("lora_sha256", None)
    return pin


def attach_backbone(model, merge_lora: bool = False) -> tuple[PreTrainedModel, lora.BackboneLora | None]:
    """The model a drafter runs for ``model`` (a ``PreTrainedModel`` or a peft ``PeftModel``, see
    :func:`heads.lora.unwrap`) and what to record about its adapters; ValueError for adapters
    tree verification cannot run."""
    if not lora.is_peft_model(model):
        return lora.unwrap(model, {}, merge=merge_lora)
    return lora.unwrap(model, base_pin(model), merge=merge_lora)


def _shipped_lora(model, directory: Path, config: dict, strict: bool, merge_lora: bool | None):
    """Put a Medusa-2 adapter's backbone LoRA (``backbone_lora/``) on ``model``, after checking that
    the folder holds the LoRA the heads were trained with and that ``model`` is its base (or
    already carries exactly that LoRA); ``(the model to run, its BackboneLora)``."""
    block = config["backbone_lora"]
    folder = directory / block["path"]
    try:
        found = lora.folder_fingerprint(folder)
    except ValueError as error:
        raise AdapterError(f"{directory}: the backbone LoRA the heads were trained with is unreadable: {error}") \
            from error
    recorded = config["target"]["lora_sha256"]
    if found != recorded:
        raise AdapterError(f"{folder}: not the LoRA these heads were trained with (fingerprint {found}, the adapter "
                           f"pins {recorded})")
    if TargetPin.of(model).recorded.get("lora_sha256") is not None:  # a PeftModel: it must carry this LoRA
        TargetPin(config["target"]).check(model, strict=strict, where=directory)
        model, backbone_lora = attach_backbone(model, merge_lora=bool(merge_lora))
        backbone_lora.shipped = True
    else:
        pin = TargetPin({**config["target"], "lora_sha256": None}).check(model, strict=strict, where=directory)
        model, backbone_lora = lora.apply_folder(model, folder, pin.recorded, merge=merge_lora is not False)
    backbone_lora.drift = dict(block.get("drift", {}))
    return model, backbone_lora


def _load_own_files(kind, model, directory: Path, config: dict, strict: bool,
                    merge_lora: bool) -> SpeculativeModel:
    """A spec on ``model`` of a kind that reads its own adapter directory (``DrafterKind.load``: its
    config holding the weights it loaded, and what the spec's metadata records of them)."""
    settings, recorded = kind.load(model, directory, config, strict=strict)
    model, backbone_lora = attach_backbone(model, merge_lora=merge_lora)
    model.requires_grad_(False)
    try:
        spec = build_spec(inspect_backbone(model), kind.name, settings)
    except ValueError as error:  # e.g. a draft model that does not fit the target (vocabulary, special ids)
        raise AdapterError(f"{directory}: {error}") from error
    spec.backbone_lora = backbone_lora
    spec.metadata = {"training": config.get("training", {}), "acceptance": config.get("acceptance", {}),
                     "target": config["target"], "source_format": interop.SELFDRAFT, **recorded}
    restore_lookup(spec, config, directory)
    return spec


def load_heads(model: PreTrainedModel, directory: str | os.PathLike, strict: bool = True,
               merge_lora: bool | None = None, learn=None) -> SpeculativeModel:
    """Attach the adapter in ``directory`` to ``model``; with ``learn`` (a learner's settings, e.g.
    ``training.online.OnlineConfig(budget=0.25)``), the drafter then learns online from the calls it
    serves (:meth:`SpeculativeModel.learn`).

    ``directory`` is a selfdraft adapter, or a checkpoint in one of the registered layouts of other
    projects (detected from its files; see :func:`heads.interop.detect_format`). ``model`` may be a
    peft ``PeftModel``: the drafter then runs its underlying model with the adapters active.

    A Medusa-2 adapter (heads trained jointly with a LoRA on the backbone) holds that LoRA in
    ``backbone_lora/``: it is loaded onto ``model`` **in place** (``model`` is its base
    checkpoint), merged into the weights unless ``merge_lora=False``, and ``spec.metadata["backbone"]``
    and a logged warning say that the backbone's outputs now differ from the original model's
    (lossless against the tuned backbone, not the original). ``merge_lora=True`` with a
    ``PeftModel`` merges its adapters (``merge_and_unload``, in place); None: merge a shipped LoRA,
    leave a ``PeftModel`` as it is.

    Raises:
        TypeError: ``model`` is neither a ``PreTrainedModel`` nor a ``PeftModel`` (e.g. None).
        TargetMismatchError: ``model`` is not the target the adapter was trained on (``strict=True``;
            with ``strict=False`` a warning is issued instead), or its sizes do not fit. A model
            carrying a LoRA is another target than its base.
        AdapterError: missing, corrupt or mis-shaped files, a bad or newer config (a bad tree
            included), sizes in the config that the weights file does not hold, an unrecognised
            directory, a backbone LoRA folder that is not the one the heads were trained with.
    """
    if not isinstance(model, PreTrainedModel) and not lora.is_peft_model(model):
        raise TypeError(f"load_heads(model, directory): model must be the target, a transformers PreTrainedModel; "
                        f"got {type(model).__name__} (a peft PeftModel of the target is accepted too)")
    check_learner_settings(learn)
    spec = _load_adapter(model, directory, strict, merge_lora)
    spec.learn(learn)  # None / False: no learner
    return spec


def _load_adapter(model, directory, strict: bool, merge_lora: bool | None) -> SpeculativeModel:
    """:func:`load_heads` without learning."""
    source = interop.detect_format(directory)
    if source == interop.SELFDRAFT:
        config, tensors = read_config(directory), None
        own = kinds.registry().get(config["kind"])
        if own is not None and own.load is not None:  # a kind with its own files (the draft kind's model or LoRA)
            return _load_own_files(own, model, Path(directory), config, strict, bool(merge_lora))
        found = read_header(Path(directory) / WEIGHTS_NAME)
    else:
        config, tensors = interop.read_external(directory, source, lora.underlying_model(model))
        found = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if config.get("backbone_lora") is None:
        TargetPin(config["target"]).check(model, strict=strict, where=directory, source=source)
    settings = drafter_config(config, directory)
    target = inspect_backbone(lora.underlying_model(model), probe=False)
    try:
        expected = expected_shapes(target, config["kind"], settings, len(found) + REGISTRATION_MARGIN)
    except (TypeError, ValueError) as error:
        raise AdapterError(f"{directory}: bad drafter hyper-parameters: {error}") from error
    check_tensor_shapes(directory, found, expected, config)
    # every check of the files is done: only now is the model changed (a LoRA applied or merged)
    if config.get("backbone_lora") is not None:
        model, backbone_lora = _shipped_lora(model, Path(directory), config, strict, merge_lora)
    else:
        model, backbone_lora = attach_backbone(model, merge_lora=bool(merge_lora))
    target = inspect_backbone(model)
    try:
        spec = build_spec(target, config["kind"], settings, config.get("tree_accuracy"))
    except ValueError as error:  # InvalidTreeError included: a tree the config describes that cannot be built
        raise AdapterError(f"{directory}: {error}") from error
    if tensors is None:
        tensors = read_weights(directory)
    check_tensor_dtypes(directory, tensors, spec.heads.state_dict())  # load_state_dict would cast silently
    spec.heads.load_state_dict(tensors, strict=True)
    spec.backbone_lora = backbone_lora
    spec.metadata = {"training": config.get("training", {}), "acceptance": config.get("acceptance", {}),
                     "target": config["target"], "source_format": source, "directory": str(directory)}
    if backbone_lora is not None:
        spec.metadata["backbone"] = backbone_lora.describe()
    if backbone_lora is not None and backbone_lora.shipped:
        logger.warning("%s: applied the backbone LoRA the heads were trained with (%s): the backbone's outputs now "
                       "differ from the original model's (drift measured after training: %s); generation is "
                       "lossless against the tuned backbone, not against the original", directory,
                       "merged" if backbone_lora.merged else "unmerged", backbone_lora.drift or "not recorded")
    restore_lookup(spec, config, directory)
    return spec


def restore_lookup(spec: SpeculativeModel, config: Mapping, directory) -> None:
    """Re-attach the lookup part of a hybrid recorded in an adapter's ``lookup`` field (if any)."""
    if config.get("lookup") is None:
        return
    try:
        spec.set_lookup(dict(config["lookup"]))
    except (TypeError, ValueError) as error:
        raise AdapterError(f"{directory}: bad lookup settings: {error}") from error
