"""The draft kind's adapter directory: the selfdraft config (target pin, recipe, acceptance) beside
the draft model itself.

::

    adapter_config.json     selfdraft's: kind "draft", the tree shape, the target pin, and in
                            drafter.model where the draft's weights are and what they must be
    draft_model/            a full fine-tune (or an untrained draft): ``save_pretrained``
                            (config.json, model.safetensors), the base draft's tokenizer files copied
    draft_lora/             or a LoRA in peft's own layout (adapter_config.json +
                            adapter_model.safetensors): ``PeftModel.from_pretrained(draft, dir,
                            subfolder="draft_lora")`` loads it on the base draft recorded in the config

``heads.load_heads(target, dir)`` checks the target pin (``TargetMismatchError`` on another target),
then loads the draft: the folder's full model, or the recorded base draft (its fingerprint
checked) with the LoRA (its fingerprint checked) merged into it. The LoRA sits in a subfolder
because selfdraft's own ``adapter_config.json`` holds the top level.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from ..adapter import CONFIG_NAME, WEIGHTS_NAME, AdapterError, TargetPin, adapter_config, json_writer, write_directory
from ..adapter.schema import validate_config
from ..backbone import inspect_backbone, target_fingerprint, weights_fingerprint
from .calibration import check_calibration
from .config import DraftConfig
from .modules import DraftModel, load_draft_model

logger = logging.getLogger(__name__)

MODEL_FOLDER = "draft_model"
"""Subfolder of a full draft model (``save_pretrained``)."""
LORA_FOLDER = "draft_lora"
"""Subfolder of a draft LoRA in peft's layout."""
ADAPTER_FILES = (MODEL_FOLDER, LORA_FOLDER)
WEIGHT_MODES = {"full": MODEL_FOLDER, "lora": LORA_FOLDER}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def model_block(draft: DraftModel) -> dict:
    """``drafter.model`` of the adapter config: how the draft's weights are saved and their pins."""
    base = draft.base_pin or target_fingerprint(draft.model)
    block = {"weights": "lora" if draft.lora is not None else "full", "base": draft.source,
             "base_sha256": base["weights_sha256"], "base_config_sha256": base["config_sha256"]}
    block["path"] = WEIGHT_MODES[block["weights"]]
    if draft.lora is not None:
        block["lora_sha256"] = draft.lora.sha256()
    else:
        block["sha256"] = weights_fingerprint(draft.model)
    return block


def _write_model(draft: DraftModel, path: Path) -> None:
    draft.model.save_pretrained(str(path))
    if draft.source and Path(draft.source).is_dir():  # the base draft's tokenizer: a standalone model folder
        for name in TOKENIZER_FILES:
            if (Path(draft.source) / name).is_file():
                shutil.copyfile(Path(draft.source) / name, path / name)


def save_adapter(spec, directory, **metadata) -> None:
    """Write ``spec``'s draft (``KIND.save``): the config, and the draft model or its LoRA."""
    from .. import lora

    draft: DraftModel = spec.heads
    config = adapter_config(spec, **metadata)
    config["drafter"]["model"] = model_block(draft)
    config["drafter"]["calibration"] = draft.calibration.to_dict()
    config = validate_config(config, f"adapter config for {directory}")
    files = {CONFIG_NAME: json_writer(config)}
    if draft.lora is not None:
        files[LORA_FOLDER] = lambda path: lora.write_folder(draft.lora, path)
    else:
        files[MODEL_FOLDER] = lambda path: _write_model(draft, path)
    write_directory(Path(directory), files, replaceable=(*ADAPTER_FILES, WEIGHTS_NAME))


