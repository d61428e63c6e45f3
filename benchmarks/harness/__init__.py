"""The benchmark harness behind ``python -m benchmarks.run``: shipped targets and their prompt splits
(:mod:`.prompts`), the registry of methods (:mod:`.methods`), experiments as data files
(:mod:`.experiments`) and what a run writes (:mod:`.report`). The measurement loop itself is the
library's :func:`training.evaluate.paired_runs`, shared with ``selfdraft bench``."""
