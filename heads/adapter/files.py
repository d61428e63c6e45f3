"""Adapter files: ``adapter_config.json`` + ``adapter_model.safetensors``, pinned to one target.

The config records the format version, the drafter kind and hyper-parameters, the target's
identity (see :func:`heads.backbone.target_fingerprint`), the training recipe and acceptance
measured at save time; :mod:`heads.adapter.schema` checks every field on load. The safetensors
file holds only the drafter's tensors, contiguous and unaliased. A Medusa-2 adapter adds the
backbone's LoRA in peft's own layout in ``backbone_lora/`` (:mod:`heads.lora`), pinned by the
target's ``lora_sha256``. A save writes a complete sibling
directory and exchanges it with the old one, so the path holds the old adapter or the new one at
every instant (:mod:`heads.adapter.directory`, the project's one atomic directory writer: adapters,
exports, hub folders). Assembling a drafter from these files is
:func:`heads.loading.load_heads`; this package does not know about models or drafter kinds.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..backbone import target_fingerprint
from ..lora import FOLDER_NAME as LORA_FOLDER
from ..lora import write_folder
from .directory import write_directory
from .schema import FORMAT_VERSION, LORA_FORMAT_VERSION, SAMPLE_FORMAT_VERSION, AdapterError, validate_config

logger = logging.getLogger(__name__)


CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def json_writer(payload: object) -> Callable[[Path], None]:
    """A :func:`write_directory` writer of ``payload`` as indented, key-sorted JSON."""
    def write(path: Path) -> None:
        path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return write


def _format_version(target: dict) -> int:
    """The oldest format version that holds ``target``'s fields."""
    if target.get("weights_sample") is not None:
        return SAMPLE_FORMAT_VERSION
    return LORA_FORMAT_VERSION if target.get("lora_sha256") else FORMAT_VERSION


def adapter_config(spec, **metadata) -> dict:
    """The ``adapter_config.json`` payload of ``spec``. ``metadata`` may give ``training`` (the
    recipe), ``acceptance`` (``{mix: entry}``) and ``revision`` (the target checkpoint's commit)."""
    backbone_lora = spec.backbone_lora
    if backbone_lora is not None:  # the base checkpoint (fingerprinted before any merge) and the LoRA
        target = backbone_lora.pin(revision=metadata.get("revision"))
    else:
        target = target_fingerprint(spec.backbone, revision=metadata.get("revision"))
    return {
        "format_version": _format_version(target),
        "library": "selfdraft",
        "kind": spec.kind,
        "drafter": spec.config.to_dict(),
        "target": target,
        # Medusa-2: the backbone's LoRA, saved beside the heads in peft's layout
        **({"backbone_lora": {"path": LORA_FOLDER, "drift": backbone_lora.drift}}
           if backbone_lora is not None and backbone_lora.shipped else {}),
        "tree_accuracy": spec.accuracy,
        "training": metadata.get("training", spec.metadata.get("training", {})),
        "acceptance": metadata.get("acceptance", spec.metadata.get("acceptance", {})),
        # a hybrid's lookup settings; absent otherwise, so that plain adapters stay readable by older versions
        **({"lookup": spec.lookup.to_dict()} if spec.lookup is not None else {}),
    }


def save_adapter(spec, directory: str | os.PathLike, **metadata) -> None:
    """Write ``spec``'s drafter and its config into ``directory`` (replacing a previous adapter)."""
    config = validate_config(adapter_config(spec, **metadata), f"adapter config for {directory}")
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in spec.heads.state_dict().items()}

    def write_weights(path: Path) -> None:
        save_file(tensors, str(path), metadata={"format": "pt", "library": "selfdraft"})

    files = {CONFIG_NAME: json_writer(config), WEIGHTS_NAME: write_weights}
    if "backbone_lora" in config:
        files[LORA_FOLDER] = lambda path: write_folder(spec.backbone_lora, path)
    write_directory(Path(directory), files, replaceable=(LORA_FOLDER,))


def _hub_cache_blobs(directory: Path) -> Path | None:
    """The ``blobs`` folder of the Hugging Face cache repository holding ``directory`` when it lies
    under a ``snapshots/<revision>`` folder there (whose files are links into ``blobs``)."""
    for ancestor in (directory, *directory.parents):
        if ancestor.parent.name == "snapshots":
            return ancestor.parent.parent / "blobs"
    return None


def check_inside(path: Path) -> Path:
    """``path`` after checking that what it resolves to lies inside its own directory (a symbolic
    link pointing elsewhere is refused: the adapter directory is what the user vetted), or inside
    the ``blobs`` folder of the Hugging Face cache repository it belongs to."""
    path = Path(path)
    directory = Path(os.path.realpath(path.parent))
    resolved = Path(os.path.realpath(path))
    blobs = _hub_cache_blobs(Path(os.path.abspath(path.parent)))
    allowed = [directory] + ([Path(os.path.realpath(blobs))] if blobs is not None else [])
    if not any(resolved == root or root in resolved.parents for root in allowed):
        raise AdapterError(f"{path} is a symbolic link to {resolved}, outside the adapter directory {path.parent}: "
                           "refusing to read files from elsewhere; copy the file into the directory")
    return path


def check_tensor_dtypes(directory, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """:class:`AdapterError` naming the first tensor of ``tensors`` stored with a non-floating
    dtype where the drafter's own tensor of that name (``expected``, its state dict) is floating
    (loading would cast it silently), or the reverse (an index buffer stored as floats)."""
    for name, tensor in sorted(tensors.items()):
        wanted = expected.get(name)
        if wanted is None or tensor.dtype.is_floating_point == wanted.dtype.is_floating_point:
            continue
        kind = "floating" if wanted.dtype.is_floating_point else f"integer ({wanted.dtype})"
        raise AdapterError(f"{directory}: tensor {name} is stored as {str(tensor.dtype).replace('torch.', '')}; "
                           f"the drafter expects a {kind} tensor")


def read_json(path: Path) -> object:
    """Parsed JSON of ``path``; :class:`AdapterError` when missing or invalid (or a link to a file
    outside its directory, :func:`check_inside`)."""
    if not path.is_file():
        raise AdapterError(f"{path} not found")
    check_inside(path)
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
    """All tensors of a safetensors file; :class:`AdapterError` when missing, corrupt or truncated
    (or a link to a file outside its directory, :func:`check_inside`)."""
    if not path.is_file():
        raise AdapterError(f"{path} not found")
    check_inside(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{path} is corrupted or truncated: {error}") from error


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of a safetensors file, from its header only (no tensor data is read);
    :class:`AdapterError` when missing or corrupt (or a link outside its directory)."""
    if not path.is_file():
        raise AdapterError(f"{path} not found")
    check_inside(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{path} is corrupted or truncated: {error}") from error


def read_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    return read_safetensors(Path(directory) / WEIGHTS_NAME)
