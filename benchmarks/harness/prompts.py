"""The shipped targets, their prompt mixes and the fixed tuning/check split of each mix."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: method and experiment paths are relative to it."""
PROMPTS = ROOT / "benchmarks" / "targets" / "prompts"
TARGETS = {
    "stories260K": {"path": "benchmarks/targets/stories260K", "mixes": ("stories",)},
    "demo-llama": {"path": "benchmarks/targets/demo-llama", "mixes": ("code", "prose")},
    "demo-draft": {"path": "benchmarks/targets/demo-draft", "mixes": ("code", "prose")},
}
"""Target name -> its model directory and the held-out mixes it is measured on
(``targets/prompts/<mix>.jsonl``; never trained on)."""
SPLITS = ("tuning", "check")


class BenchmarkError(ValueError):
    """Bad input to the harness (an unknown name, a missing file, an impossible setting) or a
    greedy output that differs from ``generate``; the message names what is wrong."""


def mix_prompts(mix: str, split: str, count: int | None = None, directory: Path = PROMPTS) -> list[str]:
    """The first ``count`` prompt texts (None: all) of ``split`` of ``mix``: the mix's non-empty lines
    numbered from 0, even lines the ``tuning`` split, odd lines the ``check`` split. Anything tuned
    is tuned on one split and reported on the other."""
    path = directory / f"{mix}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in directory.glob("*.jsonl"))
        raise BenchmarkError(f"unknown mix {mix!r}: no {path.name} in {directory} (mixes: {', '.join(known)})")
    if split not in SPLITS:
        raise BenchmarkError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    texts = [json.loads(line)["prompt"] for line in lines][SPLITS.index(split)::2]
    if count is not None and count > len(texts):
        raise BenchmarkError(f"mix {mix!r} has {len(texts)} prompts in its {split} split; {count} asked for")
    return texts[:count]


def target_directory(name: str) -> Path:
    if name not in TARGETS:
        raise BenchmarkError(f"unknown target {name!r}: expected one of {', '.join(TARGETS)}")
    return ROOT / TARGETS[name]["path"]


TRAINING = {"code": "train_code.jsonl", "prose": "train_prose.jsonl", "stories": "stories_train.jsonl"}
"""Per mix, its training prompts (disjoint from the held-out mix)."""


def mixed_training_file(path: Path, per_mix: int, mixes: tuple[str, ...] = ("code", "prose")) -> Path:
    """The first ``per_mix`` training prompts of each of ``mixes``, interleaved, written to the jsonl
    file ``path`` (what the demo-llama adapters are distilled on)."""
    lines = [(PROMPTS / TRAINING[mix]).read_text().splitlines()[:per_mix] for mix in mixes]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(line for group in zip(*lines) for line in group) + "\n")
    return path
