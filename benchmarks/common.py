"""The names ``bench_auto.py`` and ``bench_draft.py`` import from before the harness
(``benchmarks/run.py``); this module goes when they are folded into it."""

from benchmarks.harness.prompts import PROMPTS
from benchmarks.harness.report import write_json

__all__ = ["PROMPTS", "write_json"]
