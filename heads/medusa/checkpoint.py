"""Checkpoint layouts of other Medusa implementations: export to them, import from them.

Formats and the loader versions they were matched against (read at these commits):

* ``medusa``: FasterDecoding/Medusa at e2a5d20 (2024-04-18). ``medusa/model/medusa_model.py``
  (``MedusaModel.from_pretrained``, MEDUSA-v0.1 path) reads ``config.json`` (``medusa_num_heads``,
  ``medusa_num_layers``, ``base_model_name_or_path``; no ``model_type``, so ``AutoConfig`` fails and
  that path is taken) and ``torch.load("medusa_lm_head.pt")`` into ``medusa_head`` (state-dict keys
  ``{h}.{l}.linear.weight|bias`` for the residual blocks, ``{h}.{L}.weight`` for head ``h``'s
  vocabulary projection); ``medusa/train/train_legacy.py`` writes the same keys to
  ``medusa_lm_head.safetensors``. Export writes both files (the ``.pt`` holds plain tensors and is
  readable with ``torch.load(weights_only=True)``); import reads the safetensors file when present.
  Two habits of that loader: it builds each head from *one* block repeated ``medusa_num_layers``
  times (``[ResBlock(d)] * n``), so export refuses differing blocks; and it forces
  ``medusa_num_heads = 5`` (a TODO in the code) and loads with ``strict=False``: heads beyond ours
  keep transformers' random initialisation, heads beyond 5 are dropped (:func:`fasterdecoding_heads_note`).
* ``medusa-vllm``: vLLM ``vllm/model_executor/models/medusa.py`` at 01dbb08 (``Medusa.load_weights``)
  with ``vllm/transformers_utils/configs/medusa.py`` at 0531c22 (``MedusaConfig``): ``config.json``
  with ``architectures: ["MedusaModel"]``, ``model_type: "medusa"``, ``hidden_size``, ``vocab_size``,
  ``num_heads``, ``num_hidden_layers``, ``truncated_vocab_size``, ``original_lm_head``,
  ``medusa_fc_bias`` (vLLM defaults it to False; written explicitly); tensors
  ``blocks.{h}.layers.{l}.weight|bias``, ``lm_heads.{h}.weight`` (``lm_heads.0`` only with
  ``original_lm_head``), optional ``token_map`` with a truncated vocabulary, optional
  ``medusa_heads.`` prefix.

Medusa heads map one to one onto both layouts (the features they read, the top layer after the
final norm, are the same in all three implementations). A draft vocabulary (``draft_vocab_size``,
``token_map``) is vLLM's truncated vocabulary: ``truncated_vocab_size`` rows per ``lm_heads.{h}``
and ``token_map`` holding their target ids, into which vLLM scatters the logits (``-inf``
elsewhere), as selfdraft does; FasterDecoding's layout has none and refuses it.
"""

from __future__ import annotations

import json
import pickle
import shlex
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from ..adapter import FORMAT_VERSION, AdapterError, TargetPin, check_inside, json_writer, read_safetensors
from ..families import MEDUSA_EXPORT_FAMILIES, medusa_exportable
from ..kind import CheckpointFormat, ExportOptions

MEDUSA_TENSORS = "medusa_lm_head.safetensors"
MEDUSA_PICKLE = "medusa_lm_head.pt"
VLLM_TENSORS = "model.safetensors"


def _output_head(model, config: dict, directory) -> torch.Tensor:
    """The target's output-head weight ``[V, d]`` on the CPU, after checking ``model`` is the
    adapter's target (its rows get written into the export)."""
    if model is None:
        raise AdapterError(
            f"{directory}: this adapter shares the target's output head (share_lm_head), which it does not hold; "
            "pass --model TARGET_DIR (the target, to copy its output head into the export), or train without "
            "--share-lm-head"
        )
    TargetPin(config["target"]).check(model, where=directory, purpose="its output head goes into the export")
    return model.get_output_embeddings().weight.detach().to("cpu")


