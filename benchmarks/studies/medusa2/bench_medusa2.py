"""Medusa-1 against Medusa-2 (heads trained jointly with a LoRA on the backbone) on the same step budget.

For each shipped target, two adapters are distilled with ``selfdraft train`` from the same data,
prompts, seed, batch and steps:

- ``medusa1``: the heads alone on the frozen backbone;
- ``medusa2``: ``--joint`` (a LoRA r=16, alpha=32 on q_proj/v_proj, self-distilled against the
  original model, the heads' loss weighted by lambda=0.2 after a heads-only phase; Medusa-2's schedule);
- with ``--sweep TARGET``, more joint settings on that target (``SWEEP``: lambda 0.05 and 1, the
  LoRA on every linear layer, and that with on-policy data), to show the trade-off between tau and drift.

``--divergence`` names the heads' objective for every variant of a run (``selfdraft train
--divergence``: ``fkl``, the default, or an acceptance objective such as ``tvd`` or ``lk_hybrid``);
the tuned backbone's self-distillation term stays KL(original || tuned) whichever it is.

Each is then loaded on a fresh copy of the target (``heads.load_heads``: the Medusa-2 adapter merges
its LoRA into that copy) and measured on held-out prompts per mix, speculative and plain generation
alternating in one process (``training.evaluate.measure``: greedy, ``max_new_tokens`` per prompt,
medians of per-prompt speedups; the plain side is each spec's own backbone, so Medusa-2's speedup is
against the *tuned* model's ``generate``). Reported per mix: tau (tokens per target forward, bonus
included), acceptance by depth, tokens/s each way, speedup, and whether outputs were identical to
the backbone's own ``generate``.

The tuned backbone's drift from the original, on the held-out prompt texts (real text, not model
output): perplexity of each model and its relative change, mean per-token KL(original || tuned),
top-1 agreement per position, and greedy agreement over ``--agreement-tokens`` generated tokens
(share of positions where both models' greedy continuations hold the same token, and the mean
length of the identical prefix).

Writes ``medusa2.json`` and ``medusa2.png`` beside this script
(``python -m benchmarks.studies.medusa2.bench_medusa2``). Adapters are cached under
``benchmarks/results/adapters/medusa2-<target>-<variant>[-lr<heads lr>][-<divergence>]`` (``--retrain`` to redo them;
``--train-only`` to distil without measuring, e.g. in the background).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.studies.common import (ACCEPTANCE_DEFINITION, RESULTS, ROOT, TAU_DEFINITION, mixed_training_file, table,
                                       write_json)
from training.config import DIVERGENCES

HERE = Path(__file__).resolve().parent
MIXED = RESULTS / "cache" / "train_mixed.jsonl"
"""demo-llama's training prompts: 96 of each mix interleaved, written when missing."""

