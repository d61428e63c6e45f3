"""Calibrated acceptance: how many tokens a prefix of a step's tree is expected to commit.

A row commits its accepted path (at most one node per depth) plus one token, so a tree's expected
accepted length is the sum over its nodes of the chance each is on the path. Per node index (parents
before children, better candidates first) the model counts the rows whose tree held the node (all
verified), those with its parent accepted, and those with it accepted. A node in every tree asked for
it, under one parent (a template's), has its parent's chance times its own given its parent's: the
shallow nodes of a small nested size move the deeper ones' chances. Where trees vary (lookup's,
dynamic trees: a node exists where the drafter is sure) its chance is the share of its rows that
accepted it. A prefix of node order is itself a tree whose nodes are accepted as in the whole tree
(under sampling, with the same chance): each drafted step shows what every smaller size would get.

Evidence fades with a half-life in steps, plain steps included, and choices use an upper confidence
bound on a prefix's total, so no size is locked out by a few early steps. The prior (the acceptance
by depth the adapter recorded at save time) fades with the evidence: the bound widens, the estimate
does not drift back to a prior measured on other text. At a request's start the evidence of earlier
requests is weighed by how much requests differ (:meth:`AcceptanceModel.new_request`).
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch

HALF_LIFE = 64
"""Steps after which a step's evidence counts half: a choice rests on a few replies' worth of steps,
and a stretch of plain steps reopens the question."""

CONFIDENCE = 1.0
"""Standard errors added to an option's expected accepted tokens in choices (an upper confidence
bound): an option seen on few rows, or long ago, is tried again before it is written off."""

PRIOR_STEPS = 4.0
"""Steps' worth of weight given to the prior (the recorded or the uninformed acceptance)."""

UNINFORMED = 0.5
"""Prior chance that a drafted token is accepted, given its parent was, when the adapter recorded no
acceptance (lookup, untrained drafters): the accepted path reaches depth ``d`` with ``UNINFORMED ** d``."""

