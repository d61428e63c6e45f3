"""The fields of ``adapter_config.json`` and their checks.

Every field a loader relies on is checked here, with an error that names the file and the field.
A config from a newer ``format_version`` is refused with a message to upgrade selfdraft; unknown
top-level or target fields are refused (a newer writer bumps the version when it adds one). The
free-form parts (the training recipe, extra keys inside an acceptance entry) are checked only for
the keys that have a meaning here.
"""

from __future__ import annotations

import base64
import binascii
import re
from numbers import Real

from ..fingerprint import sample_mismatches


FORMAT_VERSION = 1
"""Version of the adapter layout this selfdraft writes for a plain target."""
LORA_FORMAT_VERSION = 2
"""Version written when the target carries a LoRA (``target.lora_sha256``, ``backbone_lora``), the
first with those fields, and the newest this selfdraft reads. Plain adapters keep version 1, so
selfdraft versions that read 1 only still load them (and refuse LoRA adapters as newer)."""
SAMPLE_FORMAT_VERSION = 3
"""Version written when the target records ``weights_sample`` (the dtype-tolerant part of the pin,
:func:`heads.fingerprint.weight_sample`): every adapter this selfdraft saves. Versions 1 and 2
(``weights_sha256`` only) still load; their weights are checked exactly, which an fp16 copy of the
target cannot always pass (see :func:`weights_note`)."""
NEWEST_FORMAT_VERSION = SAMPLE_FORMAT_VERSION

TOP_LEVEL_FIELDS = ("format_version", "library", "kind", "drafter", "target", "tree_accuracy", "training",
                    "lookup", "backbone_lora",
                    "acceptance")
TARGET_FIELDS = ("name_or_path", "revision", "model_type", "config_sha256", "weights_sha256", "vocab_size",
                 "hidden_size", "dtype", "lora_sha256", "weights_sample")
PINNED_FIELDS = ("model_type", "config_sha256", "weights_sha256", "vocab_size", "hidden_size", "lora_sha256")
"""Target fields that must match the model an adapter is loaded on (``strict=True``)."""

