"""EAGLE-1 and EAGLE-3 checkpoint layouts: export of ``eagle1``/``eagle3``-layout drafters, import.
vLLM speculators' EAGLE-3 layout (``speculators``) is the ``eagle3`` layout translated by
:mod:`heads.eagle.speculators`.

Matched against these loaders (source read at these commits):

* ``eagle`` (EAGLE-1): SafeAILab/EAGLE ``eagle/model/cnets1.py`` at cb7e084 (``fc = Linear(2h, h,
  bias=True)`` over ``cat(inputs_embeds, hidden_states)``; layer 0 without ``input_layernorm``; no
  final norm: the base model's head reads the layer output); vLLM
  ``vllm/model_executor/models/llama_eagle.py`` at 00da923 (``EagleLlamaForCausalLM``; layer 0 with
  ``disable_input_layernorm``; skips ``embed_tokens`` and shares the target's with PP=1); SGLang
  ``python/sglang/srt/models/llama_eagle.py`` at 034b3be (``LlamaForCausalLMEagle``; ``fc`` with bias;
  embeddings and head set from the target). Files: ``config.json`` (a Llama config with
  ``num_hidden_layers`` = drafter layers) and ``model.safetensors`` with ``fc.weight`` ``[h, 2h]``,
  ``fc.bias`` ``[h]``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.{gate,up,
  down}_proj.weight``, ``layers.{i}.post_attention_layernorm.weight`` (and ``input_layernorm`` for
  ``i > 0``); no embedding, no head. ``architectures`` is ``["LlamaForCausalLMEagle",
  "LlamaForCausalLM"]``: SGLang resolves the first, vLLM's ``EAGLEConfig`` prefixes ``Eagle`` to each
  and resolves ``EagleLlamaForCausalLM`` (both registries take the first architecture they know;
  not checked on a running engine). Caveat: vLLM 00da923 builds ``fc`` *without* bias and skips
  ``fc.bias`` silently, so a drafter served there loses its projection bias (SafeAILab and SGLang
  keep it); the export's serving notes say so, and ``ExportOptions.fc_bias=False`` (``export
  --no-fc-bias``) writes a bias-free ``fc``, refused unless the bias is zero (dropping it exactly).
* ``eagle3``: SGLang ``python/sglang/srt/models/llama_eagle3.py`` at 03d5a77
  (``LlamaForCausalLMEagle3``: ``midlayer`` concatenates ``[input_layernorm(embeds);
  hidden_norm(hidden)]`` into q/k/v of ``2h`` inputs, residual = hidden; ``fc`` only when the hidden
  width is ``3h``, so deeper steps feed back the pre-norm output; ``norm`` then ``lm_head`` of
  ``draft_vocab_size`` rows; ``d2t`` read as ``hot_token_id = d2t + arange``; ``tie_word_embeddings``
  true would make ``lm_head`` the embedding, so it is written false); vLLM ``llama_eagle3.py`` at
  00bd149 (``Eagle3LlamaForCausalLM``: ``midlayer.`` renamed ``layers.0.``, ``d2t`` →
  ``draft_id_to_target_id``, ``t2d`` skipped, ``norm_before_residual`` false by default); SpecForge
  ``specforge/modeling/draft/llama3_eagle.py`` and ``specforge/export/to_sglang.py`` at a6b6b02
  (required keys ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``t2d``, ``d2t``; embeddings
  dropped; ``d2t[i] = used[i] - i`` over the draft ids sorted ascending, ``t2d`` a bool mask over the
  target vocabulary). ``config.json``: Llama fields, ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``num_hidden_layers: 1``, ``draft_vocab_size``, the captured layers in both engines' conventions
  (:func:`aux_layer_keys`): ``eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state:
  true}`` for SGLang (``set_eagle3_layers_to_capture``: ``layers_to_capture = [id + 1]``, id ``l`` is
  the output of decoder layer ``l`` before the final norm, i.e. selfdraft's ``feature_layers`` index
  ``k`` is id ``k - 1``) and a top-level ``eagle_aux_hidden_state_layer_ids`` for vLLM, which reads
  only that key (``eagle3_utils``; a nested one is ignored and vLLM silently falls back to its
  default layers) and captures the stream *entering* layer ``id`` (id ``k``). The layers are written
  in increasing order with ``fc``'s column blocks permuted to match (:func:`layer_order`): every
  loader concatenates the captured layers in layer order. ``target_hidden_size`` is written only when
  it differs from ``hidden_size``: SafeAILab's EAGLE-3 ``Model`` (``eagle/model/cnets.py``) skips
  loading the target's embeddings when the key exists and, loading with ``strict=False``, would
  draft with random embeddings. ``lm_head.weight`` holds the target's output-head rows of the
  draft vocabulary (the drafter reads through the frozen head), so a checkpoint with its own trained
  ``lm_head`` (other rows) is refused on import.
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from ..adapter import FORMAT_VERSION, AdapterError, TargetPin, json_writer, read_safetensors
from ..families import is_llama, llama_config, llama_config_differences
from ..kind import CheckpointFormat, ExportOptions
from .config import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS
from .speculators import SPECULATORS, eagle3_view, speculators_files
from .speculators import detect as detect_speculators

logger = logging.getLogger(__name__)

EAGLE_TENSORS = "model.safetensors"
EAGLE1_ARCHITECTURES = ["LlamaForCausalLMEagle", "LlamaForCausalLM"]
EAGLE3_ARCHITECTURES = ["LlamaForCausalLMEagle3"]
_LABEL = {"eagle": "EAGLE-1", "eagle3": "EAGLE-3"}
_LAYOUT = {"eagle": "eagle1", "eagle3": "eagle3"}
# speculators (heads/eagle/speculators.py) wraps the eagle3 layout: everything else is eagle3's


# ----------------------------------------------------------------------------- refusals

def eagle_refusals(config: dict, fmt: str, target_layers: int | None = None) -> list[str]:
    """Why the EAGLE adapter ``config`` cannot be written as ``fmt`` (``eagle`` or ``eagle3``);
    ``target_layers``: the target's decoder layers, to check ``feature_layers`` (eagle3)."""
    drafter, family = config["drafter"], config["target"].get("model_type")
    label, layout = _LABEL[fmt], drafter.get("layout", "native")
    reasons = []
    if drafter.get("parallel", 1) > 1 and not separable_heads(drafter):
        reasons.append(f"this drafter drafts {drafter['parallel']} depths in parallel with "
                       f"{drafter.get('parallel_mode', 'heads')} (parallel > 1), which shares the drafter's layer and "
                       "which EAGLE checkpoint layouts cannot hold: train with --parallel 1, or with "
                       "--parallel-mode heads (the heads stay behind and engines draft sequentially)")
    if not is_llama(family):
        reasons.append(f"{label} loaders build Llama decoder layers; the target is {family!r} "
                       "(train on a Llama target)")
    layers = drafter.get("feature_layers")
    if fmt == "eagle":
        if layout != "eagle1":
            reasons.append(f"this drafter has layout {layout!r}, not the EAGLE-1 layer (no input layernorm in the "
                           "first layer, no final norm): train with --eagle-layout eagle1")
        if layers is not None:
            reasons.append(f"EAGLE-1 reads the top-layer features only; this drafter fuses layers {list(layers)} "
                           "(train without --feature-layers, or export --format eagle3)")
        if drafter.get("draft_vocab_size") is not None:
            reasons.append("EAGLE-1 drafts over the full vocabulary; this drafter has draft_vocab_size "
                           f"{drafter['draft_vocab_size']} (train without --draft-vocab-size)")
        return reasons
    if layout != "eagle3":
        reasons.append(f"this drafter has layout {layout!r}, not the EAGLE-3 midlayer: train with --eagle-layout "
                       "eagle3 --feature-layers LOW,MID,HIGH")
    if layers is None or len(layers) != 3:
        reasons.append("EAGLE-3's fc fuses exactly three target layers (h x 3h); this drafter has feature_layers "
                       f"{layers} (train with three --feature-layers below the top layer)")
    elif target_layers is not None and not all(1 <= index < target_layers for index in layers):
        reasons.append("EAGLE-3 loaders capture decoder-layer outputs before the final norm "
                       f"(eagle_aux_hidden_state_layer_ids = feature_layers - 1); feature_layers {list(layers)} "
                       f"must lie in 1..{target_layers - 1} (0, the embeddings, and the post-norm top layer have "
                       "no id)")
    return reasons


