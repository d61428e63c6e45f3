"""Which draft wins at which serving temperature (DistillSpec's question, on either shipped target),
and whether the CLI's default recipe serves both greedy and sampled traffic.

Medusa heads and the EAGLE drafter (``--eagle-for``, default ``hf``: the native layout) are each
distilled several ways (``--recipes``, :data:`RECIPES`) on the same step budget per kind
(``--steps``):

- ``greedy-off``: the target's greedy continuations (off-policy), divergence at T=1;
- ``T0.7-on``: divergence at T=0.7 on the target's samples at 0.7, half of each batch on-policy
  (sequences speculative generation with the current drafter samples at 0.7, refreshed 4 times);
- ``T1.0-on``: the same at T=1.0;
- ``default``: no recipe flag, the CLI's default recipe of the kind (:func:`training.recipe.default_recipe`);
- ``mix-*``: candidates that were tuned against it.

Each is served at T in ``--serve`` on ``--prompts`` prompts of the ``--split`` of each mix (code,
prose; default the check split, odd lines): speculative and plain generation alternate prompt by
prompt in one process at the same temperature (``training.evaluate.measure``; medians over prompts).
Reports tau (tokens per target forward, bonus included), acceptance by depth, tokens/s each way and
speedup per cell, per mix, and every recipe's tau and speedup over the specialised draft of the
serving temperature (:data:`MATCHED`); writes ``temperature.json`` and ``temperature.png`` beside
this script (``--target stories260K``: ``temperature_stories260K.json`` / ``.png``, one mix,
training prompts from ``stories_train.jsonl``, and by default the CLI's own step budget and learning
rate, as the shipped adapters; ``--split tuning`` adds ``_tuning``). Adapters are cached under
``benchmarks/results/adapters`` keyed by their steps and flags (``--retrain`` to redo them);
``--train-only`` trains and stops, so that training and timing can run pinned to different cores.

Candidates under sampling (``--candidates``): ``sampled`` (the kinds' default ``sample="auto"``:
each node's children drawn from the drafter's warped distribution, accepted with min(1, p/q)),
``top-k`` (``sample="never"``: the drafter's top-k tokens as point masses) or ``both``, side by
side in the same cells (greedy cells are the same either way and are measured once); the plot and
the winners use the first mode listed. ``--quick``: a smoke run (tiny budgets, written to
``temperature_quick.json``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.harness.prompts import SPLITS, TARGETS, mix_prompts, mixed_training_file, target_directory
from benchmarks.studies.common import RESULTS, table, write_json
from training.recipe import default_recipe

HERE = Path(__file__).resolve().parent
TARGETS = {name: TARGETS[name] for name in ("demo-llama", "stories260K")}

RECIPES = {
    "greedy-off": ["--temperature", "1.0", "--data-temperature", "0"],
    "T0.7-on": ["--temperature", "0.7", "--data-temperature", "0.7", "--on-policy"],
    "T1.0-on": ["--temperature", "1.0", "--data-temperature", "1.0", "--on-policy"],
    "default": [],
    "mix-on": ["--data-temperature", "0", "--on-policy", "--on-policy-temperature", "0.7"],
    "mix-data-T0.7": ["--temperature", "0.7", "--data-temperature", "0", "0.7"],
    "mix-data-on": ["--data-temperature", "0", "0.7", "--on-policy", "--on-policy-temperature", "0.7",
                    "--on-policy-ratio", "0.25"],
    "mix-data-on-T0.7": ["--temperature", "0.7", "--data-temperature", "0", "0.7", "--on-policy",
                         "--on-policy-temperature", "0.7", "--on-policy-ratio", "0.25"],
    "mix-data-half-on": ["--data-temperature", "0", "0.7", "--on-policy", "--on-policy-temperature", "0.7",
                         "--on-policy-ratio", "0.5"],
    "mix-2to1": ["--data-temperature", "0", "0", "0.7"],
}
"""Recipe name -> its ``selfdraft train`` flags. ``default``: no recipe flag (the CLI's default recipe,
whatever it is at the time of the run); ``mix-*``: candidates for that default, tuned on the tuning
split (``mix-on``: greedy data plus half of each batch on-policy at 0.7; ``mix-data-T0.7``: the
default's mixed data with the divergence at 0.7; ``mix-data-on``: the mixed data plus a quarter
on-policy at 0.7, ``mix-data-on-T0.7`` with the divergence at 0.7, ``mix-data-half-on`` with half
on-policy; ``mix-2to1``: two greedy continuations for each one sampled at 0.7)."""
MATCHED = {0.0: "greedy-off", 0.7: "T0.7-on", 1.0: "T1.0-on"}
"""The draft trained for each serving temperature (0.5 has none)."""
SERVING = (0.0, 0.5, 0.7, 1.0)
STUDY_RECIPES = ("greedy-off", "T0.7-on", "default")
"""``--recipes``' default: the specialised drafts and the CLI's default recipe."""
COLUMNS = ["kind", "recipe", "candidates", "serve_T", "mix", "tau", "tok/s plain", "tok/s spec", "speedup", "accept"]
CANDIDATES = {"sampled": "auto", "top-k": "never"}
"""``--candidates`` choice -> the kinds' ``sample`` mode."""
QUICK = {"steps": [4, 4], "train_prompts": 4, "train_new_tokens": 12, "max_length": 32, "pool_prompts": 2,
         "prompts": 2, "max_new_tokens": 12}
