"""What a run reports and writes: per method a summary of its paired runs, the result JSON, the plot
and the index ``benchmarks/results/README.md``."""

from __future__ import annotations

import json
import os
import platform
import random
import re
import statistics
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from .prompts import ROOT

RESULTS = ROOT / "benchmarks" / "results"
DEFINITIONS = {
    "speedup": "median over batches of the seconds per new token of generate over the method's (same batch)",
    "speedup_interval_90": "90% percentile-bootstrap interval of that median",
    "tau": "new tokens per target forward and row, bonus token and prefill included, over all calls",
    "acceptance_by_position": "share of verify steps that accepted at least i + 1 drafted tokens, per depth i",
    "draft_ms_per_step": "ms per verify step in the drafter and cutting its tree (DecodeStats.phases draft, tree)",
    "verify_ms_per_step": "ms per verify step in the mask, the target forward, acceptance, cache and commit",
    "plan_ms_per_step": "ms per verify step in speculate='auto''s planner (DecodeStats.phases plan)",
}
DRAFT_PHASES = ("draft", "tree")
VERIFY_PHASES = ("mask", "forward", "accept", "cache", "commit")
LEGACY = {"auto": "benchmarks/bench_auto.py (benchmarks/auto_grid.sh)", "demo": "make demo (benchmarks/demo.py)"}
"""Result files not written by the harness, by name prefix: the script that writes them."""


def bootstrap_median(values: list[float], draws: int = 1000, seed: int = 0) -> list[float]:
    """A 90% percentile-bootstrap interval ``[low, high]`` of the median of ``values``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return [medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]]


def summarise(runs: list, baseline: list) -> dict:
    """One method's :class:`training.evaluate.Run` per batch against ``generate``'s on the same batches."""
    speedups = [(plain.seconds / max(1, plain.new_tokens)) / (run.seconds / max(1, run.new_tokens))
                for plain, run in zip(baseline, runs)]
    summary = {"speedup": statistics.median(speedups), "speedup_interval_90": bootstrap_median(speedups),
               "per_batch": [round(value, 4) for value in speedups],
               "tokens_per_s": sum(run.new_tokens for run in runs) / sum(run.seconds for run in runs)}
    stats = [run.stats for run in runs if run.stats is not None]
    if stats:
        from training.evaluate import acceptance_by_position

        steps = max(1, sum(s.target_forwards - 1 for s in stats))  # verify forwards: the prefills left out
        draft = sum(s.phases.get(phase, 0.0) for s in stats for phase in DRAFT_PHASES)
        verify = sum(s.phases.get(phase, 0.0) for s in stats for phase in VERIFY_PHASES)
        plan = sum(s.phases.get("plan", 0.0) for s in stats)
        summary.update(
            tau=sum(s.new_tokens for s in stats) / max(1, sum(s.row_forwards for s in stats)),
            acceptance_by_position=acceptance_by_position(stats),
            draft_ms_per_step=1000 * draft / steps, verify_ms_per_step=1000 * verify / steps,
            plan_ms_per_step=1000 * plan / steps,
        )
        if stats[-1].speculation is not None:
            summary["last_speculation"] = stats[-1].speculation
    return summary


def leaders(summaries: dict, selfdraft: set[str]) -> dict:
    """The fastest selfdraft method and the fastest peer (transformers' prompt lookup or assisted
    generation) of a cell by median speedup, and the ratio of the two (when both ran)."""
    best = {}
    for key, names in (("best_selfdraft", selfdraft), ("best_peer", set(summaries) - selfdraft - {"generate"})):
        if names:
            name = max(names, key=lambda n: summaries[n]["speedup"])
            best[key] = {"name": name, "speedup": summaries[name]["speedup"]}
    if len(best) == 2:
        best["best_over_best_peer"] = best["best_selfdraft"]["speedup"] / best["best_peer"]["speedup"]
    return best


def git_commit() -> str:
    """HEAD's short hash, ``+changes`` when tracked files differ from it ("unknown" outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def write_json(name: str, payload: dict, directory: Path = RESULTS) -> Path:
    """``payload`` with ``machine`` (:func:`machine`) written to ``directory/name`` atomically."""
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    os.replace(temporary, path)
    return path


def describe_machine(entry: dict | None) -> str:
    if not entry:
        return "-"
    where = entry.get("cuda") or f"{entry.get('cpus')} CPUs {entry.get('processor') or ''}".strip()
    return f"{where}, torch {entry.get('torch')}, {entry.get('threads')} thread(s)"


def _last_commit(path: Path) -> tuple[str, str]:
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h %cs", "--", str(path)], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
    return (out[0], out[1]) if len(out) == 2 else ("uncommitted", "-")