def _sha(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def check_drafter(drafter: Mapping, where: str) -> None:
    """AdapterError unless the ``drafter`` block's ``model`` says where the weights are and pins them."""
    block = drafter.get("model")
    if not isinstance(block, Mapping):
        raise AdapterError(f"{where}: a draft adapter's drafter.model must be an object naming its weights; got "
                           f"{block!r}")
    weights = block.get("weights")
    if weights not in WEIGHT_MODES:
        raise AdapterError(f"{where}: drafter.model.weights must be one of {sorted(WEIGHT_MODES)}; got {weights!r}")
    if block.get("path") != WEIGHT_MODES[weights]:
        raise AdapterError(f"{where}: drafter.model.path must be {WEIGHT_MODES[weights]!r} for {weights} weights; got "
                           f"{block.get('path')!r}")
    if block.get("base") is not None and not isinstance(block["base"], str):
        raise AdapterError(f"{where}: drafter.model.base must be a path, a hub id or null; got {block['base']!r}")
    pins = ("base_sha256", "lora_sha256") if weights == "lora" else ("base_sha256", "sha256")
    for key in pins:
        if not _sha(block.get(key)):
            raise AdapterError(f"{where}: drafter.model.{key} must be a 64-digit lowercase sha256 hex string; got "
                               f"{block.get(key)!r}")
    if drafter.get("calibration") is not None:
        try:
            check_calibration(drafter["calibration"])
        except ValueError as error:
            raise AdapterError(f"{where}: drafter.calibration: {error}") from error
    if weights == "lora" and not block.get("base"):
        raise AdapterError(f"{where}: a draft LoRA needs drafter.model.base, the draft model it was trained on")


def _full_draft(directory: Path, block: Mapping, target):
    folder = directory / block["path"]
    try:
        draft = load_draft_model(folder, target)
    except ValueError as error:
        raise AdapterError(f"{directory}: the draft model is unreadable: {error}") from error
    found = weights_fingerprint(draft)
    if found != block["sha256"]:
        raise AdapterError(f"{folder}: not the draft model this adapter was saved with (weights fingerprint {found}, "
                           f"the config pins {block['sha256']})")
    return draft


def _lora_draft(directory: Path, block: Mapping, target):
    from .. import lora

    folder, base = directory / block["path"], block["base"]
    try:
        found = lora.folder_fingerprint(folder)
    except ValueError as error:
        raise AdapterError(f"{directory}: the draft's LoRA is unreadable: {error}") from error
    if found != block["lora_sha256"]:
        raise AdapterError(f"{folder}: not the LoRA this adapter was saved with (fingerprint {found}, the config "
                           f"pins {block['lora_sha256']})")
    try:
        draft = load_draft_model(base, target)
    except ValueError as error:
        raise AdapterError(f"{directory}: the draft LoRA's base model {base!r} cannot be loaded ({error}); it is "
                           "recorded in adapter_config.json (drafter.model.base)") from error
    if weights_fingerprint(draft) != block["base_sha256"]:
        raise AdapterError(f"{directory}: the draft model at {base!r} is not the one the LoRA was trained on (weights "
                           f"fingerprint {weights_fingerprint(draft)}, the config pins {block['base_sha256']})")
    draft, _ = lora.apply_folder(draft, folder, base_pin={}, merge=True)
    return draft.eval()


def load_adapter(model, directory: Path, config: dict, strict: bool = True) -> tuple[DraftConfig, dict]:
    """What :func:`save_adapter` wrote, for a spec on ``model`` (``KIND.load``): the draft config
    holding the loaded draft model, and what the spec's metadata records of it (``draft``).

    Raises ``TargetMismatchError`` when ``model`` is not the pinned target (``strict``; a warning
    otherwise) and ``AdapterError`` for a missing, swapped or unreadable draft or LoRA."""
    from .. import lora

    directory = Path(directory)
    check_drafter(config["drafter"], str(directory / CONFIG_NAME))
    block = config["drafter"]["model"]
    try:
        settings = DraftConfig(**{key: value for key, value in config["drafter"].items() if key != "model"})
    except (TypeError, ValueError) as error:
        raise AdapterError(f"{directory}: bad drafter hyper-parameters: {error}") from error
    TargetPin(config["target"]).check(model, strict=strict, where=directory)
    plain = inspect_backbone(lora.underlying_model(model), probe=False)
    draft = (_lora_draft if block["weights"] == "lora" else _full_draft)(directory, block, plain)
    return replace(settings, draft_model=draft), {"draft": dict(block)}
