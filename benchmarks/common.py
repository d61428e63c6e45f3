"""Helpers shared by the benchmark scripts: timing, medians, JSON results, the shipped target and
its prompt sets, adapters distilled with ``selfdraft train`` and one row per speed measurement."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = RESULTS.parent / "targets" / "demo-llama"
PROMPTS = RESULTS.parent / "targets" / "prompts"
MIXES = ("code", "prose")
TAU_DEFINITION = ("tau: tokens committed per target forward, the bonus token included, over all target forwards "
                  "of each generate call (the prefill too); plain decoding has tau 1")
ACCEPTANCE_DEFINITION = ("acceptance_by_depth[i]: share of verification steps that accepted at least i + 1 "
                         "drafted tokens (tree depth i + 1)")


def median_seconds(function: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> dict:
    return {
        "platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_json(name: str, payload: dict) -> Path:
    """Write ``payload`` (plus machine info) to ``benchmarks/results/name`` atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    os.replace(temporary, path)
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(value):
        if isinstance(value, list):
            return " ".join(f"{item:.2f}" for item in value)
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def mixed_training_file(path: Path, per_mix: int) -> Path:
    """Interleave the first ``per_mix`` training prompts of each mix into the jsonl file ``path``."""
    lines = {mix: (PROMPTS / f"train_{mix}.jsonl").read_text().splitlines()[:per_mix] for mix in MIXES}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(line for pair in zip(*lines.values()) for line in pair) + "\n")
    return path


def train_adapter(name: str, data: Path, steps: int, max_prompts: int, kind: str = "medusa",
                  options: Sequence[str] = (), retrain: bool = False, max_new_tokens: int = 64,
                  max_length: int = 128, lr: float = 2e-3) -> Path:
    """Distil an adapter on the shipped target with ``selfdraft train`` (batch 8, the target's greedy
    continuations cached under ``results/cache``) into ``results/adapters/name``, its training
    summary into ``results/adapters/name.json``; an adapter already there is reused unless ``retrain``."""
    from training.cli import main as selfdraft

    adapter = RESULTS / "adapters" / name
    if (adapter / "adapter_config.json").is_file() and not retrain:
        return adapter
    selfdraft([
        "train", "--model", str(TARGET), "--kind", kind, "--data", str(data), "--out", str(adapter),
        "--steps", str(steps), "--batch-size", "8", "--lr", str(lr), "--max-new-tokens", str(max_new_tokens),
        "--max-length", str(max_length), "--max-prompts", str(max_prompts), "--cache-dir", str(RESULTS / "cache"),
        "--eval-prompts", "0", "--json", str(adapter.parent / f"{name}.json"), "--no-progress", *options,
    ])
    return adapter


def training_summary(name: str) -> dict | None:
    """The ``selfdraft train`` summary of adapter ``name`` without its per-step curves (None: absent)."""
    path = RESULTS / "adapters" / f"{name}.json"
    if not path.is_file():
        return None
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in ("losses", "agreement")}


def speed_row(report, **labels) -> dict:
    """One table row of a :class:`training.evaluate.SpeedReport`: ``labels`` first, then tokens/s each
    way, speedup, tau, acceptance by depth and the per-step terms of the bound
    speedup <= tau x t(plain token) / (t(verify) + t(draft))."""
    steps = max(1.0, report.new_tokens / max(report.tau, 1e-9) - report.prompts)  # verify steps (prefills excluded)
    return {
        **labels, "tok/s plain": report.tokens_per_s_plain, "tok/s spec": report.tokens_per_s_spec,
        "speedup": report.speedup, "tau": report.tau, "acceptance_by_depth": list(report.acceptance_by_position),
        "verify ms/step": 1000 * report.verify_seconds / steps, "draft ms/step": 1000 * report.draft_seconds / steps,
        "plain ms/token": 1000 * report.plain_seconds / max(1, report.new_tokens), "identical": report.identical,
    }


@torch.no_grad()
def bare_verify_ms(spec, prompt_length: int, sizes=(1, 2, 4, 8, 12, 16, 24, 32, 48), repeats: int = 5) -> dict:
    """Bare forward cost (ms) of ``n`` new tokens on a cache of ``prompt_length`` (a chain: the
    mask's shape, not its content, sets the cost)."""
    from heads.backbone import inspect_backbone
    from tree_attention import cache as cache_ops
    from tree_attention.mask import additive_mask, prefill_attention_mask

    target = inspect_backbone(spec.backbone)
    vocab = target.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_length))
    cache = cache_ops.new_cache()
    target.forward(prompt, torch.arange(prompt_length)[None],
                   prefill_attention_mask(prompt_length, target.layout, target.dtype, "cpu"), cache, "last")
    costs = {}
    for size in sizes:
        tokens = torch.randint(0, vocab, (1, size))
        positions = torch.arange(prompt_length, prompt_length + size)[None]
        visible = torch.ones(1, size, prompt_length + size, dtype=torch.bool).tril_(prompt_length)
        mask = additive_mask(visible, target.dtype)
        if isinstance(target.layout, dict):
            mask = {kind: mask for kind in target.layout}
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            target.forward(tokens, positions, mask, cache, "all")
            times.append(time.perf_counter() - start)
            cache_ops.crop(cache, prompt_length)
        costs[size] = 1000 * statistics.median(times[1:])
    return costs


def bare_call_seconds(stats, verify_ms: dict, prefill_seconds: float) -> float | None:
    """What a loop with no work of its own would take for the call ``stats`` describes: ``generate``'s
    own prefill of the prompt (``prefill_seconds``), the drafter's time in the loop, and a bare verify
    forward of each step's tree width (``verify_ms``: ms by width, interpolated). None for a call
    without steps (``speculate="auto"`` handing the call to ``generate``).

    ``speedup / (plain seconds / this)`` = ``this / the call's seconds`` is the loop's efficiency; with
    no prefill and one tree width throughout it is the issue's ``speedup / (tau x t_generate_step /
    (t_draft + t_verify_bare))``. Unlike that form it neither charges the prompt's forward (which no
    loop can speed up) to the loop nor prices trees of varying width at the mean width (the verify
    cost is concave in the width, so that flatters lookup, whose trees run from 1 to 40 nodes)."""
    if not stats.steps or "draft" not in stats.phases:
        return None
    verify = sum(interpolate(verify_ms, step.width) for step in stats.steps) / 1000
    return prefill_seconds + stats.phases["draft"] + verify


def interpolate(costs: dict, size: float) -> float:
    sizes = sorted(costs)
    if size <= sizes[0]:
        return costs[sizes[0]]
    for low, high in zip(sizes, sizes[1:]):
        if size <= high:
            return costs[low] + (costs[high] - costs[low]) * (size - low) / (high - low)
    return costs[sizes[-1]] * size / sizes[-1]