DEFAULTS = {
    "demo-llama": {"steps": [60, 120], "lr": 2e-3, "train_prompts": 64, "train_new_tokens": 48, "max_length": 96,
                   "pool_prompts": 8, "warmup_steps": 5},
    "stories260K": {"steps": [300, 300], "lr": None, "train_prompts": 500, "train_new_tokens": 128,
                    "max_length": 256, "pool_prompts": 32, "warmup_steps": None},
}
"""Per target, what is not given on the command line (None: the CLI's own default); stories260K: the
CLI's defaults and all 500 training prompts, as its shipped adapters were trained (``greedy-off`` is
then their recipe)."""


def mixed_file(target: str, per_mix: int) -> Path:
    """The first ``per_mix`` training prompts of each of ``target``'s mixes, interleaved, in one jsonl file."""
    name = f"train_mixed_{per_mix}" if target == "demo-llama" else f"train_{target}_{per_mix}"
    return mixed_training_file(RESULTS / "cache" / f"{name}.jsonl", per_mix, TARGETS[target]["mixes"])


def train(kind: str, recipe: str, data: Path, args) -> tuple[Path, dict]:
    """The cached adapter of ``kind`` x ``recipe`` (trained with ``selfdraft train`` if missing)."""
    from training.cli import main as selfdraft

    prefix = "temperature" if args.target == "demo-llama" else f"temperature-{args.target}"
    adapter = RESULTS / "adapters" / f"{prefix}-{kind}-{recipe}{'-quick' if args.quick else ''}"
    steps = args.steps[("medusa", "eagle").index(kind)]
    optional = [] if args.lr is None else ["--lr", str(args.lr)]
    optional += [] if args.warmup_steps is None else ["--warmup-steps", str(args.warmup_steps)]
    optional += ["--for", args.eagle_for] if kind == "eagle" else []
    prompts = len(TARGETS[args.target]["mixes"]) * args.train_prompts
    summary = adapter.parent / f"{adapter.name}.json"
    flags = [f"--steps={steps}", *optional, *(RECIPES[recipe] or [repr(default_recipe(kind))])]  # changed: retrained
    stale = not summary.is_file() or json.loads(summary.read_text()).get("recipe_flags") != flags
    if not (adapter / "adapter_config.json").is_file() or stale or args.retrain:
        started = time.perf_counter()
        selfdraft([
            "train", "--model", str(target_directory(args.target)), "--kind", kind, "--data", str(data),
            "--out", str(adapter), "--steps", str(steps), "--batch-size", "8", *optional,
            "--max-new-tokens", str(args.train_new_tokens), "--max-length", str(args.max_length),
            "--max-prompts", str(prompts), "--cache-dir", str(RESULTS / "cache"),
            "--on-policy-refresh", str(max(1, steps // 4)), "--on-policy-prompts", str(args.pool_prompts),
            "--eval-prompts", "0", "--json", str(summary), "--no-progress", "--seed", "0", *RECIPES[recipe],
        ])
        payload = json.loads(summary.read_text())
        payload["wall_seconds"] = time.perf_counter() - started  # data generation included
        payload["recipe_flags"] = flags
        summary.write_text(json.dumps(payload, indent=2) + "\n")
    payload = json.loads(summary.read_text())
    return adapter, {key: payload.get(key) for key in ("seconds", "wall_seconds", "final_loss",
                                                       "on_policy_refreshes", "on_policy_tau")}


def plot(rows: list[dict], kinds: list[str], path: Path, target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(kinds), figsize=(5.5 * len(kinds), 7.5), squeeze=False)
    for column, kind in enumerate(kinds):
        for recipe in dict.fromkeys(row["recipe"] for row in rows):
            for row_index, (metric, label) in enumerate((("tau", "tau (tokens / target forward)"),
                                                         ("speedup", "speedup vs model.generate (median)"))):
                axis = axes[row_index][column]
                for mix, style in zip(TARGETS[target]["mixes"], ("-", "--")):
                    cells = sorted((r for r in rows if (r["kind"], r["recipe"], r["mix"]) == (kind, recipe, mix)),
                                   key=lambda r: r["serve_T"])
                    axis.plot([c["serve_T"] for c in cells], [c[metric] for c in cells], style, marker="o",
                              color=f"C{list(RECIPES).index(recipe)}", label=f"{recipe} ({mix})")
                axis.set_xlabel("serving temperature (0 = greedy)")
                axis.set_ylabel(label)
                axis.set_title(f"{kind}: {metric} vs serving temperature")
        axes[0][column].legend(fontsize=7)
        axes[1][column].axhline(1.0, color="gray", linewidth=1)
    figure.suptitle(f"drafts distilled greedy/off-policy, on-policy at T=0.7, on-policy at T=1.0 ({target})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def candidate_comparison(rows: list[dict]) -> list[dict]:
    """Per sampled cell measured with both candidate modes: tau and speedup of each, side by side."""
    cells = {}
    for row in rows:
        if row["serve_T"] > 0:
            cells.setdefault((row["kind"], row["recipe"], row["serve_T"], row["mix"]), {})[row["candidates"]] = row
    return [{"kind": kind, "recipe": recipe, "serve_T": temperature, "mix": mix,
             "tau sampled": pair["sampled"]["tau"], "tau top-k": pair["top-k"]["tau"],
             "speedup sampled": pair["sampled"]["speedup"], "speedup top-k": pair["top-k"]["speedup"]}
            for (kind, recipe, temperature, mix), pair in cells.items() if len(pair) == 2]


def winners(rows: list[dict], kinds: list[str], serving: list[float]) -> dict:
    """Per kind and serving temperature: the recipe with the highest tau summed over mixes."""
    best = {}
    recipes = list(dict.fromkeys(row["recipe"] for row in rows))
    for kind in kinds:
        for temperature in serving:
            scores = {recipe: sum(r["tau"] for r in rows if (r["kind"], r["recipe"], r["serve_T"])
                                  == (kind, recipe, temperature)) for recipe in recipes}
            best[f"{kind}@T={temperature}"] = max(scores, key=scores.get)
    return best


def against_specialised(rows: list[dict]) -> list[dict]:
    """Per cell of every recipe that is not the serving temperature's specialised draft
    (:data:`MATCHED`): its tau, per-position acceptance and speedup over the specialised draft's in
    the same kind, temperature and mix."""
    matched = {(r["kind"], r["serve_T"], r["mix"]): r for r in rows if MATCHED.get(r["serve_T"]) == r["recipe"]}
    ratios = []
    for row in rows:
        reference = matched.get((row["kind"], row["serve_T"], row["mix"]))
        if reference is None or reference is row:
            continue
        ratios.append({"kind": row["kind"], "recipe": row["recipe"], "specialised": reference["recipe"],
                       "serve_T": row["serve_T"], "mix": row["mix"], "tau": row["tau"],
                       "tau specialised": reference["tau"], "tau ratio": row["tau"] / reference["tau"],
                       "speedup": row["speedup"], "speedup specialised": reference["speedup"],
                       "speedup ratio": row["speedup"] / reference["speedup"],
                       "accept": row["accept"], "accept specialised": reference["accept"]})
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=list(TARGETS), default="demo-llama", help="shipped target")
    parser.add_argument("--kinds", nargs="+", default=["medusa", "eagle"], choices=("medusa", "eagle"))
    parser.add_argument("--steps", type=int, nargs=2, default=None, metavar=("MEDUSA", "EAGLE"),
                        help="distillation steps per adapter of each kind (the same for its three recipes; "
                             "default per target, DEFAULTS)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default per target, DEFAULTS)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="warm-up steps (default per target)")
    parser.add_argument("--train-prompts", type=int, default=None, help="training prompts per mix (default per target)")
    parser.add_argument("--train-new-tokens", type=int, default=None,
                        help="generated tokens per training prompt (default per target)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per training sequence (default per target)")
    parser.add_argument("--pool-prompts", type=int, default=None, help="on-policy prompts per refresh (default per target)")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(STUDY_RECIPES),
                        help="recipes to train and serve (default: " + " ".join(STUDY_RECIPES) + ")")
    parser.add_argument("--serve", type=float, nargs="+", default=list(SERVING), metavar="T",
                        help="serving temperatures (default: " + " ".join(f"{t:g}" for t in SERVING) + ")")
    parser.add_argument("--split", choices=SPLITS, default="check",
                        help="held-out prompts from this split of each mix (tuning: even lines, check: odd lines; "
                             "default check)")
    parser.add_argument("--prompts", type=int, default=12, help="held-out prompts per mix and cell")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated per held-out prompt")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while measuring")
    parser.add_argument("--train-threads", type=int, default=2, help="torch threads while distilling")
    parser.add_argument("--retrain", action="store_true", help="retrain cached adapters")
    parser.add_argument("--candidates", choices=("sampled", "top-k", "both"), default="sampled",
                        help="candidates under sampling: drawn from the drafter's q (the default), its top-k "
                             "tokens, or both side by side")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny budgets, temperature_quick.json")
    parser.add_argument("--eagle-for", choices=("any", "hf"), default="hf",
                        help="EAGLE's --for (default hf: the native layout with parallel depths, as the shipped "
                             "stories260K-eagle-T0.7; any: the exportable EAGLE-3 layout)")
    parser.add_argument("--train-only", action="store_true",
                        help="train (or find cached) the adapters and stop: training and timing can then run pinned "
                             "to different cores")
    args = parser.parse_args()
    for key, value in DEFAULTS[args.target].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    counts = {"--steps": min(args.steps), "--train-prompts": args.train_prompts,
              "--train-new-tokens": args.train_new_tokens, "--max-length": args.max_length,
              "--pool-prompts": args.pool_prompts, "--prompts": args.prompts, "--max-new-tokens": args.max_new_tokens,
              "--threads": args.threads, "--train-threads": args.train_threads}
    for flag, value in counts.items():  # before any training or measuring starts
        if value < 1:
            parser.error(f"{flag} must be a positive integer; got {value}")
    if any(not t >= 0 for t in args.serve):
        parser.error(f"--serve temperatures must be >= 0 (0: greedy); got {args.serve}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0; got {args.warmup_steps}")
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be a positive number; got {args.lr}")
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    modes = list(CANDIDATES) if args.candidates == "both" else [args.candidates]
    suffix = (("" if args.target == "demo-llama" else f"_{args.target}") + ("_quick" if args.quick else "")
              + ("_tuning" if args.split == "tuning" else ""))
    mixes = TARGETS[args.target]["mixes"]  # held-out prompts: targets/prompts/<mix>.jsonl

    import heads
    from training.commands.common import load_model
    from training.evaluate import encode_prompts, measure

    started = time.perf_counter()
    data = mixed_file(args.target, args.train_prompts)
    adapters, training = {}, {}
    torch.set_num_threads(args.train_threads)
    for kind in args.kinds:
        for recipe in args.recipes:
            adapters[kind, recipe], training[f"{kind}/{recipe}"] = train(kind, recipe, data, args)
            print(f"{kind}/{recipe}: {json.dumps(training[f'{kind}/{recipe}'])}", flush=True)
    if args.train_only:
        return
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(str(target_directory(args.target)))
    prompts = {mix: encode_prompts(tokenizer, mix_prompts(mix, args.split, args.prompts), args.prompts)
               for mix in mixes}
    rows = []
    for (kind, recipe), adapter in adapters.items():
        spec = heads.load_heads(model, adapter)
        for mode in modes:
            spec.config.sample = CANDIDATES[mode]
            spec.set_tree(None)  # a drafter built for this sample mode
            for temperature in args.serve:
                if temperature == 0 and mode != modes[0]:
                    continue  # greedy drafts the top-k tokens in every mode
                for mix in mixes:
                    report = measure(spec, prompts[mix], args.max_new_tokens, temperature=temperature, seed=0)
                    rows.append({"kind": kind, "recipe": recipe, "candidates": mode if temperature else "top-k",
                                 "serve_T": temperature, "mix": mix, "tau": report.tau,
                                 "tok/s plain": report.tokens_per_s_plain, "tok/s spec": report.tokens_per_s_spec,
                                 "speedup": report.speedup,
                                 "accept": " ".join(f"{a:.2f}" for a in report.acceptance_by_position[:6]),
                                 "identical": report.identical if temperature == 0 else None})
                    print(table([rows[-1]], COLUMNS), flush=True)
    print("\n" + table(rows, COLUMNS))
    comparison = candidate_comparison(rows)
    if comparison:
        print("\nsampled vs top-k candidates:\n" + table(comparison, list(comparison[0])))
    primary = [row for row in rows if row["serve_T"] == 0 or row["candidates"] == modes[0]]
    best = winners(primary, args.kinds, args.serve)
    ratios = against_specialised(primary)
    if ratios:
        print("\nagainst the specialised draft:\n" + table(ratios, list(ratios[0])))
    matched = {key: best[key] == MATCHED[float(key.split("=")[1])] for key in best
               if float(key.split("=")[1]) in MATCHED}
    print("\nbest draft by tau (summed over mixes):", json.dumps(best, indent=1))
    print("matched draft wins its column:", json.dumps(matched, indent=1))
    path = write_json(f"temperature{suffix}.json", {
        "target": TARGETS[args.target]["path"], "split": args.split, "prompts_per_mix": args.prompts,
        "max_new_tokens": args.max_new_tokens, "serving_temperatures": args.serve,
        "settings": {key: getattr(args, key) for key in ("steps", "lr", "train_prompts", "train_new_tokens",
                                                          "max_length", "pool_prompts", "warmup_steps", "threads",
                                                          "train_threads", "candidates", "eagle_for")},
        "recipes": {name: RECIPES[name] for name in args.recipes}, "cells": rows,
        "against_specialised": ratios, "candidate_comparison": comparison, "winners": best,
        "matched_wins": matched,
        "training": training, "seconds": time.perf_counter() - started,
    }, HERE)
    figure = HERE / f"temperature{suffix}.png"
    plot(primary, args.kinds, figure, args.target)
    print(f"wrote {path} and {figure} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
