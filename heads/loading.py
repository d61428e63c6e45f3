"""Assembling a :class:`~heads.model.SpeculativeModel` from files: a selfdraft adapter or another
project's checkpoint (detected from its files, never guessed; see :mod:`heads.interop`)."""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel

from . import interop, kinds
from .adapter import AdapterError, TargetPin, read_config, read_weights
from .backbone import inspect_backbone
from .model import SpeculativeModel, build_spec


def _check_tensors(directory, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise AdapterError(f"{directory}: tensors do not match the drafter: missing {missing}, unexpected {unexpected}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise AdapterError(
                f"{directory}: tensor {name} has shape {tuple(tensor.shape)}, the drafter expects "
                f"{tuple(expected[name].shape)}"
            )


def drafter_config(config: dict, directory) -> object:
    """The kind's config object from an adapter config's ``kind`` and ``drafter`` blocks."""
    try:
        kind = kinds.get(config["kind"])
    except ValueError:
        raise AdapterError(f"{directory}: kind {config['kind']!r} is not supported (known: {kinds.names()})") from None
    if kind.check_drafter is not None:
        kind.check_drafter(config["drafter"], str(directory))
    try:
        return kind.config_class(**config["drafter"])
    except (TypeError, ValueError) as error:
        raise AdapterError(f"{directory}: bad drafter hyper-parameters: {error}") from error


def load_heads(model: PreTrainedModel, directory: str | os.PathLike, strict: bool = True) -> SpeculativeModel:
    """Attach the adapter in ``directory`` to ``model``.

    ``directory`` is a selfdraft adapter, or a checkpoint in one of the registered layouts of other
    projects (detected from its files; see :func:`heads.interop.detect_format`).

    Raises:
        TargetMismatchError: ``model`` is not the target the adapter was trained on (``strict=True``;
            with ``strict=False`` a warning is issued instead), or its sizes do not fit.
        AdapterError: missing, corrupt or mis-shaped files, a bad or newer config, an unrecognised
            directory.
    """
    source = interop.detect_format(directory)
    if source == interop.SELFDRAFT:
        config, tensors = read_config(directory), None
    else:
        config, tensors = interop.read_external(directory, source, model)
    TargetPin(config["target"]).check(model, strict=strict, where=directory, source=source)
    settings = drafter_config(config, directory)
    spec = build_spec(inspect_backbone(model), config["kind"], settings, config.get("tree_accuracy"))
    if tensors is None:
        tensors = read_weights(directory)
    _check_tensors(directory, tensors, spec.heads.state_dict())
    spec.heads.load_state_dict(tensors, strict=True)
    spec.metadata = {"training": config.get("training", {}), "acceptance": config.get("acceptance", {}),
                     "target": config["target"], "source_format": source}
    return spec
