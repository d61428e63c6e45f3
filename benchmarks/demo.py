"""`make demo`: distil Medusa heads against the shipped demo target and show the speedup.

1. loads the shipped target (``benchmarks/targets/demo-llama``);
2. distils 4 Medusa heads on the target's own continuations of training prompts of both mixes
   (code and prose), with a progress bar, exactly as ``selfdraft train`` does; the generated data
   is cached under ``demo-out/cache`` so a second run reuses it;
3. generates greedily on held-out prompts of each mix with and without the heads, in one process,
   and prints tokens/s each way, speedup, tau and acceptance by head;
4. writes the adapter (``demo-out/adapter``), a JSON summary and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.harness.prompts import PROMPTS, TARGETS, mixed_training_file, target_directory  # noqa: E402

TARGET = target_directory("demo-llama")
MIXES = TARGETS["demo-llama"]["mixes"]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for offset, (mix, report) in enumerate(results.items()):
        rates = report["acceptance_by_position"]
        left.bar([i + 0.4 * offset for i in range(len(rates))], rates, width=0.4, label=mix)
    left.set_xlabel("drafted position (head)")
    left.set_ylabel("share of steps accepting it")
    left.set_title("acceptance by position")
    left.legend()
    mixes = list(results)
    right.bar(mixes, [results[m]["speedup"] for m in mixes], color=["tab:blue", "tab:orange"][: len(mixes)])
    right.axhline(1.0, color="gray", linewidth=1)
    right.set_ylabel("speedup vs model.generate (median)")
    right.set_title("wall-clock speedup, greedy, batch 1")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "demo-out"), help="output directory")
    parser.add_argument("--steps", type=int, default=150, help="distillation steps")
    parser.add_argument("--train-prompts", type=int, default=96, help="training prompts per mix")
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per mix")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (TARGET / "model.safetensors").is_file():
        raise SystemExit(f"the shipped demo target is missing: {TARGET}")

    import heads
    from training.cli import main as selfdraft
    from training.commands.common import load_model
    from training.prompts import load_prompts
    from training.evaluate import encode_prompts, measure

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    adapter = out / "adapter"
    started = time.perf_counter()
    data = mixed_training_file(out / "train_mixed.jsonl", args.train_prompts)
    print(f"distilling Medusa heads against {TARGET.name} on {2 * args.train_prompts} prompts "
          f"(continuations cached in {out / 'cache'})", flush=True)
    selfdraft([
        "train", "--model", str(TARGET), "--kind", "medusa", "--data", str(data), "--out", str(adapter),
        "--steps", str(args.steps), "--batch-size", "8", "--lr", "2e-3", "--max-new-tokens", "64",
        "--max-length", "128", "--cache-dir", str(out / "cache"), "--eval-prompts", "0",
        "--json", str(out / "train.json"),
    ])
    model, tokenizer = load_model(str(TARGET))
    spec = heads.load_heads(model, adapter)
    results = {}
    for mix in MIXES:
        prompts = encode_prompts(tokenizer, load_prompts(PROMPTS / f"{mix}.jsonl"), args.eval_prompts)
        results[mix] = measure(spec, prompts, args.max_new_tokens).to_dict()
    print(f"\n{'mix':<7}{'plain tok/s':>12}{'spec tok/s':>12}{'speedup':>9}{'tau':>6}  acceptance by head"
          f"   (greedy, batch 1, {args.max_new_tokens} new tokens, {args.eval_prompts} held-out prompts, "
          f"tree {spec.tree.size - 1} nodes)")
    for mix, report in results.items():
        heads_rates = " ".join(f"{rate:.2f}" for rate in report["acceptance_by_position"])
        print(f"{mix:<7}{report['tokens_per_s_plain']:>12.1f}{report['tokens_per_s_spec']:>12.1f}"
              f"{report['speedup']:>8.2f}x{report['tau']:>6.2f}  {heads_rates}"
              f"{'' if report['identical'] else '   OUTPUTS DIFFER'}")
    summary = {"target": str(TARGET), "adapter": str(adapter), "results": results,
               "training": json.loads((out / "train.json").read_text()),
               "seconds": time.perf_counter() - started}
    (out / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(results, out / "demo.png")
    print(f"\nadapter: {adapter}\nplot: {out / 'demo.png'}\nsummary: {out / 'demo.json'}  "
          f"({summary['seconds']:.0f} s in all)")


if __name__ == "__main__":
    main()
