"""EAGLE dynamic-tree sweep on the shipped target: which (depth, top_k, total_tokens) to default to.

Distils one EAGLE drafter with ``selfdraft train --kind eagle`` on the target's continuations of
training prompts of both mixes (cached under ``benchmarks/results/adapters/eagle-mixed``), then
generates greedily on held-out prompts of each mix for every tree shape, speculative and plain
alternating in one process (medians over prompts). Reports per shape: tokens/s each way, speedup,
tau (tokens per target forward, bonus included), acceptance by depth, and the terms of the bound
speedup <= tau x t(1) / (t(verify) + t(draft)) per step. Writes ``benchmarks/results/eagle_tree.json``
(``--results``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    MIXES, PROMPTS, RESULTS, TARGET, mixed_training_file, speed_row, table, train_adapter, training_summary, write_json,
)

SHAPES = ("4:1:4", "6:1:6", "4:2:8", "5:4:8", "3:4:12", "5:4:12", "8:4:12", "5:2:12", "5:8:12", "5:4:16",
          "5:4:24", "5:10:60")
"""depth:top_k:total_tokens; 5:10:60 is EAGLE-2's GPU default."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=250, help="distillation steps")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--unroll-steps", type=int, default=1, help="training-time-test steps")
    parser.add_argument("--train-prompts", type=int, default=200, help="training prompts per mix")
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts per mix")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="depth:top_k:total_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--retrain", action="store_true", help="retrain the cached adapter")
    parser.add_argument("--results", default="eagle_tree.json", help="file name under benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (TARGET / "model.safetensors").is_file():
        raise SystemExit(f"the shipped demo target is missing: {TARGET}")

    import heads
    from training.commands.common import load_model
    from training.prompts import load_prompts
    from training.evaluate import encode_prompts, measure

    data = mixed_training_file(RESULTS / "cache" / "train_mixed.jsonl", args.train_prompts)
    adapter = train_adapter("eagle-mixed", data, args.steps, 2 * args.train_prompts, kind="eagle", retrain=args.retrain,
                            max_new_tokens=128, max_length=192, lr=args.lr,
                            options=["--unroll-steps", str(args.unroll_steps)])
    model, tokenizer = load_model(str(TARGET))
    prompts = {mix: encode_prompts(tokenizer, load_prompts(PROMPTS / f"{mix}.jsonl"), args.prompts) for mix in MIXES}
    spec = heads.load_heads(model, adapter)
    rows = []
    for shape in args.shapes:
        depth, top_k, total = (int(part) for part in shape.split(":"))
        spec.set_tree(dict(depth=depth, top_k=top_k, total_tokens=total))
        for mix in MIXES:
            rows.append(speed_row(measure(spec, prompts[mix], args.max_new_tokens), shape=shape, eval_mix=mix))
            print(table([rows[-1]], list(rows[-1])), flush=True)
    summary = {}
    for shape in args.shapes:
        mine = [r for r in rows if r["shape"] == shape]
        summary[shape] = {"speedup": statistics.mean(r["speedup"] for r in mine),
                          "tau": statistics.mean(r["tau"] for r in mine)}
    best = max(summary, key=lambda shape: summary[shape]["speedup"])
    columns = ["shape", "eval_mix", "tok/s plain", "tok/s spec", "speedup", "tau", "acceptance_by_depth",
               "verify ms/step", "draft ms/step", "plain ms/token", "identical"]
    print("\nEAGLE tree sweep (depth:top_k:total_tokens):\n" + table(rows, columns))
    print("\nmean over mixes:\n" + table([{"shape": s, **v} for s, v in summary.items()], ["shape", "speedup", "tau"]))
    print(f"best mean speedup: {best} ({summary[best]['speedup']:.2f}x)")
    path = write_json(args.results, {
        "target": str(TARGET), "max_new_tokens": args.max_new_tokens, "prompts_per_mix": args.prompts,
        "threads": args.threads, "rows": rows, "mean_over_mixes": summary, "best": best,
        "training": training_summary("eagle-mixed"),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
