"""Checkpoint layouts of other projects: detection, export and import, generic over kinds.

Each kind lists its layouts (``DrafterKind.formats``, in ``heads/<kind>/checkpoint.py``: file
names, config keys, tensor names and the loader commits they were matched against). This module
detects which layout a directory holds, asks the kind to write or read it, and handles what all
layouts share: an export also writes ``selfdraft.json`` (the adapter's own config: target pin,
recipe, acceptance, tree), which the external loaders ignore and :func:`read_external` uses to
restore the pin on re-import, and ``README.md``: the vLLM / SGLang / selfdraft commands that load
it (:func:`serving`, the layout's ``serve``). Refusals that need only the adapter config
(:func:`check_export`) come before any model is loaded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import kinds
from .adapter import (
    CONFIG_NAME, AdapterError, json_writer, read_config, read_json, read_weights, write_directory,
)
from .adapter.schema import validate_config
from .kind import ExportOptions

logger = logging.getLogger(__name__)

SELFDRAFT = "selfdraft"
SIDECAR_NAME = "selfdraft.json"
README_NAME = "README.md"


def format_names() -> tuple[str, ...]:
    """Every registered checkpoint layout (the ``export --format`` choices)."""
    return tuple(kinds.formats())


def _safetensors_names(directory: Path) -> list[str]:
    """Tensor names in the safetensors files of ``directory`` (headers only, no data read)."""
    names: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                names.extend(handle.keys())
        except (SafetensorError, OSError, ValueError) as error:
            raise AdapterError(f"{path} is corrupted or truncated: {error}") from error
    return names


def detect_format(directory: str | os.PathLike) -> str:
    """Which layout ``directory`` holds: :data:`SELFDRAFT` or one of :data:`FORMATS`.

    Raises :class:`AdapterError` naming what was looked for when nothing matches.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise AdapterError(f"{directory} not found: an adapter directory holds {CONFIG_NAME} and "
                           "adapter_model.safetensors (or a Medusa/EAGLE checkpoint)")
    if (directory / CONFIG_NAME).is_file():
        return SELFDRAFT
    config_path = directory / "config.json"
    if config_path.is_file():
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise AdapterError(f"{config_path}: expected a JSON object")
        architectures = [str(name) for name in config.get("architectures") or []]
        names: list[str] = []

        def tensor_names() -> list[str]:
            if not names:
                names.extend(_safetensors_names(directory))
            return names

        for name, (_, fmt) in kinds.formats().items():
            if fmt.detect(config, architectures, tensor_names):
                return name
    found = sorted(p.name for p in directory.iterdir())[:12]
    raise AdapterError(
        f"{directory} is not a recognised adapter directory. Looked for: {CONFIG_NAME} (selfdraft); config.json "
        "with medusa_num_heads (FasterDecoding Medusa); config.json with model_type 'medusa' or architectures "
        "['MedusaModel'] (vLLM Medusa); config.json with eagle_config or draft_vocab_size, or midlayer.* tensors "
        "(EAGLE-3); config.json with speculators_model_type (vLLM speculators); an Eagle architecture, or "
        "fc.weight and layers.0.* tensors in *.safetensors (EAGLE-1). "
        f"Found: {found}"
    )


def _sidecar(config: dict, fmt: str) -> dict:
    return {"format": fmt, "selfdraft_adapter": config,
            "note": "selfdraft's own adapter config (target pin, recipe, acceptance); other loaders ignore this file"}


def check_export(adapter_dir: str | os.PathLike, fmt: str, options: ExportOptions | None = None) -> dict:
    """The adapter config of ``adapter_dir`` after every refusal that needs no model: an unknown
    format, another kind's format, a Medusa-2 backbone LoRA, and the layout's own refusals from the
    config (:class:`AdapterError` naming what to use instead)."""
    known = kinds.formats()
    if fmt not in known:
        raise AdapterError(f"format must be one of {tuple(known)}; got {fmt!r}")
    kind, layout = known[fmt]
    config = read_config(adapter_dir)
    if config.get("backbone_lora") is not None:
        raise AdapterError(f"{adapter_dir}: a Medusa-2 adapter (heads trained with a LoRA on the backbone, in "
                           f"{config['backbone_lora']['path']}/) cannot be exported as {fmt!r}: that layout has no "
                           "place for the backbone's LoRA, and the heads alone expect the tuned backbone. Serve the "
                           "target with the LoRA merged (peft's merge_and_unload) and these heads, or train Medusa-1 "
                           "heads (without --joint) to export")
    if config["kind"] != kind.name:
        other = sorted(name for name, (owner, _) in known.items() if owner.name == config["kind"])
        raise AdapterError(f"{adapter_dir}: format {fmt!r} holds {kind.name} drafters; this adapter is kind "
                           f"{config['kind']!r} (use --format {' or '.join(other) or '(none: this kind has no export)'})")
    reasons = layout.refusals(config, fmt, options or ExportOptions()) if layout.refusals is not None else []
    if reasons:
        raise AdapterError(f"{adapter_dir}: cannot export this {kind.name} drafter as {fmt!r}: " + "; ".join(reasons))
    return config


def serving(config: dict, fmt: str, options: ExportOptions) -> dict:
    """``{"commands": {engine: command line or why not}, "notes": [...]}`` for an ``fmt`` export."""
    layout = kinds.formats()[fmt][1]
    served = layout.serve(config, fmt, options) if layout.serve is not None else {"commands": {}, "notes": []}
    python = (f"import heads; from transformers import AutoModelForCausalLM; "
              f"spec = heads.load_heads(AutoModelForCausalLM.from_pretrained({options.target!r}), {options.out!r})")
    return {"commands": {**served["commands"], "selfdraft (transformers)": f'python -c "{python}"'},
            "notes": list(served["notes"])}


