"""EAGLE vs Medusa on the shipped target: speedup, tau, acceptance by depth, tree sweeps, unrolled training.

Greedy, batch 1, the same held-out prompts of each mix (code, prose) for every drafter, speculative
and plain ``model.generate`` alternating prompt by prompt in one process (medians over prompts).
Adapters are distilled with ``selfdraft train`` on the target's own greedy continuations of the
training prompts of both mixes (one cached data set for all of them; EAGLE features computed online
per batch) and cached under ``benchmarks/results/adapters``:

* ``medusa-mixed``: 4 Medusa heads;
* ``eagle-mixed-u1`` and ``eagle-mixed-u3``: EAGLE drafters trained with ``--unroll-steps`` 1 and 3
  on the same step budget (the unrolled vs non-unrolled figure: acceptance at each depth).

Parts of one run:

1. **compare**: each drafter at its default tree on each mix;
2. **sweep**: the EAGLE drafter with the higher speedup at its default (averaged over mixes) over
   ``depth:top_k:total_tokens`` shapes, Medusa over tree sizes; the wall-clock optimum (most
   tokens/s, ranked by speedup over plain decoding measured alongside) is reported apart from the
   acceptance optimum (highest tau) and the worst-mix optimum (best speedup on its worst mix);
3. **traffic** (``--traffic``, off by default: two more adapters): Medusa heads trained on one mix,
   served on each.

Each row: tokens/s each way, speedup vs ``model.generate``, tau (tokens committed per target forward,
bonus token included), acceptance by depth, and the per-step terms of the bound
speedup <= tau x t(plain token) / (t(verify) + t(draft)). Writes ``benchmarks/results/speedup.json``
and ``speedup.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    ACCEPTANCE_DEFINITION, MIXES, PROMPTS, RESULTS, TARGET, TAU_DEFINITION, mixed_training_file, speed_row, table,
    train_adapter, training_summary, write_json,
)

EAGLE_SHAPES = ("4:1:4", "6:1:6", "8:1:8", "4:2:8", "6:2:12", "8:2:16", "5:4:16", "7:10:60")
"""depth:top_k:total_tokens; 7:10:60 is EAGLE-2's GPU default (depth 7, top_k 10, 60 tokens)."""
MEDUSA_TREES = (4, 8, 16, 32)
UNROLLS = (1, 3)
COLUMNS = ["drafter", "tree", "eval_mix", "tok/s plain", "tok/s spec", "speedup", "tau", "acceptance_by_depth",
           "verify ms/step", "draft ms/step", "plain ms/token", "identical"]


def eagle_shape(text: str) -> dict:
    depth, top_k, total = (int(part) for part in text.split(":"))
    return dict(depth=depth, top_k=top_k, total_tokens=total)


def shape_name(spec) -> str:
    """The tree label of a spec: Medusa's node count, EAGLE's ``depth:top_k:total_tokens``."""
    if spec.kind == "medusa":
        return str(spec.tree.size - 1)
    return f"{spec.drafter.depth}:{spec.drafter.top_k}:{spec.drafter.total_tokens}"