_REQUESTS = 32  # earlier requests the spread of acceptance between requests is measured over
_RESCALE = 1e-150  # the running weight is folded back into the counts below this (float64 range)
_REFRESH = max(1, HALF_LIFE // 8)  # fades between refreshes of the estimates (weights move < 9%)


class AcceptanceModel:
    """Per-node acceptance under one acceptance rule and sampling setting.

    Counts are numpy arrays on the host (a step touches a few dozen entries; tensor calls would cost
    more than the arithmetic). Fading is a running weight: a step adds ``1 / scale`` and a count's
    faded value is ``stored x scale``, so a step costs one multiplication, not one per array."""

    def __init__(self, prior_by_depth: Sequence[float] = (), width: int = 1) -> None:
        """``width``: the widest tree the drafter is configured to propose (root included), known
        before it proposes anything (a drafter's first trees may be empty: lookup)."""
        self.prior_by_depth = [float(rate) for rate in prior_by_depth]
        self.exists = np.zeros(0)  # rows whose tree held (and verified) node i (stored, see scale)
        self.on_path = np.zeros(0)  # rows in which node i was accepted
        self.reached = np.zeros(0)  # rows whose tree held node i with its parent accepted
        self.prior_on, self.prior_seen = np.zeros(0), np.zeros(0)  # prior pseudo-counts (fading with the counts)
        self.parent = np.zeros(0, dtype=np.int64)  # node i's parent in the latest tree that held it (-1: none)
        self.stable = np.zeros(0, dtype=bool)  # node i in every tree asked for it, under one parent (a template's)
        self.asked = np.zeros(0)  # rows of drafted steps whose tree could hold node i (stored)
        self.scale = 1.0  # faded value = stored x scale
        self.width = max(1, width)  # the widest tree proposed (root included), at least the configured one
        self.steps, self.rows_seen = 0, 0  # drafted steps and their rows observed (unfaded)
        self._pending: list[tuple] = []  # (weight, trees, paths, lengths, capacity) of steps not yet counted
        self._request = [0.0, 0]  # this request's rows whose tree held node 1: accepted, held (unfaded)
        self._requests: deque[tuple[float, int]] = deque(maxlen=_REQUESTS)  # earlier ones': (rate, rows)
        self._cache: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._faded, self._gains_key, self._gains = 0, None, None  # fades since the estimates; prefix_estimates' key, result
        self._decay = 0.5 ** (1.0 / HALF_LIFE)
        self._grow(self.width)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.exists, self.on_path, self.reached, self.asked, self.prior_on, self.prior_seen

    def _grow(self, width: int) -> None:
        grow = width - self.exists.size
        if grow > 0:
            self.exists, self.on_path, self.reached, self.asked, self.prior_on, self.prior_seen = (
                np.concatenate([array, np.zeros(grow)]) for array in self._arrays())
            self.parent, self.stable = np.append(self.parent, np.full(grow, -1)), np.append(self.stable, np.ones(grow, dtype=bool))

    def fade(self) -> None:
        """One step passed (any step): earlier evidence counts a little less."""
        self.scale *= self._decay
        if self.scale < _RESCALE:
            self._count()  # (pending steps carry weights of the current scale)
            for array in self._arrays():
                array *= self.scale
            self.scale, self._cache = 1.0, None
        self._faded += 1
        self._cache = None if self._faded >= _REFRESH else self._cache  # (the bounds moved enough)

    def observe(self, trees, paths: torch.Tensor, lengths: torch.Tensor, capacity: int | None = None) -> None:
        """One drafted step: the trees verified whole (a ``TreeBatch``; roots alone where nothing was
        proposed), what was accepted (``paths`` ``[R, L]`` node indices, ``lengths`` ``[R]`` with the
        root), ``capacity``: the most nodes (root included) the drafter was asked for (a node beyond
        it counts neither as proposed nor as missing; None: the model's width). Counted when the
        estimates are next read (together, cheaper than a step at a time in the loop)."""
        self.width, self.steps, self.rows_seen = max(self.width, trees.width), self.steps + 1, self.rows_seen + trees.rows
        self._pending.append((1.0 / self.scale, trees, paths, lengths, capacity))
        self._cache = None

    def new_request(self) -> float | None:
        """A new request begins: earlier requests' evidence becomes its prior, each node's rates kept,
        worth at most the empirical-Bayes weight of the first node's acceptance (in rows): a row's
        variance within a request over the variance of the requests' true rates (their spread less
        what their row counts explain). Where requests differ (repetitive code, fresh prose) its own
        steps take over within a few; where they are alike the evidence stands. Returns the weight
        (None: no cut, under 3 earlier requests or no spread)."""
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
        seen = (self.exists + self.prior_seen) * self.scale
        cut = np.minimum(1.0, rows / np.maximum(seen, 1e-300))
        for array in self._arrays():
            array *= cut[:array.size]
        self._cache = None
        return rows

    def _count(self) -> None:
        """Count the pending steps: nodes each row's tree held (all verified), accepted, with their parent accepted."""
        self._grow(self.width)
        for weight, trees, paths, lengths, capacity in self._pending:
            rows, width = trees.rows, trees.width
            self._grow(width)
            self.asked[:(asked := self.width if capacity is None else max(capacity, width))] += rows * weight
            parents, paths, lengths = trees.parents.numpy(), paths.numpy(), lengths.numpy()
            if rows == 1:  # (the common case, in few array operations)
                size = fewest = width if trees.uniform else int(trees.sizes[0])
                path, parent = paths[0, :lengths[0]], parents[0, :size]
                accepted = np.zeros(width, dtype=bool)
                accepted[path] = True
                self.exists[:size] += weight
                self.on_path[path] += weight
                self.reached[1:size] += weight * accepted[parent[1:]]
                first, hit = int(size > 1), int(path.size > 1 and path[1] == 1)  # (node 1: the root's first child)
            else:
                sizes = np.full(rows, width) if trees.uniform else trees.sizes.numpy()  # real nodes per row
                row = int(sizes.argmax())  # (the widest row: its parents are kept per node index)
                size, fewest, parent, first = int(sizes[row]), int(sizes.min()), parents[row, :int(sizes[row])], int((sizes > 1).sum())
                held = np.arange(width)[None, :] < sizes[:, None]  # [R, N]: node in the row's tree
                valid = np.arange(paths.shape[1])[None, :] < lengths[:, None]
                accepted = np.zeros((rows, width), dtype=bool)  # [R, N]: node on the row's accepted path
                accepted[np.nonzero(valid)[0], paths[valid]] = True
                self.exists[:width] += weight * held.sum(axis=0)
                self.on_path[:width] += weight * accepted.sum(axis=0)  # (below: roots and padding have parent -1)
                self.reached[1:width] += weight * (np.take_along_axis(accepted, np.maximum(parents, 0), axis=1) & held)[:, 1:].sum(axis=0)
                hit = int(((lengths > 1) & (paths[:, 1] == 1)).sum()) if paths.shape[1] > 1 else 0
            self.stable[fewest:asked] = False  # (a template's node: in every tree asked for it, under one parent)
            if not np.array_equal(self.parent[1:size], parent[1:]):
                self.stable[1:size] &= (self.parent[1:size] < 0) | (self.parent[1:size] == parent[1:])
                self.parent[1:size] = parent[1:]
            if size > 1 and self.prior_seen[size - 1] == 0:  # (a root alone has no prior)
                self._spread_prior(trees.depths[0 if rows == 1 else row, :size].numpy(), weight)
            self._request[0] += hit
            self._request[1] += first
        self._pending.clear()

    def _spread_prior(self, depths: np.ndarray, weight: float) -> None:
        """Give the nodes of one row's tree (``depths``, one per node) seen for the first time their
        share of their depth's prior acceptance, with the ``weight`` of the step that showed them."""
        for index in np.flatnonzero(self.prior_seen[:depths.size] == 0).tolist():
            depth, prior = int(depths[index]), self.prior_by_depth
            if depth == 0:
                continue
            reach = prior[depth - 1] if depth - 1 < len(prior) else 0.0 if prior else UNINFORMED ** depth
            # (fading with the evidence: a plain stretch widens the bound, the rate stays put)
            self.prior_on[index], self.prior_seen[index] = PRIOR_STEPS * reach / max(1, int((depths == depth).sum())) * weight, PRIOR_STEPS * weight

    def _estimates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node index: the chance it exists in a row's tree, its acceptance given it was verified
        (module docstring), the rows' worth of (faded) evidence with the prior's. Existence starts from
        a prior of 1 (weight :data:`PRIOR_STEPS`): a drafter that proposed nothing is asked again."""
        if self._cache is None:
            self._count()
            seen = (self.exists + self.prior_seen) * self.scale
            rate = (self.on_path + self.prior_on) / np.maximum(self.exists + self.prior_seen, 1e-300)
            if (template := np.flatnonzero(self.stable[1:]) + 1).size:  # (module docstring)
                parent, prior = np.maximum(self.parent, 0), self.prior_on / np.maximum(self.prior_seen, 1e-300)
                above = np.where(parent > 0, prior[parent], 1.0)  # the prior given the parent's, as pseudo-counts:
                prior = np.minimum(np.divide(prior, above, out=np.zeros_like(prior), where=above > 0), 1.0) * self.prior_seen
                given = np.divide(self.on_path + prior, total := self.reached + self.prior_seen, out=np.zeros_like(total), where=total > 0).tolist()
                rate, parent = rate.tolist(), parent.tolist()
                for index in template.tolist():  # (parents before children; lists: numpy scalars cost more)
                    rate[index] = min(given[index], 1.0) * (rate[parent[index]] if parent[index] else 1.0)
                rate = np.array(rate)
            exists = np.minimum((self.exists * self.scale + PRIOR_STEPS) / (self.asked * self.scale + PRIOR_STEPS), 1.0)
            rate[0] = exists[0] = 0.0  # the root is always committed, counted as the bonus token
            self._cache, self._faded = (exists, rate, seen), 0
        return self._cache

    def prefix_estimates(self, width: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For ``n = 1 .. width`` (index ``n - 1``; n = 1: the root alone): the expected drafted tokens a
        row accepts from the first ``n`` nodes of its tree, the margin of an upper confidence bound above
        it (:data:`CONFIDENCE` standard errors of each prefix's total: per-node bounds would add up and
        favour more nodes), and the expected padded width of ``rows`` such trees."""
        if self._cache is not None and self._gains_key == (width, rows):
            return self._gains
        exists, rate, seen = self._estimates()
        count = min(width, exists.size)
        gain, bonus, padded = np.zeros(width), np.zeros(width), np.ones(width)
        if count > 1:
            gain[:count] = np.cumsum(exists[:count] * rate[:count])
            padded[:count] += np.cumsum(exists[:count] if rows == 1 else 1.0 - (1.0 - exists[:count]) ** rows)
            # a prefix total's standard error: each node's rate over its evidence, weighted by its presence
            spread = exists[:count] ** 2 * np.maximum(rate[:count] * (1 - rate[:count]), 0.01) / (seen[:count] + 1)
            bonus[:count] = CONFIDENCE * np.sqrt(np.cumsum(spread))
            gain[0] = bonus[0] = 0.0
            gain[count:], padded[count:], bonus[count:] = gain[count - 1], padded[count - 1], bonus[count - 1]
        self._gains_key, self._gains = (width, rows), (gain, bonus, padded)  # kept while the estimates stand
        return self._gains

    def summary(self) -> dict:
        (exists, rate, seen), (gain, bonus, _) = self._estimates(), self.prefix_estimates(self.width, 1)
        return {"steps": self.steps, "width": self.width, "evidence_rows": round(float(seen[1]) if seen.size > 1 else 0.0, 1),
                "expected_accepted": round(float(gain[-1] + bonus[-1]), 3),
                "node_acceptance": np.round(rate[1:16], 3).tolist(), "node_presence": np.round(exists[1:16], 3).tolist()}