TARGETS = {
    "stories260K": {"model": ROOT / "benchmarks/targets/stories260K",
                    "data": ROOT / "benchmarks/targets/prompts/stories_train.jsonl",
                    "mixes": {"stories": ROOT / "benchmarks/targets/prompts/stories.jsonl"},
                    "steps": 300, "max_prompts": 200, "max_new_tokens": 96, "max_length": 256},
    "demo-llama": {"model": ROOT / "benchmarks/targets/demo-llama", "data": MIXED,
                   "mixes": {"code": ROOT / "benchmarks/targets/prompts/code.jsonl",
                             "prose": ROOT / "benchmarks/targets/prompts/prose.jsonl"},
                   "steps": 100, "max_prompts": 192, "max_new_tokens": 128, "max_length": 256},
}
JOINT = ["--joint", "--lora-r", "16", "--lora-alpha", "32", "--lora-targets", "q_proj,v_proj"]
VARIANTS = {"medusa1": [], "medusa2": JOINT}
"""The compared variants: ``selfdraft train`` flags beyond the shared ones."""
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
WIDE = ["--joint", "--lora-r", "64", "--lora-alpha", "128", "--lora-targets", ALL_LINEAR, "--lora-lr", "1e-3"]
"""A rank-64 LoRA on every linear layer at a LoRA learning rate of 1e-3 (lambda set per variant)."""
SWEEP = {"medusa2-lambda0.05": [*JOINT, "--joint-lambda", "0.05"], "medusa2-lambda1": [*JOINT, "--joint-lambda", "1"],
         "medusa2-lambda0.1": [*JOINT, "--joint-lambda", "0.1"],
         "medusa2-all-linear": [*JOINT[:-1], ALL_LINEAR],
         "medusa2-all-linear-lambda0.05": [*JOINT[:-1], ALL_LINEAR, "--joint-lambda", "0.05"],
         "medusa2-all-linear-r64-lambda0.05": [*WIDE[:-2], "--joint-lambda", "0.05"],
         **{f"medusa2-all-linear-r64-lambda{value}-lora-lr1e-3": [*WIDE, "--joint-lambda", value]
            for value in ("0.015", "0.03", "0.1", "0.3", "1")},
         "medusa2-all-linear-on-policy": [*JOINT[:-1], ALL_LINEAR, "--on-policy", "--on-policy-temperature", "0",
                                          "--on-policy-refresh", "60", "--on-policy-prompts", "16"]}
"""More joint settings (``--sweep``, on the small target): the trade-off between tau and drift. The
on-policy variant trains half of each batch on the *tuned* backbone's own greedy continuations
(regenerated every 60 steps), the contexts its heads meet when serving."""
COLUMNS = ["target", "variant", "mix", "tau", "accept", "tok/s plain", "tok/s spec", "speedup", "identical"]


def group(target: str, lr: float = 1e-3, divergence: str = "fkl") -> str:
    """The name under which one target's run at heads' learning rate ``lr`` and heads' objective
    ``divergence`` is kept in the JSON (runs at other learning rates or objectives keep theirs)."""
    return target + ("" if lr == 1e-3 else f"@lr{lr:g}") + ("" if divergence == "fkl" else f"@{divergence}")


def adapter_path(target: str, variant: str, lr: float = 1e-3, divergence: str = "fkl") -> Path:
    """The cached adapter of ``target`` x ``variant`` trained at heads' learning rate ``lr`` with the
    heads' objective ``divergence``."""
    return RESULTS / "adapters" / (f"medusa2-{target}-{variant}" + ("" if lr == 1e-3 else f"-lr{lr:g}")
                                   + ("" if divergence == "fkl" else f"-{divergence}"))


def train(target: str, variant: str, args) -> dict:
    """Distil (unless cached) and return the training summary of ``target`` x ``variant``."""
    from training.cli import main as selfdraft

    settings = TARGETS[target]
    adapter = adapter_path(target, variant, args.lr, args.divergence)
    summary = adapter.parent / f"{adapter.name}.json"
    steps = args.steps.get(target, settings["steps"])
    if not settings["data"].is_file():
        mixed_training_file(settings["data"], 96)
    if not (adapter / "adapter_config.json").is_file() or not summary.is_file() or args.retrain:
        started = time.perf_counter()
        code = selfdraft([
            "train", "--model", str(settings["model"]), "--kind", "medusa", "--data", str(settings["data"]),
            "--out", str(adapter), "--steps", str(steps), "--batch-size", "8", "--lr", str(args.lr),
            "--max-new-tokens", str(settings["max_new_tokens"]), "--max-length", str(settings["max_length"]),
            "--max-prompts", str(settings["max_prompts"]), "--cache-dir", str(args.cache_dir), "--seed", "0",
            "--eval-prompts", "0", "--json", str(summary), "--no-progress", "--divergence", args.divergence,
            "--data-temperature", "0",  # greedy data, as these results were measured (not the mixed default)
            *{**VARIANTS, **SWEEP}[variant]])
        if code:
            raise SystemExit(f"selfdraft train failed for {target}/{variant} (exit {code})")
        payload = json.loads(summary.read_text())
        payload["wall_seconds"] = time.perf_counter() - started  # data generation included
        summary.write_text(json.dumps(payload, indent=2) + "\n")
    payload = json.loads(summary.read_text())
    return {key: payload.get(key) for key in ("seconds", "wall_seconds", "final_loss", "backbone_drift")} | {
        "steps": len(payload.get("losses", [])), "held_out_accuracy_top1": [row[0] for row in payload["accuracy"]]}


