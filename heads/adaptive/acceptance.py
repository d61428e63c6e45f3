"""Calibrated acceptance: how many tokens a prefix of a step's tree is expected to commit.

A row commits its accepted path plus one token, so a tree's expected accepted length is the sum over
its nodes of the chance each is on the path. Per node index (parents before children, better
candidates first) the model counts how often the node existed in a row's tree (all are verified) and
was on the accepted path. A prefix of node order is itself a tree whose nodes are accepted as in the
whole tree, so each drafted step shows what every smaller nested size would have got. Evidence and
the prior (the acceptance by depth recorded at save time) fade with a half-life in steps, and choices
use an upper confidence bound on a prefix's total, so no size is locked out by a few early steps. At
a request's start earlier requests' evidence is weighed by how much requests differ; the rows left
when others finish (those that accepted least) are priced by their rows bucket's own steps as well."""
from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch

HALF_LIFE = 64
"""Steps after which a step's evidence counts half: a few replies' worth; a plain stretch reopens choices."""

CONFIDENCE = 1.0
"""Standard errors added to an option's expected accepted tokens (an upper confidence bound): an option
seen on few rows, or long ago, is tried again before it is written off."""

PRIOR_STEPS = 4.0
"""Steps' worth of weight of a prior: the recorded (or uninformed) acceptance; pooled rates over fewer rows."""

UNINFORMED = 0.5
"""Prior chance that a drafted token is accepted, given its parent was, when the adapter recorded no
acceptance (lookup, untrained drafters): the accepted path reaches depth ``d`` with ``UNINFORMED ** d``."""