def medusa_name_map(num_heads: int, num_layers: int, layout: str, bias: bool = True,
                    shared_projection: bool = False) -> dict[str, str]:
    """``{selfdraft name: external name}`` of Medusa heads in ``layout`` (``medusa`` or
    ``medusa-vllm``). ``shared_projection``: one ``lm_heads.0`` for all heads (vLLM
    ``original_lm_head``), mapped from ``projections.0``."""
    names: dict[str, str] = {}
    for head in range(num_heads):
        for layer in range(num_layers):
            prefix = f"{head}.{layer}.linear" if layout == "medusa" else f"blocks.{head}.layers.{layer}"
            names[f"blocks.{head}.{layer}.linear.weight"] = f"{prefix}.weight"
            if bias:
                names[f"blocks.{head}.{layer}.linear.bias"] = f"{prefix}.bias"
        if not shared_projection or head == 0:
            names[f"projections.{head}.weight"] = (f"{head}.{num_layers}.weight" if layout == "medusa"
                                                   else f"lm_heads.{head}.weight")
    return names


def _identical_blocks(tensors: dict[str, torch.Tensor], num_heads: int, num_layers: int) -> bool:
    return all(
        torch.equal(tensors[f"blocks.{h}.{layer}.linear.{p}"], tensors[f"blocks.{h}.0.linear.{p}"])
        for h in range(num_heads) for layer in range(1, num_layers) for p in ("weight", "bias")
    )


def medusa_refusals(config: dict, layout: str, options: ExportOptions | None = None) -> list[str]:
    """Why a Medusa adapter cannot be written as ``layout``, from its config alone."""
    drafter, reasons = config["drafter"], []
    if options is not None and not options.fc_bias:
        reasons.append("--no-fc-bias applies to --format eagle (EAGLE-1's fc); Medusa layouts have no fc")
    if layout != "medusa":
        return reasons
    if drafter.get("draft_vocab_size") is not None:
        reasons.append(f"these heads score a draft vocabulary of {drafter['draft_vocab_size']} tokens, which "
                       "FasterDecoding's MedusaModel cannot load: export --format medusa-vllm (truncated_vocab_size "
                       "and token_map), or train with --draft-vocab-size full")
    family = config["target"].get("model_type")
    if not medusa_exportable(family):
        reasons.append(f"FasterDecoding's MedusaModel loads {MEDUSA_EXPORT_FAMILIES} targets only; this target is "
                       f"{family!r}: export --format medusa-vllm")
    return reasons


def fasterdecoding_heads_note(num_heads: int) -> str | None:
    """What FasterDecoding's loader (e2a5d20) does with ``num_heads`` heads: it builds 5 whatever the
    config says and loads ``medusa_lm_head.pt`` with ``strict=False``."""
    if num_heads == 5:
        return None
    if num_heads < 5:
        extra = (f"head {num_heads}" if num_heads == 4 else f"heads {num_heads}-4")
        return (f"FasterDecoding's MedusaModel.from_pretrained (e2a5d20) builds 5 heads whatever medusa_num_heads "
                f"says and loads medusa_lm_head.pt with strict=False: this adapter's {num_heads} heads load as heads "
                f"0-{num_heads - 1}, {extra} stay{'s' if num_heads == 4 else ''} as transformers initialises missing "
                "weights (random, untrained), without an error. Its default "
                f"tree (mc_sim_7b_63) drafts 4 deep: "
                + ("every node comes from this adapter's heads" if num_heads >= 4 else
                   f"depths {num_heads + 1}-4 draft from untrained heads (lower acceptance, outputs still the "
                   "target's); pass medusa_choices no deeper than " + str(num_heads)))
    return (f"FasterDecoding's MedusaModel.from_pretrained (e2a5d20) builds 5 heads whatever medusa_num_heads says "
            f"and loads medusa_lm_head.pt with strict=False: heads 5-{num_heads - 1} of this adapter are dropped "
            "without an error (heads 0-4 load); its default tree (mc_sim_7b_63) drafts 4 deep and uses heads 0-3")


