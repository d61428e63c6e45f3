"""What several studies use: the demo target, definitions of the reported figures, a text table and
a median timer. Results of a study are written into its own folder (``write_json(name, payload, HERE)``)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from benchmarks.harness.prompts import PROMPTS, ROOT, mixed_training_file
from benchmarks.harness.report import RESULTS, machine, write_json

__all__ = ["ACCEPTANCE_DEFINITION", "MIXES", "PROMPTS", "RESULTS", "ROOT", "TARGET", "TAU_DEFINITION", "machine",
           "median_seconds", "mixed_training_file", "table", "write_json"]

TARGET = ROOT / "benchmarks" / "targets" / "demo-llama"
MIXES = ("code", "prose")
TAU_DEFINITION = ("tau: tokens committed per target forward, the bonus token included, over all target forwards "
                  "of each generate call (the prefill too); plain decoding has tau 1")
ACCEPTANCE_DEFINITION = ("acceptance_by_depth[i]: share of verification steps that accepted at least i + 1 "
                         "drafted tokens (tree depth i + 1)")


def median_seconds(function: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``repeats`` calls of ``function`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(rows: list[dict], columns: list[str]) -> str:
    """``rows`` as aligned text columns (floats to 3 places, lists of floats to 2)."""
    def cell(value):
        if isinstance(value, list):
            return " ".join(f"{item:.2f}" for item in value)
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)
