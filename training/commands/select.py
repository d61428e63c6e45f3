"""``selfdraft select``: which drafter to serve, measured on the user's own prompts.

The best small model is often not the best draft (DistillSpec): acceptance and the draft's own
cost decide. Every candidate (selfdraft adapters of any kind, trained draft-model adapters
included; raw draft model directories; lookup at a node budget) generates on the same prompts at
the serving temperature and batch size, beside plain ``model.generate``, in one process and a
rotating order. The ranking is by wall-clock speedup (median over batches of t_generate /
t_candidate), printed with the terms of the bound

    speedup <= tau x t_step / (t_draft + t_verify)

tau (tokens per target forward and row, bonus included), t_step (one plain ``generate`` step),
t_draft and t_verify (per verify step, from ``DecodeStats.phases``: ``draft`` + ``tree``, and the
verification mask, forward, acceptance, cache and commit).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .common import (
    UsageError, add_paragraphs_argument, check_input_directory, check_int, check_model, check_number, check_output_file,
    load_model, read_prompts, require, write_json,
)

VERIFY_PHASES = ("mask", "forward", "accept", "cache", "commit")


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "select", help="rank candidate drafters on your prompts at your serving settings",
        description="Measure every candidate drafter (selfdraft adapters, draft models, lookup) against plain "
                    "generation on the same prompts at the serving temperature and batch size, in one process; "
                    "print a ranking by wall-clock speedup with tau, draft and verify cost per step and the bound "
                    "tau x t_step / (t_draft + t_verify), and write it as JSON.",
    )
    parser.add_argument("--model", required=True, help="the target: local Hugging Face model directory (or hub id)")
    parser.add_argument("--data", required=True, help="your prompts (jsonl or plain text)")
    parser.add_argument("--adapter", action="append", default=[], metavar="DIR",
                        help="a selfdraft adapter (any kind, trained draft models included) or an imported "
                             "checkpoint; repeat for several")
    parser.add_argument("--draft", action="append", default=[], metavar="DIR",
                        help="a draft model directory (a small causal LM sharing the target's tokenizer), served as a "
                             "chain of --draft-depth tokens; repeat for several")
    parser.add_argument("--draft-depth", type=int, default=4, help="tokens per draft-model chain (default 4)")
    parser.add_argument("--lookup", action="append", type=int, default=[], metavar="N",
                        help="lookup drafting (no training) with N nodes per step; repeat for several budgets")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="serving temperature (0: greedy; sampling with top_k 0, top_p 1)")
    parser.add_argument("--batch-size", type=int, default=1, help="serving batch size (left-padded batches)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts to use (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampled generation")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", default=None, help="write the ranking to this JSON file")
    add_paragraphs_argument(parser)
    parser.set_defaults(handler=run)


def check_arguments(args) -> None:
    """Every check that needs no model (UsageError on the first problem)."""
    require(args.adapter or args.draft or args.lookup,
            "give at least one candidate: --adapter DIR, --draft DIR or --lookup N")
    check_number(args.temperature, "--temperature", 0.0)
    for flag, value, minimum in (("--batch-size", args.batch_size, 1), ("--prompts", args.prompts, 1),
                                 ("--max-new-tokens", args.max_new_tokens, 1), ("--draft-depth", args.draft_depth, 1),
                                 ("--seed", args.seed, 0), ("--threads", args.threads, 1)):
        check_int(value, flag, minimum)
    for budget in args.lookup:
        check_int(budget, "--lookup", 1, " (lookup nodes per step)")
    check_model(args.model)
    for directory in args.adapter:
        check_input_directory(directory, "--adapter")
        _check_adapter_files(directory)
    for directory in args.draft:
        check_model(directory, "--draft")
        require(Path(directory).is_dir(), f"--draft {directory}: no such directory (a draft model directory)")
    read_prompts(args.data, None, paragraphs=args.paragraphs)
    check_output_file(args.json, "--json")


def _check_adapter_files(directory: str) -> None:
    """A recognised adapter layout, and for selfdraft's own a valid config (before the model loads)."""
    from heads import interop
    from heads.adapter import AdapterError, read_config

    try:
        if interop.detect_format(directory) == interop.SELFDRAFT:
            read_config(directory)
    except AdapterError as error:
        raise UsageError(f"--adapter {directory}: {error}") from error


def _unique(name: str, taken: set[str]) -> str:
    candidate, index = name, 2
    while candidate in taken:
        candidate, index = f"{name}#{index}", index + 1
    taken.add(candidate)
    return candidate


def candidates(args, model) -> dict[str, tuple[str, object]]:
    """``{name: (description, spec)}`` of every candidate; a bad adapter or draft is a UsageError."""
    import heads
    from heads.adapter import AdapterError

    specs, taken = {}, set()
    for directory in args.adapter:
        try:
            spec = heads.load_heads(model, directory)
        except AdapterError as error:
            raise UsageError(f"--adapter {directory}: {error}") from error
        specs[_unique(Path(directory).name, taken)] = (f"adapter ({spec.kind})", spec)
    for directory in args.draft:
        try:
            spec = heads.attach_heads(model, kind="draft", draft_model=directory, depth=args.draft_depth, top_k=1,
                                      total_tokens=args.draft_depth)
        except ValueError as error:
            raise UsageError(f"--draft {directory}: {error}") from error
        specs[_unique(f"draft:{Path(directory).name}", taken)] = (f"draft model (chain of {args.draft_depth})", spec)
    for budget in args.lookup:
        specs[_unique(f"lookup:{budget}", taken)] = (f"lookup ({budget} nodes)",
                                                     heads.attach_heads(model, kind="lookup", tree=budget,
                                                                        history_tokens=0))
    return specs