def separable_heads(drafter: dict) -> bool:
    """Whether a parallel drafter's extra depths come from Medusa-style heads (``parallel_mode``
    ``heads``): trained with their input's gradient stopped, they leave the drafter's layer exactly a
    sequential drafter's, so an export writes that layer alone and engines draft sequentially
    (``mask`` and ``block`` train the layer on their mask queries as well)."""
    return drafter.get("parallel", 1) > 1 and drafter.get("parallel_mode", "heads") == "heads"


PARALLEL_HEADS = "parallel_heads."
"""Prefix of a ``heads`` mode drafter's parallel heads' tensors (not exported)."""


def layout_refusals(config: dict, fmt: str, options: ExportOptions) -> list[str]:
    """:func:`eagle_refusals` from the adapter config alone (``CheckpointFormat.refusals``), and a
    bias-free ``fc`` asked of a layout whose ``fc`` has no bias anyway."""
    reasons = eagle_refusals(config, "eagle3" if fmt == SPECULATORS else fmt)
    if reasons and fmt != "eagle":  # --for trains the EAGLE-3 layout (eagle3, speculators), not EAGLE-1's
        reasons.append("`selfdraft train --kind eagle --for vllm` (or --for sglang) trains a drafter this format "
                       "holds")
    if not options.fc_bias and fmt != "eagle":
        reasons.append("--no-fc-bias applies to --format eagle (EAGLE-1's fc); EAGLE-3's fc has no bias")
    return reasons