_REQUESTS = 32  # earlier requests the spread of acceptance between requests is measured over
_RESCALE = 1e-150  # the running weight is folded back into the counts below this (float64 range)
_REFRESH = max(1, HALF_LIFE // 8)  # fades between refreshes of the estimates (weights move < 9%)


class AcceptanceModel:
    """Per-node acceptance under one acceptance rule and sampling setting. Counts are host numpy arrays;
    fading is a running weight (a step adds ``1 / scale``, a count's faded value is ``stored x scale``)."""

    def __init__(self, prior_by_depth: Sequence[float] = (), width: int = 1) -> None:
        """``width``: the widest tree the drafter is configured to propose (root included)."""
        self.prior_by_depth = [float(rate) for rate in prior_by_depth]
        # held_ends[j]: rows whose tree held nodes 0 .. j and no more, asked_ends[j]: rows of drafted steps whose
        # tree could (stored, see scale): a step adds to one entry; node i's rows are the tail sum from i
        self.held_ends, self.asked_ends, self.on_path = np.zeros(0), np.zeros(0), np.zeros(0)  # on_path: rows accepting i
        self.by_rows: dict[int, np.ndarray] = {}  # per rows bucket (a power of two): [2, width] its steps' held_ends, on_path
        self.prior_on, self.prior_seen = np.zeros(0), np.zeros(0)  # prior pseudo-counts (stored, fading as the counts)
        self.scale = 1.0  # faded value = stored x scale
        self.width = max(1, width)  # the widest tree proposed (root included), at least the configured one
        self.steps, self.rows_seen = 0, 0  # drafted steps and their rows observed (unfaded)
        self._pending: list[tuple] = []  # (weight, trees, paths, lengths, capacity) of steps not yet counted
        self._request = [0.0, 0]  # this request's rows whose tree held node 1: accepted, held (unfaded)
        self._requests: deque[tuple[float, int]] = deque(maxlen=_REQUESTS)  # earlier ones': (rate, rows)
        self._cache: tuple[np.ndarray, ...] | None = None  # what _estimates returns, and their prefix sums
        self._faded = 0  # fades since the estimates were computed
        self._reach: dict[int, np.ndarray] = {}  # per rows: the chance the padded trees reach node i
        self._decay = 0.5 ** (1.0 / HALF_LIFE)
        self._grow(self.width)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.held_ends, self.on_path, self.asked_ends, self.prior_on, self.prior_seen

    def _grow(self, width: int) -> None:
        if (grow := width - self.on_path.size) > 0:
            self.held_ends, self.on_path, self.asked_ends, self.prior_on, self.prior_seen = (
                np.concatenate([array, np.zeros(grow)]) for array in self._arrays())
            self.by_rows = {bucket: np.pad(own, ((0, 0), (0, grow))) for bucket, own in self.by_rows.items()}

    def fade(self) -> None:
        """One step passed (any step): earlier evidence counts a little less."""
        self.scale *= self._decay
        if self.scale < _RESCALE:
            self._count()  # (pending steps carry weights of the current scale)
            for array in (*self._arrays(), *self.by_rows.values()):
                array *= self.scale
            self.scale, self._cache = 1.0, None
        self._faded += 1
        self._cache = None if self._faded >= _REFRESH else self._cache  # (the bounds moved enough)

    def observe(self, trees, paths: torch.Tensor, lengths: torch.Tensor, capacity: int | None = None) -> None:
        """One drafted step, counted when the estimates are next read: the trees verified (roots alone where
        nothing was proposed), ``paths`` ``[R, L]`` accepted node indices, ``lengths`` ``[R]`` (root included),
        ``capacity``: the most nodes the drafter was asked for (beyond: neither proposed nor missing)."""
        self.width = max(self.width, trees.width)
        self.rows_seen += trees.rows
        self._pending.append((1.0 / self.scale, trees, paths, lengths, capacity))
        self.steps += 1
        self._cache = None

    def new_request(self) -> float | None:
        """A new request begins: earlier requests' evidence becomes its prior, rates kept, worth at most the
        empirical-Bayes weight of the first node's acceptance (rows): a row's variance within a request over
        the variance of the requests' true rates. Where requests differ its own steps take over within a few;
        where they are alike the evidence stands. Returns the weight (None: no cut, < 3 requests, no spread)."""
        self._count()
        accepted, held = self._request
        if held > 0:
            self._requests.append((accepted / held, held))
        self._request = [0.0, 0]
        if len(self._requests) < 3:
            return None
        rates, counts = np.array(self._requests).T
        within = max(float(rates.mean() * (1.0 - rates.mean())), 1e-6)
        between = float(rates.var(ddof=1)) - within * float((1.0 / counts).mean())
        if between <= 0.0:
            return None
        rows = max(1.0, within / between)
        held = _tail_sums(self.held_ends)
        cut = np.minimum(1.0, rows / np.maximum((held + self.prior_seen) * self.scale, 1e-300))
        self.held_ends, self.asked_ends = _ends(held * cut), _ends(_tail_sums(self.asked_ends) * cut)
        for array in (self.on_path, self.prior_on, self.prior_seen):
            array *= cut
        for own in self.by_rows.values():
            own[0], own[1] = _ends(_tail_sums(own[0]) * cut), own[1] * cut
        self._cache = None
        return rows

    def _count(self) -> None:
        """Count the pending steps: the nodes each row's tree held (all verified) and its accepted path."""
        if not self._pending:
            return
        self._grow(self.width)  # (the widest tree observed: every pending one fits)
        held_ends, asked_ends, on_path, request = self.held_ends, self.asked_ends, self.on_path, self._request
        for weight, trees, paths, lengths, capacity in self._pending:
            rows, width, before = trees.rows, trees.width, np.stack([held_ends, on_path])
            asked_ends[min(self.width if capacity is None else max(capacity, width), asked_ends.size) - 1] += rows * weight
            if trees.uniform:  # every row holds every node (a template's)
                held_ends[width - 1] += rows * weight
                held, row, first = width, 0, rows if width > 1 else 0
            elif rows == 1:
                held, row = int(trees.sizes[0]), 0
                held_ends[held - 1] += weight
                first = int(held > 1)
            else:
                sizes = trees.sizes.numpy()
                held_ends[:width] += weight * np.bincount(sizes - 1, minlength=width)[:width]
                row = int(sizes.argmax())
                held, first = int(sizes[row]), int((sizes > 1).sum())
            if held > 1 and self.prior_seen[held - 1] == 0:  # (a root alone has no prior)
                self._spread_prior(trees.depths[row, :held].numpy(), weight)
            if rows == 1:  # (host lists: a path is a few nodes, cheaper than array indexing)
                path = paths.tolist()[0][:int(lengths)]
                for node in path:
                    on_path[node] += weight
                request[0] += float(len(path) > 1 and path[1] == 1)  # (node 1: the root's first child)
            else:
                paths, lengths = paths.numpy(), lengths.numpy()
                accepted = paths[np.arange(paths.shape[1])[None, :] < lengths[:, None]]
                on_path[:width] += weight * np.bincount(accepted, minlength=width)[:width]
                if paths.shape[1] > 1:
                    request[0] += float(((lengths > 1) & (paths[:, 1] == 1)).sum())
            request[1] += first
            self.by_rows.setdefault(1 << (rows.bit_length() - 1), np.zeros_like(before))[:] += np.stack([held_ends, on_path]) - before
        self._pending.clear()

    def _spread_prior(self, depths: np.ndarray, weight: float) -> None:
        """Nodes of a row's tree (``depths``) seen first: their depth's prior share, at the step's ``weight``."""
        for index in np.flatnonzero((self.prior_seen[:depths.size] == 0) & (depths > 0)).tolist():
            depth = int(depths[index])
            reach = (self.prior_by_depth[depth - 1] if depth - 1 < len(self.prior_by_depth)
                     else 0.0 if self.prior_by_depth else UNINFORMED ** depth)
            # (fading with the evidence: a plain stretch widens the bound, the rate stays put)
            self.prior_on[index] = PRIOR_STEPS * reach / max(1, int((depths == depth).sum())) * weight
            self.prior_seen[index] = PRIOR_STEPS * weight

    def _estimates(self) -> tuple[np.ndarray, ...]:
        """Per node (read-only, kept until they move): its chance to exist in a row's tree (prior 1, weight
        :data:`PRIOR_STEPS`), its acceptance given verified, the rows' worth of evidence with the prior's, and
        prefix sums of expected accepted tokens and of the bound's margin (:meth:`prefix_estimates`)."""
        if self._cache is None:
            self._count()
            held = _tail_sums(self.held_ends) * self.scale
            seen = held + self.prior_seen * self.scale
            rate = (self.on_path + self.prior_on) * self.scale / np.maximum(seen, 1e-300)
            exists = np.minimum((held + PRIOR_STEPS) / (_tail_sums(self.asked_ends) * self.scale + PRIOR_STEPS), 1.0)
            rate[0] = exists[0] = 0.0  # the root is always committed, counted as the bonus token
            gain = np.cumsum(exists * rate)
            # a prefix total's standard error: each node's rate over its evidence, weighted by its presence
            bonus = CONFIDENCE * np.sqrt(np.cumsum(exists ** 2 * np.maximum(rate * (1 - rate), 0.01) / (seen + 1)))
            for array in (exists, rate, seen, gain, bonus):
                array.flags.writeable = False
            self._cache, self._faded, self._reach = (exists, rate, seen, gain, bonus), 0, {}
        return self._cache

    def prefix_estimates(self, width: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For ``n = 1 .. width`` (index ``n - 1``), read-only: the drafted tokens a row is expected to accept
        from its tree's first ``n`` nodes, the bound's margin (:data:`CONFIDENCE` standard errors of the
        prefix's total), and the chance that ``rows`` trees padded to the largest verify node ``n - 1``.
        Over fewer rows than steps were seen with, the rows left (where rows finish at their token budget:
        those that accepted least) weigh their rows bucket's own steps against the pooled rates, these worth
        :data:`PRIOR_STEPS` steps of as many rows; the bound's margin stays the pooled one's."""
        exists, rate, _, gain, bonus = self._estimates()
        if rows not in self._reach:
            reach, bucket = 1.0 - (1.0 - exists) ** rows, 1 << (rows.bit_length() - 1)
            reach[0], own = 1.0, self.by_rows.get(bucket) if bucket < max(self.by_rows, default=0) else None
            if own is not None:
                pooled = PRIOR_STEPS * bucket
                shifted = (own[1] * self.scale + pooled * rate) / (_tail_sums(own[0]) * self.scale + pooled)
                shifted[0], gain = 0.0, np.cumsum(exists * shifted)  # (the root: the bonus token)
            reach.flags.writeable = gain.flags.writeable = False
            self._reach[rows] = (gain, reach)
        gain, reach = self._reach[rows]
        if width <= exists.size:
            return gain[:width], bonus[:width], reach[:width]
        pad = width - exists.size  # nodes never drafted: nothing more accepted, never verified
        return (np.append(gain, np.full(pad, gain[-1])), np.append(bonus, np.full(pad, bonus[-1])),
                np.append(reach, np.zeros(pad)))

    def summary(self) -> dict:
        exists, rate, seen, _, _ = self._estimates()
        shown = min(exists.size, 16)
        gain, bonus, _ = self.prefix_estimates(self.width, 1)
        return {"steps": self.steps, "width": self.width, "evidence_rows": round(float(seen[1]) if seen.size > 1 else 0.0, 1),
                "expected_accepted": round(float(gain[-1] + bonus[-1]), 3),
                "node_acceptance": [round(float(value), 3) for value in rate[1:shown]],
                "node_presence": [round(float(value), 3) for value in exists[1:shown]]}


def _tail_sums(ends: np.ndarray) -> np.ndarray:
    return ends[::-1].cumsum()[::-1]  # out[i] = ends[i:].sum(): rows that held (or could hold) node i


def _ends(tails: np.ndarray) -> np.ndarray:
    return tails - np.append(tails[1:], 0.0)  # the inverse of _tail_sums
