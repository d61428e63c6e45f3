"""Trained drafter kinds head to head, greedy, paired per prompt: is one kind faster than another?

``bench_peers.py`` runs a dozen methods on 6 prompts per mix; two kinds within a few percent of each
other there swap places from run to run. This benchmark runs only ``model.generate`` and the adapters
given (``--adapter NAME=DIR``) on one target and mix, on many held-out prompts, in one process, the
methods in rotating order per prompt, and reports per adapter the median speedup over ``generate``
(seconds per new token), tau, draft ms per step, and for each pair the per-prompt ratio of their
speedups (both measured against the same ``generate`` call): its median, a bootstrap 90% interval of
that median, and the share of prompts where the first is faster. Every output is checked identical
to ``generate``. Writes ``benchmarks/results/kinds_<target>_<mix>.json``.
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
    parser.add_argument("--adapter", action="append", required=True, metavar="NAME=DIR",
                        help="a trained adapter for the target (repeatable; two or more)")
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
    if len(adapters) < 2:
        parser.error("give at least two --adapter NAME=DIR to compare")
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
    prompts = prompts_of(tokenizer, target["mixes"][args.mix], args.prompts)
    specs = {name: heads.load_heads(model, directory) for name, directory in args.adapters.items()}
    names = list(specs)
    for prompt in prompts[:2]:  # warm-up
        model.generate(prompt, max_new_tokens=16, do_sample=False)
        for spec in specs.values():
            spec.generate(prompt, max_new_tokens=16, do_sample=False)
    runs = {name: [] for name in names}
    started = time.perf_counter()
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            methods = ["generate"] + names
            shift = index % len(methods)
            seconds, outputs = {}, {}
            for method in methods[shift:] + methods[:shift]:
                begin = time.perf_counter()
                if method == "generate":
                    outputs[method] = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
                else:
                    outputs[method] = specs[method].generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
                seconds[method] = time.perf_counter() - begin
                if method != "generate":
                    stats = specs[method].last_stats
                    steps = max(1, stats.target_forwards - 1)
                    runs[method].append({"seconds": seconds[method], "tau": stats.tau,
                                         "draft_ms": 1000 * stats.draft_seconds / steps})
            new = outputs["generate"].shape[1] - prompt.shape[1]
            for name in names:
                if not torch.equal(outputs[name], outputs["generate"]):
                    raise SystemExit(f"{name}: output differs from model.generate on prompt {index}")
                run = runs[name][-1]
                run["speedup"] = (seconds["generate"] / new) / (run["seconds"] / new)
    results = {name: {"speedup": statistics.median(r["speedup"] for r in runs[name]),
                      "tau": statistics.mean(r["tau"] for r in runs[name]),
                      "draft_ms_per_step": statistics.median(r["draft_ms"] for r in runs[name]),
                      "per_prompt": [round(r["speedup"], 4) for r in runs[name]]} for name in names}
    pairs = {}
    for first, second in itertools.combinations(names, 2):
        ratios = [a["speedup"] / b["speedup"] for a, b in zip(runs[first], runs[second])]
        low, high = bootstrap_median(ratios)
        pairs[f"{first}/{second}"] = {"median_ratio": statistics.median(ratios), "interval_90": [low, high],
                                      "first_faster": sum(ratio > 1 for ratio in ratios) / len(ratios)}
    for name, result in results.items():
        print(f"{name:>16}: {result['speedup']:.3f}x  tau {result['tau']:.2f}  draft {result['draft_ms_per_step']:.3f} ms/step")
    for pair, result in pairs.items():
        low, high = result["interval_90"]
        print(f"{pair:>33}: median ratio {result['median_ratio']:.3f} (90% {low:.3f}-{high:.3f}), "
              f"first faster on {100 * result['first_faster']:.0f}% of prompts")
    path = write_json(f"kinds_{args.target}_{args.mix}.json", {
        "target": args.target, "mix": args.mix, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "adapters": args.adapters, "results": results, "pairs": pairs,
        "seconds": time.perf_counter() - started,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