def _pinned_model(model, config: dict, adapter_dir, fmt: str):
    """``model`` after checking it is the adapter's target (its config and head go into the export)."""
    if model is None:
        raise AdapterError(f"{adapter_dir}: an {_LABEL[fmt]} checkpoint holds the target's Llama config"
                           + (" and output-head rows (lm_head)" if fmt == "eagle3" else "")
                           + ", which the adapter does not: pass --model TARGET_DIR (the adapter's target)")
    TargetPin(config["target"]).check(model, where=adapter_dir, purpose="its config goes into the export")
    return model


# ----------------------------------------------------------------------------- export

def eagle_name_map(tensor_names, fmt: str) -> dict[str, str]:
    """``{selfdraft name: external name}`` of an ``eagle1``/``eagle3`` drafter's tensors."""
    names = {}
    for name in tensor_names:
        if name == "token_map":
            continue
        if fmt == "eagle":
            names[name] = ("fc." + name.removeprefix("projection.") if name.startswith("projection.")
                           else name.removeprefix("decoder."))
        elif name == "fusion.weight":
            names[name] = "fc.weight"
        elif name.startswith("decoder.norm."):
            names[name] = name.removeprefix("decoder.")
        else:
            names[name] = "midlayer." + name.removeprefix("decoder.")
    return names


def layer_order(feature_layers, fc_weight: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """``feature_layers`` in increasing order and ``fc_weight`` ``[h, k x H]`` with its column blocks
    permuted to match: every EAGLE-3 loader concatenates the captured layers in layer order, so a
    drafter trained on another order computes the same function with its blocks reordered."""
    layers = [int(index) for index in feature_layers]
    order = sorted(range(len(layers)), key=layers.__getitem__)
    width = fc_weight.shape[1] // len(layers)
    blocks = [fc_weight[:, index * width:(index + 1) * width] for index in order]
    return [layers[index] for index in order], torch.cat(blocks, dim=1).contiguous()


def aux_layer_keys(feature_layers) -> dict:
    """The config keys naming the captured target layers, in both engines' conventions: vLLM reads
    the top-level ``eagle_aux_hidden_state_layer_ids`` and captures the stream *entering* layer
    ``id`` (selfdraft's feature index itself); SGLang reads ``eagle_config``'s and captures the
    *output* of layer ``id`` (the feature index - 1)."""
    layers = [int(index) for index in feature_layers]
    return {"eagle_aux_hidden_state_layer_ids": layers,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [index - 1 for index in layers],
                             "use_aux_hidden_state": True}}


