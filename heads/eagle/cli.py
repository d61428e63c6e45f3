"""EAGLE's ``selfdraft train`` flags: how they are declared and what they become (``attach_heads``
options and ``TrainConfig`` fields). The train command adds every trainable kind's flags."""

from __future__ import annotations

import argparse

from ..draft_vocab_flags import DRAFT_VOCAB_FROM, auto_draft_vocab, draft_vocab

LAYOUTS = ("native", "eagle1", "eagle3")
DRAFTING_MODES = ("sequential", "parallel", "auto")
PARALLEL_MODES = ("heads", "mask", "block")
HEAD_INPUTS = ("prediction", "feature")
"""The choices of ``--eagle-layout``, ``--drafting``, ``--parallel-mode`` and ``--head-input``: those of
:class:`~heads.eagle.config.EagleConfig` (same names there; a test keeps them equal), declared here
because the config module imports torch and the flags must not."""

LEARNING_RATE = 1e-2
"""``selfdraft train --kind eagle``'s default ``--lr``. The drafter's projection and decoder layer start
random (Medusa's heads start as the identity and a copy of the output head), so they need a larger
step than heads to learn in a few hundred steps (chosen with ``benchmarks/studies/eagle_recipe``;
figures in CHANGELOG.md)."""
TOKEN_WEIGHT = 1.0
"""``--token-weight``'s default (EAGLE-1 uses 0.1): with a small token loss the feature regression
dominates and top-1 agreement, what acceptance counts, lags (``benchmarks/studies/eagle_recipe``;
figures in CHANGELOG.md)."""
PARALLEL = 4
"""``selfdraft train --kind eagle --for hf``'s default ``--parallel`` (engines load sequential drafters:
see :func:`deploy`), with ``--drafting auto``: the drafter also
learns three Medusa-style heads for depths 2-4 (``--parallel-mode heads``), and greedy serving
drafts each step sequentially or in parallel, whichever commits more tokens per second on the machine
and traffic (:mod:`heads.eagle.switch`). The drafter itself trains exactly as a sequential drafter's
(``--parallel 1``): the heads read its depth-1 prediction with the gradient stopped. (With
``--parallel-mode mask`` it shares its layer with mask queries, see ``--mask-query-weight``.) Four
parallel depths ran level with or ahead of three (figures in CHANGELOG.md)."""

MASK_QUERY_WEIGHT = {"mask": 0.2, "block": 1.0}
"""``--mask-query-weight``'s default per ``--parallel-mode``: a ``mask`` drafter also drafts sequentially
(``--drafting auto``), so its mask queries' losses weigh less than the sequential step's; a ``block``
drafter drafts every depth below the first from them, so every depth weighs alike (up to
``head_decay``)."""


