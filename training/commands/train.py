"""``selfdraft train``: distil a drafter against a frozen model and save the adapter.

``--kind`` takes any trainable kind of the registry (:mod:`heads.kinds`); every trainable kind
adds its own flags (``heads/<kind>/cli.py``) and turns them into ``attach_heads`` options and
``TrainConfig`` fields. A flag of another kind that was given reaches ``attach_heads`` too, which
refuses it by name.

``--for`` names where the adapter will be served: a kind's ``cli.deploy`` sets the flags not given
to a configuration that engine's loaders take (EAGLE: the EAGLE-3 layout, sequential drafting) and
refuses given flags that contradict it; the command prints, before loading the model, which export
formats and engines the configuration reaches.

Without ``--eval-data``, tau is measured on a seeded share of the training prompts held out from
training (``--eval-fraction``); the adapter records which split each figure comes from.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from heads import _refuse_foreign_options, kinds, lora_flags

from ..config import DIVERGENCES
from ..recipe import DIVERGENCE_TEMPERATURE, default_recipe, recipe
from .common import (
    Interrupted, UsageError, add_paragraphs_argument, check_int, check_model, check_number,
    check_output_directory, check_output_file, load_model, logger, read_prompts, require, write_json,
)

ENGINES = ("any", "vllm", "sglang", "hf")
"""``--for`` choices: serving engines (``vllm``, ``sglang``), ``any`` (what every engine the kind has a
format for loads) and ``hf`` (selfdraft's own generate only, which allows selfdraft-only settings)."""
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
EVAL_FRACTION = 0.1
"""``--eval-fraction``'s default: the share of the training prompts held out to measure tau on (at most
``--eval-prompts`` of them)."""
MIN_TRAINING_PROMPTS = 2
"""Fewest prompts left to train on after the held-out split; with fewer, tau is measured in-sample."""


class _KindArguments:
    """What a kind's ``cli.add_arguments`` sees of the parser: ``add_argument_group`` and
    ``add_argument``. A flag an earlier kind already added (e.g. ``--num-layers``) is shared when
    it means the same thing (dest, type, default, action); its help gains the later kind's text."""

    def __init__(self, container, added: dict[str, argparse.Action]) -> None:
        self.container = container
        self.added = added

    def add_argument_group(self, *args, **kwargs) -> "_KindArguments":
        return _KindArguments(self.container.add_argument_group(*args, **kwargs), self.added)

    def add_argument(self, *flags: str, **settings) -> argparse.Action:
        existing = self.added.get(flags[0])
        if existing is None:
            action = self.container.add_argument(*flags, **settings)
            self.added.update(dict.fromkeys(flags, action))
            return action
        probe = argparse.ArgumentParser(add_help=False).add_argument(*flags, **settings)
        fields = ("dest", "type", "default", "nargs", "const", "choices", "option_strings")
        if any(getattr(probe, name) != getattr(existing, name) for name in fields) or type(probe) is not type(existing):
            raise ValueError(f"{flags[0]}: two drafter kinds declare it differently; give one of them another name")
        if probe.help and probe.help not in (existing.help or ""):
            existing.help = f"{existing.help}; {probe.help}" if existing.help else probe.help
        return existing


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "train", help="distil draft heads against a frozen model",
        description="Distil a drafter (Medusa heads or an EAGLE drafter) against a frozen causal LM on its own "
                    "continuations of the given prompts (self-distillation), evaluate tau on held-out prompts and "
                    "save the adapter.",
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model directory (or hub id)")
    parser.add_argument("--kind", choices=tuple(kinds.command_lines()), default="medusa", help="drafter kind")
    parser.add_argument("--for", dest="target_engine", choices=ENGINES, default=None,
                        help="where the adapter will be served: vllm or sglang (a configuration their loaders take, "
                             "e.g. EAGLE-3 layout and sequential drafting for --kind eagle; flags that contradict it "
                             "are refused), any (every engine the kind exports to), hf (selfdraft's generate only: "
                             "allows selfdraft-only settings such as EAGLE's parallel depths). Default: any, or hf "
                             "where a given flag or the target rules engines out (printed before training)")
    parser.add_argument("--data", required=True,
                        help="prompts: jsonl ({'prompt'}, {'text'} or ShareGPT {'conversations'}) or plain text (one "
                             "prompt per line; see --paragraphs)")
    add_paragraphs_argument(parser)
    parser.add_argument("--out", required=True, help="adapter directory to write")
    parser.add_argument("--lookup", type=int, default=None, metavar="N",
                        help="save the adapter as a hybrid: its trees plus lookup drafting of N nodes per step")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step, all processes")
    parser.add_argument("--gradient-accumulation", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate of AdamW (default: the kind's, " + ", ".join(
                            f"{name} {default_learning_rate(name):g}" for name in kinds.command_lines()) + ")")
    parser.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps before cosine decay")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no", help="fp32 or bf16 autocast")
    parser.add_argument("--loss", "--divergence", dest="divergence", choices=DIVERGENCES, default="fkl",
                        help="objective at each drafting depth (docs/training.md): fkl (forward KL, default), rkl, "
                             "jsd, tvd (1 - alpha, alpha = sum min(p, q)), ce, nla (-log alpha), lk_hybrid (KL/TV)")
    parser.add_argument("--position-decay", type=float, default=None, metavar="DECAY",
                        help="loss weight DECAY ** k of drafting depth k + 1 (Medusa, EAGLE), in (0, 1] (default 0.8)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="temperature of both distributions in the divergence; match the serving temperature "
                             f"(default {DIVERGENCE_TEMPERATURE:g}). Giving it, --data-temperature or an on-policy "
                             "flag specialises the recipe; without any of them the adapter is trained for greedy and "
                             "sampled serving alike (the default recipe, docs/training.md)")
    parser.add_argument("--jsd-beta", type=float, default=0.5,
                        help="--loss jsd: weight of the target's distribution, in (0, 1) (default 0.5)")
    added: dict[str, argparse.Action] = {}
    for cli in kinds.command_lines().values():
        cli.add_arguments(_KindArguments(parser, added))
    parser.add_argument("--max-prompts", type=int, default=None, help="use at most this many prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="length of the target's continuation generated per prompt (distillation data)")
    parser.add_argument("--data-temperature", type=float, nargs="+", default=None, metavar="T",
                        help="temperature of the target's continuations (0: greedy, for greedy serving); several "
                             "values: prompt i is continued at the (i mod count)-th (default: 0, or with no "
                             "temperature flag the kind's default recipe: " + ", ".join(
                                 f"{name} " + " ".join(f"{value:g}" for value in default_recipe(name).data_temperatures)
                                 for name in kinds.command_lines()) + ")")
    _add_on_policy_arguments(parser)
    parser.add_argument("--original-text", action="store_true",
                        help="train on the prompts' original text instead of the target's continuations")
    parser.add_argument("--max-length", type=int, default=256, help="token length of each training sequence")
    parser.add_argument("--generation-batch-size", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--cache-dir", default=None,
                        help="where generated data is cached (default: $SELFDRAFT_CACHE/distill, else "
                             "~/.cache/selfdraft/distill)")
    parser.add_argument("--checkpoint-dir", default=None, help="directory for resumable checkpoints")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    parser.add_argument("--eval-data", default=None,
                        help="prompts for the final tau evaluation (default: a held-out share of --data, see "
                             "--eval-fraction)")
    parser.add_argument("--eval-fraction", type=float, default=None,
                        help="without --eval-data: share of the --data prompts held out from training (a seeded "
                             "choice, at least 1, at most --eval-prompts) to measure tau on (default "
                             f"{EVAL_FRACTION:g}; "
                             "0: measure on training prompts, recorded as in-sample)")
    parser.add_argument("--eval-prompts", type=int, default=8, help="prompts to evaluate (0: skip)")
    parser.add_argument("--eval-max-new-tokens", type=int, default=64, help="tokens per evaluation prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of batches and sampled data")
    parser.add_argument("--revision", default=None,
                        help="commit of the target checkpoint (hub ids: loaded at it); recorded in the adapter's pin")
    parser.add_argument("--json", default=None, help="write the training summary to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run)


def _add_on_policy_arguments(parser) -> None:
    group = parser.add_argument_group("on-policy data (DistillSpec)")
    group.add_argument("--on-policy", action="store_true",
                       help="mix in sequences that speculative generation with the current drafter produces from the "
                            "training prompts at the serving temperature, re-scored by the target (ratio 0.5 unless "
                            "--on-policy-ratio is given)")
    group.add_argument("--on-policy-ratio", type=float, default=None,
                       help="share of each batch taken from on-policy data, in [0, 1] (> 0 implies --on-policy)")
    group.add_argument("--on-policy-refresh", type=int, default=50,
                       help="regenerate the on-policy data with the current drafter every N steps (default 50)")
    group.add_argument("--on-policy-temperature", type=float, default=None,
                       help="temperature of on-policy generation (the serving temperature; 0: greedy; "
                            "default: --temperature)")
    group.add_argument("--on-policy-prompts", type=int, default=32,
                       help="training prompts generated from at each refresh (default 32)")


def default_learning_rate(kind: str) -> float:
    """``--lr`` when not given: the kind's ``cli.LEARNING_RATE`` (``TrainConfig``'s default when it has none)."""
    from ..config import TrainConfig

    return getattr(kinds.command_lines()[kind], "LEARNING_RATE", TrainConfig.learning_rate)


def train_config(args):
    """The ``TrainConfig`` of the flags (every trainable kind's loss fields included)."""
    from ..trainer import TrainConfig

    lora_flags.check(args, {name: lora_flags.switch(kind) for name, kind in kinds.registry().items()})
    kind_fields = {}
    for cli in kinds.command_lines().values():
        kind_fields.update(cli.train_options(args))
    chosen = recipe(args)
    return TrainConfig(
        on_policy_ratio=chosen.on_policy_ratio, on_policy_refresh=args.on_policy_refresh,
        on_policy_temperature=chosen.on_policy_temperature, on_policy_prompts=args.on_policy_prompts,
        on_policy_max_new_tokens=args.max_new_tokens,
        steps=args.steps, batch_size=args.batch_size, gradient_accumulation=args.gradient_accumulation,
        learning_rate=default_learning_rate(args.kind) if args.lr is None else args.lr,
        warmup_steps=args.warmup_steps, mixed_precision=args.mixed_precision,
        divergence=args.divergence, temperature=chosen.temperature, jsd_beta=args.jsd_beta, seed=args.seed,
        checkpoint_every=args.checkpoint_every, **kind_fields,
        **({} if args.position_decay is None else {"head_decay": args.position_decay}),
    )


def drafter_options(args) -> dict:
    """The ``attach_heads`` options of ``--kind``, plus every other kind's flag that was given (not
    None), so that ``attach_heads`` refuses a flag of the wrong kind by name."""
    options = {}
    for cli in kinds.command_lines().values():
        options.update({key: value for key, value in cli.options(args).items() if value is not None})
    options.update(kinds.command_lines()[args.kind].options(args))
    return options


def resolved_options(args, model_config) -> dict:
    """:func:`drafter_options` with the options that depend on the target (e.g. EAGLE's
    ``--draft-vocab-size auto``) resolved against its config."""
    options = drafter_options(args)
    target_options = getattr(kinds.command_lines()[args.kind], "target_options", None)
    if target_options is not None:
        options.update(target_options(args, int(model_config.get_text_config().vocab_size)))
    return options


def _sequences(args, model, tokenizer, prompts, accelerator):
    """The training sequences: the target's continuations of the prompts (cached; prompt ``i`` at
    the recipe's ``data_temperatures[i % count]``), or their text."""
    import heads
    from ..distill_data import default_cache_dir, generate_mixed_distillation_data
    from ..prompts import text_sequences

    target_id = heads.backbone.target_fingerprint(model)["weights_sha256"]
    with accelerator.main_process_first():  # main generates and caches, the others read the cache
        if args.original_text:
            sequences = text_sequences(tokenizer, prompts, args.max_length)
        else:
            sequences, _ = generate_mixed_distillation_data(
                model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                temperatures=recipe(args).data_temperatures, seed=args.seed,
                cache_dir=args.cache_dir or default_cache_dir(), target_id=target_id,
                batch_size=args.generation_batch_size, progress=not args.no_progress and accelerator.is_main_process,
                max_prompt_tokens=max(1, args.max_length - args.max_new_tokens), truncate=True,
            )
    return [sequence[: args.max_length] for sequence in sequences if sequence.numel() > 2]


def evaluation_split(args, prompts: list[str]) -> tuple[list[str], list[str], str | None]:
    """``(training prompts, evaluation prompts, split)`` of ``--data``'s prompts. ``split`` is what
    the adapter records with tau: ``held-out`` (a seeded ``--eval-fraction`` of the prompts, never
    trained on), ``in-sample`` (``--eval-fraction 0``, or too few prompts to hold any out: the first
    training prompts), ``eval-data`` (``--eval-data``'s prompts, read later) or None (no evaluation)."""
    from ..prompts import hold_out

    if not args.eval_prompts:
        return prompts, [], None
    if args.eval_data:
        return prompts, [], "eval-data"
    fraction = EVAL_FRACTION if args.eval_fraction is None else args.eval_fraction
    count = min(args.eval_prompts, max(1, math.ceil(len(prompts) * fraction))) if fraction else 0
    if count and len(prompts) - count < MIN_TRAINING_PROMPTS:
        logger.warning("%d prompts in %s: too few to hold %d out for the evaluation; tau is measured on training "
                       "prompts (recorded as in-sample)", len(prompts), args.data, count)
        count = 0
    if not count:
        return prompts, prompts[: args.eval_prompts], "in-sample"
    kept, held_out = hold_out(prompts, count, args.seed)
    logger.info("held out %d of the %d prompts of %s to measure tau on (--eval-fraction %g)", count, len(prompts),
                args.data, fraction)
    return kept, held_out, "held-out"


def _measured_acceptance(args, spec, tokenizer, config, texts: list[str], split: str) -> dict:
    """``{data stem: entry}`` (or a list of entries, one per temperature) measured on the evaluation
    prompts ``texts`` (``--eval-data``'s when ``split`` is ``eval-data``); each entry records ``split``."""
    from ..evaluate import encode_prompts, measure

    eval_path = args.eval_data or args.data
    if split == "eval-data":
        texts = read_prompts(eval_path, tokenizer, "--eval-data", paragraphs=args.paragraphs)
    eval_prompts = encode_prompts(tokenizer, texts, args.eval_prompts)
    entries = []
    for temperature in recipe(args).evaluated_at:
        report = measure(spec, eval_prompts, args.eval_max_new_tokens, plain=False, temperature=temperature,
                         seed=args.seed)
        entry = {"tau": report.tau, "acceptance_by_position": report.acceptance_by_position,
                 "prefix_survival": report.prefix_survival, "conditional_acceptance": report.conditional_acceptance,
                 "prompts": report.prompts, "max_new_tokens": args.eval_max_new_tokens,
                 "tokens_per_s_spec": report.tokens_per_s_spec, "split": split}
        entries.append({**entry, "temperature": temperature} if temperature else entry)
        logger.info("%s tau %.3f on %d prompts of %s at temperature %g", split, report.tau, report.prompts, eval_path,
                    temperature)
    return {Path(eval_path).stem: entries[0] if len(entries) == 1 else entries}


def _recipe(args, config, prompts, accelerator, engine: str, held_out: int) -> dict:
    return {
        "data": str(args.data), "prompts": len(prompts), "held_out_prompts": held_out, "for": engine,
        "divergence": args.divergence, **recipe(args).record(config),
        "original_text": args.original_text, "steps": args.steps,
        "config": config.__dict__, "processes": accelerator.num_processes,
    }


def resolve_engine(args, model_config) -> str:
    """``--for`` resolved by the kind (``cli.deploy``, which sets the flags not given to what the
    engine loads); a kind without engine formats keeps ``--for`` as given (``any`` by default)."""
    deploy = getattr(kinds.command_lines()[args.kind], "deploy", None)
    if deploy is None:
        return args.target_engine or "any"
    try:
        return deploy(args, args.target_engine, model_config)
    except ValueError as error:
        raise UsageError(str(error)) from error


def export_line(args, engine: str, drafter: dict, model_config) -> str:
    """One line: the export formats (and the engines that load them) the adapter of drafter config ``drafter``
    will reach, and the engines it will not load in, with the first reason."""
    cli = kinds.command_lines()[args.kind]
    exports = getattr(cli, "exports", None)
    head = f"--for {engine}{'' if args.target_engine else ' (default)'}: this {args.kind} adapter"
    if exports is None:
        return f"{head} has no engine checkpoint format (selfdraft export); selfdraft's generate serves it"
    refusals, engine_formats = exports(drafter, model_config), cli.ENGINE_FORMATS
    loaders = {fmt: [ENGINE_NAMES[name] for name, formats in engine_formats.items() if fmt in formats]
               for fmt in refusals}
    ready = [f"{fmt} ({', '.join(loaders[fmt]) or 'its reference loader'})" for fmt, why in refusals.items() if not why]
    line = f"{head} will export to {', '.join(ready) if ready else 'no engine format'}"
    missing = [name for name, formats in engine_formats.items() if not any(not refusals[fmt] for fmt in formats)]
    if missing:
        reasons = [why[0] for name in missing for fmt in engine_formats[name] for why in [refusals[fmt]] if why]
        engines = " or ".join(ENGINE_NAMES[name] for name in missing)
        line += f"; it will not load in {engines}" + (f": {reasons[0]}" if reasons else "")
        if engine == "hf" and reasons:
            line += " (train with --for vllm or --for sglang for an engine)"
    return line


def _target_config(args):
    """The target's ``config.json`` (no weights), a :class:`UsageError` naming ``--model`` when unreadable."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(args.model, revision=args.revision)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--model {args.model}: cannot read its config: {error}") from error


def check_arguments(args, processes: int):
    """Every check of the flags and paths that needs no model weights: counts, input files (the
    prompt files are parsed), output paths, ``--for`` against the target's config and the other
    flags (the flags not given are set to the engine's configuration), the kind's options and, with
    ``--resume``, the checkpoint and its recipe. Returns ``(TrainConfig, engine, export line)``;
    :class:`UsageError` (or ``CheckpointError``) on the first problem."""
    from heads.adapter import CONFIG_NAME, WEIGHTS_NAME
    from heads.lora import FOLDER_NAME as LORA_FOLDER
    from .. import checkpoint

    for flag, value, minimum, meaning in (
            ("--steps", args.steps, 1, ""), ("--batch-size", args.batch_size, 1, ""),
            ("--gradient-accumulation", args.gradient_accumulation, 1, ""),
            ("--warmup-steps", args.warmup_steps, 0, ""), ("--max-prompts", args.max_prompts, 1, ""),
            ("--max-new-tokens", args.max_new_tokens, 1, ""),
            ("--max-length", args.max_length, 3, " (a training sequence needs at least 3 tokens)"),
            ("--generation-batch-size", args.generation_batch_size, 1, ""),
            ("--checkpoint-every", args.checkpoint_every, 0, " (0: never)"),
            ("--eval-prompts", args.eval_prompts, 0, " (0: skip the evaluation)"),
            ("--eval-max-new-tokens", args.eval_max_new_tokens, 1, ""),
            ("--on-policy-refresh", args.on_policy_refresh, 1, ""),
            ("--on-policy-prompts", args.on_policy_prompts, 1, ""), ("--seed", args.seed, 0, ""),
            ("--lookup", args.lookup, 1, " (lookup nodes per step of the hybrid)")):
        check_int(value, flag, minimum, meaning)
    check_number(args.lr, "--lr", 0.0, inclusive=False)
    require(args.eval_fraction is None or 0 <= args.eval_fraction < 1,
            f"--eval-fraction must be a number >= 0 and < 1 (the share of --data held out); got {args.eval_fraction}")
    require(not (args.eval_fraction is not None and args.eval_data),
            "--eval-fraction holds out --data prompts; with --eval-data tau is measured on that file: give one of them")
    check_number(args.temperature, "--temperature", 0.0, inclusive=False)
    check_number(args.position_decay, "--position-decay", 0.0, inclusive=False, maximum=1.0)
    require(0 < args.jsd_beta < 1, f"--jsd-beta must lie in (0, 1) (the target's weight in JSD); got {args.jsd_beta}")
    for value in args.data_temperature or ():
        check_number(value, "--data-temperature", 0.0)
    check_number(args.on_policy_ratio, "--on-policy-ratio", 0.0, maximum=1.0)
    check_number(args.on_policy_temperature, "--on-policy-temperature", 0.0)
    require(not (args.resume and not args.checkpoint_dir),
            "--resume needs --checkpoint-dir (where the checkpoints are)")
    require(not (args.checkpoint_every and not args.checkpoint_dir),
            f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir (where to write the checkpoints)")
    check_model(args.model)
    read_prompts(args.data, None, "--data", args.paragraphs)  # parsed now (chats rendered plainly): errors come first
    if args.eval_data:
        read_prompts(args.eval_data, None, "--eval-data", paragraphs=args.paragraphs)
    own_files = tuple(name for kind in kinds.registry().values() for name in kind.adapter_files)  # e.g. draft_model/
    check_output_directory(args.out, "--out", replaceable=(CONFIG_NAME, WEIGHTS_NAME, LORA_FOLDER, *own_files))
    check_output_file(args.json, "--json")
    for flag, path in (("--cache-dir", args.cache_dir), ("--checkpoint-dir", args.checkpoint_dir)):
        if path is not None and Path(path).exists():
            require(Path(path).is_dir(), f"{flag} {path}: exists and is not a directory")
        elif path is not None:
            check_output_file(path, flag)
    model_config = _target_config(args)
    engine = resolve_engine(args, model_config)
    try:
        config = train_config(args)
        options = drafter_options(args)
        _refuse_foreign_options(kinds.get(args.kind), options)  # the check attach_heads makes, naming the owner
        kinds.get(args.kind).make_config(**options)
        drafter = kinds.get(args.kind).make_config(**resolved_options(args, model_config))  # as built on the target
    except ValueError as error:
        raise UsageError(str(error)) from error
    joint = [name for name, kind in kinds.registry().items() if kind.extra.get("joint_training")]
    require(not config.joint or args.kind in joint,
            f"--joint: joint training (a LoRA on the backbone) is for --kind {' or '.join(joint)}, not {args.kind}")
    if args.resume:  # the run's drafter as it will be built on this target, compared with the checkpoint's
        directory = checkpoint.latest_checkpoint(args.checkpoint_dir)
        saved = checkpoint.read_state(directory)
        current = checkpoint.recipe(config.__dict__, args.kind, drafter.to_dict(), processes)
        checkpoint.check_recipe(saved, current, directory)
    return config, engine, export_line(args, engine, drafter.to_dict(), model_config)


def resume_hint(args) -> str:
    """Where an interrupted run can resume from, and how (one line)."""
    from ..checkpoint import CheckpointError, latest_checkpoint

    if not args.checkpoint_dir:
        return "no checkpoint was written; give --checkpoint-dir DIR --checkpoint-every N to make training resumable"
    try:
        directory = latest_checkpoint(args.checkpoint_dir)
    except CheckpointError:
        return (f"no checkpoint under {args.checkpoint_dir} yet"
                + ("" if args.checkpoint_every else " (--checkpoint-every N writes one every N steps)"))
    again = "run the same command again" if args.resume else "run the same command with --resume"
    return f"the latest checkpoint is {directory}; {again} to continue from it"


def run(args) -> int:
    import torch
    from accelerate import Accelerator

    import heads
    from ..prompts import tokenize_prompts, tokenizer_pad_id
    from ..trainer import make_trainer

    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available())
    config, engine, exports = check_arguments(args, accelerator.num_processes)
    if accelerator.is_main_process:
        print(exports)
    model, tokenizer = load_model(args.model, revision=args.revision)
    if config.joint:  # LoRA targets are checked against the model before any data is generated
        try:
            heads.lora.check_targets(model, config.lora_targets)
        except ValueError as error:
            raise UsageError(f"--lora-targets: {error}") from error
    prompts = read_prompts(args.data, tokenizer, paragraphs=args.paragraphs)[: args.max_prompts]
    prompts, eval_texts, split = evaluation_split(args, prompts)
    sequences = _sequences(args, model, tokenizer, prompts, accelerator)
    torch.manual_seed(args.seed)  # drafters initialised at random (EAGLE) start alike in every run and process
    try:
        spec = heads.attach_heads(model, kind=args.kind, **resolved_options(args, model.config))
    except ValueError as error:  # e.g. a draft model that does not share the target's vocabulary
        raise UsageError(str(error)) from error
    prompt_ids = None
    if config.on_policy_ratio:  # the training share of the prompts (the last ones' sequences are held out)
        prompt_ids = tokenize_prompts(tokenizer, prompts, max(1, args.max_length - args.max_new_tokens), truncate=True)
        prompt_ids = prompt_ids[: max(1, len(prompt_ids) - max(1, int(len(sequences) * config.validation_fraction)))]
    try:
        trainer = make_trainer(spec, sequences, config, pad_id=tokenizer_pad_id(tokenizer),
                               checkpoint_dir=args.checkpoint_dir, progress=not args.no_progress,
                               accelerator=accelerator, prompts=prompt_ids)
    except ValueError as error:  # e.g. too few usable sequences in the data
        raise UsageError(str(error)) from error
    try:
        result = trainer.train(resume=args.resume)
    except KeyboardInterrupt:
        raise Interrupted(resume_hint(args)) from None
    final_loss = result.losses[-1] if result.losses else None
    summary = {"final_loss": final_loss, **result.to_dict()}
    if accelerator.is_main_process:
        acceptance = _measured_acceptance(args, spec, tokenizer, config, eval_texts, split) if split else {}
        if split:
            summary["eval"] = acceptance
        if spec.backbone_lora is not None:
            summary["backbone_drift"] = spec.backbone_lora.drift
        if args.lookup:
            spec.set_lookup(budget=args.lookup)
        held_out = len(eval_texts) if split == "held-out" else 0
        spec.save_pretrained(args.out, training=_recipe(args, config, prompts, accelerator, engine, held_out),
                             acceptance=acceptance,
                             revision=args.revision)
        write_json(args.json, summary)
        finished = (" (the checkpoint had finished the run: no step trained)"
                    if result.start_step >= config.steps else "")
        loss = "n/a" if final_loss is None else f"{final_loss:.4f}"
        print(f"saved adapter to {args.out}; final loss {loss}{finished}")
        if spec.backbone_lora is not None and spec.backbone_lora.shipped:
            drift = spec.backbone_lora.drift
            print(f"backbone LoRA saved in {args.out}/{heads.lora.FOLDER_NAME}: the tuned backbone's outputs differ "
                  f"from the original model's (held-out KL {drift.get('kl_per_token', float('nan')):.4f} per token, "
                  f"greedy agreement {drift.get('top1_agreement', float('nan')):.3f}); generation with this adapter "
                  "is lossless against the tuned backbone only")
    accelerator.wait_for_everyone()
    return 0