def feature_layers_of(config: dict, target_layers: int, where: Path) -> list[int]:
    """selfdraft's ``feature_layers`` from an EAGLE-3 config: SGLang's ``eagle_config`` ids + 1,
    or vLLM's top-level ids as they are; both present must agree."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    found = {}
    for name, ids, shift in (("eagle_config.eagle_aux_hidden_state_layer_ids", nested, 1),
                             ("eagle_aux_hidden_state_layer_ids", top, 0)):
        if ids is None:
            continue
        if not isinstance(ids, list) or len(ids) != 3 or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise AdapterError(f"{where}: {name} must list three layer ids; got {ids!r}")
        found[name] = [i + shift for i in ids]
    if not found:
        raise AdapterError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids (SGLang) or "
                           "eagle_aux_hidden_state_layer_ids (vLLM) must list three layer ids; found neither")
    if len(found) == 2 and found["eagle_config.eagle_aux_hidden_state_layer_ids"] != found[
            "eagle_aux_hidden_state_layer_ids"]:
        raise AdapterError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {nested} (SGLang: outputs of "
                           f"layers) and eagle_aux_hidden_state_layer_ids {top} (vLLM: inputs of layers) name "
                           "different layers; they must differ by exactly one")
    layers = next(iter(found.values()))
    if not all(index < target_layers for index in layers):
        raise AdapterError(f"{where}: aux layer ids name layers beyond this {target_layers}-layer target (SGLang's "
                           f"eagle_config ids lie in 0..{target_layers - 2}, decoder-layer outputs before the final "
                           f"norm; vLLM's top-level ids in 0..{target_layers - 1}); got {nested or top}")
    if layers != sorted(layers):
        raise AdapterError(f"{where}: aux layer ids must be in increasing order (the loaders concatenate the "
                           f"captured layers in layer order); got {layers}")
    return layers


def vocabulary_maps(token_map: torch.Tensor | None, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft ids sorted ascending ``[V']`` (the order SpecForge's ``d2t`` requires), ``d2t``
    (int64 offsets, ``ids - arange``) and ``t2d`` (bool ``[V]``)."""
    ids = torch.arange(vocab_size) if token_map is None else torch.sort(token_map.long()).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids, ids - torch.arange(ids.numel()), t2d


def _without_bias(external: dict[str, torch.Tensor], adapter_dir) -> dict[str, torch.Tensor]:
    """EAGLE-1 tensors without ``fc.bias`` (``--no-fc-bias``), exact only for a zero bias."""
    bias = external.pop("fc.bias")
    if bool(bias.abs().max() > 0):
        raise AdapterError(f"{adapter_dir}: --no-fc-bias: this drafter's fc.bias is not zero (largest |b| "
                           f"{float(bias.abs().max()):.3g}), so a bias-free fc predicts differently. Export with "
                           "the bias for SGLang or SafeAILab EAGLE, or for vLLM train an EAGLE-3 drafter "
                           "(selfdraft train --kind eagle --for vllm) and export --format speculators or eagle3")
    return external