@torch.no_grad()
def drift(original, tuned, texts: list[torch.Tensor], prompts: list[torch.Tensor], tokens: int) -> dict:
    """The tuned model's drift from the original on held-out texts (perplexity, KL, top-1) and
    greedy continuations of ``prompts`` (``tokens`` each)."""
    from heads.lora import drift_terms, summarise_drift

    totals: dict[str, float] = {}
    for ids in texts:
        mask = torch.ones_like(ids)
        terms = drift_terms(tuned(ids).logits, original(ids).logits, ids, mask)
        for key, value in terms.items():
            totals[key] = totals.get(key, 0.0) + value
    result = summarise_drift(totals)
    matches, prefixes, count = 0, [], 0
    for prompt in prompts:
        settings = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=tokens,
                        min_new_tokens=tokens, eos_token_id=None)
        first = original.generate(prompt, **settings)[0, prompt.shape[1]:]
        second = tuned.generate(prompt, **settings)[0, prompt.shape[1]:]
        length = min(len(first), len(second))
        same = (first[:length] == second[:length]).long()
        matches += int(same.sum())
        count += length
        prefixes.append(int(same.cumprod(0).sum()))
    result.update({"greedy_token_agreement": matches / max(1, count), "greedy_identical_prefix": sum(prefixes) /
                   max(1, len(prefixes)), "greedy_tokens": tokens, "greedy_prompts": len(prompts),
                   "texts": len(texts)})
    return result


def measure_target(target: str, variants: list[str], args) -> tuple[list[dict], dict]:
    import heads
    from training.commands.common import load_model
    from training.evaluate import encode_prompts, measure
    from training.prompts import load_prompts

    settings = TARGETS[target]
    original, tokenizer = load_model(str(settings["model"]))
    specs = {"medusa1": heads.load_heads(original, adapter_path(target, "medusa1", args.lr, args.divergence))}
    for variant in variants:  # each Medusa-2 adapter merges its LoRA into a fresh copy of the target
        if variant != "medusa1":
            specs[variant] = heads.load_heads(load_model(str(settings["model"]))[0],
                                             adapter_path(target, variant, args.lr, args.divergence))
    rows = []
    texts, agreement_prompts = [], []
    for mix, path in settings["mixes"].items():
        prompts = encode_prompts(tokenizer, load_prompts(path), args.prompts)
        for variant in variants:
            report = measure(specs[variant], prompts, args.max_new_tokens)
            rows.append({"target": target, "group": group(target, args.lr, args.divergence), "variant": variant,
                         "mix": mix, "heads_lr": args.lr, "divergence": args.divergence, "tau": report.tau,
                         "acceptance_by_depth": list(report.acceptance_by_position),
                         "accept": " ".join(f"{a:.2f}" for a in report.acceptance_by_position[:5]),
                         "tok/s plain": report.tokens_per_s_plain, "tok/s spec": report.tokens_per_s_spec,
                         "speedup": report.speedup, "identical": report.identical,
                         "draft_s": report.draft_seconds, "verify_s": report.verify_seconds})
            print(table([rows[-1]], COLUMNS), flush=True)
        held_out = encode_prompts(tokenizer, load_prompts(path), args.drift_texts)
        texts += [ids[:, :args.max_text_tokens] for ids in held_out]
        agreement_prompts += held_out[:args.agreement_prompts]
    drifts = {}
    for variant, spec in specs.items():
        if variant != "medusa1":
            drifts[variant] = drift(original, spec.backbone, texts, agreement_prompts, args.agreement_tokens)
            drifts[variant]["recorded_at_training"] = spec.metadata["backbone"]["drift"]
            print(f"{target}/{variant} drift: {json.dumps(drifts[variant])}", flush=True)
    return rows, drifts


