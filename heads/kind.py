"""What a drafter kind is: the one object each ``heads/<kind>/`` package registers
(:mod:`heads.kinds` holds the registry). Everything outside a kind's folder asks this object
instead of comparing the kind's name."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from torch import nn

Writer = Callable[[Path], None]

SAMPLE_MODES = ("auto", "never", "always")
"""A kind's ``sample`` option (candidates under the lossless sampling rule): ``auto`` draws them
from the drafter's own warped distribution where the kind can, ``never`` keeps the top-k tokens
(point masses), ``always`` is ``auto`` that refuses shapes the kind cannot sample. Greedy and
lossy rules always get the top-k tokens."""


def default_policy_sizes(spec) -> tuple[int, ...]:
    return (2, 4, 8, 16)


@dataclass(frozen=True)
class ExportOptions:
    """What an export writes beyond the adapter itself, and how its serving commands name things."""

    out: str = "EXPORT_DIR"
    """The export directory, as the printed commands name it."""
    target: str = "TARGET_MODEL"
    """The target model as the serving commands name it (a hub id or a local directory)."""
    verifier: str | None = None
    """The hub id recorded as the verifier where a layout records one (speculators); None: ``target``."""
    num_speculative_tokens: int = 3
    """Tokens drafted per step in chain-drafting engines (vLLM, SGLang with top-k 1)."""
    fc_bias: bool = True
    """EAGLE-1: write ``fc.bias`` (False: a bias-free ``fc``, for loaders that build it without one)."""


@dataclass(frozen=True)
class CheckpointFormat:
    """Another project's checkpoint layout for a kind: how to recognise, write and read it."""

    name: str
    detect: Callable[[dict, list[str], Callable[[], list[str]]], bool]
    """``(config.json, its architectures, a function listing the tensor names)`` → is this layout."""
    export: Callable[[dict, dict, str, object, object, ExportOptions], dict[str, Writer]]
    """``(adapter config, tensors, format, target model or None, adapter dir, options)`` → files to write."""
    read: Callable[[Path, dict, str, object], tuple[dict, dict]]
    """``(directory, config.json, format, target model)`` → (adapter config, ``{name: tensor}``)."""
    files: tuple[str, ...] = ()
    """File names an export writes (an older export of them may be replaced)."""
    refusals: Callable[[dict, str, ExportOptions], list[str]] | None = None
    """``(adapter config, format, options)`` → why the adapter cannot be written in this layout, from
    its config alone (asked before any model is loaded)."""
    serve: Callable[[dict, str, ExportOptions], dict] | None = None
    """``(adapter config, format, options)`` → ``{"commands": {engine: command line or why not},
    "notes": [...]}``: how each engine loads the export (printed and written to its README)."""


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter, as every generic part of selfdraft sees it.

    ``make_config(**options)`` turns ``attach_heads`` keyword options into the kind's config
    (raising ValueError for an option it does not take); ``build_heads`` builds the trainable
    module (None for kinds with nothing to train); ``build_drafter(spec, tree)`` the object that
    proposes trees (``tree_attention.decode.Drafter``).
    """

    name: str
    config_class: type
    make_config: Callable[..., object]
    build_heads: Callable[[object, object], nn.Module | None]
    build_drafter: Callable[[object, object], object]
    options: tuple[str, ...] = ()
    """The ``attach_heads`` keyword options of this kind (``make_config``'s arguments)."""
    target_view: Callable[[object, object], object] | None = None
    """The view of the backbone the decode loop runs (e.g. one returning more layers as features)."""
    policy_sizes: Callable[[object], tuple[int, ...]] = default_policy_sizes
    """Tree sizes (drafted nodes) ``speculate="auto"`` chooses from, a single node besides; one size
    alone: the drafter sizes its trees itself up to it, and ``auto`` decides only whether a step drafts."""
    static_tree: bool = False
    """The drafter fills one fixed tree template (``spec.tree``)."""
    trainable: bool = True
    """Whether the kind has tensors to train and save as an adapter."""
    check_drafter: Callable[[Mapping, str], None] | None = None
    """Checks of an adapter config's ``drafter`` block beyond the config class's own."""
    formats: tuple[CheckpointFormat, ...] = ()
    sidecar_keys: tuple[str, ...] = ()
    """Drafter fields an export's sidecar must agree on with the checkpoint beside it."""
    restore_sidecar: Callable[[dict, dict, object, Path], dict] | None = None
    """``(own config, tensors, model, sidecar path)`` → tensors, after a sidecar restored the config."""
    bind_rule: Callable[[object, object], object] | None = None
    """``(drafter, acceptance rule) -> drafter`` set up for the serving rule (e.g. sampled
    candidates drawn at the rule's own settings); called by ``generate`` before each run."""
    loss: Callable[..., object] | None = None
    """The training hook (``heads/<kind>/loss.py``) the generic trainer calls."""
    cli: object | None = None
    """The kind's command-line options: ``add_arguments(parser)`` and ``options(args)``."""
    save: Callable[..., None] | None = None
    """``(spec, directory, **metadata)``: write the kind's own adapter directory (None: the generic
    ``adapter_config.json`` + ``adapter_model.safetensors`` of ``spec.heads``' tensors)."""
    load: Callable[..., object] | None = None
    """``(model, directory, config, strict=)`` -> ``(kind config, metadata)``: read what :attr:`save`
    wrote: the kind's config holding what it loaded (e.g. a draft model) and what ``spec.metadata``
    records of it; ``config`` is the checked ``adapter_config.json``, the target pin not yet
    compared (the hook compares it, ``strict`` as in ``load_heads``). ``heads.load_heads`` builds
    the spec from them."""
    adapter_files: tuple[str, ...] = ()
    """Names :attr:`save` writes beside ``adapter_config.json`` (an earlier output with them may be replaced)."""
    hybrid: Callable[[object], object] | None = None
    """``(config) -> hybrid``: this kind's drafting added to any other kind's trees
    (``SpeculativeModel.set_lookup``); ``hybrid.wrap(drafter)`` is the drafter of the merged trees. At
    most one kind has it (:func:`heads.kinds.hybrid`)."""
    extra: dict = field(default_factory=dict)


def refuse_options(kind: str, allowed: tuple[str, ...], options: Mapping[str, object]) -> None:
    """ValueError naming the options ``kind`` does not take."""
    unknown = sorted(name for name, value in options.items() if name not in allowed and value is not None)
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not option(s) of kind={kind!r} (its options: {list(allowed)})")