def export_files(config: dict, tensors: dict[str, torch.Tensor], fmt: str, model,
                 adapter_dir, options: ExportOptions = ExportOptions()) -> dict[str, Callable[[Path], None]]:
    """The files of the ``fmt`` checkpoint of an EAGLE adapter; :class:`AdapterError` listing every
    reason when the layout cannot hold the drafter exactly."""
    wrapper, fmt = fmt, ("eagle3" if fmt == SPECULATORS else fmt)
    target_layers = None if model is None else int(model.config.num_hidden_layers)
    reasons = eagle_refusals(config, fmt, target_layers)
    if reasons:
        raise AdapterError(f"{adapter_dir}: cannot export this EAGLE drafter as {wrapper!r} without changing what it "
                           "predicts: " + "; ".join(reasons))
    model = _pinned_model(model, config, adapter_dir, fmt)
    drafter, dtype = config["drafter"], config["target"].get("dtype") or "float32"
    if separable_heads(drafter):  # the sequential drafter alone; the sidecar describes it as exported
        tensors = {name: tensor for name, tensor in tensors.items() if not name.startswith(PARALLEL_HEADS)}
        drafter.update(parallel=1, drafting="sequential")
    external = {theirs: tensors[ours].contiguous() for ours, theirs in eagle_name_map(tensors, fmt).items()}
    if fmt == "eagle":
        if not options.fc_bias:
            external = _without_bias(external, adapter_dir)
        payload = llama_config(model, drafter["num_layers"], EAGLE1_ARCHITECTURES, dtype)
    else:
        head = model.get_output_embeddings()
        if head.bias is not None:
            raise AdapterError(f"{adapter_dir}: the target's output head has a bias, which EAGLE-3's lm_head lacks")
        ids, d2t, t2d = vocabulary_maps(tensors.get("token_map"), head.out_features)
        external.update({"lm_head.weight": head.weight.detach().to("cpu")[ids].contiguous(), "d2t": d2t, "t2d": t2d})
        layers, external["fc.weight"] = layer_order(drafter["feature_layers"], external["fc.weight"])
        drafter["feature_layers"] = layers  # the sidecar describes the drafter as exported (the same function)
        payload = llama_config(model, 1, EAGLE3_ARCHITECTURES, dtype)
        payload.update(draft_vocab_size=int(ids.numel()), **aux_layer_keys(layers))
        if int(head.in_features) != payload["hidden_size"]:  # SafeAILab skips the target's embeddings when present
            payload["target_hidden_size"] = int(head.in_features)
        if wrapper == SPECULATORS:
            payload, external = speculators_files(payload, external, config, model, options)
    return {"config.json": json_writer(payload),
            EAGLE_TENSORS: lambda path: save_file(external, str(path), metadata={"format": "pt"})}


def serve_commands(config: dict, fmt: str, options: ExportOptions) -> dict:
    """How vLLM, SGLang and selfdraft load an ``fmt`` export (``CheckpointFormat.serve``). Flags as
    documented by vLLM (``--speculative-config`` with ``method`` ``eagle``/``eagle3``, ``model``,
    ``num_speculative_tokens``; a speculators folder also serves alone, ``vllm serve DIR``) and
    SGLang (``--speculative-algorithm EAGLE``/``EAGLE3``, ``--speculative-draft-model-path``, a
    chain of ``--speculative-num-steps`` with ``--speculative-eagle-topk 1`` and
    ``--speculative-num-draft-tokens`` = steps + 1)."""
    steps, target, out = options.num_speculative_tokens, shlex.quote(options.target), shlex.quote(options.out)
    method = "eagle" if fmt == "eagle" else "eagle3"
    speculative = json.dumps({"method": method, "model": options.out, "num_speculative_tokens": steps})
    commands = {"vLLM": f"vllm serve {target} --speculative-config {shlex.quote(speculative)}"}
    if fmt == SPECULATORS:
        commands["vLLM (verifier read from config.json)"] = f"vllm serve {out}"
        commands["SGLang"] = ("not this layout: SGLang reads the EAGLE-3 layout (selfdraft export --format eagle3); "
                              "the speculators format is vLLM's")
    else:
        commands["SGLang"] = (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm "
                              f"{method.upper()} --speculative-draft-model-path {out} --speculative-num-steps {steps} "
                              f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}")
    notes = []
    if separable_heads(config["drafter"]):
        notes.append(f"the adapter's {config['drafter']['parallel'] - 1} parallel heads are not in this export: "
                     "engines draft one depth at a time with the drafter's layer, which the heads never trained; "
                     "selfdraft serves the adapter itself with its parallel drafting")
    if fmt == "eagle" and options.fc_bias:
        notes.append("fc.bias: SafeAILab EAGLE and SGLang (LlamaForCausalLMEagle) load it; vLLM's EAGLE-1 model "
                     "(EagleLlamaForCausalLM) builds fc without a bias and drops fc.bias silently, so under vLLM this "
                     "drafter predicts differently (lower acceptance, outputs still the target's). For vLLM prefer "
                     "an EAGLE-3 drafter (selfdraft train --kind eagle --for vllm, export --format speculators)")
    if fmt == SPECULATORS:
        notes.append(f"config.json records the verifier as {options.verifier or config['target'].get('name_or_path')!r}"
                     " (set it with --verifier HUB_ID); `vllm serve EXPORT_DIR` loads that model as the target")
    return {"commands": commands, "notes": notes}


