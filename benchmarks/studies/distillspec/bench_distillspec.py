"""DistillSpec on the demo target: the shipped draft model before and after distillation, served by
selfdraft (chain and tree) and by transformers' assisted generation, greedy and sampled.

Drafts (all from ``benchmarks/targets/demo-draft``, full fine-tunes with ``selfdraft train --kind
draft``, the same prompts, seed, batch, learning rate and step budget):

- ``undistilled``: the shipped draft (trained on text, not on the target);
- ``off_fkl_T0``: off-policy, forward KL, on the target's greedy continuations (standard KD);
- ``on_<div>_T0``: on-policy (DistillSpec lambda = 1: every batch from the draft's own **greedy**
  continuations, regenerated every ``--refresh`` steps, re-scored by the target), divergence
  ``<div>`` in fkl, rkl, jsd (beta 0.5), tvd, for greedy serving;
- ``on_<div>_T1``: the same with the draft **sampling at T = 1.0** (the serving temperature).

Every divergence is taken at temperature 1.0 (the T = 0 serving rule is argmax agreement, which no
divergence at T = 0 expresses; at T = 1.0 it is the serving temperature itself).

Each draft is served at T = 0, 0.7 and 1.0 (sampling with top_k 0, top_p 1) as a chain (depth 4,
sampled from the draft's own q under sampling, Leviathan's rule) and as a dynamic tree (depth 4,
top-k 2, 8 nodes, top-k candidates), as a chain of up to 8 that stops below a node the draft is less
than 40% sure of (``chain_c``: transformers' assistant confidence threshold), and by
``model.generate(assistant_model=draft)``, all side by side in one process: per prompt, plain
``generate`` and every method in a rotating order. Reported per (draft, method, temperature):
wall-clock speedup (median over prompts of t_generate / t_method), tau (tokens per target forward;
for assisted generation counted with a forward hook on the target), the per-token acceptance alpha
of chains (accepted / (accepted + rejected) drafted tokens), acceptance by depth, draft and verify
ms per step and the bound tau x t_generate_step / (t_draft + t_verify).

``best_distilled_over_undistilled``: the best distilled draft's speedup divided by the undistilled
draft's, each at the temperature the distilled one was trained for (T = 0 for ``*_T0``, 1.0 for
``*_T1``), each draft at its best shape; also per training and per serving temperature. ``goals``:
the issue's (>= 1.10x greedy and at T = 1.0; selfdraft >= 1.1x assisted generation greedy).

Writes ``benchmarks/results/distillspec.json`` and ``distillspec.png``. Drafts are cached under
``benchmarks/results/adapters/distillspec/`` (checkpointed, resumed when interrupted; ``--retrain``
to redo them; ``--train-only`` to distil without measuring, e.g. in the background; ``--drafts`` a
subset). ``--quick``: a one-minute smoke run (3 drafts of 4 steps under ``benchmarks/results/adapters/
distillspec_quick``, 1 prompt per mix). Run the measurement alone on the machine::

    python -m benchmarks.studies.distillspec.bench_distillspec
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.studies.common import ACCEPTANCE_DEFINITION, PROMPTS, RESULTS, ROOT, TAU_DEFINITION, TARGET, table

HERE = Path(__file__).resolve().parent
DRAFT = ROOT / "benchmarks/targets/demo-draft"
DRAFTS_DIR = RESULTS / "adapters" / "distillspec"
DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")
TEMPERATURES = (0.0, 0.7, 1.0)
COLUMNS = ["speedup", "tau", "alpha", "draft_ms_per_step", "verify_ms_per_step", "bound"]
SHAPES = {"chain": dict(depth=4, top_k=1, total_tokens=4), "tree": dict(depth=4, top_k=2, total_tokens=8),
          # a chain that stops below a node the draft is less than 40% sure of (transformers' assistant default)
          "chain_c": dict(depth=8, top_k=1, total_tokens=8, confidence=0.4)}


def recipes(only: list[str] | None = None) -> dict[str, dict]:
    """``{name: {"trained_for": T, "flags": [...]}}`` of the distilled drafts (``only``: these)."""
    drafts = {"off_fkl_T0": {"trained_for": 0.0, "flags": ["--divergence", "fkl", "--data-temperature", "0"]}}
    for serving, suffix in ((0.0, "T0"), (1.0, "T1")):
        for divergence in DIVERGENCES:
            drafts[f"on_{divergence}_{suffix}"] = {"trained_for": serving, "flags": [
                "--divergence", divergence, "--on-policy-ratio", "1", "--on-policy-temperature", str(serving)]}
    unknown = sorted(set(only or ()) - set(drafts))
    if unknown:
        raise SystemExit(f"--drafts: unknown {unknown}; choose from {sorted(drafts)}")
    return {name: recipe for name, recipe in drafts.items() if only is None or name in only}


def train(args) -> dict[str, dict]:
    """Distil every missing draft (each resumable from its checkpoints); their training summaries."""
    from training.cli import main as selfdraft

    summaries = {}
    for name, recipe in recipes(args.drafts).items():
        out, summary = args.drafts_dir / name, args.drafts_dir / f"{name}.json"
        checkpoints = args.drafts_dir / "checkpoints" / name
        if (out / "adapter_config.json").is_file() and summary.is_file() and not args.retrain:
            summaries[name] = json.loads(summary.read_text())
            continue
        resume = ["--resume"] if (checkpoints / "latest").is_file() and not args.retrain else []
        started = time.perf_counter()
        code = selfdraft([
            "train", "--model", str(TARGET), "--kind", "draft", "--draft", str(DRAFT), "--data", str(args.data),
            "--out", str(out), "--steps", str(args.steps), "--batch-size", "8", "--lr", str(args.lr),
            "--warmup-steps", "10", "--temperature", "1.0", "--max-prompts", str(args.max_prompts),
            "--on-policy-refresh", str(args.refresh), "--on-policy-prompts", str(args.pool),
            "--cache-dir", str(args.cache_dir), "--checkpoint-dir", str(checkpoints), "--checkpoint-every",
            str(args.checkpoint_every), "--eval-prompts", "0", "--json", str(summary), "--no-progress",
            *recipe["flags"], *resume,
        ])
        if code != 0:
            raise SystemExit(f"selfdraft train for {name} exited {code}")
        summaries[name] = json.loads(summary.read_text())
        print(f"{name}: trained in {time.perf_counter() - started:.0f} s, loss {summaries[name]['losses'][0]:.3f} -> "
              f"{summaries[name]['losses'][-1]:.3f}", flush=True)
    return summaries


def held_out_prompts(tokenizer, per_mix: int) -> list[tuple[str, torch.Tensor]]:
    prompts = []
    for mix in ("code", "prose"):
        lines = (PROMPTS / f"{mix}.jsonl").read_text().splitlines()
        for line in [line for line in lines if line.strip()][:per_mix]:
            prompts.append((mix, tokenizer(json.loads(line)["prompt"], return_tensors="pt").input_ids))
    return prompts


class ForwardCounter:
    """Counts the target's forward calls while ``active`` (tau of assisted generation)."""

    def __init__(self, model) -> None:
        self.calls, self.active = 0, False
        model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        self.calls += self.active


