"""The cost curve: seconds of one verify forward by rows and tree width, and seconds of drafting.

Every verify forward (plain steps included) teaches one table: per power-of-two rows bucket, each
width's median of its latest timings, interpolated linearly (past the widest: its cost). A bucket is
priced by its own table once plain steps are timed there, until then by the next larger one's. At one row a
width's excess over a plain step is shrunk as if one more sample had cost a plain step, its samples
weighed by age (a width timed on few steps or long ago is tried again). No width is priced above a
wider one, nor above the same width over more rows. Drafting seconds and each option's own verify
seconds are means per option and rows bucket, shrunk the same way; a request's first ``propose`` and
the extra seconds of a switch between plain and drafting are kept apart. Timings are stored divided
by the machine's speed (the median of the latest plain steps' seconds over their stored cost).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

from .acceptance import HALF_LIFE

_REFRESH = PRIOR_TIMINGS = max(1, HALF_LIFE // 16)  # steps a priced curve serves; a width's first timings

COST_HORIZON = 32
"""Latest timings a cost summarises: one step's noise (bursts of added time) does not move it, and it
follows the cache growing and the machine's load."""


class RecentTimings:
    """The latest :data:`COST_HORIZON` timings of one cost: their median where every step does the same work
    (one verify width), their mean where it varies (``varies``: a skewed spread's median understates it)."""

    __slots__ = ("samples", "count", "stamp", "varies", "_value")

    def __init__(self, varies: bool = False) -> None:
        self.samples: deque[float] = deque(maxlen=COST_HORIZON)
        self.count, self.stamp, self.varies = 0, 0, varies  # (stamp: the curve's clock at the latest sample)
        self._value: float | None = None

    def add(self, sample: float, stamp: int) -> None:
        self.samples.append(sample)
        self.count, self.stamp, self._value = self.count + 1, stamp, None

    @property
    def value(self) -> float:
        if self._value is None:
            summary = statistics.fmean if self.varies else statistics.median
            self._value = summary(self.samples) if self.samples else 0.0
        return self._value

    @property
    def evidence(self) -> int:  # samples the value rests on
        return min(self.count, COST_HORIZON)

    def shrunk(self, toward: float, now: int) -> tuple[float, float]:
        """The value as if one more sample had cost ``toward``, its samples weighed by age (halved every
        :data:`~heads.adaptive.acceptance.HALF_LIFE` steps since the latest) and by count."""
        evidence = self.evidence
        aged = evidence * 0.5 ** ((now - self.stamp) / HALF_LIFE)
        excess = self.value - toward
        return toward + excess * aged / (aged + 1), toward + excess * evidence / (evidence + 1)


_SPEED_HORIZON = COST_HORIZON // 4  # latest plain steps the speed is the median of (a plan's worth)


def rows_bucket(rows: int) -> int:
    """The power of two at or below ``rows`` (rows >= 1)."""
    return 1 << (rows.bit_length() - 1) if rows > 0 else 1