# ----------------------------------------------------------------------------- import

def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise AdapterError(f"{directory}: no *.safetensors file (a pytorch_model.bin checkpoint, as SafeAILab "
                           "publishes, must be converted to safetensors first)")
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        tensors.update(read_safetensors(path))
    return tensors


def _check_llama_config(config: dict, model, where: Path) -> None:
    """The checkpoint's layer sizes must be the target's: the drafter is built from the target's config."""
    differences = llama_config_differences(config, model)
    if differences:
        raise AdapterError(f"{where}: selfdraft builds the drafter's layer from the target's config, which must match "
                           f"the checkpoint's: target {model.config.model_type!r}; differences: {differences}")
    if config.get("bias") or config.get("norm_before_residual") or config.get("fc_norm"):
        raise AdapterError(f"{where}: bias / norm_before_residual / fc_norm variants are not supported")


def _imported_config(drafter: dict, config: dict, vocab: int, hidden: int) -> dict:
    drafter = {"depth": DEFAULT_DEPTH, "top_k": DEFAULT_TOP_K, "total_tokens": DEFAULT_TOTAL_TOKENS,
               "feature_layers": None, "draft_vocab_size": None, **drafter}
    return {"format_version": FORMAT_VERSION, "library": "selfdraft", "kind": "eagle", "drafter": drafter,
            "target": {"name_or_path": str(config.get("base_model_name_or_path") or ""), "config_sha256": None,
                       "weights_sha256": None, "vocab_size": vocab, "hidden_size": hidden},
            "tree_accuracy": None, "training": {}, "acceptance": {}}


def _rename(tensors: dict[str, torch.Tensor], rename: Callable[[str], str | None]) -> dict[str, torch.Tensor]:
    return {new: tensor for name, tensor in tensors.items() if (new := rename(name)) is not None}


def _draft_vocabulary(tensors: dict, model, where: Path) -> torch.Tensor | None:
    """Check ``lm_head``/``d2t``/``t2d`` against the target's head; the draft ids (None: all, in order)."""
    missing = [name for name in ("lm_head.weight", "d2t") if name not in tensors]
    if missing:
        raise AdapterError(f"{where}: an EAGLE-3 checkpoint must hold {missing} (SpecForge's required keys)")
    lm_head, d2t = tensors.pop("lm_head.weight"), tensors.pop("d2t").long()
    ids = d2t + torch.arange(d2t.numel())
    head = model.get_output_embeddings().weight.detach().to("cpu")
    if ids.min() < 0 or ids.max() >= head.shape[0] or ids.unique().numel() != ids.numel():
        raise AdapterError(f"{where}: d2t + arange gives ids outside 0..{head.shape[0] - 1} or repeated ids")
    t2d = tensors.pop("t2d", None)
    if t2d is not None and not torch.equal(torch.nonzero(t2d.bool()).flatten(), torch.sort(ids).values):
        raise AdapterError(f"{where}: t2d and d2t disagree (nonzero(t2d) must equal d2t + arange, sorted)")
    if tuple(lm_head.shape) != (ids.numel(), head.shape[1]) or not torch.equal(lm_head.to(head.dtype), head[ids]):
        raise AdapterError(f"{where}: lm_head.weight is not the target's output-head rows of the draft vocabulary; "
                           "selfdraft's eagle3 layout drafts through the frozen target head, so a separately trained "
                           "lm_head cannot be loaded without changing its predictions")
    return None if torch.equal(ids, torch.arange(head.shape[0])) else ids


