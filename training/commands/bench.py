"""``selfdraft bench``: speculative vs plain generation on the same prompts, in one process."""

from __future__ import annotations

from .common import (
    UsageError, add_paragraphs_argument, check_input_directory, check_int, check_model, check_number, check_output_file,
    load_model, read_prompts, write_json,
)


def format_rates(rates) -> str:
    """Per-depth rates as ``"0.91 0.72 -"`` (``-``: undefined, e.g. a conditional rate past the
    deepest accepted depth); ``"-"`` for none."""
    return " ".join("-" if rate is None else f"{rate:.2f}" for rate in rates) or "-"


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "bench", help="speculative vs plain generation on your prompts",
        description="Generate greedily with and without the adapter on the same prompts in one process; print "
                    "tokens/s each way, speedup, tau (tokens per target forward, bonus included) and acceptance by "
                    "position both ways (prefix survival P(accepted >= k) and conditional P(accept at k | accepted "
                    "k-1)), and check the outputs are identical.",
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model directory (or hub id)")
    parser.add_argument("--adapter", default=None,
                        help="adapter directory written by `selfdraft train` (none: the lookup kind, see --lookup)")
    parser.add_argument("--lookup", type=int, default=None, metavar="N",
                        help="add lookup drafting of N nodes per step to the adapter's trees (a hybrid), or without "
                             "--adapter: the lookup kind alone (0: the adapter's own setting)")
    parser.add_argument("--lookup-corpus", default=None, metavar="FILE",
                        help="texts (jsonl or plain text, as --data) lookup also matches against")
    parser.add_argument("--data", required=True, help="prompts (jsonl or plain text)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--prompts", type=int, default=10, help="number of prompts to use")
    parser.add_argument("--tree", type=int, default=None, help="default tree of this many drafted nodes")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (0: greedy; sampling arrives with lossless speculative sampling)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    add_paragraphs_argument(parser)
    parser.set_defaults(handler=run)


def run(args) -> int:
    import torch

    import heads
    from ..evaluate import encode_prompts, measure

    check_number(args.temperature, "--temperature", 0.0)
    check_int(args.max_new_tokens, "--max-new-tokens", 1)
    check_int(args.prompts, "--prompts", 1)
    check_int(args.tree, "--tree", 0)
    check_int(args.threads, "--threads", 1)
    check_model(args.model)
    if args.adapter is not None:
        check_input_directory(args.adapter, "--adapter")
    elif not args.lookup:
        raise UsageError("give --adapter DIR, or --lookup N to measure the lookup kind (no adapter)")
    check_int(args.lookup, "--lookup", 0)
    if args.lookup_corpus is not None:
        read_prompts(args.lookup_corpus, None, "--lookup-corpus", paragraphs=args.paragraphs)
    read_prompts(args.data, None, paragraphs=args.paragraphs)
    check_output_file(args.json, "--json")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    corpus = (read_prompts(args.lookup_corpus, tokenizer, "--lookup-corpus", paragraphs=args.paragraphs)
              if args.lookup_corpus else None)
    lookup = {"corpus": corpus, "tokenizer": tokenizer if corpus else None}
    if args.adapter is None:
        spec = heads.attach_heads(model, kind="lookup", tree=args.lookup, **lookup)
    else:
        spec = heads.load_heads(model, args.adapter)
        if args.lookup or corpus:
            settings = {**(spec.lookup.to_dict() if spec.lookup is not None else {}), **lookup}
            if args.lookup:
                settings["budget"] = args.lookup
            spec.set_lookup(settings)
    if args.tree is not None:
        try:
            spec.set_tree(args.tree)
        except ValueError as error:
            raise UsageError(f"--tree {args.tree}: {error}") from error
    prompts = encode_prompts(tokenizer, read_prompts(args.data, tokenizer, paragraphs=args.paragraphs), args.prompts)
    report = measure(spec, prompts, args.max_new_tokens, temperature=args.temperature)
    sampled = args.temperature > 0
    rows = [
        ("tokens/s plain", f"{report.tokens_per_s_plain:.1f}"),
        ("tokens/s speculative", f"{report.tokens_per_s_spec:.1f}"),
        ("speedup (median)", f"{report.speedup:.2f}x"), ("tau", f"{report.tau:.2f}"),
        ("prefix survival P(>=k)", format_rates(report.prefix_survival)),
        ("conditional P(k | k-1)", format_rates(report.conditional_acceptance)),
        ("identical to generate", "not checked (sampling)" if sampled else str(report.identical)),
        ("tree nodes", str(report.tree_size)),
    ]
    for name, value in rows:
        print(f"{name:<24} {value}")
    # sampled outputs are not compared token by token (lossless sampling is tested statistically)
    write_json(args.json, {**report.to_dict(), "temperature": args.temperature,
                           "identical": None if sampled else report.identical})
    return 0 if sampled or report.identical else 1
