"""The ``selfdraft`` command line: ``train`` and ``bench`` here; ``check``, ``export`` and ``push``
in :mod:`training.adapter_commands`.

Multi-process training runs the same command under accelerate, e.g.
``accelerate launch --num_processes 2 -m training.cli train ...`` (add ``--cpu`` on a CPU machine).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger("selfdraft")


def _load_model(directory: str, dtype: str = "float32", revision: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, revision=revision)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), revision=revision)
    model.eval()
    return model, tokenizer


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_suffix(target.suffix + ".tmp")
        temporary.write_text(json.dumps(payload, indent=2) + "\n")
        temporary.replace(target)


def add_train_parser(commands) -> None:
    parser = commands.add_parser(
        "train", help="distil draft heads against a frozen model",
        description="Distil a drafter (Medusa heads or an EAGLE drafter) against a frozen causal LM on its own "
                    "continuations of the given prompts (self-distillation), evaluate tau on held-out prompts and "
                    "save the adapter.",
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model directory (or hub id)")
    parser.add_argument("--kind", choices=("medusa", "eagle"), default="medusa", help="drafter kind")
    parser.add_argument("--data", required=True,
                        help="prompts: jsonl ({'prompt'}, {'text'} or ShareGPT {'conversations'}) or plain text")
    parser.add_argument("--out", required=True, help="adapter directory to write")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step, all processes")
    parser.add_argument("--gradient-accumulation", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of AdamW (default 1e-3)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps before cosine decay")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no", help="fp32 or bf16 autocast")
    parser.add_argument("--divergence", choices=("fkl", "rkl", "jsd", "tvd", "ce"), default="fkl",
                        help="divergence between head and target distributions (default forward KL)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="temperature of both distributions in the divergence; match the serving temperature")
    parser.add_argument("--hard-label-weight", type=float, default=0.0,
                        help="weight of plain cross-entropy to the target's tokens, added to the divergence")
    parser.add_argument("--num-heads", type=int, default=None,
                        help="Medusa heads (head k predicts token t+k+2; default 4)")
    parser.add_argument("--num-layers", type=int, default=1,
                        help="residual blocks per Medusa head; decoder layers of the EAGLE drafter")
    parser.add_argument("--share-lm-head", action="store_true", help="Medusa: reuse the frozen output head in every head")
    _add_eagle_arguments(parser)
    parser.add_argument("--max-prompts", type=int, default=None, help="use at most this many prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="length of the target's continuation generated per prompt (distillation data)")
    parser.add_argument("--data-temperature", type=float, default=0.0,
                        help="temperature of the target's continuations (0: greedy, for greedy serving)")
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
    parser.add_argument("--original-text", action="store_true",
                        help="train on the prompts' original text instead of the target's continuations")
    parser.add_argument("--max-length", type=int, default=256, help="token length of each training sequence")
    parser.add_argument("--generation-batch-size", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--cache-dir", default=".selfdraft-cache", help="where generated data is cached")
    parser.add_argument("--checkpoint-dir", default=None, help="directory for resumable checkpoints")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    parser.add_argument("--eval-data", default=None, help="held-out prompts for the final tau evaluation")
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts to evaluate (0: skip)")
    parser.add_argument("--eval-max-new-tokens", type=int, default=64, help="tokens per evaluation prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of batches and sampled data")
    parser.add_argument("--revision", default=None,
                        help="commit of the target checkpoint (hub ids: loaded at it); recorded in the adapter's pin")
    parser.add_argument("--json", default=None, help="write the training summary to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run_train)


def _layer_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as 2,6,11; got {text!r}")


def _add_eagle_arguments(parser) -> None:
    group = parser.add_argument_group("EAGLE drafter (--kind eagle)")
    group.add_argument("--depth", type=int, default=None, help="deepest level of the dynamic draft tree")
    group.add_argument("--top-k", type=int, default=None, help="children per expanded node of the dynamic tree")
    group.add_argument("--total-tokens", type=int, default=None, help="drafted nodes verified per step")
    group.add_argument("--feature-layers", type=_layer_list, default=None,
                       help="EAGLE-3: comma-separated backbone hidden states to fuse as input (0: embeddings, "
                            "num_hidden_layers: top layer), e.g. 2,6,11")
    group.add_argument("--draft-vocab-size", type=int, default=None,
                       help="EAGLE-3: reduced draft vocabulary of the most frequent target tokens in the data")
    group.add_argument("--eagle-layout", choices=("native", "eagle1", "eagle3"), default=None,
                       help="drafter architecture: native (default; selfdraft's, any family), eagle1 (the EAGLE-1 "
                            "layer, exportable with --format eagle) or eagle3 (the EAGLE-3 midlayer, needs three "
                            "--feature-layers, exportable with --format eagle3); Llama-family targets only")
    group.add_argument("--feature-weight", type=float, default=1.0,
                       help="weight of the smooth-L1 next-feature regression (default 1.0)")
    group.add_argument("--token-weight", type=float, default=0.1,
                       help="weight of the token divergence to the target (default 0.1)")
    group.add_argument("--feature-noise", type=float, default=0.1,
                       help="half-width of the uniform noise added to input features (default 0.1)")
    group.add_argument("--unroll-steps", type=int, default=1,
                       help="drafting steps unrolled on the drafter's own features in training (training-time "
                            "test; default 1)")


def _on_policy_ratio(args) -> float:
    if args.on_policy_ratio is None:
        return 0.5 if args.on_policy else 0.0
    if args.on_policy and args.on_policy_ratio == 0:
        raise ValueError("--on-policy with --on-policy-ratio 0: give a ratio in (0, 1] or drop --on-policy")
    return args.on_policy_ratio


def _train_config(args):
    from .trainer import TrainConfig

    return TrainConfig(
        on_policy_ratio=_on_policy_ratio(args), on_policy_refresh=args.on_policy_refresh,
        on_policy_temperature=args.on_policy_temperature, on_policy_prompts=args.on_policy_prompts,
        on_policy_max_new_tokens=args.max_new_tokens,
        steps=args.steps, batch_size=args.batch_size, gradient_accumulation=args.gradient_accumulation,
        learning_rate=args.lr, warmup_steps=args.warmup_steps, mixed_precision=args.mixed_precision,
        divergence=args.divergence, temperature=args.temperature, hard_label_weight=args.hard_label_weight,
        seed=args.seed, checkpoint_every=args.checkpoint_every, feature_weight=args.feature_weight,
        token_weight=args.token_weight, feature_noise=args.feature_noise, unroll_steps=args.unroll_steps,
    )


def run_train(args) -> int:
    import torch
    from accelerate import Accelerator

    import heads
    from .data import generate_distillation_data, load_prompts, text_sequences, tokenize_prompts
    from .evaluate import encode_prompts, measure
    from .trainer import make_trainer

    config = _train_config(args)
    accelerator = Accelerator(mixed_precision=config.mixed_precision, cpu=not torch.cuda.is_available())
    model, tokenizer = _load_model(args.model, revision=args.revision)
    prompts = load_prompts(args.data, tokenizer)[: args.max_prompts]
    target_id = heads.backbone.target_fingerprint(model)["weights_sha256"]
    with accelerator.main_process_first():  # main generates and caches, the others read the cache
        if args.original_text:
            sequences = text_sequences(tokenizer, prompts, args.max_length)
        else:
            sequences = generate_distillation_data(
                model, tokenizer, prompts, max_new_tokens=args.max_new_tokens, temperature=args.data_temperature,
                seed=args.seed, cache_dir=args.cache_dir, target_id=target_id,
                batch_size=args.generation_batch_size, progress=not args.no_progress and accelerator.is_main_process,
                max_prompt_tokens=max(1, args.max_length - args.max_new_tokens), truncate=True,
            )
    sequences = [sequence[: args.max_length] for sequence in sequences if sequence.numel() > 2]
    torch.manual_seed(args.seed)  # drafters initialised at random (EAGLE) start alike in every run and process
    spec = heads.attach_heads(model, kind=args.kind, num_heads=args.num_heads, num_layers=args.num_layers,
                              share_lm_head=args.share_lm_head or None, depth=args.depth, top_k=args.top_k,
                              total_tokens=args.total_tokens, feature_layers=args.feature_layers,
                              draft_vocab_size=args.draft_vocab_size,
                              layout=args.eagle_layout)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_ids = None
    if config.on_policy_ratio:  # the training share of the prompts (the last ones' sequences are held out)
        prompt_ids = tokenize_prompts(tokenizer, prompts, max(1, args.max_length - args.max_new_tokens), truncate=True)
        prompt_ids = prompt_ids[: max(1, len(prompt_ids) - max(1, int(len(sequences) * config.validation_fraction)))]
    trainer = make_trainer(spec, sequences, config, pad_id=pad_id, checkpoint_dir=args.checkpoint_dir,
                           progress=not args.no_progress, accelerator=accelerator, prompts=prompt_ids)
    result = trainer.train(resume=args.resume)
    summary = {"final_loss": result.losses[-1] if result.losses else None, **result.to_dict()}
    if accelerator.is_main_process:
        acceptance = {}
        if args.eval_prompts:
            eval_path = args.eval_data or args.data
            eval_prompts = encode_prompts(tokenizer, load_prompts(eval_path, tokenizer), args.eval_prompts)
            # greedy, and the serving temperature an on-policy run was matched to
            temperatures = sorted({0.0, config.serving_temperature if config.on_policy_ratio else 0.0})
            entries = []
            for temperature in temperatures:
                report = measure(spec, eval_prompts, args.eval_max_new_tokens, plain=False, temperature=temperature,
                                 seed=args.seed)
                entry = {"tau": report.tau, "acceptance_by_position": report.acceptance_by_position,
                         "prompts": report.prompts, "max_new_tokens": args.eval_max_new_tokens,
                         "tokens_per_s_spec": report.tokens_per_s_spec}
                entries.append({**entry, "temperature": temperature} if temperature else entry)
                logger.info("held-out tau %.3f on %s at temperature %g", report.tau, eval_path, temperature)
            acceptance[Path(eval_path).stem] = entries[0] if len(entries) == 1 else entries
            summary["eval"] = acceptance
        recipe = {
            "data": str(args.data), "prompts": len(prompts), "divergence": args.divergence,
            "temperature": args.temperature, "data_temperature": args.data_temperature,
            "on_policy": config.on_policy_ratio > 0, "on_policy_ratio": config.on_policy_ratio,
            "on_policy_refresh": config.on_policy_refresh if config.on_policy_ratio else None,
            "on_policy_temperature": config.serving_temperature if config.on_policy_ratio else None,
            "original_text": args.original_text, "steps": args.steps,
            "config": config.__dict__, "processes": accelerator.num_processes,
        }
        spec.save_pretrained(args.out, training=recipe, acceptance=acceptance, revision=args.revision)
        _write_json(args.json, summary)
        print(f"saved adapter to {args.out}; final loss {summary['final_loss']:.4f}")
    accelerator.wait_for_everyone()
    return 0


def add_bench_parser(commands) -> None:
    parser = commands.add_parser(
        "bench", help="speculative vs plain generation on your prompts",
        description="Generate greedily with and without the adapter on the same prompts in one process; print "
                    "tokens/s each way, speedup, tau (tokens per target forward, bonus included) and acceptance by "
                    "position, and check the outputs are identical.",
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model directory (or hub id)")
    parser.add_argument("--adapter", required=True, help="adapter directory written by `selfdraft train`")
    parser.add_argument("--data", required=True, help="prompts (jsonl or plain text)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--prompts", type=int, default=10, help="number of prompts to use")
    parser.add_argument("--tree", type=int, default=None, help="default tree of this many drafted nodes")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (0: greedy; sampling arrives with lossless speculative sampling)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.set_defaults(handler=run_bench)


def run_bench(args) -> int:
    import torch

    import heads
    from .data import load_prompts
    from .evaluate import encode_prompts, measure

    if not args.temperature >= 0:
        raise SystemExit(f"selfdraft bench: --temperature must be >= 0 (0: greedy); got {args.temperature}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load_model(args.model)
    spec = heads.load_heads(model, args.adapter)
    if args.tree is not None:
        spec.set_tree(args.tree)
    prompts = encode_prompts(tokenizer, load_prompts(args.data, tokenizer), args.prompts)
    report = measure(spec, prompts, args.max_new_tokens, temperature=args.temperature)
    sampled = args.temperature > 0
    rows = [
        ("tokens/s plain", f"{report.tokens_per_s_plain:.1f}"), ("tokens/s speculative", f"{report.tokens_per_s_spec:.1f}"),
        ("speedup (median)", f"{report.speedup:.2f}x"), ("tau", f"{report.tau:.2f}"),
        ("acceptance by position", " ".join(f"{a:.2f}" for a in report.acceptance_by_position)),
        ("identical to generate", "not checked (sampling)" if sampled else str(report.identical)),
        ("tree nodes", str(report.tree_size)),
    ]
    for name, value in rows:
        print(f"{name:<24} {value}")
    # sampled outputs are not compared token by token (lossless sampling is tested statistically)
    _write_json(args.json, {**report.to_dict(), "temperature": args.temperature,
                            "identical": None if sampled else report.identical})
    return 0 if sampled or report.identical else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfdraft",
        description="Make a frozen Hugging Face causal LM draft for itself: train draft heads by self-distillation, "
                    "benchmark them against plain generation.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_train_parser(commands)
    add_bench_parser(commands)
    from .adapter_commands import add_adapter_parsers

    add_adapter_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