def index_line(path: Path, directory: Path) -> str:
    name = path.relative_to(directory).as_posix() + ("/" if path.is_dir() else "")
    source = path if path.suffix == ".json" else path.with_suffix(".json")
    payload = {}
    if source.is_file():
        try:
            payload = json.loads(source.read_text())
        except ValueError:
            payload = {}
    run = payload.get("run") if isinstance(payload, dict) else None
    if run:
        return (f"| `{name}` | {run['experiment']} | `{run['command']}` | {run['commit']} | {run['date']} | "
                f"{describe_machine(payload.get('machine'))} |")
    commit, date = _last_commit(path)
    script = next((script for prefix, script in LEGACY.items() if name.startswith(prefix)), "not the harness")
    return f"| `{name}` | - | {script} | {commit} (committed) | {date} | {describe_machine(payload.get('machine'))} |"


def write_index(directory: Path = RESULTS) -> Path:
    """``directory/README.md``: one line per result file (a folder counts as one) with the experiment,
    the command that made it, the commit it ran on, its date and machine."""
    lines = ["# Benchmark results", "",
             "The latest run of each experiment (`python -m benchmarks.run EXPERIMENT`, see "
             "[docs/benchmarks.md](../../docs/benchmarks.md)); this index is rewritten by every run.", "",
             "| file | experiment | command | commit | date (UTC) | machine |", "| --- | --- | --- | --- | --- | --- |"]
    entries = sorted(p for p in directory.iterdir() if p.name != "README.md" and not p.name.endswith(".tmp")
                     and p.name not in ("adapters", "cache"))
    lines += [index_line(path, directory) for path in entries]
    path = directory / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_record(experiment: str, command: str, seconds: float) -> dict:
    return {"experiment": experiment, "command": command, "commit": git_commit(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "seconds": round(seconds, 1)}


def label(name: str) -> str:
    """A method's name with its directories shortened to their last part (for tables and plots)."""
    return re.sub(r"[\w.\-]*/", "", name)


def table(cell: dict) -> str:
    """A cell's methods as text rows: speedup, its interval, tau and acceptance by depth."""
    rows = [f"{'method':<58}{'speedup':>9}{'90% interval':>15}{'tau':>7}  acceptance by depth"]
    for name, entry in cell["methods"].items():
        low, high = entry["speedup_interval_90"]
        tau = f"{entry['tau']:.2f}" if "tau" in entry else "-"
        rates = " ".join(f"{rate:.2f}" for rate in entry.get("acceptance_by_position", [])[:6])
        rows.append(f"{label(name)[-57:]:<58}{entry['speedup']:>8.2f}x{f'{low:.2f}-{high:.2f}':>15}{tau:>7}  {rates}")
    if "best_over_best_peer" in cell:
        ours, peer = label(cell["best_selfdraft"]["name"]), label(cell["best_peer"]["name"])
        rows.append(f"best selfdraft / best peer: {cell['best_over_best_peer']:.2f} ({ours} against {peer})")
    return "\n".join(rows)


def plot(cells: list[dict], path: Path) -> Path | None:
    """One panel per target and mix: speedup over ``generate`` per method, one bar per temperature
    and batch size. None (and a printed line) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[plot]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((cell["target"], cell["mix"]) for cell in cells))
    figure, axes = plt.subplots(1, len(panels), figsize=(max(5.0, 0.5 * _width(cells)) * len(panels), 4.5),
                                squeeze=False)
    for axis, (target, mix) in zip(axes[0], panels):
        mine = [cell for cell in cells if (cell["target"], cell["mix"]) == (target, mix)]
        methods = [name for name in mine[0]["methods"] if name != "generate"]
        width = 0.8 / len(mine)
        for offset, cell in enumerate(mine):
            axis.bar([i + offset * width for i in range(len(methods))],
                     [cell["methods"][name]["speedup"] for name in methods], width,
                     label=f"T={cell['temperature']:g}, batch {cell['batch']}")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(methods))],
                        [label(name) for name in methods], rotation=60, ha="right", fontsize=7)
        axis.set_title(f"{target} / {mix}", fontsize=9)
        axis.set_ylabel("speedup over generate (median)")
    handles, names = axes[0][0].get_legend_handles_labels()  # every panel has the same temperatures and batches
    figure.legend(handles, names, loc="upper center", ncol=min(len(names), 6), fontsize=7)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.06 * -(-len(names) // 6)))  # room for the legend's rows
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _width(cells: list[dict]) -> int:
    return max(len(cell["methods"]) for cell in cells)