def serving_text(served: dict) -> str:
    """The commands and notes of :func:`serving` as plain lines (what ``selfdraft export`` prints)."""
    lines = [f"{engine}:\n  {command}" for engine, command in served["commands"].items()]
    lines += [f"note: {note}" for note in served["notes"]]
    return "\n".join(lines)


def export_readme(config: dict, fmt: str, adapter_dir, served: dict) -> str:
    """``README.md`` of an export: what it is and the commands that serve it."""
    target = config["target"].get("name_or_path") or "its target"
    lines = [f"# {fmt} export of a selfdraft {config['kind']} drafter", "",
             f"Written by `selfdraft export --format {fmt}` from the adapter `{adapter_dir}`, trained on `{target}`. "
             f"`{SIDECAR_NAME}` holds selfdraft's own config (target pin, recipe, acceptance); engines ignore it.", "",
             "## Serve", ""]
    for engine, command in served["commands"].items():
        if command.startswith(("not ", "not:")):
            lines += [f"**{engine}**: {command}", ""]
        else:
            lines += [f"**{engine}**", "", "```bash", command, "```", ""]
    if served["notes"]:
        lines += ["## Notes", ""] + [f"- {note}" for note in served["notes"]] + [""]
    return "\n".join(lines)


def export_adapter(adapter_dir: str | os.PathLike, fmt: str, out: str | os.PathLike, model=None,
                   options: ExportOptions | None = None) -> Path:
    """Write the selfdraft adapter in ``adapter_dir`` to ``out`` in layout ``fmt`` (atomically),
    with ``README.md`` (the serving commands, :func:`serving`) and ``selfdraft.json``.

    ``model`` (the target) is needed where the layout holds some of the target's tensors or
    config. ``options``: what the commands call the export and the target, the verifier id, the
    speculative tokens, EAGLE-1's ``fc.bias`` (default: ``ExportOptions(out=str(out))``). Raises
    :class:`AdapterError` when the layout cannot represent the drafter exactly, saying what to
    train with instead.
    """
    config = check_export(adapter_dir, fmt, options)
    if options is None:
        options = ExportOptions(out=str(out), target=target_name(config, None, model))
    layout = kinds.formats()[fmt][1]
    served = serving(config, fmt, options)  # (of the adapter as trained: the export may describe less of it)
    files = layout.export(config, read_weights(adapter_dir), fmt, model, adapter_dir, options)
    files[SIDECAR_NAME] = json_writer(_sidecar(config, fmt))
    readme = export_readme(config, fmt, adapter_dir, served)
    files[README_NAME] = lambda path: path.write_text(readme)
    write_directory(Path(out), files, replaceable=export_file_names())
    logger.info("exported %s as %s to %s", adapter_dir, fmt, out)
    return Path(out)


def export_file_names() -> tuple[str, ...]:
    """Every name an export may write (an older export of any layout may be replaced)."""
    return tuple(sorted({name for _, other in kinds.formats().values() for name in other.files}
                        | {SIDECAR_NAME, README_NAME}))


def target_name(config: dict, given: str | None, model=None) -> str:
    """The target as serving commands name it: ``given``, else the model's ``_name_or_path``, else
    the name the adapter's pin records."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") if model is not None else ""
    return given or name or config["target"].get("name_or_path") or "TARGET_MODEL"


def _apply_sidecar(directory: Path, config: dict, tensors: dict, model) -> tuple[dict, dict]:
    """Restore selfdraft's own config from ``selfdraft.json`` when an export left one, after
    checking it describes the checkpoint beside it."""
    path = directory / SIDECAR_NAME
    if not path.is_file():
        return config, tensors
    sidecar = read_json(path)
    if not isinstance(sidecar, dict) or "selfdraft_adapter" not in sidecar:
        raise AdapterError(f"{path}: expected an object with 'selfdraft_adapter'")
    own = validate_config(sidecar["selfdraft_adapter"], str(path))
    kind = kinds.get(config["kind"])
    keys = [("drafter", key) for key in kind.sidecar_keys] + [("target", "vocab_size"), ("target", "hidden_size")]
    for block, key in keys:
        if own[block].get(key) != config[block].get(key):
            raise AdapterError(f"{path} does not describe the checkpoint beside it: {block}.{key} is "
                               f"{own[block].get(key)!r} there, {config[block].get(key)!r} in the checkpoint")
    if kind.restore_sidecar is not None:
        tensors = kind.restore_sidecar(own, tensors, model, path)
    return own, tensors


def read_external(directory: str | os.PathLike, fmt: str, model) -> tuple[dict, dict[str, torch.Tensor]]:
    """An external checkpoint as (selfdraft adapter config, ``{selfdraft name: tensor}``).

    The config's target records the sizes (and, after a selfdraft export, the full pin); a
    checkpoint from elsewhere records no weights fingerprint (``weights_sha256`` None).
    """
    directory = Path(directory)
    known = kinds.formats()
    if fmt not in known:
        raise AdapterError(f"{directory}: unknown format {fmt!r} (known: {tuple(known)})")
    config = read_json(directory / "config.json")
    imported, tensors = known[fmt][1].read(directory, config, fmt, model)
    imported, tensors = _apply_sidecar(directory, imported, tensors, model)
    return validate_config(imported, f"{directory} ({fmt})", pinned=False), tensors
