"""Helpers shared by the benchmark scripts: timing, medians, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"


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
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)