def layer_list(text: str) -> list[int]:
    """``"2,6,11"`` -> ``[2, 6, 11]`` (an argparse type)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as 2,6,11; got {text!r}")


ENGINE_UNROLL_STEPS = 2
"""``--unroll-steps`` when not given for an engine layout: an exported drafter drafts sequentially,
each depth after the first from its own predicted features, so training unrolls one such step (the
training-time test of EAGLE-3; measured in CHANGELOG.md, 2026-12-06). ``--for hf`` drafts depths in
parallel by default, which sequential unrolling does not train, and keeps 1."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("EAGLE drafter (--kind eagle)")
    group.add_argument("--num-layers", type=int, default=None, help="decoder layers of the EAGLE drafter (default 1)")
    group.add_argument("--depth", type=int, default=None, help="deepest level of the dynamic draft tree")
    group.add_argument("--top-k", type=int, default=None, help="children per expanded node of the dynamic tree")
    group.add_argument("--total-tokens", type=int, default=None, help="drafted nodes verified per step")
    group.add_argument("--feature-layers", type=layer_list, default=None,
                       help="EAGLE-3: comma-separated backbone hidden states to fuse as input (0: embeddings, "
                            "num_hidden_layers: top layer), e.g. 2,6,11")
    group.add_argument("--draft-vocab-size", type=draft_vocab, default="auto",
                       help="reduced draft vocabulary of the most frequent target tokens in the data (EAGLE-3): a "
                            f"count, full, or auto (default: a quarter of the vocabulary from {DRAFT_VOCAB_FROM} "
                            "tokens up, all of it below; full with --eagle-layout eagle1)")
    group.add_argument("--eagle-layout", choices=LAYOUTS, default=None,
                       help="drafter architecture: native (selfdraft's, any family; the default with --for hf), "
                            "eagle1 (the EAGLE-1 layer, exportable with --format eagle) or eagle3 (the EAGLE-3 "
                            "midlayer fusing three --feature-layers, exportable with --format eagle3 and speculators; "
                            "the default with --for any/vllm/sglang); eagle1 and eagle3: Llama-family targets only")
    group.add_argument("--parallel", type=int, default=None,
                       help=f"depths drafted from one drafter forward per step (see --parallel-mode; "
                            f"default {PARALLEL} with --for hf and --drafting auto, 1 for engines; 1: sequential "
                            "EAGLE only, one forward per "
                            "tree level). K > 1 drafts a static "
                            "top-k tree of min(depth, K) levels from one forward per step")
    group.add_argument("--drafting", choices=DRAFTING_MODES, default=None,
                       help="how a drafter trained with --parallel > 1 drafts: auto (default with --parallel > 1: "
                            "greedy calls measure both modes while serving and draft with the faster), parallel or "
                            "sequential")
    group.add_argument("--parallel-mode", choices=PARALLEL_MODES, default=None,
                       help="--parallel > 1: where depths 2..K come from: heads (default; Medusa-style heads with their "
                            "own output rows, see --head-input, which leave the drafter's layer to sequential drafting; "
                            "with --for vllm/sglang/any the export holds that layer alone), mask "
                            "(learned mask queries in the drafter forward, sharing its layer) or block (mask queries and a "
                            "sequential head that conditions each depth on the token drafted above it; dynamic trees, "
                            "drafting parallel by default)")
    group.add_argument("--head-input", choices=HEAD_INPUTS, default=None,
                       help="--parallel-mode heads: what the heads read: prediction (default; the drafter's depth-1 "
                            "prediction at the root, which has seen the context and the root token) or feature (the "
                            "root's backbone feature, as Medusa's heads)")
    group.add_argument("--mask-query-weight", type=float, default=None,
                       help="--parallel-mode mask or block: weight of the mask queries' losses against the teacher-forced "
                            f"pairs' (default {MASK_QUERY_WEIGHT['mask']:g} for mask, which also drafts sequentially; "
                            f"{MASK_QUERY_WEIGHT['block']:g} for block, which drafts from them; higher favours the parallel "
                            "mode over the sequential one)")
    group.add_argument("--parallel-tokens", type=int, default=None,
                       help="--drafting auto: drafted nodes of the parallel mode's static tree (default 16)")
    group.add_argument("--min-acceptance", type=float, default=None,
                       help="chains (--top-k 1): stop drafting once the calibrated probability that every node so "
                            "far is accepted falls below this (default 0.5; 0: always --depth nodes)")
    group.add_argument("--siblings", type=int, default=None,
                       help="chains (--top-k 1), greedy and typical acceptance: the next best tokens added as leaves "
                            "beside each unsure chain node, with no extra drafter forward (default 1; 0: plain chains)")
    group.add_argument("--feature-weight", type=float, default=1.0,
                       help="weight of the smooth-L1 next-feature regression (default 1.0)")
    group.add_argument("--token-weight", type=float, default=TOKEN_WEIGHT,
                       help=f"weight of the token divergence to the target (default {TOKEN_WEIGHT:g}; EAGLE-1: 0.1)")
    group.add_argument("--feature-noise", type=float, default=0.1,
                       help="half-width of the uniform noise added to input features (default 0.1)")
    group.add_argument("--unroll-steps", type=int, default=None,
                       help="drafting steps unrolled on the drafter's own features in training (training-time "
                            f"test; default {ENGINE_UNROLL_STEPS} for the engine layouts of --for any/vllm/sglang, "
                            "1 with --for hf)")


def default_parallel(args: argparse.Namespace) -> bool:
    """Whether ``--parallel`` defaults to :data:`PARALLEL`: not where another flag asks for what parallel
    drafting cannot do (``--unroll-steps`` > 1 trains sequential steps; the ``eagle1``/``eagle3``
    layouts are for export to formats without parallel depths; ``--drafting sequential``)."""
    return (args.unroll_steps in (None, 1) and args.eagle_layout in (None, "native")
            and getattr(args, "drafting", None) in (None, "auto", "parallel"))