def read_eagle(directory: Path, config: dict, fmt: str, model) -> tuple[dict, dict[str, torch.Tensor]]:
    """An EAGLE-1/EAGLE-3 (or speculators EAGLE-3) checkpoint as (selfdraft adapter config,
    ``{selfdraft name: tensor}``)."""
    where = directory / "config.json"
    tensors, depth = _read_tensors(directory), None
    if fmt == SPECULATORS:
        config, tensors, depth = eagle3_view(config, tensors, model, where)
        fmt = "eagle3"
    _check_llama_config(config, model, where)
    dropped = sorted(name for name in tensors if "embed_tokens" in name)
    if dropped:
        logger.info("%s: ignoring %s (the loaders share the target's embeddings)", directory, dropped)
    tensors = {name: tensor for name, tensor in tensors.items() if name not in dropped}
    vocab, hidden = int(model.config.vocab_size), int(model.config.hidden_size)
    if fmt == "eagle":
        layers = config.get("num_hidden_layers")
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise AdapterError(f"{where}: num_hidden_layers must be a positive int; got {layers!r}")
        ours = _rename(tensors, lambda n: "projection." + n.removeprefix("fc.") if n.startswith("fc.")
                       else "decoder." + n)
        if "projection.weight" in ours and "projection.bias" not in ours:  # a bias-free fc (vLLM): exact as zeros
            ours["projection.bias"] = ours["projection.weight"].new_zeros(ours["projection.weight"].shape[0])
        return _imported_config({"num_layers": layers, "layout": "eagle1"}, config, vocab, hidden), ours
    eagle = config.get("eagle_config") or {}
    if config.get("num_hidden_layers", 1) != 1 or not eagle.get("use_aux_hidden_state", True):
        raise AdapterError(f"{where}: only one midlayer with aux hidden states is supported (num_hidden_layers 1, "
                           "use_aux_hidden_state true)")
    layers = feature_layers_of(config, int(model.config.num_hidden_layers), where)
    token_ids = _draft_vocabulary(tensors, model, directory)
    ours = _rename(tensors, lambda n: "fusion.weight" if n == "fc.weight" else "decoder." + n.removeprefix("midlayer."))
    if token_ids is not None:
        ours["token_map"] = token_ids
    drafter = {"num_layers": 1, "layout": "eagle3", "feature_layers": layers,
               "draft_vocab_size": None if token_ids is None else int(token_ids.numel())}
    if depth is not None:  # speculators' greedy proposal: a chain of speculative_tokens drafts
        drafter.update(depth=depth, top_k=1, total_tokens=depth)
    return _imported_config(drafter, config, vocab, hidden), ours


def _is_eagle3(config: dict, architectures: list[str], names) -> bool:
    if "speculators_model_type" in config:
        return False
    return ("eagle_config" in config or "draft_vocab_size" in config or any("Eagle3" in a for a in architectures)
            or any(name.startswith("midlayer.") for name in names()))


def _is_eagle1(config: dict, architectures: list[str], names) -> bool:
    return any("Eagle" in a for a in architectures) or ("fc.weight" in names()
                                                        and any(n.startswith("layers.0.") for n in names()))


FORMATS = tuple(
    CheckpointFormat(name, detect, export_files, read_eagle, ("config.json", EAGLE_TENSORS), layout_refusals,
                     serve_commands)
    for name, detect in ((SPECULATORS, detect_speculators), ("eagle3", _is_eagle3), ("eagle", _is_eagle1))
)