ACCEPTANCE_NUMBERS = ("tau", "tokens_per_s_spec", "tokens_per_s_plain", "speedup", "temperature")
ACCEPTANCE_COUNTS = ("prompts", "max_new_tokens")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DTYPES = {"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2"}


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded: missing or corrupt files, wrong shapes or fields."""


class TargetMismatchError(AdapterError):
    """The adapter was trained on another target checkpoint."""


def _number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_version(config: dict, where: str) -> None:
    """Refuse a missing, malformed or newer ``format_version``."""
    version = config.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise AdapterError(f"{where}: format_version must be an int; got {version!r}")
    if version > NEWEST_FORMAT_VERSION:
        raise AdapterError(
            f"{where}: written by a newer selfdraft (adapter format_version {version}; this selfdraft reads "
            f"format_version {NEWEST_FORMAT_VERSION} and older): upgrade selfdraft (pip install -U selfdraft)"
        )
    if version < 1:
        raise AdapterError(f"{where}: format_version {version} is not a selfdraft adapter format (expected 1..."
                           f"{NEWEST_FORMAT_VERSION})")


def check_target(target: object, where: str, pinned: bool = True) -> None:
    """Check the ``target`` block. ``pinned=False`` (checkpoints imported from other formats)
    lets the two sha256 fields be None: the checkpoint does not say which weights it was trained on."""
    if not isinstance(target, dict):
        raise AdapterError(f"{where}: field 'target' must be an object; got {type(target).__name__}")
    unknown = sorted(set(target) - set(TARGET_FIELDS))
    if unknown:
        raise AdapterError(f"{where}: unknown target field(s) {unknown} (known: {list(TARGET_FIELDS)})")
    for key in ("config_sha256", "weights_sha256", "lora_sha256"):
        value = target.get(key)
        if value is None and (not pinned or key == "lora_sha256"):
            continue
        if not isinstance(value, str) or not _SHA256.match(value):
            raise AdapterError(f"{where}: target.{key} must be a 64-digit lowercase sha256 hex string; got {value!r}")
    for key in ("vocab_size", "hidden_size"):
        value = target.get(key)
        if not _count(value) or value == 0:
            raise AdapterError(f"{where}: target.{key} must be a positive int; got {value!r}")
    for key in ("name_or_path", "model_type", "revision"):
        value = target.get(key)
        if value is not None and not isinstance(value, str):
            raise AdapterError(f"{where}: target.{key} must be a string or null; got {value!r}")
    if "model_type" not in target and pinned:
        raise AdapterError(f"{where}: missing field 'target.model_type'")
    dtype = target.get("dtype")
    if dtype is not None and dtype not in _DTYPES:
        raise AdapterError(f"{where}: target.dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    if target.get("weights_sample") is not None:
        check_weights_sample(target["weights_sample"], where)


def check_weights_sample(sample: object, where: str) -> None:
    """``target.weights_sample``: ``{"per_tensor": int >= 1, "layout_sha256": sha256, "float32": base64}``."""
    expected = "an object {per_tensor: positive int, layout_sha256: sha256 hex, float32: base64 of float32 values}"
    if not isinstance(sample, dict) or set(sample) != {"per_tensor", "layout_sha256", "float32"}:
        raise AdapterError(f"{where}: target.weights_sample must be {expected}; got {str(sample)[:80]!r}")
    if not _count(sample["per_tensor"]) or sample["per_tensor"] == 0:
        raise AdapterError(f"{where}: target.weights_sample.per_tensor must be a positive int; got "
                           f"{sample['per_tensor']!r}")
    if not isinstance(sample["layout_sha256"], str) or not _SHA256.match(sample["layout_sha256"]):
        raise AdapterError(f"{where}: target.weights_sample.layout_sha256 must be a 64-digit lowercase sha256 hex "
                           f"string; got {sample['layout_sha256']!r}")
    try:
        raw = base64.b64decode(sample["float32"], validate=True) if isinstance(sample["float32"], str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None or len(raw) % 4:
        raise AdapterError(f"{where}: target.weights_sample.float32 must be base64 of little-endian float32 values; "
                           f"got {str(sample['float32'])[:40]!r}")


def check_tree_accuracy(accuracy: object, where: str) -> None:
    """``tree_accuracy``: null or one list per head of top-k accuracies in [0, 1]."""
    if accuracy is None:
        return
    rows_ok = isinstance(accuracy, list) and all(isinstance(row, list) for row in accuracy)
    if not rows_ok or not all(_number(value) and 0.0 <= value <= 1.0 for row in accuracy for value in row):
        raise AdapterError(f"{where}: tree_accuracy must be null or a list of lists of numbers in [0, 1]; "
                           f"got {accuracy!r}")


def acceptance_entries(acceptance: dict) -> list[tuple[str, dict]]:
    """(mix, entry) pairs of an ``acceptance`` block: an entry per mix, or a list per mix (one per
    temperature)."""
    pairs = []
    for mix, value in acceptance.items():
        for entry in (value if isinstance(value, list) else [value]):
            pairs.append((mix, entry))
    return pairs


def recorded_acceptance(acceptance: dict, sampled: bool = False) -> list[float]:
    """The mean acceptance by depth over an ``acceptance`` block's entries recorded greedy (no
    temperature, or 0) or, ``sampled``, at a temperature (acceptance under one says little of the
    other): the prior of ``speculate="auto"``'s acceptance model."""
    rows = [row for _, entry in acceptance_entries(acceptance) if isinstance(entry, dict)
            and (float(entry.get("temperature") or 0) > 0) == sampled and (row := entry.get("acceptance_by_position"))]
    if not rows:
        return []
    depth = max(len(row) for row in rows)
    return [sum(row[index] for row in rows if index < len(row)) / sum(1 for row in rows if index < len(row))
            for index in range(depth)]


