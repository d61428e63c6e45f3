"""The block drafter against Medusa and EAGLE, each trained with ``selfdraft train``'s defaults and
the same step budget, served side by side (issue: "More accepted tokens per unit of drafting cost").

Per target (stories260K on ``stories_train.jsonl``; demo-llama on the first ``--per-mix`` training
prompts of code and prose, interleaved) the study trains, with the command line and nothing but the
kind's flags: ``--kind medusa``, ``--kind eagle --for hf`` (parallel heads, drafting auto),
``--kind eagle`` (the exportable EAGLE-3 layout, sequential) and ``--kind eagle --for hf
--parallel-mode block``, every kind the same steps (:data:`STEPS` per target, or ``--steps``; adapters cached under
``benchmarks/results/adapters/block-study/``, ``--retrain`` to redo them). Then the benchmark harness
(``python -m benchmarks.run``: paired, rotating order, one process, greedy outputs checked identical)
serves them and ``generate`` on the chosen split (:data:`SERVING`); each target's tables go to
``runs/<target>/`` beside this script (latest only).

    python -m benchmarks.studies.block_drafter.bench_block --targets stories260K demo-llama
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.prompts import PROMPTS, ROOT, mixed_training_file
from benchmarks.harness.report import RESULTS

HERE = Path(__file__).resolve().parent
ADAPTERS = RESULTS / "adapters" / "block-study"
KINDS = {
    "medusa": ["--kind", "medusa"],
    "eagle-hf": ["--kind", "eagle", "--for", "hf"],
    "eagle": ["--kind", "eagle"],
    "block": ["--kind", "eagle", "--for", "hf", "--parallel-mode", "block"],
    "block-k8": ["--kind", "eagle", "--for", "hf", "--parallel-mode", "block", "--parallel", "8"],
}
TARGETS = {"stories260K": ("stories",), "demo-llama": ("code", "prose")}
STEPS = {"stories260K": 300, "demo-llama": 150}
"""Training steps per target (the shipped adapters' budgets: a demo-llama step costs about 15 times a
stories260K one on a CPU core)."""


def training_data(target: str, per_mix: int) -> Path:
    if target == "stories260K":
        return PROMPTS / "stories_train.jsonl"
    return mixed_training_file(ADAPTERS / "demo-llama-train.jsonl", per_mix)


def train(target: str, kind: str, args) -> Path:
    """The cached adapter of ``kind`` on ``target`` (trained with the command line when missing)."""
    out = ADAPTERS / f"{target}-{kind}"
    if (out / "adapter_model.safetensors").exists() and not args.retrain:
        return out
    command = [sys.executable, "-m", "training.cli", "train", "--model", str(ROOT / "benchmarks/targets" / target),
               "--data", str(training_data(target, args.per_mix)), "--steps", str(args.steps or STEPS[target]),
               "--out", str(out),
               *KINDS[kind]]
    print("training:", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


SERVING = {"stories260K": {"temperatures": [0.0, 0.7], "prompts": 20, "max_new_tokens": 128},
           "demo-llama": {"temperatures": [0.0], "prompts": 12, "max_new_tokens": 96}}
"""Cells served per target: the temperatures, prompts per mix and tokens per prompt."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=sorted(TARGETS))
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=["medusa", "eagle-hf", "block"],
                        help="default: medusa eagle-hf block (the README's demo-llama runs add block-k8)")
    parser.add_argument("--steps", type=int, default=None, help="training steps, every kind alike (default: STEPS)")
    parser.add_argument("--per-mix", type=int, default=92, help="demo-llama training prompts per mix")
    parser.add_argument("--split", choices=("tuning", "check"), default="check")
    parser.add_argument("--retrain", action="store_true")
    args = parser.parse_args(argv)
    if (args.steps is not None and args.steps < 1) or args.per_mix < 1:
        parser.error("--steps and --per-mix must be at least 1")
    for target in args.targets:
        adapters = [train(target, kind, args) for kind in args.kinds]
        cells = SERVING[target]
        command = [sys.executable, "-m", "benchmarks.run", "kinds", "--target", target, "--mix", *TARGETS[target],
                   "--temperature", *[str(value) for value in cells["temperatures"]], "--split", args.split,
                   "--prompts", str(cells["prompts"]), "--max-new-tokens", str(cells["max_new_tokens"]),
                   "--out", str((HERE / "runs" / target).relative_to(ROOT)), "--method", "generate",
                   *[str(path.relative_to(ROOT)) for path in adapters]]  # (relative: the run's record names them)
        subprocess.run(command, check=True, cwd=ROOT)  # -> runs/<target>/kinds.json, .png, README.md
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