def _medusa_export_tensors(config: dict, tensors: dict[str, torch.Tensor], layout: str, model,
                           directory) -> tuple[dict[str, torch.Tensor], bool]:
    """External tensors for a Medusa adapter, and whether the projection is shared (vLLM)."""
    drafter = config["drafter"]
    num_heads, num_layers, shared = drafter["num_heads"], drafter["num_layers"], drafter["share_lm_head"]
    reasons = medusa_refusals(config, layout)
    if reasons:
        raise AdapterError(f"{directory}: " + "; ".join(reasons))
    if layout == "medusa":
        if num_layers > 1 and not _identical_blocks(tensors, num_heads, num_layers):
            raise AdapterError(
                f"{directory}: FasterDecoding builds each head from one residual block repeated medusa_num_layers "
                f"times ([ResBlock(d)] * n), so {num_layers} different blocks would load as one: train with "
                "--num-layers 1, or export --format medusa-vllm")
    tensors = dict(tensors)
    if shared:
        head = _output_head(model, config, directory)
        for index in range(1 if layout == "medusa-vllm" else num_heads):
            tensors[f"projections.{index}.weight"] = head.clone()
    names = medusa_name_map(num_heads, num_layers, layout, shared_projection=shared and layout == "medusa-vllm")
    external = {theirs: tensors[ours].contiguous() for ours, theirs in names.items()}
    if "token_map" in tensors:  # vLLM: lm_heads of truncated_vocab_size rows, logits scattered by token_map
        external["token_map"] = tensors["token_map"].to(torch.long).contiguous()
    return external, shared


def _export_medusa(config: dict, tensors: dict, fmt: str, model, adapter_dir,
                   options: ExportOptions = ExportOptions()) -> dict[str, Callable[[Path], None]]:
    external, shared = _medusa_export_tensors(config, tensors, fmt, model, adapter_dir)
    drafter, target = config["drafter"], config["target"]
    files: dict[str, Callable[[Path], None]] = {}
    if fmt == "medusa":  # fasterdecoding_heads_note reaches the user through the export's README (serve_commands)
        files["config.json"] = json_writer({
            "medusa_num_heads": drafter["num_heads"], "medusa_num_layers": drafter["num_layers"],
            "base_model_name_or_path": target.get("name_or_path") or "",
            "hidden_size": target["hidden_size"], "vocab_size": target["vocab_size"],
        })
        files[MEDUSA_TENSORS] = lambda path: save_file(external, str(path), metadata={"format": "pt"})
        files[MEDUSA_PICKLE] = lambda path: torch.save(external, str(path))
    else:
        files["config.json"] = json_writer({
            "architectures": ["MedusaModel"], "model_type": "medusa",
            "hidden_size": target["hidden_size"], "vocab_size": target["vocab_size"],
            "truncated_vocab_size": drafter.get("draft_vocab_size") or target["vocab_size"],
            "num_heads": drafter["num_heads"],
            "num_hidden_layers": drafter["num_layers"], "original_lm_head": shared, "medusa_fc_bias": True,
            "max_paths": 64, "topk": 10,
        })
        files[VLLM_TENSORS] = lambda path: save_file(external, str(path), metadata={"format": "pt"})
    return files


def serve_commands(config: dict, fmt: str, options: ExportOptions) -> dict:
    """How engines load a Medusa export (``CheckpointFormat.serve``): vLLM's Medusa proposer reads the
    ``medusa-vllm`` layout (``--speculative-config`` ``method: medusa``, at most one token per head);
    SGLang has no Medusa proposer; FasterDecoding loads the ``medusa`` layout in Python."""
    heads_count = config["drafter"]["num_heads"]
    tokens = min(options.num_speculative_tokens, heads_count)
    commands, notes = {}, []
    if fmt == "medusa-vllm":
        speculative = json.dumps({"method": "medusa", "model": options.out, "num_speculative_tokens": tokens})
        commands["vLLM"] = f"vllm serve {shlex.quote(options.target)} --speculative-config {shlex.quote(speculative)}"
        if tokens < options.num_speculative_tokens:
            notes.append(f"num_speculative_tokens lowered to {tokens}: vLLM's Medusa drafts one token per head")
    else:
        commands["vLLM"] = "not this layout: vLLM's Medusa reads selfdraft export --format medusa-vllm"
        commands["FasterDecoding Medusa (Python)"] = (
            f"python -c \"from medusa.model.medusa_model import MedusaModel; "
            f"MedusaModel.from_pretrained({options.out!r})\"")
        note = fasterdecoding_heads_note(heads_count)
        if note is not None:
            notes.append(note)
    commands["SGLang"] = "not supported: SGLang has no Medusa proposer (train an EAGLE drafter: --kind eagle --for sglang)"
    return {"commands": commands, "notes": notes}


