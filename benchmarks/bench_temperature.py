"""Which draft wins at which serving temperature (DistillSpec's point, measured here).

On the shipped target, Medusa heads and the EAGLE drafter are distilled three ways:
(a) greedy data, off-policy (divergence at T=1, target's greedy continuations);
(b) on-policy at T=0.7 (divergence and sampled data at 0.7, pool refreshed by the current drafter);
(c) on-policy at T=1.0.
Each is served at T in {0, 0.5, 0.7, 1.0} on held-out prompts of each mix; plain and speculative
generation alternate in one process at the same temperature. Reports tau, tokens/s and speedup per
cell, per mix; writes ``benchmarks/results/temperature.json`` and ``temperature.png`` (acceptance vs
serving temperature).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import RESULTS, table, write_json  # noqa: E402
from benchmarks.demo import MIXES, PROMPTS, TARGET  # noqa: E402

RECIPES = {
    "greedy-offpolicy": ["--temperature", "1.0", "--data-temperature", "0"],
    "T0.7-onpolicy": ["--temperature", "0.7", "--data-temperature", "0.7", "--on-policy"],
    "T1.0-onpolicy": ["--temperature", "1.0", "--data-temperature", "1.0", "--on-policy"],
}
SERVING = (0.0, 0.5, 0.7, 1.0)


def train(kind: str, recipe: str, data: Path, args) -> Path:
    from training.cli import main as selfdraft

    adapter = RESULTS / "adapters" / f"temperature-{kind}-{recipe}"
    if (adapter / "adapter_config.json").is_file() and not args.retrain:
        return adapter
    selfdraft([
        "train", "--model", str(TARGET), "--kind", kind, "--data", str(data), "--out", str(adapter),
        "--steps", str(args.steps), "--batch-size", "8", "--max-new-tokens", "96", "--max-length", "160",
        "--max-prompts", str(args.train_prompts), "--cache-dir", str(RESULTS / "cache"), "--eval-prompts", "0",
        "--on-policy-refresh", str(max(1, args.steps // 4)), "--json", str(adapter.parent / f"{adapter.name}.json"),
        "--no-progress", *RECIPES[recipe],
    ])
    return adapter


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["kind"] for r in rows})
    figure, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for axis, kind in zip(axes[0], kinds):
        for recipe in RECIPES:
            cells = [r for r in rows if r["kind"] == kind and r["recipe"] == recipe]
            by_temperature = {}
            for cell in cells:
                by_temperature.setdefault(cell["serve_T"], []).append(cell["tau"])
            temperatures = sorted(by_temperature)
            axis.plot(temperatures, [sum(by_temperature[t]) / len(by_temperature[t]) for t in temperatures],
                      marker="o", label=recipe)
        axis.set_title(f"{kind}: tau vs serving temperature (mean of mixes)")
        axis.set_xlabel("serving temperature (0 = greedy)")
        axis.set_ylabel("tau (tokens / target forward)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["medusa", "eagle"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--train-prompts", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per mix and cell")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--retrain", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import heads
    from benchmarks.bench_speedup import mixed_file
    from training.cli import _load_model
    from training.data import load_prompts
    from training.evaluate import encode_prompts, measure

    data = mixed_file(args.train_prompts // 2)
    model, tokenizer = _load_model(str(TARGET))
    prompts = {mix: encode_prompts(tokenizer, load_prompts(PROMPTS / f"{mix}.jsonl"), args.prompts) for mix in MIXES}
    rows = []
    for kind in args.kinds:
        for recipe in RECIPES:
            spec = heads.load_heads(model, train(kind, recipe, data, args))
            for temperature in SERVING:
                for mix in MIXES:
                    report = measure(spec, prompts[mix], args.max_new_tokens, temperature=temperature)
                    rows.append({"kind": kind, "recipe": recipe, "serve_T": temperature, "mix": mix,
                                 "tau": report.tau, "tok/s plain": report.tokens_per_s_plain,
                                 "tok/s spec": report.tokens_per_s_spec, "speedup": report.speedup,
                                 "accept": " ".join(f"{a:.2f}" for a in report.acceptance_by_position[:4])})
                    print(table([rows[-1]], list(rows[-1])), flush=True)
    columns = ["kind", "recipe", "serve_T", "mix", "tau", "tok/s plain", "tok/s spec", "speedup", "accept"]
    print("\n" + table(rows, columns))
    winners = {}
    for kind in args.kinds:
        for temperature in SERVING:
            cells = [r for r in rows if r["kind"] == kind and r["serve_T"] == temperature]
            scores = {recipe: sum(c["tau"] for c in cells if c["recipe"] == recipe) for recipe in RECIPES}
            winners[f"{kind}@T={temperature}"] = max(scores, key=scores.get)
    print("\nbest draft (by tau, summed over mixes) per serving temperature:", json.dumps(winners, indent=1))
    path = write_json("temperature.json", {"target": str(TARGET), "cells": rows, "winners": winners,
                                           "prompts_per_mix": args.prompts, "max_new_tokens": args.max_new_tokens})
    plot(rows, RESULTS / "temperature.png")
    print(f"wrote {path} and {RESULTS / 'temperature.png'}")


if __name__ == "__main__":
    main()