def check_acceptance(acceptance: object, where: str) -> None:
    """``acceptance``: ``{mix: entry | [entry, ...]}``; an entry holds at least ``tau``."""
    if not isinstance(acceptance, dict):
        raise AdapterError(f"{where}: field 'acceptance' must be an object; got {type(acceptance).__name__}")
    for mix, entry in acceptance_entries(acceptance):
        name = f"{where}: acceptance[{mix!r}]"
        if not isinstance(entry, dict):
            raise AdapterError(f"{name} must be an object (or a list of objects); got {entry!r}")
        if "tau" not in entry:
            raise AdapterError(f"{name} has no 'tau'")
        for key in ACCEPTANCE_NUMBERS:
            if key in entry and not (_number(entry[key]) and entry[key] >= 0):
                raise AdapterError(f"{name}.{key} must be a non-negative number; got {entry[key]!r}")
        for key in ACCEPTANCE_COUNTS:
            if key in entry and not _count(entry[key]):
                raise AdapterError(f"{name}.{key} must be a non-negative int; got {entry[key]!r}")
        rates = entry.get("acceptance_by_position", [])
        if not isinstance(rates, list) or not all(_number(rate) and 0.0 <= rate <= 1.0 for rate in rates):
            raise AdapterError(f"{name}.acceptance_by_position must be a list of numbers in [0, 1]; got {rates!r}")


def check_backbone_lora(config: dict, where: str) -> None:
    """``backbone_lora`` (Medusa-2: the backbone's LoRA shipped with the heads): an object naming
    its subfolder ``path``, with a ``drift`` object; the target then pins the LoRA
    (``target.lora_sha256``) and the format version is at least 2."""
    if "lora_sha256" in config["target"] and config["format_version"] < LORA_FORMAT_VERSION:
        raise AdapterError(f"{where}: target.lora_sha256 needs format_version >= {LORA_FORMAT_VERSION}")
    block = config.get("backbone_lora")
    if block is None:
        return
    if not isinstance(block, dict):
        raise AdapterError(f"{where}: field 'backbone_lora' must be an object; got {block!r}")
    path = block.get("path")
    if not isinstance(path, str) or not path or "/" in path or "\\" in path or path in (".", ".."):
        raise AdapterError(f"{where}: backbone_lora.path must name a subfolder of the adapter; got {path!r}")
    if not isinstance(block.get("drift", {}), dict):
        raise AdapterError(f"{where}: backbone_lora.drift must be an object; got {block['drift']!r}")
    if config["target"].get("lora_sha256") is None:
        raise AdapterError(f"{where}: backbone_lora needs target.lora_sha256 (the LoRA's fingerprint)")
    if config["format_version"] < LORA_FORMAT_VERSION:
        raise AdapterError(f"{where}: backbone_lora needs format_version >= {LORA_FORMAT_VERSION}")


def validate_config(config: object, where: str, pinned: bool = True) -> dict:
    """Check every field of an adapter config; return it. Raises :class:`AdapterError` naming
    ``where`` (a file) and the field. The drafter block's own fields are the kind's to check
    (``DrafterKind.check_drafter``, asked by :mod:`heads.loading`)."""
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: an adapter config is a JSON object; got {type(config).__name__}")
    check_version(config, where)
    unknown = sorted(set(config) - set(TOP_LEVEL_FIELDS))
    if unknown:
        raise AdapterError(f"{where}: unknown field(s) {unknown} for format_version {config['format_version']} "
                           f"(known: {list(TOP_LEVEL_FIELDS)})")
    for key in ("kind", "drafter", "target"):
        if key not in config:
            raise AdapterError(f"{where}: missing field {key!r}")
    if config.get("library", "selfdraft") != "selfdraft":
        raise AdapterError(f"{where}: library {config['library']!r} is not 'selfdraft'")
    if not isinstance(config["kind"], str):
        raise AdapterError(f"{where}: field 'kind' must be a string; got {config['kind']!r}")
    if not isinstance(config["drafter"], dict):
        raise AdapterError(f"{where}: field 'drafter' must be an object; got {config['drafter']!r}")
    check_target(config["target"], where, pinned)
    check_tree_accuracy(config.get("tree_accuracy"), where)
    if not isinstance(config.get("training", {}), dict):
        raise AdapterError(f"{where}: field 'training' must be an object; got {config['training']!r}")
    check_acceptance(config.get("acceptance", {}), where)
    check_backbone_lora(config, where)
    if config["target"].get("weights_sample") is not None and config["format_version"] < SAMPLE_FORMAT_VERSION:
        raise AdapterError(f"{where}: target.weights_sample needs format_version >= {SAMPLE_FORMAT_VERSION}")
    if not isinstance(config.get("lookup", {}), dict):
        raise AdapterError(f"{where}: field 'lookup' (the lookup settings of a hybrid) must be an object; got "
                           f"{config['lookup']!r}")
    return config