def plot(rows: list[dict], drifts: dict, path: Path) -> None:
    """Left: tau per target/mix and variant. Right: tau gain over Medusa-1 against the held-out
    perplexity change of each Medusa-2 variant (the trade-off)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cell_of(row: dict) -> tuple[str, str]:
        return row.get("group", row["target"]), row["mix"]

    cells = sorted({cell_of(r) for r in rows}, key=lambda c: (list(TARGETS).index(c[0].split("@")[0]), c))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    figure, axes = plt.subplots(1, 2, figsize=(14, 5.2))
    for index, cell in enumerate(cells):  # Medusa-1 as a bar, each Medusa-2 variant as a dot above it
        taus = {r["variant"]: r["tau"] for r in rows if cell_of(r) == cell}
        axes[0].bar(index, taus["medusa1"], 0.6, color="lightgray", edgecolor="gray")
        others = [taus[v] for v in variants[1:] if v in taus]
        axes[0].scatter([index] * len(others), others, color=f"C{index}", s=14, zorder=3)
    axes[0].set_xticks(range(len(cells)), [f"{t.replace('@', chr(10))}\n{m}" for t, m in cells], fontsize=7)
    axes[0].set_ylabel("tau (tokens / target forward)")
    axes[0].set_title("held-out tau: Medusa-1 (bar), Medusa-2 settings (dots), same budget", fontsize=9)
    axes[0].set_ylim(bottom=1.0)
    clip = 15.0  # % drift; farther points are drawn at the edge
    for index, cell in enumerate(cells):  # one curve per target/mix, heads' lr and objective
        base = next(r["tau"] for r in rows if (*cell_of(r), r["variant"]) == (*cell, "medusa1"))
        points = []
        for variant in variants[1:]:
            row = next((r for r in rows if (*cell_of(r), r["variant"]) == (*cell, variant)), None)
            if row is not None:
                change = 100 * drifts[f"{cell[0]}/{variant}"]["perplexity_change"]
                name = variant + (f" ({change:.0f}%)" if change > clip else "")
                points.append((min(change, clip), row["tau"] - base, name))
        points.sort()
        axes[1].plot([x for x, _, _ in points], [y for _, y, _ in points], marker="o", color=f"C{index}",
                     linewidth=0.8, label=f"{cell[0]} / {cell[1]}")
        for change, gain, variant in points:
            axes[1].annotate(variant.removeprefix("medusa2-").replace("-lora-lr1e-3", ""), (change, gain), fontsize=5)
    axes[1].legend(fontsize=6)
    axes[1].axhline(0.3, color="gray", linestyle="--", linewidth=1)
    axes[1].axvline(2.0, color="gray", linestyle="--", linewidth=1)
    axes[1].set_xlabel("held-out perplexity change of the tuned backbone (%)")
    axes[1].set_ylabel("tau gain over Medusa-1")
    axes[1].set_title("Medusa-2: tau gained against drift (goal: upper left of the dashed lines)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=[*VARIANTS, *SWEEP],
                        help="variants to train and measure (medusa1 is always measured)")
    parser.add_argument("--sweep", nargs="*", default=[], choices=list(TARGETS),
                        help="targets on which the --variants are joined by every setting of SWEEP")
    parser.add_argument("--steps", type=json.loads, default={}, help='per-target steps, e.g. {"demo-llama": 100}')
    parser.add_argument("--lr", type=float, default=1e-3, help="heads' learning rate (every variant)")
    parser.add_argument("--divergence", default="fkl", choices=DIVERGENCES,
                        help="heads' objective (every variant; the backbone's self-distillation stays KL)")
    parser.add_argument("--cache-dir", default=str(RESULTS / "cache"), help="distillation data cache")
    parser.add_argument("--prompts", type=int, default=12, help="held-out prompts per mix for speed and tau")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drift-texts", type=int, default=100, help="held-out texts per mix for perplexity/KL")
    parser.add_argument("--max-text-tokens", type=int, default=256)
    parser.add_argument("--agreement-prompts", type=int, default=8, help="prompts per mix for greedy agreement")
    parser.add_argument("--agreement-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--train-only", action="store_true")
    parser.add_argument("--fresh", action="store_true",
                        help="drop the figures of targets not measured in this run from medusa2.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    first = [] if args.train_only else ["medusa1"]  # the baseline is measured always, trained when asked
    chosen = {target: list(dict.fromkeys([*first, *args.variants, *(SWEEP if target in args.sweep else [])]))
              for target in args.targets}
    training = {}
    for target, variants in chosen.items():
        for variant in variants:
            training[f"{group(target, args.lr, args.divergence)}/{variant}"] = summary = train(target, variant, args)
            print(f"{target}/{variant}: {json.dumps(summary)}", flush=True)
    if args.train_only:
        return
    rows, drifts = [], {}
    for target, variants in chosen.items():
        target_rows, target_drifts = measure_target(target, variants, args)
        rows += target_rows
        name = group(target, args.lr, args.divergence)
        drifts.update({f"{name}/{variant}": value for variant, value in target_drifts.items()})
    previous = HERE / "medusa2.json"
    kept = json.loads(previous.read_text()) if previous.is_file() and not args.fresh else {}
    groups = {group(target, args.lr, args.divergence) for target in chosen}
    if kept:  # targets (at a heads' lr) not measured in this run keep their earlier figures (each from one run)
        rows = [r for r in kept.get("cells", []) if r.get("group", r["target"]) not in groups] + rows
        drifts = {**{k: v for k, v in kept.get("drift", {}).items() if k.split("/")[0] not in groups}, **drifts}
        training = {**{k: v for k, v in kept.get("training", {}).items() if k.split("/")[0] not in groups}, **training}
    print("\n" + table(rows, COLUMNS))
    goal = {}
    for row in rows:
        if row["variant"] == "medusa1":
            continue
        name = row.get("group", row["target"])
        base = next(o["tau"] for o in rows if o["variant"] == "medusa1" and (o.get("group", o["target"]), o["mix"]) ==
                    (name, row["mix"]))
        change = drifts[f"{name}/{row['variant']}"]["perplexity_change"]
        goal[f"{name}/{row['mix']}/{row['variant']}"] = {
            "tau_gain": row["tau"] - base, "perplexity_change": change,
            "met": row["tau"] - base >= 0.3 and change <= 0.02}
    print("goal (tau +0.3 at <= 2% held-out perplexity):", json.dumps(goal, indent=1))
    path = write_json("medusa2.json", {
        "settings": {key: getattr(args, key) for key in ("steps", "lr", "divergence", "prompts", "max_new_tokens",
                                                          "drift_texts", "max_text_tokens", "agreement_prompts",
                                                          "agreement_tokens", "threads")},
        "variants": {**VARIANTS, **SWEEP},
        "targets": {name: {key: str(value) if isinstance(value, Path) else
                           ({k: str(v) for k, v in value.items()} if isinstance(value, dict) else value)
                           for key, value in TARGETS[name].items()} for name in dict.fromkeys(r["target"] for r in rows)},
        "measured_at": {**kept.get("measured_at", {}), **{name: time.strftime("%Y-%m-%d %H:%M") for name in groups}},
        "definitions": {"tau": TAU_DEFINITION, "acceptance_by_depth": ACCEPTANCE_DEFINITION},
        "cells": rows, "drift": drifts, "goal": goal, "training": training,
        "seconds": time.perf_counter() - started,
    }, HERE)
    plot(rows, drifts, HERE / "medusa2.png")
    print(f"wrote {path} and {HERE / 'medusa2.png'} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