def methods(target, drafts: dict, counter: ForwardCounter, shapes: list[str]) -> dict:
    """``{(draft, method): callable(prompt, max_new, settings, generator) -> (output, stats, forwards)}``."""
    import heads

    pad = target.generation_config.pad_token_id
    table = {}
    for name, model in drafts.items():
        for shape in shapes:
            tree = SHAPES[shape]
            spec = heads.attach_heads(target, kind="draft", draft_model=model, **tree)
            table[(name, shape)] = lambda p, n, settings, generator, spec=spec: (
                spec.generate(p, max_new_tokens=n, generator=generator, **settings), spec.last_stats, None)

        def assisted(p, n, settings, generator, model=model):
            counter.calls, counter.active = 0, True
            try:
                output = target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=n, assistant_model=model,
                                         pad_token_id=pad, **settings)
            finally:
                counter.active = False
            return output, None, counter.calls
        table[(name, "assisted")] = assisted
    return table


def run_temperature(target, table: dict, prompts, temperature: float, max_new: int) -> dict:
    """Per method, per prompt: seconds, new tokens, forwards, accepted lengths and phase seconds;
    plain ``generate`` timed beside every method, in a rotating order."""
    sampled = temperature > 0
    settings = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
    pad = target.generation_config.pad_token_id
    names = ["generate", *table]
    runs = {name: [] for name in names}
    for name in names:  # warm-up
        call = table.get(name)
        if call is not None:
            call(prompts[0][1], 4, settings, torch.Generator().manual_seed(0))
    for index, (mix, prompt) in enumerate(prompts):
        order = names[index % len(names):] + names[:index % len(names)]
        for name in order:
            torch.manual_seed(1000 + index)
            generator = torch.Generator().manual_seed(1000 + index)
            start = time.perf_counter()
            if name == "generate":
                output = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new,
                                         pad_token_id=pad, **settings)
                stats, forwards = None, output.shape[1] - prompt.shape[1]
            else:
                output, stats, forwards = table[name](prompt, max_new, settings, generator)
            seconds = time.perf_counter() - start
            record = {"mix": mix, "seconds": seconds, "new": output.shape[1] - prompt.shape[1], "output": output}
            if stats is not None:
                phases = stats.phases
                record.update(forwards=stats.target_forwards, accepted=list(stats.accepted_lengths),
                              draft=phases["draft"] + phases["tree"],
                              verify=sum(phases[k] for k in ("mask", "forward", "accept", "cache", "commit")))
            else:
                record["forwards"] = forwards
            runs[name].append(record)
    return runs