def measure(model, specs: dict, prompt_batches: list, temperature: float, max_new_tokens: int, seed: int) -> dict:
    """Per candidate and for plain ``generate``: one :class:`training.evaluate.Run` per batch."""
    from ..evaluate import paired_runs, plain_method, spec_method

    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = next(iter(sorted(_eos(model))), 0)
    methods = {"generate": plain_method(model, temperature, pad)}
    methods.update({name: spec_method(spec, temperature, pad_token_id=pad) for name, (_, spec) in specs.items()})
    return paired_runs(methods, prompt_batches, max_new_tokens, warmup=prompt_batches[0],
                       warmup_tokens=min(4, max_new_tokens), seed=seed, pad_token_id=pad)


def _eos(model) -> set[int]:
    from heads.model import eos_token_ids

    return set(eos_token_ids(model))


def rank(runs: dict, specs: dict, sampled: bool) -> tuple[dict, list[dict]]:
    """The plain baseline and the candidates' entries, best first."""
    plain = runs["generate"]
    plain_seconds, plain_steps = sum(r.seconds for r in plain), sum(r.steps for r in plain)
    step_ms = 1000 * plain_seconds / max(1, plain_steps)
    baseline = {"tokens_per_s": sum(r.new_tokens for r in plain) / plain_seconds, "step_ms": step_ms}
    entries = []
    for name, (description, _) in specs.items():
        records = runs[name]
        ratios = [p.seconds / r.seconds * r.new_tokens / max(1, p.new_tokens) for p, r in zip(plain, records)]
        stats = [r.stats for r in records]
        new, row_forwards = sum(s.new_tokens for s in stats), sum(s.row_forwards for s in stats)
        accepted = [length for s in stats for length in s.accepted_lengths]
        steps = max(1, sum(s.target_forwards - 1 for s in stats))  # verify forwards (the prefill left out)
        depth = max((len(s.acceptance_by_position) for s in stats), default=0)
        draft = sum(s.phases.get("draft", 0.0) + s.phases.get("tree", 0.0) for s in stats)
        verify = sum(sum(s.phases.get(phase, 0.0) for phase in VERIFY_PHASES) for s in stats)
        tau = new / row_forwards if row_forwards else 0.0
        entry = {
            "name": name, "candidate": description, "speedup": statistics.median(ratios), "tau": tau,
            "tokens_per_s": sum(r.new_tokens for r in records) / sum(r.seconds for r in records),
            "acceptance_by_position": [sum(length > d for length in accepted) / max(1, len(accepted))
                                       for d in range(depth)],
            "draft_ms_per_step": 1000 * draft / steps, "verify_ms_per_step": 1000 * verify / steps,
        }
        entry["bound"] = tau * step_ms / max(1e-9, entry["draft_ms_per_step"] + entry["verify_ms_per_step"])
        if not sampled:
            import torch

            entry["identical"] = all(torch.equal(p.output, r.output) for p, r in zip(plain, records))
        entries.append(entry)
    entries.sort(key=lambda entry: entry["speedup"], reverse=True)
    return baseline, entries


def print_ranking(baseline: dict, entries: list[dict]) -> None:
    header = (f"{'rank':<5}{'candidate':<28}{'speedup':>8}{'tau':>7}{'draft ms':>10}{'verify ms':>10}{'bound':>7}"
              f"{'tok/s':>8}  acceptance by depth")
    print(header)
    for position, entry in enumerate(entries, start=1):
        rates = " ".join(f"{rate:.2f}" for rate in entry["acceptance_by_position"])
        print(f"{position:<5}{entry['name'][:27]:<28}{entry['speedup']:>7.2f}x{entry['tau']:>7.2f}"
              f"{entry['draft_ms_per_step']:>10.1f}{entry['verify_ms_per_step']:>10.1f}{entry['bound']:>7.2f}"
              f"{entry['tokens_per_s']:>8.1f}  {rates}")
    print(f"{'-':<5}{'model.generate':<28}{1.0:>7.2f}x{1.0:>7.2f}{'':>10}{baseline['step_ms']:>10.1f}{'':>7}"
          f"{baseline['tokens_per_s']:>8.1f}  (plain: ms per step)")
    best = entries[0]
    if best["speedup"] > 1.0:
        print(f"best: {best['name']} ({best['speedup']:.2f}x over model.generate)")
    else:
        print(f"no candidate beats model.generate here (best: {best['name']}, {best['speedup']:.2f}x)")


def run(args) -> int:
    import torch

    from ..evaluate import encode_batches

    check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    texts = read_prompts(args.data, tokenizer, paragraphs=args.paragraphs)
    texts = [text for text in texts if text.strip()][: args.prompts]
    require(bool(texts), f"--data {args.data}: no non-empty prompt")
    specs = candidates(args, model)
    prompt_batches = encode_batches(tokenizer, texts, args.batch_size)
    runs = measure(model, specs, prompt_batches, args.temperature, args.max_new_tokens, args.seed)
    baseline, entries = rank(runs, specs, args.temperature > 0)
    print_ranking(baseline, entries)
    write_json(args.json, {
        "model": args.model, "data": str(args.data), "temperature": args.temperature, "batch_size": args.batch_size,
        "prompts": len(texts), "max_new_tokens": args.max_new_tokens, "plain": baseline, "ranking": entries,
        "best": entries[0]["name"],
        "bound": "speedup <= tau x t_step / (t_draft + t_verify): tau tokens per target forward and row (bonus "
                 "included), t_step one plain generate step, t_draft and t_verify per verify step",
    })
    return 0
