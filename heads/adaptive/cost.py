"""The cost curve: seconds of one verify forward by rows and tree width, and seconds of drafting.

Verify cost depends on the rows a step decodes and the nodes it verifies per row, not on which
drafter proposed them, so every verify forward the loop runs (plain steps included) teaches the
same table. Rows are kept in power-of-two buckets; within a bucket each width is the median of its
latest timings,
and a width never verified is priced by interpolating its measured neighbours linearly in the width
(for a cost that grows with the width, cheaper than any interpolation in a concave function of it,
such as ``log2(width)``, so an unmeasured width in between is tried rather than written off), and past
the widest measured width at that width's cost (optimistic: a wider tree is tried once, then known).
A width's excess cost over a plain step counts as if it had one more sample at the plain cost, so a
width written off on one noisy step is tried again, and the estimate converges as samples come; and
no width is priced above a wider one (the lower envelope): timing noise on a shared machine only ever
adds time, and verifying more nodes never costs less.
Drafting cost is kept per rows bucket for a drafter's steady steps; a request's first ``propose``
(the drafter catching up on the prompt) is kept apart and never charged to a step's choice.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

COST_HORIZON = 32
"""Latest observations a cost is the median of: enough that one step's timing noise (a shared
machine only ever adds time, in bursts) does not move it, few enough to follow the cache growing and
the machine's load changing."""


class RecentMedian:
    """The median of the latest :data:`COST_HORIZON` samples (robust to bursts of timing noise, where
    a mean is not: one slow step must not write off a tree size)."""

    __slots__ = ("samples", "count", "_value")

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=COST_HORIZON)
        self.count = 0
        self._value: float | None = None

    def add(self, sample: float) -> None:
        self.samples.append(sample)
        self.count += 1
        self._value = None

    @property
    def value(self) -> float:
        if self._value is None:
            self._value = statistics.median(self.samples) if self.samples else 0.0
        return self._value


def rows_bucket(rows: int) -> int:
    """The power of two at or below ``rows`` (rows >= 1)."""
    return 1 << (rows.bit_length() - 1) if rows > 0 else 1


class CostCurve:
    """Verify and drafting seconds learned from the steps served (one per spec, all calls)."""

    def __init__(self) -> None:
        self.verify: dict[int, dict[int, RecentMedian]] = {}
        self.drafting: dict[str | None, dict[int, RecentMedian]] = {}  # per drafting mode, per rows bucket
        self.first_drafting: dict[str | None, dict[int, RecentMedian]] = {}
        self._curves: dict[int, list] = {}  # per bucket: widths, seconds, width -> index, envelope

    def observe_verify(self, rows: int, width: int, seconds: float) -> None:
        bucket = rows_bucket(rows)
        table = self.verify.setdefault(bucket, {})
        mean = table.get(width)
        if mean is None:
            mean = table[width] = RecentMedian()
            self._curves.pop(bucket, None)
        mean.add(seconds)
        if bucket in self._curves:  # keep the interpolation table in step (widths unchanged)
            if width == 1:  # every width is priced against the plain step
                for other in self.verify[bucket]:
                    self._price(bucket, other)
            else:
                self._price(bucket, width)

    def observe_draft(self, rows: int, seconds: float, first: bool, mode: str | None = None) -> None:
        """A drafting step's seconds (``first``: a request's first ``propose``, kept apart)."""
        table = (self.first_drafting if first else self.drafting).setdefault(mode, {})
        table.setdefault(rows_bucket(rows), RecentMedian()).add(seconds)

    def _table(self, rows: int, tables: dict) -> object | None:
        """The table of ``rows``' bucket, else the nearest measured bucket's (None: nothing measured)."""
        bucket = rows_bucket(rows)
        if bucket in tables:
            return tables[bucket]
        if not tables:
            return None
        return tables[min(tables, key=lambda other: (abs(math.log2(other / bucket)), other))]

    def knows_plain(self, rows: int) -> bool:
        """Whether a plain step (width 1) has been timed in ``rows``' bucket."""
        return 1 in self.verify.get(rows_bucket(rows), {})

    def verify_curve(self, rows: int, widths: np.ndarray) -> np.ndarray | None:
        """Predicted seconds of a verify forward over ``rows`` rows of each of ``widths`` nodes per
        row (None: no verify forward timed yet)."""
        bucket = rows_bucket(rows)
        if bucket not in self.verify:
            if not self.verify:
                return None
            bucket = min(self.verify, key=lambda other: (abs(math.log2(other / rows_bucket(rows))), other))
        curve = self._curves.get(bucket)
        if curve is None:
            table = self.verify[bucket]
            measured = sorted(table)
            curve = self._curves[bucket] = [np.array(measured, dtype=float), np.zeros(len(measured)),
                                            {width: index for index, width in enumerate(measured)}, None]
            for width in measured:
                self._price(bucket, width)
        if curve[3] is None:  # the lower envelope: no width priced above a wider one
            curve[3] = np.minimum.accumulate(curve[1][::-1])[::-1]
        return np.interp(widths, curve[0], curve[3])

    def _price(self, bucket: int, width: int) -> None:
        """Set ``width``'s entry of ``bucket``'s curve: its median, its excess over the plain step's cost
        shrunk as if one more sample had cost what a plain step costs (a width timed on few steps,
        perhaps noisy ones, is tried again before it is written off)."""
        table, curve = self.verify[bucket], self._curves[bucket]
        mean = table[width]
        plain = table.get(1)
        value = mean.value
        if plain is not None and width != 1:
            count = min(mean.count, COST_HORIZON)
            value = plain.value + (mean.value - plain.value) * count / (count + 1)
        curve[1][curve[2][width]] = value
        curve[3] = None

    def verify_seconds(self, rows: int, width: int) -> float | None:
        """:meth:`verify_curve` for one width."""
        curve = self.verify_curve(rows, np.array([width]))
        return None if curve is None else float(curve[0])

    def draft_seconds(self, rows: int, mode: str | None = None) -> float:
        """Predicted seconds of one steady drafting step in ``mode`` over ``rows`` rows (0 before
        any is timed: optimistic, so the mode gets tried)."""
        table = self._table(rows, self.drafting.get(mode, {}))
        return 0.0 if table is None else table.value

    def summary(self) -> dict:
        """Measured costs in milliseconds, for ``last_stats.speculation``."""
        return {"verify_ms": {bucket: {width: round(1e3 * mean.value, 3) for width, mean in sorted(table.items())}
                              for bucket, table in sorted(self.verify.items())},
                "draft_ms": {str(mode): {bucket: round(1e3 * mean.value, 3) for bucket, mean in sorted(table.items())}
                             for mode, table in self.drafting.items()},
                "first_draft_ms": {str(mode): {bucket: round(1e3 * mean.value, 3) for bucket, mean in sorted(table.items())}
                                   for mode, table in self.first_drafting.items()}}
