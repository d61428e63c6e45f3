"""Methods head to head, greedy, paired per prompt: is one faster than another?

``bench_peers.py`` runs a dozen methods on 6 prompts per mix; two within a few percent of each other
there swap places from run to run. This benchmark runs only ``model.generate`` and the methods asked
for on one target and mix, on many held-out prompts, in one process, the methods in rotating order
per prompt: the adapters given (``--adapter NAME=DIR``), with ``--hybrid`` also each as a hybrid with
lookup (10 nodes, no cross-request history) under ``speculate="auto"`` (``NAME+lookup@auto``), with
``--lookup N ...`` the lookup kind alone (``lookup_N``, fixed tree and ``@auto``), and with
``--prompt-lookup N ...`` transformers' prompt lookup (``prompt_lookup_nN``), and with ``--history``
each lookup N also with its default cross-request history under ``speculate="auto"``
(``lookup_N+history@auto``: a spec of its own whose history holds the earlier held-out requests'
text, each prompt run once; the warm-up runs on two other prompts; every method then runs on prompts
that share no 12-word window with each other, :func:`distinct_prompts`). It reports per
method the median speedup over ``generate`` (seconds per new token), tau and draft ms per step
(selfdraft), and for each pair the per-prompt ratio of their speedups (both measured against the same
``generate`` call): its median, a bootstrap 90% interval of that median, and the share of prompts
where the first is faster. Every output is checked identical to ``generate``. Writes
``benchmarks/results/kinds_<target>_<mix>.json`` (``--out`` to name it).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_json  # noqa: E402
from benchmarks.bench_peers import TARGETS, load_target, prompts_of  # noqa: E402


WINDOW = 12
"""Words: with ``--history``, no two prompts of a run share a window of this many (the held-out sets
hold overlapping excerpts, e.g. 20 of demo prose's first 62 prompts share one with another; a
history holding a near-duplicate request would copy its continuation)."""


def distinct_prompts(tokenizer, file: str, count: int) -> list[torch.Tensor]:
    """The first ``count`` prompts of ``file`` that share no :data:`WINDOW`-word window with an
    earlier one kept."""
    import json

    from benchmarks.common import PROMPTS

    kept, seen = [], set()
    for line in (PROMPTS / file).read_text().splitlines():
        if not line.strip():
            continue
        text = json.loads(line)["prompt"]
        words = text.split()
        windows = {tuple(words[i:i + WINDOW]) for i in range(max(1, len(words) - WINDOW + 1))}
        if windows & seen:
            continue
        seen |= windows
        kept.append(tokenizer(text, return_tensors="pt").input_ids)
        if len(kept) == count:
            break
    return kept


def bootstrap_median(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% percentile-bootstrap interval of the median of ``values``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, choices=list(TARGETS))
    parser.add_argument("--mix", required=True, help="a held-out mix of the target (demo-llama: code, prose; "
                                                     "stories260K: stories)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                        help="a trained adapter for the target (repeatable)")
    parser.add_argument("--hybrid", action="store_true",
                        help="also each adapter with lookup (10 nodes) under speculate='auto'")
    parser.add_argument("--lookup", type=int, nargs="+", default=[], metavar="N",
                        help="selfdraft's lookup kind alone with a tree of N nodes (no cross-request history), "
                             "fixed and under speculate='auto'")
    parser.add_argument("--prompt-lookup", type=int, nargs="+", default=[], metavar="N",
                        help="transformers' prompt lookup with prompt_lookup_num_tokens=N as peers")
    parser.add_argument("--history", action="store_true",
                        help="also each --lookup N with lookup's default cross-request history, under speculate='auto'")
    parser.add_argument("--out", default=None, help="results file name under benchmarks/results")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    mixes = TARGETS[args.target]["mixes"]
    if args.mix not in mixes:
        parser.error(f"--mix must be one of {sorted(mixes)} for {args.target}; got {args.mix!r}")
    adapters = {}
    for item in args.adapter:
        name, sep, directory = item.partition("=")
        if not sep or not name or not directory:
            parser.error(f"--adapter must be NAME=DIR; got {item!r}")
        if not (Path(directory) / "adapter_config.json").is_file():
            parser.error(f"--adapter {name}: no adapter_config.json in {directory!r}")
        if name in adapters:
            parser.error(f"--adapter names must differ; {name!r} given twice")
        adapters[name] = directory
    if len(adapters) * (1 + args.hybrid) + len(args.prompt_lookup) + 2 * len(args.lookup) < 2:
        parser.error("give at least two methods to compare (--adapter NAME=DIR, --hybrid, --lookup N, "
                     "--prompt-lookup N)")
    if args.history and not args.lookup:
        parser.error("--history adds lookup with its cross-request history for each --lookup N; give --lookup N")
    if args.hybrid and not adapters:
        parser.error("--hybrid makes each --adapter a hybrid with lookup; give an --adapter NAME=DIR")
    for flag, sizes in (("--prompt-lookup", args.prompt_lookup), ("--lookup", args.lookup)):
        if any(size < 1 for size in sizes):
            parser.error(f"{flag} sizes must be at least 1; got {sizes}")
    if args.out is not None and (not args.out.endswith(".json") or "/" in args.out):
        parser.error(f"--out must be a .json file name (no folders); got {args.out!r}")
    for flag, value in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{flag} must be at least 1; got {value}")
    args.adapters = adapters
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import heads

    target = TARGETS[args.target]
    model, tokenizer = load_target(target["path"])
    pick = distinct_prompts if args.history else prompts_of
    prompts = pick(tokenizer, target["mixes"][args.mix], args.prompts + 2)
    prompts, warmup = prompts[:args.prompts], prompts[args.prompts:]  # (a history holds other requests only)
    pad = model.generation_config.pad_token_id
    methods = {}  # name -> (callable(prompt, max_new) -> output, its spec or None)
    for name, directory in args.adapters.items():
        spec = heads.load_heads(model, directory)
        methods[name] = (lambda p, n, spec=spec: spec.generate(p, max_new_tokens=n, do_sample=False), spec)
        if args.hybrid:
            hybrid = heads.load_heads(model, directory)
            hybrid.set_lookup(budget=10, history_tokens=0)
            methods[f"{name}+lookup@auto"] = (lambda p, n, spec=hybrid: spec.generate(
                p, max_new_tokens=n, do_sample=False, speculate="auto"), hybrid)
    for size in args.lookup:
        lookup = heads.attach_heads(model, kind="lookup", tree=size, history_tokens=0)
        methods[f"lookup_{size}"] = (lambda p, n, spec=lookup: spec.generate(p, max_new_tokens=n, do_sample=False),
                                     lookup)
        methods[f"lookup_{size}@auto"] = (lambda p, n, spec=lookup: spec.generate(
            p, max_new_tokens=n, do_sample=False, speculate="auto"), lookup)
        if args.history:  # its own spec: no other method's run of a prompt may enter its history
            remembering = heads.attach_heads(model, kind="lookup", tree=size)
            methods[f"lookup_{size}+history@auto"] = (lambda p, n, spec=remembering: spec.generate(
                p, max_new_tokens=n, do_sample=False, speculate="auto"), remembering)
    for size in args.prompt_lookup:
        methods[f"prompt_lookup_n{size}"] = (lambda p, n, size=size: model.generate(
            p, max_new_tokens=n, do_sample=False, prompt_lookup_num_tokens=size, pad_token_id=pad), None)
    names = list(methods)
    for prompt in warmup:
        model.generate(prompt, max_new_tokens=16, do_sample=False)
        for run, _ in methods.values():
            run(prompt, 16)
    runs = {name: [] for name in names}
    started = time.perf_counter()
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            order = ["generate"] + names
            shift = index % len(order)
            seconds, outputs = {}, {}
            for method in order[shift:] + order[:shift]:
                begin = time.perf_counter()
                if method == "generate":
                    outputs[method] = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False,
                                                     pad_token_id=pad)
                else:
                    outputs[method] = methods[method][0](prompt, args.max_new_tokens)
                seconds[method] = time.perf_counter() - begin
                if method != "generate":
                    spec = methods[method][1]
                    stats = spec.last_stats if spec is not None else None
                    steps = max(1, stats.target_forwards - 1) if stats is not None else 1
                    runs[method].append({"seconds": seconds[method], "tau": stats.tau if stats else None,
                                         "draft_ms": 1000 * stats.draft_seconds / steps if stats else None})
            new = outputs["generate"].shape[1] - prompt.shape[1]
            for name in names:
                if not torch.equal(outputs[name], outputs["generate"]):
                    raise SystemExit(f"{name}: output differs from model.generate on prompt {index}")
                run = runs[name][-1]
                run["speedup"] = (seconds["generate"] / new) / (run["seconds"] / new)
    selfdraft = [name for name in names if methods[name][1] is not None]
    results = {name: {"speedup": statistics.median(r["speedup"] for r in runs[name]),
                      "per_prompt": [round(r["speedup"], 4) for r in runs[name]]} for name in names}
    for name in selfdraft:
        results[name].update(tau=statistics.mean(r["tau"] for r in runs[name]),
                             draft_ms_per_step=statistics.median(r["draft_ms"] for r in runs[name]))
    pairs = {}
    for first, second in itertools.combinations(names, 2):
        ratios = [a["speedup"] / b["speedup"] for a, b in zip(runs[first], runs[second])]
        low, high = bootstrap_median(ratios)
        pairs[f"{first}/{second}"] = {"median_ratio": statistics.median(ratios), "interval_90": [low, high],
                                      "first_faster": sum(ratio > 1 for ratio in ratios) / len(ratios)}
    for name, result in results.items():
        extra = f"  tau {result['tau']:.2f}  draft {result['draft_ms_per_step']:.3f} ms/step" if "tau" in result else ""
        print(f"{name:>22}: {result['speedup']:.3f}x{extra}")
    for pair, result in pairs.items():
        low, high = result["interval_90"]
        print(f"{pair:>33}: median ratio {result['median_ratio']:.3f} (90% {low:.3f}-{high:.3f}), "
              f"first faster on {100 * result['first_faster']:.0f}% of prompts")
    path = write_json(args.out or f"kinds_{args.target}_{args.mix}.json", {
        "target": args.target, "mix": args.mix, "prompts": len(prompts), "history": args.history,
        "prompts_distinct_by_words": WINDOW if args.history else None,
        "max_new_tokens": args.max_new_tokens, "adapters": args.adapters, "hybrid_lookup_budget": 10 if args.hybrid else None,
        "results": results, "pairs": pairs,
        "seconds": time.perf_counter() - started,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