def alpha(accepted: list[int], depth: int) -> float:
    """Per-token acceptance of chains: accepted / (accepted + rejected) drafted tokens (a step that
    accepted fewer than ``depth`` rejected one)."""
    kept = sum(accepted)
    rejected = sum(1 for length in accepted if length < depth)
    return kept / (kept + rejected) if kept + rejected else 0.0


def summarise(runs: dict, sampled: bool) -> dict:
    plain = runs["generate"]
    step_ms = 1000 * sum(r["seconds"] for r in plain) / sum(r["new"] for r in plain)
    result = {}
    for name, records in runs.items():
        if name == "generate":
            continue
        draft, method = name
        ratios = [p["seconds"] / r["seconds"] * r["new"] / p["new"] for p, r in zip(plain, records)]
        new, forwards = sum(r["new"] for r in records), sum(r["forwards"] for r in records)
        entry = {"speedup": statistics.median(ratios), "tau": new / forwards if forwards else 0.0,
                 "tokens_per_s": new / sum(r["seconds"] for r in records)}
        if not sampled:
            entry["identical"] = all(torch.equal(p["output"], r["output"]) for p, r in zip(plain, records))
        if "accepted" in records[0]:
            accepted = [length for r in records for length in r["accepted"]]
            steps = max(1, len(accepted))
            depth = SHAPES[method]["depth"]
            entry["acceptance_by_depth"] = [sum(length > d for length in accepted) / steps for d in range(depth)]
            if method == "chain":
                entry["alpha"] = alpha(accepted, depth)
            entry["draft_ms_per_step"] = 1000 * sum(r["draft"] for r in records) / steps
            entry["verify_ms_per_step"] = 1000 * sum(r["verify"] for r in records) / steps
            entry["bound"] = entry["tau"] * step_ms / (entry["draft_ms_per_step"] + entry["verify_ms_per_step"])
        result.setdefault(draft, {})[method] = entry
    return {"generate_ms_per_token": step_ms, "drafts": result}


def best_selfdraft(entry: dict) -> tuple[str, float]:
    shape = max((s for s in SHAPES if s in entry), key=lambda s: entry[s]["speedup"])
    return shape, entry[shape]["speedup"]