def _positive(config: dict, key: str, where: Path, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(f"{where}: {key} must be a positive int; got {value!r}")
    return value


def _external_config(num_heads: int, num_layers: int, name: str, vocab: int, hidden: int,
                     draft_vocab: int | None = None) -> dict:
    return {
        "format_version": FORMAT_VERSION, "library": "selfdraft", "kind": "medusa",
        "drafter": {"num_heads": num_heads, "num_layers": num_layers, "share_lm_head": False, "tree": None,
                    "draft_vocab_size": draft_vocab},
        "target": {"name_or_path": name, "config_sha256": None, "weights_sha256": None,
                   "vocab_size": vocab, "hidden_size": hidden},
        "tree_accuracy": None, "training": {}, "acceptance": {},
    }


def _rename(tensors: dict[str, torch.Tensor], names: dict[str, str], directory: Path,
            fill_bias: bool = False) -> dict[str, torch.Tensor]:
    """``{selfdraft name: tensor}`` from external ``tensors`` named by ``names``; exactly the
    mapped names must be present. ``fill_bias``: blocks without bias get a zero bias (exact)."""
    wanted = set(names.values())
    missing, unexpected = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
    if missing or unexpected:
        raise AdapterError(f"{directory}: tensors do not match its config: missing {missing[:8]}, "
                           f"unexpected {unexpected[:8]}")
    ours = {mine: tensors[theirs] for mine, theirs in names.items()}
    if fill_bias:
        for name in [n for n in ours if n.endswith(".linear.weight")]:
            ours[name[: -len("weight")] + "bias"] = ours[name].new_zeros(ours[name].shape[0])
    return ours


def _read_medusa_tensors(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / MEDUSA_TENSORS).is_file():
        return read_safetensors(directory / MEDUSA_TENSORS)
    path = directory / MEDUSA_PICKLE
    if not path.is_file():
        raise AdapterError(f"{directory}: a FasterDecoding Medusa checkpoint holds {MEDUSA_TENSORS} or {MEDUSA_PICKLE}")
    check_inside(path)
    try:
        tensors = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        raise AdapterError(f"{path} could not be read as plain tensors (torch.load weights_only=True): {error}") \
            from error
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise AdapterError(f"{path} does not hold a state dict of tensors")
    return tensors


def _read_medusa(directory: Path, config: dict) -> tuple[dict, dict]:
    where = directory / "config.json"
    num_heads = _positive(config, "medusa_num_heads", where)
    num_layers = _positive(config, "medusa_num_layers", where, default=1)
    tensors = _read_medusa_tensors(directory)
    heads_in_file = sorted({int(name.split(".")[0]) for name in tensors if name.split(".")[0].isdigit()})
    if heads_in_file and heads_in_file[-1] + 1 != num_heads:
        raise AdapterError(f"{directory}: the weights hold heads 0..{heads_in_file[-1]} but config.json says "
                           f"medusa_num_heads {num_heads}; fix config.json")
    ours = _rename(tensors, medusa_name_map(num_heads, num_layers, "medusa"), directory)
    vocab, hidden = ours["projections.0.weight"].shape
    return _external_config(num_heads, num_layers, str(config.get("base_model_name_or_path") or ""),
                            vocab, hidden), ours


def _read_medusa_vllm(directory: Path, config: dict) -> tuple[dict, dict]:
    where = directory / "config.json"
    num_heads = _positive(config, "num_heads", where)
    num_layers = _positive(config, "num_hidden_layers", where)
    vocab, hidden = _positive(config, "vocab_size", where), _positive(config, "hidden_size", where)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, tensor in read_safetensors(path).items():
            tensors[name.removeprefix("medusa_heads.")] = tensor
    truncated = config.get("truncated_vocab_size", vocab)
    if truncated is None:
        truncated = vocab
    if isinstance(truncated, bool) or not isinstance(truncated, int) or not 1 <= truncated <= vocab:
        raise AdapterError(f"{where}: truncated_vocab_size must be an int in 1..vocab_size ({vocab}); got {truncated!r}")
    token_map = tensors.pop("token_map", None)
    if truncated < vocab:  # vLLM's truncated vocabulary: our draft vocabulary
        if token_map is None or tuple(token_map.shape) != (truncated,):
            raise AdapterError(f"{directory}: truncated_vocab_size {truncated} needs a token_map tensor of "
                               f"{truncated} target ids; got {None if token_map is None else tuple(token_map.shape)}")
        token_map = token_map.to(torch.long)
        if int(token_map.min()) < 0 or int(token_map.max()) >= vocab or token_map.unique().numel() != truncated:
            raise AdapterError(f"{directory}: token_map must hold {truncated} distinct ids below vocab_size {vocab}")
    else:
        token_map = None  # vLLM ignores a token_map without truncation, and so does this import
    bias = bool(config.get("medusa_fc_bias", False))
    if not bias and any(name.endswith(".bias") for name in tensors):
        raise AdapterError(f"{where}: medusa_fc_bias is false (vLLM's default) but the weights hold block biases, "
                           "which vLLM would ignore; set medusa_fc_bias: true if they are meant to be used")
    shared = bool(config.get("original_lm_head", False))
    names = medusa_name_map(num_heads, num_layers, "medusa-vllm", bias=bias, shared_projection=shared)
    ours = _rename(tensors, names, directory, fill_bias=not bias)
    if shared:  # vLLM uses lm_heads.0 for every head: one copy per head here
        for head in range(1, num_heads):
            ours[f"projections.{head}.weight"] = ours["projections.0.weight"]
    if token_map is not None:
        if shared:
            raise AdapterError(f"{directory}: original_lm_head with a truncated vocabulary is not supported")
        for head in range(num_heads):  # vLLM slices full-vocabulary lm_heads by token_map when loading
            name = f"projections.{head}.weight"
            if ours[name].shape[0] == vocab:
                ours[name] = ours[name][token_map]
        ours["token_map"] = token_map
    if tuple(ours["projections.0.weight"].shape) != (truncated, hidden):
        raise AdapterError(f"{directory}: lm_heads have shape {tuple(ours['projections.0.weight'].shape)}, "
                           f"config.json says {truncated} scored tokens x hidden_size {hidden}")
    return _external_config(num_heads, num_layers, "", vocab, hidden,
                            truncated if token_map is not None else None), ours


def restore_sidecar(own: dict, tensors: dict, model, path: Path) -> dict:
    """After an export's sidecar restored the config: heads that share the target's output head
    got its rows copied into their projections; on that target they must equal its head (on
    another one, loading reports the mismatch), and the copies are dropped."""
    if not own["drafter"].get("share_lm_head"):
        return tensors
    head = model.get_output_embeddings().weight.detach().to("cpu")
    projections = [name for name in tensors if name.startswith("projections.")]
    same_target = not TargetPin(own["target"]).differences(TargetPin.of(model))
    if same_target and not all(torch.equal(tensors[name], head.to(tensors[name].dtype)) for name in projections):
        raise AdapterError(f"{path} says the heads share the target's output head, but the checkpoint's "
                           "projections differ from this model's output head")
    return {name: tensor for name, tensor in tensors.items() if name not in projections}


def _is_vllm(config: dict, architectures: list[str], names) -> bool:
    return config.get("model_type") == "medusa" or "MedusaModel" in architectures


def _is_fasterdecoding(config: dict, architectures: list[str], names) -> bool:
    return "medusa_num_heads" in config


FORMATS = (
    CheckpointFormat("medusa-vllm", _is_vllm, _export_medusa, lambda d, c, f, m: _read_medusa_vllm(d, c),
                     ("config.json", VLLM_TENSORS), medusa_refusals, serve_commands),
    CheckpointFormat("medusa", _is_fasterdecoding, _export_medusa, lambda d, c, f, m: _read_medusa(d, c),
                     ("config.json", MEDUSA_TENSORS, MEDUSA_PICKLE), medusa_refusals, serve_commands),
)
