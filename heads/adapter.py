"""Adapter files: ``adapter_config.json`` + ``adapter_model.safetensors``, pinned to one target.

The config records the format version, the drafter kind and hyper-parameters, the target's
identity (see :func:`heads.backbone.target_fingerprint`), the training recipe and acceptance
measured at save time. The safetensors file holds only the drafter's tensors, contiguous and
unaliased. A save writes a complete sibling directory and swaps it in with renames, so an
interrupted save leaves either the old adapter or the new one, never half of one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from .backbone import inspect_backbone, target_fingerprint

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PINNED_FIELDS = ("config_sha256", "weights_sha256", "vocab_size", "hidden_size")


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded: missing or corrupt files, wrong shapes."""


class TargetMismatchError(AdapterError):
    """The adapter was trained on another target checkpoint."""


def _write_directory(directory: Path, files: dict[str, callable]) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        for name, write in files.items():
            write(staging / name)
        backup = None
        if directory.exists():
            backup = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, backup)
        os.replace(staging, directory)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def adapter_config(spec, **metadata) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "library": "selfdraft",
        "kind": spec.kind,
        "drafter": spec.config.to_dict(),
        "target": target_fingerprint(spec.backbone),
        "tree_accuracy": spec.accuracy,
        "training": metadata.get("training", spec.metadata.get("training", {})),
        "acceptance": metadata.get("acceptance", spec.metadata.get("acceptance", {})),
    }


def save_adapter(spec, directory: str | os.PathLike, **metadata) -> None:
    """Write ``spec``'s drafter and its config into ``directory`` (replacing what is there)."""
    config = adapter_config(spec, **metadata)
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in spec.heads.state_dict().items()}

    def write_config(path: Path) -> None:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def write_weights(path: Path) -> None:
        save_file(tensors, str(path), metadata={"format": "pt", "library": "selfdraft"})

    _write_directory(Path(directory), {CONFIG_NAME: write_config, WEIGHTS_NAME: write_weights})


def read_config(directory: str | os.PathLike) -> dict:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"{path} not found: an adapter directory holds {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise AdapterError(f"{path} is not valid JSON: {error}") from error
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise AdapterError(f"{path}: format_version {version!r} is not supported (expected {FORMAT_VERSION})")
    for key in ("kind", "drafter", "target"):
        if key not in config:
            raise AdapterError(f"{path}: missing field {key!r}")
    return config


def target_differences(recorded: dict, current: dict) -> list[str]:
    """Human-readable differences between two target fingerprints (pinned fields only)."""
    names = {"config_sha256": "config", "weights_sha256": "weights", "vocab_size": "vocab size",
             "hidden_size": "hidden size"}
    return [
        f"{names[key]}: adapter has {recorded.get(key)!r}, model has {current.get(key)!r}"
        for key in _PINNED_FIELDS if recorded.get(key) != current.get(key)
    ]


def read_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise AdapterError(f"{path} not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{path} is corrupted or truncated: {error}") from error


def load_heads(model: PreTrainedModel, directory: str | os.PathLike, strict: bool = True):
    """Attach the adapter in ``directory`` to ``model``.

    Raises:
        TargetMismatchError: ``model`` is not the target the adapter was trained on (``strict=True``;
            with ``strict=False`` a warning is issued instead).
        AdapterError: missing, corrupt or mis-shaped files.
    """
    from .model import KINDS, build_spec

    config = read_config(directory)
    current = target_fingerprint(model)
    differences = target_differences(config["target"], current)
    if differences:
        message = (f"adapter {directory} was trained on another target "
                   f"({config['target'].get('name_or_path')!r}): " + "; ".join(differences)
                   + ". Outputs stay correct but acceptance may drop: re-measure with `selfdraft check`.")
        if strict:
            raise TargetMismatchError(message)
        warnings.warn(message, stacklevel=2)
    if config["kind"] not in KINDS:
        raise AdapterError(f"{directory}: kind {config['kind']!r} is not supported (known: {tuple(KINDS)})")
    try:
        drafter_config = KINDS[config["kind"]].config_class(**config["drafter"])
    except (TypeError, ValueError) as error:
        raise AdapterError(f"{directory}: bad drafter hyper-parameters: {error}") from error
    spec = build_spec(inspect_backbone(model), config["kind"], drafter_config, config.get("tree_accuracy"))
    tensors = read_weights(directory)
    expected = spec.heads.state_dict()
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
    spec.heads.load_state_dict(tensors, strict=True)
    spec.metadata = {"training": config.get("training", {}), "acceptance": config.get("acceptance", {})}
    return spec
