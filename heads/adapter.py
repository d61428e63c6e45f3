"""Adapter files: ``adapter_config.json`` + ``adapter_model.safetensors``, pinned to one target.

The config records the format version, the drafter kind and hyper-parameters, the target's
identity (see :func:`heads.backbone.target_fingerprint`), the training recipe and acceptance
measured at save time; :mod:`heads.adapter_schema` checks every field on load. The safetensors
file holds only the drafter's tensors, contiguous and unaliased. A save writes a complete sibling
directory and swaps it in with renames, so an interrupted save leaves either the old adapter or
the new one, never half of one.

:func:`load_heads` also imports the checkpoint layouts of other implementations (Medusa, vLLM,
EAGLE; see :mod:`heads.interop`): the format is detected from the files, never guessed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from .adapter_schema import (
    FORMAT_VERSION, AdapterError, TargetMismatchError, target_differences, validate_config,
)
from .backbone import inspect_backbone, target_fingerprint

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION", "CONFIG_NAME", "WEIGHTS_NAME", "AdapterError", "TargetMismatchError", "adapter_config",
    "save_adapter", "read_config", "read_weights", "load_heads", "target_differences", "write_directory",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def write_directory(directory: Path, files: dict[str, Callable[[Path], None]],
                    replaceable: Iterable[str] = ()) -> None:
    """Write ``directory`` atomically: each ``files[name](path)`` writes one file into a sibling
    staging directory, which then replaces ``directory`` by renames.

    An existing ``directory`` is replaced only when it holds nothing but names in ``files`` or
    ``replaceable`` (a previous write of the same kind); otherwise :class:`AdapterError`, so a
    mistyped output path never deletes unrelated files.
    """
    directory = Path(directory)
    if directory.exists():
        if not directory.is_dir():
            raise AdapterError(f"{directory} exists and is not a directory")
        foreign = sorted(p.name for p in directory.iterdir() if p.name not in set(files) | set(replaceable))
        if foreign:
            raise AdapterError(f"{directory} already holds other files ({', '.join(foreign[:5])}); "
                               "write into a new or empty directory")
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


def json_writer(payload: object) -> Callable[[Path], None]:
    """A :func:`write_directory` writer of ``payload`` as indented, key-sorted JSON."""
    def write(path: Path) -> None:
        path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return write


def adapter_config(spec, **metadata) -> dict:
    """The ``adapter_config.json`` payload of ``spec``. ``metadata`` may give ``training`` (the
    recipe), ``acceptance`` (``{mix: entry}``) and ``revision`` (the target checkpoint's commit)."""
    return {
        "format_version": FORMAT_VERSION,
        "library": "selfdraft",
        "kind": spec.kind,
        "drafter": spec.config.to_dict(),
        "target": target_fingerprint(spec.backbone, revision=metadata.get("revision")),
        "tree_accuracy": spec.accuracy,
        "training": metadata.get("training", spec.metadata.get("training", {})),
        "acceptance": metadata.get("acceptance", spec.metadata.get("acceptance", {})),
    }


def save_adapter(spec, directory: str | os.PathLike, **metadata) -> None:
    """Write ``spec``'s drafter and its config into ``directory`` (replacing a previous adapter)."""
    config = validate_config(adapter_config(spec, **metadata), f"adapter config for {directory}")
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in spec.heads.state_dict().items()}

    def write_weights(path: Path) -> None:
        save_file(tensors, str(path), metadata={"format": "pt", "library": "selfdraft"})

    write_directory(Path(directory), {CONFIG_NAME: json_writer(config), WEIGHTS_NAME: write_weights})


def read_json(path: Path) -> object:
    """Parsed JSON of ``path``; :class:`AdapterError` when missing or invalid."""
    if not path.is_file():
        raise AdapterError(f"{path} not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(f"{path} is not valid JSON: {error}") from error


def read_config(directory: str | os.PathLike) -> dict:
    """The checked ``adapter_config.json`` of a selfdraft adapter directory."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"{path} not found: an adapter directory holds {CONFIG_NAME} and {WEIGHTS_NAME}")
    return validate_config(read_json(path), str(path))


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; :class:`AdapterError` when missing, corrupt or truncated."""
    if not path.is_file():
        raise AdapterError(f"{path} not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{path} is corrupted or truncated: {error}") from error


def read_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    return read_safetensors(Path(directory) / WEIGHTS_NAME)


def _check_target(model: PreTrainedModel, config: dict, directory, strict: bool, source: str) -> None:
    """Compare the recorded target with ``model``: a mismatch raises (``strict``) or warns; a
    checkpoint that records no fingerprint (imported formats) warns that it cannot be verified."""
    recorded = config["target"]
    current = target_fingerprint(model)
    shape = [d for d in target_differences(recorded, current) if d.startswith(("vocab size", "hidden size"))]
    if shape:
        raise TargetMismatchError(f"{directory}: the {source} checkpoint does not fit this model: " + "; ".join(shape))
    differences = target_differences(recorded, current)
    if differences:
        message = (f"adapter {directory} was trained on another target "
                   f"({recorded.get('name_or_path')!r}): " + "; ".join(differences)
                   + ". Outputs stay correct but acceptance may drop: re-measure with `selfdraft check`.")
        if strict:
            raise TargetMismatchError(message)
        warnings.warn(message, stacklevel=3)
    elif recorded.get("weights_sha256") is None:
        warnings.warn(
            f"{directory}: this {source} checkpoint records no target fingerprint, so it cannot be verified that it "
            f"was trained on this model (it names base model {recorded.get('name_or_path')!r}). Outputs stay "
            "correct; measure acceptance with `selfdraft check`.", stacklevel=3)
    if recorded.get("dtype") not in (None, current["dtype"]):
        logger.info("adapter %s was saved from a %s target; the model is %s (tensors are cast)",
                    directory, recorded["dtype"], current["dtype"])


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


def load_heads(model: PreTrainedModel, directory: str | os.PathLike, strict: bool = True):
    """Attach the adapter in ``directory`` to ``model``.

    ``directory`` is a selfdraft adapter, or a checkpoint in one of the layouts of
    :data:`heads.interop.FORMATS` (detected from its files; see :func:`heads.interop.detect_format`).

    Raises:
        TargetMismatchError: ``model`` is not the target the adapter was trained on (``strict=True``;
            with ``strict=False`` a warning is issued instead), or its sizes do not fit.
        AdapterError: missing, corrupt or mis-shaped files, a bad or newer config, an unrecognised
            directory.
    """
    from . import interop
    from .model import KINDS, build_spec

    source = interop.detect_format(directory)
    if source == interop.SELFDRAFT:
        config, tensors = read_config(directory), None
    else:
        config, tensors = interop.read_external(directory, source, model)
    _check_target(model, config, directory, strict, source)
    if config["kind"] not in KINDS:
        raise AdapterError(f"{directory}: kind {config['kind']!r} is not supported (known: {tuple(KINDS)})")
    try:
        drafter_config = KINDS[config["kind"]].config_class(**config["drafter"])
    except (TypeError, ValueError) as error:
        raise AdapterError(f"{directory}: bad drafter hyper-parameters: {error}") from error
    spec = build_spec(inspect_backbone(model), config["kind"], drafter_config, config.get("tree_accuracy"))
    if tensors is None:
        tensors = read_weights(directory)
    _check_tensors(directory, tensors, spec.heads.state_dict())
    spec.heads.load_state_dict(tensors, strict=True)
    spec.metadata = {"training": config.get("training", {}), "acceptance": config.get("acceptance", {}),
                     "target": config["target"], "source_format": source}
    return spec