class CostCurve:
    """Verify and drafting seconds learned from the steps served (one per spec, all calls)."""

    def __init__(self) -> None:
        self.verify: dict[int, dict[int, RecentTimings]] = {}
        self.drafting, self.first_drafting = {}, {}  # per drafting option, per rows bucket: RecentTimings
        self.verify_by_option: dict[object, dict[int, RecentTimings]] = {}  # per option, per rows bucket
        self.switching = {True: RecentTimings(), False: RecentTimings()}  # a switch's extra seconds, into drafting (True)
        self.clock, self.speed = 0, 1.0  # verify forwards observed; the machine's seconds per stored second
        self._ratios: deque[float] = deque(maxlen=_SPEED_HORIZON)  # latest plain steps' seconds / stored cost
        self._curves: dict[int, tuple] = {}  # per rows bucket: what _price returned

    def observe_verify(self, rows: int, width: int, seconds: float) -> None:
        self.clock += 1
        bucket = rows_bucket(rows)
        table = self.verify.setdefault(bucket, {})
        timed = table.get(width)
        if timed is None:
            timed = table[width] = RecentTimings()
        elif width == 1 and timed.value > 0:  # (plain steps alone: see the module docstring)
            self._ratios.append(seconds / timed.value)
            self.speed = statistics.median(self._ratios)
        timed.add(seconds / self.speed, self.clock)
        if timed.count <= PRIOR_TIMINGS:  # a width's first timings move its price most: priced again now
            self._curves.pop(bucket, None)

    def observe_draft(self, rows: int, seconds: float, first: bool, mode: object = None) -> None:
        """A drafting step's seconds (``first``: a ``propose`` that catches up, kept apart)."""
        self._varying(self.first_drafting if first else self.drafting, mode, rows).add(seconds / self.speed, self.clock)

    def observe_switch(self, into_drafting: bool, extra: float) -> None:
        """The seconds a step after a switch between plain and drafting cost over a steady one."""
        self.switching[into_drafting].add(extra / self.speed, self.clock)

    def switch_seconds(self, into_drafting: bool) -> float:
        return max(0.0, self.switching[into_drafting].value) * self.speed  # (none measured: 0)

    def observe_option_verify(self, rows: int, seconds: float, option: object) -> None:
        """A drafted step's verify seconds, per drafting option as well as per width (:meth:`step_prices`)."""
        self._varying(self.verify_by_option, option, rows).add(seconds / self.speed, self.clock)

    @staticmethod
    def _varying(tables: dict, key: object, rows: int) -> RecentTimings:
        """``key``'s timings in ``rows``' bucket (a mean: the work varies), made when first needed."""
        table, bucket = tables.setdefault(key, {}), rows_bucket(rows)
        if bucket not in table:
            table[bucket] = RecentTimings(varies=True)
        return table[bucket]

    def step_prices(self, rows: int, options: list, reaches: list, drafting: bool = True) -> np.ndarray:
        """Seconds of a step of each of ``options`` over ``rows`` rows, ``[options, 2]`` (aged, unaged costs):
        drafting plus verify, the mean of its own steps (empty ones included; from :data:`PRIOR_TIMINGS`,
        shrunk toward plain), else the curve's expectation over the padded width (``reaches[option][i]``:
        its chance to reach node ``i``; lookup proposing nothing is priced near plain, not at its mean width)."""
        widths = np.arange(1.0, max(len(reach) for reach in reaches) + 1.0)
        curves = np.stack([self.verify_curve(rows, widths, aged) for aged in (True, False)])
        curves[:, 1:] -= curves[:, :-1].copy()  # (each width's seconds over the next narrower one's)
        bucket, speed, prices = rows_bucket(rows), self.speed, []
        plain = self.verify.get(bucket, {}).get(1) if self.reference(rows) in (None, bucket) else None
        for option, reach in zip(options, reaches):  # (host floats: a few options, each a few operations)
            timed = self.verify_by_option.get(option, {}).get(bucket)
            if plain is not None and timed is not None and timed.evidence >= PRIOR_TIMINGS:
                aged, steady = timed.shrunk(plain.value, self.clock)
                aged, steady = aged * speed, steady * speed
            else:
                aged, steady = (curves[:, :len(reach)] @ reach).tolist()
            if drafting and self.drafting.get(option):
                drafted = self._drafting(rows, option).shrunk(0.0, self.clock)
                aged, steady = aged + drafted[0] * speed, steady + drafted[1] * speed
            prices.append((aged, steady))
        return np.array(prices)

    @staticmethod
    def _nearest(bucket: int, tables: dict) -> int:
        return min(tables, key=lambda other: (abs(math.log2(other / bucket)), other))

    def reference(self, rows: int) -> int | None:
        """The bucket pricing ``rows`` rows: the smallest from theirs up with plain steps timed (None: none)."""
        return min((bucket for bucket, table in self.verify.items() if bucket >= rows_bucket(rows) and 1 in table
                    and table[1].evidence >= PRIOR_TIMINGS), default=None)  # (fewer rows cost no more)

    def known(self, rows: int, width: float, option: object = None) -> bool:
        """Whether a step of ``option`` over ``rows`` rows of ``width`` nodes is priced from timings in
        ``rows``' own bucket (a verify at least as wide, the option's drafting), not extrapolated."""
        bucket = rows_bucket(rows)
        return (any(other >= width for other in self.verify.get(bucket, {}))
                and (option is None or bucket in self.drafting.get(option, {})))

    def verify_curve(self, rows: int, widths: np.ndarray, aged: bool = True, stored: bool = False) -> np.ndarray | None:
        """Predicted seconds of a verify over ``rows`` rows of each of ``widths`` nodes (None: none timed yet;
        ``stored``: at speed 1); at one row each width's excess shrunk, samples weighed by age or count."""
        if not self.verify:
            return None
        bucket = self.reference(rows) or rows_bucket(rows)
        bucket = bucket if bucket in self.verify else self._nearest(bucket, self.verify)
        curve = self._curves.get(bucket)
        if curve is None or curve[0] + _REFRESH <= self.clock or curve[1].size != len(self.verify[bucket]):
            curve = self._curves[bucket] = self._price(bucket)
        return np.interp(widths, curve[1], curve[2 if aged else 3]) * (1.0 if stored else self.speed)

    def _price(self, bucket: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """``bucket``'s curve: (clock, widths timed, stored seconds with samples weighed by age, by count)."""
        table, larger, priced = self.verify[bucket], [other for other in self.verify if other > bucket], []
        timings = [table[width] for width in sorted(table)]
        widths = np.array(sorted(table), dtype=float)
        values, counts, stamps = (np.fromiter((getattr(timed, name) for timed in timings), float, len(timings))
                                  for name in ("value", "count", "stamp"))
        settled = (counts >= PRIOR_TIMINGS) | (widths == widths[0])  # (the lower envelope: none above a wider one timed often enough; one fast step must not do)
        for aged in (True, False):
            seconds, plain = values, table.get(1)
            if plain is not None and bucket == 1:  # the optimism at one row only (module docstring)
                weights = np.minimum(counts, COST_HORIZON) * (0.5 ** ((self.clock - stamps) / HALF_LIFE) if aged else 1.0)
                seconds = plain.value + (values - plain.value) * weights / (weights + 1)
                seconds[0] = plain.value
            seconds = np.minimum(seconds, np.minimum.accumulate(np.where(settled, seconds, np.inf)[::-1])[::-1])
            if larger:  # nor above the same width over more rows (a bucket's few timings may be noisy),
                # where those rows timed a width at least as large (not extrapolated)
                cap = self.verify_curve(min(larger), widths, aged, stored=True)
                seconds = np.where(widths <= max(self.verify[min(larger)]), np.minimum(seconds, cap), seconds)
                seconds = np.minimum.accumulate(seconds[::-1])[::-1]
            priced.append(seconds)
        return self.clock, widths, priced[0], priced[1]

    def verify_seconds(self, rows: int, width: int) -> float | None:
        """:meth:`verify_curve` for one width."""
        curve = self.verify_curve(rows, np.array([width]))
        return None if curve is None else float(curve[0])

    def draft_seconds(self, rows: int, mode: object = None, aged: bool = True) -> float:
        """Seconds of a steady drafting step of ``mode`` (an option) over ``rows`` rows, shrunk toward 0
        as if one more sample had cost nothing (0 before any is timed)."""
        return self._drafting(rows, mode).shrunk(0.0, self.clock)[not aged] * self.speed if self.drafting.get(mode) else 0.0

    def _drafting(self, rows: int, mode: object) -> RecentTimings:
        """``mode``'s drafting timings in ``rows``' bucket, else the nearest timed one's."""
        tables, bucket = self.drafting[mode], rows_bucket(rows)
        return tables[bucket if bucket in tables else self._nearest(bucket, tables)]

    def summary(self) -> dict:
        """Measured costs in milliseconds at the machine's current speed, for ``last_stats.speculation``."""
        def ms(tables: dict, name=lambda key: key) -> dict:
            return {name(key): {inner: round(1e3 * self.speed * timed.value, 3) for inner, timed in sorted(table.items())}
                    for key, table in tables.items()}
        return {"speed": round(self.speed, 3), "verify_ms": ms(dict(sorted(self.verify.items()))),
                "draft_ms": ms(self.drafting, str), "first_draft_ms": ms(self.first_drafting, str)}