def comparisons(results: dict, chosen: dict) -> dict:
    """``best_distilled_over_undistilled`` (as the issue defines it: the best distilled draft's speedup
    over the undistilled draft's, each at the temperature the distilled one was trained for; overall
    and per training temperature), per serving temperature the ranking of every draft by speedup and
    by chain tau, selfdraft against assisted generation, and the issue's goals."""
    ratios = {}
    for name, recipe in chosen.items():
        key = f"T={recipe['trained_for']:g}"
        if key not in results:
            continue
        drafts = results[key]["drafts"]
        shape, ours = best_selfdraft(drafts[name])
        base_shape, base = best_selfdraft(drafts["undistilled"])
        ratios[name] = {"temperature": recipe["trained_for"], "speedup": ours, "shape": shape,
                        "undistilled_speedup": base, "undistilled_shape": base_shape, "ratio": ours / base}
    by_trained = {}
    for name, entry in ratios.items():
        key = f"T={entry['temperature']:g}"
        if key not in by_trained or entry["ratio"] > by_trained[key]["ratio"]:
            by_trained[key] = {"draft": name, **entry}
    best = max(ratios, key=lambda n: ratios[n]["ratio"]) if ratios else None
    per_temperature, rankings, versus_assisted = {}, {}, {}
    for key, result in results.items():
        drafts = result["drafts"]
        base = best_selfdraft(drafts["undistilled"])[1]
        speeds = {name: best_selfdraft(entry)[1] for name, entry in drafts.items() if name != "undistilled"}
        taus = {name: entry["chain"]["tau"] for name, entry in drafts.items()}
        if speeds:
            top = max(speeds, key=speeds.get)
            per_temperature[key] = {"best": top, "speedup": speeds[top], "undistilled_speedup": base,
                                    "ratio": speeds[top] / base}
        rankings[key] = {"by_speedup": sorted(speeds, key=speeds.get, reverse=True),
                         "by_chain_tau": sorted(taus, key=taus.get, reverse=True)}
        versus_assisted[key] = {name: best_selfdraft(entry)[1] / entry["assisted"]["speedup"]
                                for name, entry in drafts.items()}
    goals = {f"distilled_over_undistilled_{key}": {"value": entry["ratio"], "draft": entry["draft"],
                                                   "target": 1.10, "met": entry["ratio"] >= 1.10}
             for key, entry in by_trained.items()}
    if "T=0" in versus_assisted:
        worst = min(versus_assisted["T=0"], key=versus_assisted["T=0"].get)
        goals["selfdraft_over_assisted_greedy"] = {
            "min_over_drafts": versus_assisted["T=0"][worst], "draft": worst, "target": 1.1,
            "met_for": sorted(n for n, v in versus_assisted["T=0"].items() if v >= 1.1),
            "met": versus_assisted["T=0"][worst] >= 1.1}
    best_block = {"value": ratios[best]["ratio"], "draft": best, **ratios[best]} if best else {}
    return {"best_distilled_over_undistilled": {**best_block, "per_training_temperature": by_trained,
                                                "per_draft": ratios, "per_serving_temperature": per_temperature},
            "rankings_per_temperature": rankings, "selfdraft_over_assisted": versus_assisted, "goals": goals}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    drafts = list(results[keys[0]]["drafts"])
    figure, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4.5), sharey=True, squeeze=False)
    axes = axes[0]
    methods = list(results[keys[0]]["drafts"][drafts[0]])
    width = 0.8 / len(methods)
    for axis, key in zip(axes, keys):
        entries = results[key]["drafts"]
        positions = range(len(drafts))
        for offset, method in enumerate(methods):
            axis.bar([x + (offset - (len(methods) - 1) / 2) * width for x in positions],
                     [entries[d][method]["speedup"] for d in drafts], width,
                     label=method if method != "assisted" else "transformers assisted")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(list(positions), drafts, rotation=60, ha="right", fontsize=8)
        axis.set_title(f"demo-llama, serving {key}")
    axes[0].set_ylabel("speedup over model.generate (median over prompts)")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def measure_all(args, summaries: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import heads
    from benchmarks.studies.common import machine

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    prompts = held_out_prompts(tokenizer, args.prompts)
    chosen = recipes(args.drafts)
    drafts = {"undistilled": AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()}
    for name in chosen:
        drafts[name] = heads.load_heads(target, args.drafts_dir / name).heads.model
    counter = ForwardCounter(target)
    table_ = methods(target, drafts, counter, args.shapes)
    results = {}
    for temperature in args.temperatures:
        started = time.perf_counter()
        runs = run_temperature(target, table_, prompts, temperature, args.max_new_tokens)
        results[f"T={temperature:g}"] = summarise(runs, temperature > 0)
        print(f"T={temperature:g}: measured in {time.perf_counter() - started:.0f} s", flush=True)
        rows = [{"draft": d, "method": m, **{k: v for k, v in e.items() if k in COLUMNS}}
                for d, entry in results[f"T={temperature:g}"]["drafts"].items() for m, e in entry.items()]
        print(table(rows, ["draft", "method", *COLUMNS]), flush=True)
    payload = {
        "target": "demo-llama", "draft": "demo-draft (2 layers, hidden 128)", "tau_definition": TAU_DEFINITION,
        "acceptance_definition": ACCEPTANCE_DEFINITION,
        "alpha_definition": "chains: accepted / (accepted + rejected) drafted tokens over all verify steps",
        "setup": {"prompts_per_mix": args.prompts, "mixes": ["code", "prose"], "max_new_tokens": args.max_new_tokens,
                  "shapes": {name: SHAPES[name] for name in args.shapes}, "temperatures": list(args.temperatures),
                  "sampling": "top_k 0, top_p 1",
                  "threads": torch.get_num_threads(),
                  "assisted": "model.generate(assistant_model=draft) with transformers' defaults (up to 20 tokens "
                              "per step, heuristic schedule, assistant confidence threshold 0.4)",
                  "training": {"steps": args.steps, "lr": args.lr, "batch_size": 8, "refresh": args.refresh,
                               "pool": args.pool, "max_prompts": args.max_prompts, "data": str(args.data),
                               "divergence_temperature": 1.0, "weights": "full fine-tune"}},
        "recipes": chosen,
        "training": {name: {k: v for k, v in summary.items() if k in ("final_loss", "seconds", "on_policy_tau",
                                                                         "on_policy_refreshes")}
                     | {"first_loss": summary["losses"][0]} for name, summary in summaries.items()},
        "results": results, **comparisons(results, chosen),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    best = payload["best_distilled_over_undistilled"]
    if best.get("draft"):
        print(f"best_distilled_over_undistilled {best['value']:.3f} ({best['draft']} at T={best['temperature']:g})")
    for name, goal in payload["goals"].items():
        print(f"goal {name}: {'met' if goal['met'] else 'NOT met'} {goal}")
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=RESULTS / "cache" / "train_mixed.jsonl",
                        help="training prompts (made from both mixes' training prompts when missing)")
    parser.add_argument("--cache-dir", type=Path, default=RESULTS / "cache",
                        help="cache of the target's continuations (selfdraft train --cache-dir)")
    parser.add_argument("--drafts-dir", type=Path, default=DRAFTS_DIR, help="where the distilled drafts live")
    parser.add_argument("--drafts", type=lambda text: text.split(","), default=None,
                        help="comma-separated subset of the distilled drafts (default: all)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-prompts", type=int, default=192)
    parser.add_argument("--refresh", type=int, default=20, help="on-policy pool regenerated every N steps")
    parser.add_argument("--pool", type=int, default=32, help="prompts per on-policy pool")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per mix (code, prose)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=lambda text: [float(t) for t in text.split(",")],
                        default=list(TEMPERATURES), help="serving temperatures, e.g. 0,0.7,1")
    parser.add_argument("--shapes", type=lambda text: text.split(","), default=list(SHAPES),
                        help=f"selfdraft shapes to serve, of {list(SHAPES)}")
    parser.add_argument("--out", type=Path, default=HERE / "distillspec.json", help="result JSON (PNG beside it)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 3 drafts of 4 steps, 1 prompt per mix, 16 tokens, T 0 and 1 (under "
                             "benchmarks/results/adapters/distillspec_quick)")
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--train-only", action="store_true")
    args = parser.parse_args()
    if set(args.shapes) - set(SHAPES):
        parser.error(f"--shapes: unknown {sorted(set(args.shapes) - set(SHAPES))}; choose from {list(SHAPES)}")
    if args.quick:
        args.drafts_dir = RESULTS / "adapters" / "distillspec_quick"
        args.out = args.drafts_dir / "distillspec.json"
        args.drafts = args.drafts or ["off_fkl_T0", "on_fkl_T0", "on_tvd_T1"]
        args.steps, args.max_prompts, args.refresh, args.pool, args.checkpoint_every = 4, 16, 2, 4, 2
        args.prompts, args.max_new_tokens, args.temperatures = 1, 16, [0.0, 1.0]
    torch.set_num_threads(1)
    if not args.data.is_file():
        from benchmarks.studies.common import mixed_training_file

        mixed_training_file(args.data, 96)
    summaries = train(args)
    if args.train_only:
        return
    measure_all(args, summaries)


if __name__ == "__main__":
    main()