def options(args: argparse.Namespace) -> dict:
    """The ``attach_heads(kind="eagle", ...)`` options; None where a flag was not given, except
    ``parallel`` and ``drafting`` when training this kind (:data:`PARALLEL`, ``auto``)."""
    parallel, drafting = args.parallel, args.drafting
    if getattr(args, "kind", None) == "eagle" and parallel is None and default_parallel(args):
        parallel = PARALLEL
    if drafting is None and parallel is not None and parallel > 1:  # a block drafter grows its own trees
        drafting = "parallel" if getattr(args, "parallel_mode", None) == "block" else "auto"
    return {"drafting": drafting, "parallel_tokens": args.parallel_tokens,
            "num_layers": args.num_layers, "depth": args.depth, "top_k": args.top_k,
            "total_tokens": args.total_tokens, "feature_layers": args.feature_layers,
            "draft_vocab_size": args.draft_vocab_size if isinstance(args.draft_vocab_size, int) else None,
            "layout": args.eagle_layout,
            "parallel": parallel, "confidence": getattr(args, "confidence", None),
            "min_acceptance": args.min_acceptance, "siblings": getattr(args, "siblings", None),
            "parallel_mode": getattr(args, "parallel_mode", None), "head_input": getattr(args, "head_input", None)}


def train_options(args: argparse.Namespace) -> dict:
    """The ``TrainConfig`` fields EAGLE's flags set."""
    return {"feature_weight": args.feature_weight, "token_weight": args.token_weight,
            "feature_noise": args.feature_noise, "unroll_steps": args.unroll_steps or 1,
            "mask_query_weight": (args.mask_query_weight if args.mask_query_weight is not None
                                  else MASK_QUERY_WEIGHT["block" if getattr(args, "parallel_mode", None) == "block" else "mask"])}


def target_options(args: argparse.Namespace, vocab_size: int) -> dict:
    """Options that depend on the loaded target: ``--draft-vocab-size auto`` resolved for a vocabulary
    of ``vocab_size`` (not for the ``eagle1`` layout, whose export format drafts the whole vocabulary)."""
    if getattr(args, "kind", None) != "eagle" or args.draft_vocab_size != "auto" or args.eagle_layout == "eagle1":
        return {}
    size = auto_draft_vocab(vocab_size)
    return {} if size is None else {"draft_vocab_size": size}


ENGINE_FORMATS = {"vllm": ("speculators", "eagle3", "eagle"), "sglang": ("eagle3", "eagle")}
"""``selfdraft export --format`` layouts of an EAGLE drafter that each serving engine loads."""

ENGINE_LAYOUT = "eagle3"
"""The layout ``selfdraft train --for vllm|sglang|any`` trains unless ``--eagle-layout eagle1`` is given:
EAGLE-3's midlayer, which exports to ``eagle3`` (vLLM, SGLang) and ``speculators`` (vLLM)."""

