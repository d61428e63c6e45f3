"""Medusa speedup on the shipped target: tree-size sweep and the traffic-mix table.

Greedy, batch 1, held-out prompts of each mix, speculative and plain generation alternating in one
process (medians over prompts). Adapters are distilled with ``selfdraft train`` on the training
prompts of one mix (code, prose) or both (mixed) and cached under ``benchmarks/results/adapters``.

Reports per configuration: tokens/s each way, speedup, tau (tokens per target forward, bonus
included), acceptance by head, and the terms of the bound speedup <= tau x t(1) / (t(verify) +
t(draft)) per step. Writes ``benchmarks/results/speedup.json`` and ``speedup.png``.
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

from benchmarks.common import RESULTS, table, write_json  # noqa: E402
from benchmarks.demo import MIXES, PROMPTS, TARGET  # noqa: E402


def train_adapter(name: str, data: Path, args) -> Path:
    from training.cli import main as selfdraft

    adapter = RESULTS / "adapters" / name
    if (adapter / "adapter_config.json").is_file() and not args.retrain:
        return adapter
    selfdraft([
        "train", "--model", str(TARGET), "--data", str(data), "--out", str(adapter), "--steps", str(args.steps),
        "--batch-size", "8", "--lr", "2e-3", "--max-new-tokens", "64", "--max-length", "128",
        "--max-prompts", str(args.train_prompts * (2 if name == "mixed" else 1)),
        "--cache-dir", str(RESULTS / "cache"), "--eval-prompts", "0", "--json", str(adapter.parent / f"{name}.json"),
        "--no-progress",
    ])
    return adapter


def mixed_file(per_mix: int) -> Path:
    lines = {mix: (PROMPTS / f"train_{mix}.jsonl").read_text().splitlines()[:per_mix] for mix in MIXES}
    path = RESULTS / "cache" / "train_mixed.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(line for pair in zip(*lines.values()) for line in pair) + "\n")
    return path


def row(adapter: str, mix: str, report, tree: int) -> dict:
    steps = max(1, report.new_tokens / max(report.tau, 1e-9) - report.prompts)  # verify steps (prefills excluded)
    return {
        "adapter": adapter, "eval_mix": mix, "tree": tree, "tok/s plain": report.tokens_per_s_plain,
        "tok/s spec": report.tokens_per_s_spec, "speedup": report.speedup, "tau": report.tau,
        "accept": " ".join(f"{a:.2f}" for a in report.acceptance_by_position[:5]),
        "verify ms/step": 1000 * report.verify_seconds / steps, "draft ms/step": 1000 * report.draft_seconds / steps,
        "plain ms/token": 1000 * report.plain_seconds / max(1, report.new_tokens), "identical": report.identical,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mix in MIXES:
        sweep = [r for r in rows if r["adapter"] == "mixed" and r["eval_mix"] == mix]
        left.plot([r["tree"] for r in sweep], [r["speedup"] for r in sweep], marker="o", label=f"speedup {mix}")
        right.plot([r["tree"] for r in sweep], [r["tau"] for r in sweep], marker="o", label=f"tau {mix}")
    for axis, label in ((left, "speedup vs model.generate"), (right, "tau (tokens / target forward)")):
        axis.set_xscale("symlog", base=2)
        axis.set_xlabel("tree nodes drafted")
        axis.set_ylabel(label)
        axis.legend()
    left.axhline(1.0, color="gray", linewidth=1)
    figure.suptitle("Medusa heads on the demo target, greedy, batch 1")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="distillation steps per adapter")
    parser.add_argument("--train-prompts", type=int, default=96, help="training prompts per mix")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per mix")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--trees", type=int, nargs="+", default=[0, 8, 16, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--retrain", action="store_true", help="retrain cached adapters")
    parser.add_argument("--mixed-adapter", default=None,
                        help="use this adapter (e.g. make demo's demo-out/adapter) instead of training the mixed one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import heads
    from training.cli import _load_model
    from training.data import load_prompts
    from training.evaluate import encode_prompts, measure

    adapters = {mix: train_adapter(mix, PROMPTS / f"train_{mix}.jsonl", args) for mix in MIXES}
    adapters["mixed"] = (Path(args.mixed_adapter) if args.mixed_adapter
                         else train_adapter("mixed", mixed_file(args.train_prompts), args))
    model, tokenizer = _load_model(str(TARGET))
    prompts = {mix: encode_prompts(tokenizer, load_prompts(PROMPTS / f"{mix}.jsonl"), args.prompts) for mix in MIXES}
    traffic = []
    for trained in MIXES:
        spec = heads.load_heads(model, adapters[trained])
        for mix in MIXES:
            traffic.append(row(trained, mix, measure(spec, prompts[mix], args.max_new_tokens), spec.tree.size - 1))
            print(table([traffic[-1]], list(traffic[-1])), flush=True)
    for _ in range(1800):  # an adapter another process (make demo) is still writing
        if (adapters["mixed"] / "adapter_config.json").is_file():
            break
        time.sleep(1)
    rows = []
    spec = heads.load_heads(model, adapters["mixed"])
    default_tree = spec.tree.size - 1
    for tree in sorted(set(args.trees) | {default_tree}):
        spec.set_tree(tree)
        for mix in MIXES:
            rows.append(row("mixed", mix, measure(spec, prompts[mix], args.max_new_tokens), tree))
            print(table([rows[-1]], list(rows[-1])), flush=True)
    training = {name: json.loads((RESULTS / "adapters" / f"{name}.json").read_text())
                for name in adapters if (RESULTS / "adapters" / f"{name}.json").is_file()}
    if args.mixed_adapter and (Path(args.mixed_adapter).parent / "train.json").is_file():
        training["mixed"] = json.loads((Path(args.mixed_adapter).parent / "train.json").read_text())
    columns = ["adapter", "eval_mix", "tree", "tok/s plain", "tok/s spec", "speedup", "tau", "accept",
               "verify ms/step", "draft ms/step", "plain ms/token", "identical"]
    print("\ntree-size sweep (mixed adapter):\n" + table(rows, columns))
    print("\ntraffic mix (adapter trained on one mix, evaluated on each):\n" + table(traffic, columns))
    for name, summary in training.items():
        print(f"training {name}: {summary['tokens_per_second']:.0f} tokens/s, peak memory "
              f"{summary['peak_memory_mb']:.0f} MB, {summary['seconds']:.0f} s, final loss {summary['final_loss']:.3f}")
    memory = {}
    for share in (False, True):
        probe = heads.attach_heads(model, share_lm_head=share)
        memory["shared_lm_head" if share else "own_lm_heads"] = {
            "parameters": sum(p.numel() for p in probe.heads.parameters()),
            "megabytes_fp32": 4 * sum(p.numel() for p in probe.heads.parameters()) / 2**20,
        }
    print("head memory:", json.dumps(memory))
    path = write_json("speedup.json", {
        "target": str(TARGET), "max_new_tokens": args.max_new_tokens, "prompts_per_mix": args.prompts,
        "default_tree": default_tree, "sweep": rows, "traffic": traffic,
        "training": {n: {k: s[k] for k in ("tokens_per_second", "peak_memory_mb", "seconds", "final_loss")}
                     for n, s in training.items()},
        "head_memory": memory,
    })
    plot(rows, RESULTS / "speedup.png")
    print(f"wrote {path} and {RESULTS / 'speedup.png'}")


if __name__ == "__main__":
    main()