def _rounding_may_differ(recorded: dict, current: dict) -> bool:
    """Whether an exact ``weights_sha256`` (samples rounded to bf16) can differ between two copies
    of one checkpoint: when fp16 is on either side (fp32 -> fp16 -> bf16 rounds twice)."""
    return "float16" in (recorded.get("dtype"), current.get("dtype"))


def weights_difference(recorded: dict, current: dict) -> str | None:
    """What differs between the recorded weights and ``current``'s, or None when they match: the
    exact ``weights_sha256``, else the rounding-tolerant ``weights_sample`` when both have one.
    An older pin (no sample) whose hash differs only where rounding may explain it is not a
    difference: :func:`weights_note` says it could not be checked."""
    if recorded.get("weights_sha256") is None or recorded["weights_sha256"] == current.get("weights_sha256"):
        return None
    if recorded.get("weights_sample") is not None and current.get("weights_sample") is not None:
        found = sample_mismatches(recorded["weights_sample"], current["weights_sample"],
                                  (recorded.get("dtype"), current.get("dtype")))
        return None if found is None else f"weights: {found}"
    if weights_note(recorded, current):
        return None
    return f"weights: adapter has {recorded['weights_sha256']!r}, model has {current.get('weights_sha256')!r}"


def weights_note(recorded: dict, current: dict) -> str | None:
    """A note when an older pin (``weights_sha256`` only) cannot be checked against ``current``:
    its hash differs, and fp16 on either side makes rounding a possible cause."""
    if recorded.get("weights_sha256") in (None, current.get("weights_sha256")) \
            or recorded.get("weights_sample") is not None or not _rounding_may_differ(recorded, current):
        return None
    return ("its weights pin (format_version < 3: an exact hash of bf16-rounded samples) cannot be checked against an "
            f"fp16 copy of the target (adapter saved from {recorded.get('dtype') or 'an unknown dtype'}, model is "
            f"{current.get('dtype')}): rounding twice changes some samples. Loaded without the weights check; the "
            "config, model type and sizes were checked. Re-save the adapter (load it on the target in fp32 or bf16, "
            "then save_pretrained) to record a dtype-tolerant pin")


def target_differences(recorded: dict, current: dict) -> list[str]:
    """Human-readable differences between two target fingerprints (pinned fields only; a field
    the recorded fingerprint leaves unknown (None) is not compared; weights are compared with a
    rounding tolerance, :func:`weights_difference`)."""
    names = {"model_type": "model type", "config_sha256": "config",
             "vocab_size": "vocab size", "hidden_size": "hidden size", "lora_sha256": "backbone LoRA"}
    differences = [
        f"{names[key]}: adapter has {recorded.get(key)!r}, model has {current.get(key)!r}"
        for key in PINNED_FIELDS
        if key != "weights_sha256" and key in recorded and recorded[key] is not None
        and recorded[key] != current.get(key)
    ]
    weights = weights_difference(recorded, current)
    if weights is not None:
        differences.append(weights)
    # a pinned target without a LoRA is the plain base model: the same base with adapters is another target
    if recorded.get("weights_sha256") is not None and recorded.get("lora_sha256") is None \
            and current.get("lora_sha256") is not None:
        differences.append(f"backbone LoRA: adapter has none, model carries one ({current['lora_sha256']!r})")
    return differences