def default_feature_layers(num_layers: int) -> list[int]:
    """The three target layers an engine-bound EAGLE-3 drafter fuses (``feature_layers``: hidden-state
    indices, 1..num_layers-1 as the loaders capture them): EAGLE-3's own choice of decoder outputs
    (2, L/2, L-3), which are ``feature_layers`` 3, L/2+1, L-2, from 8 layers up; 1, L/2, L-1 below."""
    if num_layers >= 8:
        return [3, num_layers // 2 + 1, num_layers - 2]
    return [1, num_layers // 2, num_layers - 1]


def _parallel_heads(args: argparse.Namespace) -> bool:
    """``--parallel K > 1`` in ``heads`` mode (the default mode): depths 2..K from heads that leave
    the drafter's layer a sequential drafter's, so an export holds the layer alone (engines draft
    sequentially; selfdraft drafts with the heads too)."""
    return (args.parallel is not None and args.parallel > 1
            and getattr(args, "parallel_mode", None) in (None, "heads"))


def _engine_conflicts(args: argparse.Namespace) -> list[str]:
    """The given flags that ask for what EAGLE checkpoint formats cannot hold (parallel depths that
    share the drafter's layer, the native layout, other than three fused layers or several EAGLE-3
    midlayers). Parallel heads are no conflict: the export leaves them behind."""
    conflicts = []
    heads = _parallel_heads(args)
    if args.parallel is not None and args.parallel > 1 and not heads:
        conflicts.append(f"--parallel {args.parallel}")
    if args.drafting in ("auto", "parallel") and not heads:
        conflicts.append(f"--drafting {args.drafting}")
    if args.eagle_layout == "native":
        conflicts.append("--eagle-layout native")
    if args.feature_layers is not None and (args.eagle_layout == "eagle1" or len(args.feature_layers) != 3):
        conflicts.append(f"--feature-layers {','.join(map(str, args.feature_layers))}")
    if args.num_layers is not None and args.num_layers > 1 and args.eagle_layout != "eagle1":
        conflicts.append(f"--num-layers {args.num_layers}")
    for flag, dest in (("--parallel-mode", "parallel_mode"), ("--parallel-tokens", "parallel_tokens"),
                       ("--head-input", "head_input")):
        if getattr(args, dest, None) is not None and not heads:
            conflicts.append(flag)
    return conflicts


def deploy(args: argparse.Namespace, engine: str | None, model_config) -> str:
    """Resolve ``selfdraft train --for``: the engine the run trains for (``vllm``, ``sglang``, ``any``
    or ``hf``), with EAGLE's flags that were not given set to what that engine loads (the
    :data:`ENGINE_LAYOUT` or ``eagle1`` layout, sequential drafting, three feature layers).

    ``engine`` None (``--for`` not given) means ``any`` unless a given flag asks for selfdraft-only
    drafting (``--parallel K`` included: selfdraft's native layout drafts parallel depths best) or the
    target cannot hold an exportable drafter: then ``hf`` (the export line says why). Under a named
    engine, ``--parallel K`` in ``heads`` mode trains the engine layout plus parallel heads that the
    export leaves behind. A Llama target too shallow for EAGLE-3 (fewer than 4 layers) gets the EAGLE-1 layout under
    ``any`` and ``sglang``. An explicit engine with such a flag or target is a ValueError naming them."""
    from ..families import LLAMA_EXPORT_FAMILIES, is_llama

    if engine == "hf":
        return engine
    text = model_config.get_text_config()
    family, layers = text.model_type, int(text.num_hidden_layers)
    label = f"--for {engine}" if engine else "--for (default any)"
    conflicts = _engine_conflicts(args)
    target = None
    if not is_llama(family):
        target = (f"the EAGLE checkpoint formats engines load build Llama decoder layers "
                  f"({', '.join(LLAMA_EXPORT_FAMILIES)}); this target is {family!r}")
    elif args.eagle_layout is None and layers < 4 and engine in (None, "any", "sglang"):
        args.eagle_layout = "eagle1"  # too shallow for EAGLE-3's three fused layers: the layout SGLang also loads
    elif args.eagle_layout != "eagle1" and layers < 4:
        target = (f"EAGLE-3 fuses three of the target's decoder-layer outputs 1..{layers - 1}; this target has "
                  f"{layers} layers (train with --eagle-layout eagle1)")
    if engine is None and (conflicts or target or _parallel_heads(args)):
        return "hf"  # (parallel depths asked for with no engine named: selfdraft's own layout drafts them best)
    if target:
        raise ValueError(f"{label}: {target}; use --for hf for a drafter only selfdraft serves")
    if conflicts:
        raise ValueError(f"{label}: {', '.join(conflicts)}: engines load sequential EAGLE drafters of the eagle1 or "
                         "eagle3 layout; drop these flags, or use --for hf for selfdraft-only drafting")
    args.eagle_layout = args.eagle_layout or ENGINE_LAYOUT
    if not _parallel_heads(args):
        args.parallel = 1
    if args.unroll_steps is None:
        args.unroll_steps = ENGINE_UNROLL_STEPS
    if args.eagle_layout == ENGINE_LAYOUT and args.feature_layers is None:
        args.feature_layers = default_feature_layers(layers)
    return engine or "any"


def exports(drafter: dict, model_config) -> dict[str, list[str]]:
    """``{format: reasons it cannot be written}`` (empty: it exports) for a drafter config
    ``drafter`` (``EagleConfig.to_dict()``) on a target of ``model_config``, before training."""
    from .checkpoint import eagle_refusals

    text = model_config.get_text_config()
    config = {"drafter": drafter, "target": {"model_type": text.model_type}}
    layers = int(text.num_hidden_layers)
    return {fmt: eagle_refusals(config, "eagle3" if fmt == "speculators" else fmt, layers)
            for fmt in ("eagle3", "speculators", "eagle")}