def measure_mixes(spec, drafter: str, prompts: dict, max_new_tokens: int, **labels) -> list[dict]:
    from training.evaluate import measure

    rows = []
    for mix in MIXES:
        report = measure(spec, prompts[mix], max_new_tokens)
        rows.append(speed_row(report, drafter=drafter, tree=shape_name(spec), eval_mix=mix, **labels))
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def mean_over_mixes(rows: list[dict]) -> dict:
    """Per (drafter, tree): tokens/s, speedup and tau averaged over the mixes, and the lowest speedup."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["drafter"], row["tree"]), []).append(row)
    return {key: {**{name: statistics.mean(r[name] for r in group) for name in ("tok/s spec", "speedup", "tau")},
                  "worst_mix_speedup": min(r["speedup"] for r in group)} for key, group in groups.items()}


def optima(rows: list[dict], kind: str) -> dict:
    """Of ``kind``'s sweep, over the mean of the mixes and per mix: the wall-clock optimum (highest
    speedup, i.e. spec tokens/s over the plain tokens/s measured alongside, so that drift of the shared
    machine between rows cancels), the acceptance optimum (highest tau) and, over the mixes, the
    worst-mix optimum (highest speedup on its worst mix)."""
    mine = [r for r in rows if r["drafter"].startswith(kind)]

    def best(candidates: dict, key: str) -> dict:
        tree = max(candidates, key=lambda name: candidates[name][key])
        return {"tree": tree, **candidates[tree]}

    means = {tree: values for (_, tree), values in mean_over_mixes(mine).items()}
    result = {"mean_over_mixes": {"wall_clock": best(means, "speedup"), "acceptance": best(means, "tau"),
                                  "worst_mix": best(means, "worst_mix_speedup")}}
    for mix in MIXES:
        per_mix = {r["tree"]: {k: r[k] for k in ("tok/s spec", "speedup", "tau")} for r in mine if r["eval_mix"] == mix}
        result[mix] = {"wall_clock": best(per_mix, "speedup"), "acceptance": best(per_mix, "tau")}
    return result


def plot(rows: list[dict], path: Path) -> None:
    """Speedup and tau against drafted nodes per step: Medusa's tree sizes as lines, EAGLE's shapes
    as labelled points (several shapes share a node count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for mix, color in zip(MIXES, ("tab:blue", "tab:orange")):
        medusa = sorted((r for r in rows if r["drafter"] == "medusa" and r["eval_mix"] == mix),
                        key=lambda r: int(r["tree"]))
        eagle = [r for r in rows if r["drafter"].startswith("eagle") and r["eval_mix"] == mix]
        for axis, key in ((left, "speedup"), (right, "tau")):
            axis.plot([int(r["tree"]) for r in medusa], [r[key] for r in medusa], marker="s", linestyle="--",
                      color=color, label=f"medusa {mix}")
            nodes = [int(r["tree"].split(":")[-1]) for r in eagle]
            axis.scatter(nodes, [r[key] for r in eagle], marker="o", color=color, label=f"eagle {mix} (depth:top_k:n)")
            for x, r in zip(nodes, eagle):
                axis.annotate(r["tree"], (x, r[key]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    left.axhline(1.0, color="gray", linewidth=1)
    for axis, label in ((left, "speedup vs model.generate (median)"), (right, "tau (tokens / target forward)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("drafted nodes verified per step")
        axis.set_ylabel(label)
        axis.legend(fontsize=7)
    figure.suptitle("EAGLE vs Medusa on the demo target, greedy, batch 1")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def traffic_table(model, prompts: dict, data_steps: int, args) -> list[dict]:
    """Medusa heads trained on one mix, served on each."""
    import heads

    rows = []
    for trained in MIXES:
        adapter = train_adapter(f"medusa-{trained}", PROMPTS / f"train_{trained}.jsonl", data_steps,
                                args.train_prompts, retrain=args.retrain)
        rows += measure_mixes(heads.load_heads(model, adapter), f"medusa-{trained}", prompts, args.max_new_tokens,
                              trained_on=trained)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="distillation steps per adapter (all kinds)")
    parser.add_argument("--train-prompts", type=int, default=96, help="training prompts per mix")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts per mix")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eagle-shapes", nargs="+", default=list(EAGLE_SHAPES), help="depth:top_k:total_tokens")
    parser.add_argument("--medusa-trees", type=int, nargs="+", default=list(MEDUSA_TREES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--traffic", action="store_true", help="also the traffic-mix table (two more adapters)")
    parser.add_argument("--retrain", action="store_true", help="retrain cached adapters")
    parser.add_argument("--replot", action="store_true", help="only redraw speedup.png from speedup.json")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((RESULTS / "speedup.json").read_text())["sweep"], RESULTS / "speedup.png")
        return
    torch.set_num_threads(args.threads)
    if not (TARGET / "model.safetensors").is_file():
        raise SystemExit(f"the shipped demo target is missing: {TARGET}")

    import heads
    from training.commands.common import load_model
    from training.prompts import load_prompts
    from training.evaluate import encode_prompts

    started = time.perf_counter()
    data = mixed_training_file(RESULTS / "cache" / "train_mixed.jsonl", args.train_prompts)
    budget = dict(steps=args.steps, max_prompts=2 * args.train_prompts, retrain=args.retrain)
    adapters = {"medusa": train_adapter("medusa-mixed", data, **budget)}
    for unroll in UNROLLS:
        adapters[f"eagle-u{unroll}"] = train_adapter(f"eagle-mixed-u{unroll}", data, kind="eagle",
                                                     options=["--unroll-steps", str(unroll)], **budget)
    training_seconds = time.perf_counter() - started
    model, tokenizer = load_model(str(TARGET))
    prompts = {mix: encode_prompts(tokenizer, load_prompts(PROMPTS / f"{mix}.jsonl"), args.prompts) for mix in MIXES}
    specs = {name: heads.load_heads(model, adapter) for name, adapter in adapters.items()}

    compare = [row for name, spec in specs.items() for row in measure_mixes(spec, name, prompts, args.max_new_tokens)]
    defaults = {name: shape_name(spec) for name, spec in specs.items()}
    at_default = mean_over_mixes(compare)
    sweep_eagle = max((f"eagle-u{u}" for u in UNROLLS), key=lambda n: at_default[(n, defaults[n])]["speedup"])
    sweep = [row for row in compare if row["drafter"] in ("medusa", sweep_eagle)]
    for shape in args.eagle_shapes:
        if shape != defaults[sweep_eagle]:
            specs[sweep_eagle].set_tree(eagle_shape(shape))
            sweep += measure_mixes(specs[sweep_eagle], sweep_eagle, prompts, args.max_new_tokens)
    for tree in args.medusa_trees:
        if str(tree) != defaults["medusa"]:
            specs["medusa"].set_tree(tree)
            sweep += measure_mixes(specs["medusa"], "medusa", prompts, args.max_new_tokens)
    sweep.sort(key=lambda r: (r["drafter"], int(r["tree"].split(":")[-1]), r["tree"], r["eval_mix"]))
    traffic = traffic_table(model, prompts, args.steps, args) if args.traffic else None

    best = {"eagle": optima(sweep, "eagle"), "medusa": optima(sweep, "medusa")}
    memory = {}
    for kind in ("medusa", "eagle"):
        probe = heads.attach_heads(model, kind=kind)
        count = sum(p.numel() for p in probe.heads.parameters())
        memory[kind] = {"parameters": count, "megabytes_fp32": 4 * count / 2**20}
    unrolled = {}
    for unroll in UNROLLS:
        name = f"eagle-u{unroll}"
        summary = training_summary(f"eagle-mixed-u{unroll}") or {}
        unrolled[name] = {
            "unroll_steps": unroll, "steps": args.steps, "tree": defaults[name],
            "decode_acceptance_by_depth": {r["eval_mix"]: r["acceptance_by_depth"] for r in compare
                                           if r["drafter"] == name},
            "decode_tau": {r["eval_mix"]: r["tau"] for r in compare if r["drafter"] == name},
            "chain_top1_by_step": [row[0] for row in summary.get("accuracy") or []],
            "training_seconds": summary.get("seconds"),
        }
    print("\nEAGLE vs Medusa at their default trees:\n" + table(compare, COLUMNS))
    print(f"\ntree sweep (EAGLE: {sweep_eagle}, depth:top_k:total_tokens; Medusa: nodes):\n" + table(sweep, COLUMNS))
    for kind, found in best.items():
        for criterion, value in found["mean_over_mixes"].items():
            print(f"{kind} {criterion} optimum (mean over mixes): {value['tree']}: {value['tok/s spec']:.1f} tok/s, "
                  f"speedup {value['speedup']:.2f}x (worst mix {value['worst_mix_speedup']:.2f}x), "
                  f"tau {value['tau']:.2f}")
    for name, figures in unrolled.items():
        print(f"{name}: decode acceptance by depth {figures['decode_acceptance_by_depth']}, "
              f"chain top-1 by step (held-out, training) {figures['chain_top1_by_step']}")
    if traffic:
        print("\ntraffic mix (Medusa heads trained on one mix, evaluated on each):\n"
              + table(traffic, ["trained_on"] + COLUMNS))
    names = ["medusa-mixed"] + [f"eagle-mixed-u{u}" for u in UNROLLS] + (
        [f"medusa-{mix}" for mix in MIXES] if traffic else [])
    path = write_json("speedup.json", {
        "target": str(TARGET), "max_new_tokens": args.max_new_tokens, "prompts_per_mix": args.prompts,
        "greedy": True, "batch_size": 1, "tau_definition": TAU_DEFINITION,
        "acceptance_definition": ACCEPTANCE_DEFINITION,
        "speedup_definition": "median over prompts of plain model.generate time / speculative time, same prompt",
        "training": {"steps": args.steps, "prompts": 2 * args.train_prompts, "data": "target's greedy continuations "
                     "(64 new tokens, sequences <= 128 tokens), both mixes interleaved",
                     "eagle_features": "computed online per batch (not cached)",
                     "adapters": {name: training_summary(name) for name in names},
                     "seconds_this_run": training_seconds},
        "default_trees": defaults, "sweep_eagle_adapter": sweep_eagle, "compare": compare, "sweep": sweep,
        "optima": best, "unrolled_vs_not": unrolled, "traffic": traffic, "drafter_memory": memory,
        "seconds": time.perf_counter() - started,
    })
    plot(sweep, RESULTS / "speedup.png")
    print(f"wrote {path} and {RESULTS / 'speedup.png'} ({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
