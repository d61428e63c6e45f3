"""Calibrated acceptance: how many tokens a cut of a step's tree is expected to commit.

A row commits its accepted path plus one token, and the accepted path holds at most one node per
depth, so the expected accepted length of any tree is the sum over its nodes of the probability
that the node is on the accepted path. The model keeps, per node index (node order: parents come
before children, and drafters list better candidates first), how often the node existed in a row's
tree and how often it was on the accepted path, with its mean depth. Which nodes exist is counted on the proposed trees,
their acceptance on the verified ones (a cut hides the rest). A prefix of node order is
itself a tree, and under a deterministic rule (greedy) a node of the prefix is accepted exactly
when it is accepted in the whole tree, so every drafted step counts what each smaller prefix would
have committed on the same text. Sampling rules are cut by depth instead (a cut that does not
depend on the sampled candidates), whose expected length sums the nodes at or above the depth.

Evidence fades with a half-life counted in steps, plain steps included: after a stretch of plain
steps the estimates are uncertain again and their upper confidence bound (what choices use) rises,
so no tree size is locked out by a few early steps. The prior is the acceptance by depth the adapter
recorded at save time (spread evenly over the nodes of each depth the first time they are seen).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

HALF_LIFE = 64
"""Steps after which a step's evidence counts half: long enough that a choice rests on a few
replies' worth of steps, short enough that a stretch of plain steps reopens the question."""

CONFIDENCE = 1.0
"""Standard errors added to each node's acceptance rate in choices (an upper confidence bound)."""

PRIOR_STEPS = 4.0
"""Steps' worth of weight given to the prior (the recorded or the uninformed acceptance)."""

UNINFORMED = 0.5
"""Prior chance that a drafted token is accepted, given its parent was, when the adapter recorded no
acceptance (lookup, untrained drafters): the accepted path reaches depth ``d`` with ``UNINFORMED ** d``."""


class AcceptanceModel:
    """Per-node acceptance under one acceptance rule and sampling setting (one per rule key).

    Counts are numpy arrays on the host (a step updates a few dozen entries; tensor calls would cost
    more than the arithmetic)."""

    def __init__(self, prior_by_depth: Sequence[float] = ()) -> None:
        self.prior_by_depth = [float(rate) for rate in prior_by_depth]
        self.exists = np.zeros(0)  # decayed rows whose proposed tree held node i
        self.present = np.zeros(0)  # decayed rows that verified node i
        self.on_path = np.zeros(0)  # decayed rows in which node i was accepted
        self.depth_sum = np.zeros(0)
        self.prior_on = np.zeros(0)  # prior pseudo-counts, spread per depth
        self.prior_seen = np.zeros(0)
        self.rows = 0.0  # decayed rows of drafted steps
        self.width = 0.0  # running mean of the proposed trees' width (padded, root included)
        self.steps = 0
        self._cache: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._decay = 0.5 ** (1.0 / HALF_LIFE)

    def _grow(self, width: int) -> None:
        grow = width - self.present.size
        if grow > 0:
            self.exists, self.present, self.on_path, self.depth_sum, self.prior_on, self.prior_seen = (
                np.concatenate([array, np.zeros(grow)]) for array in
                (self.exists, self.present, self.on_path, self.depth_sum, self.prior_on, self.prior_seen))

    def fade(self) -> None:
        """One step passed (any step): earlier evidence counts a little less."""
        for array in (self.exists, self.present, self.on_path, self.depth_sum):
            array *= self._decay
        self.rows *= self._decay
        self._cache = None

    def proposed(self, sizes: torch.Tensor, depths: torch.Tensor) -> None:
        """The trees a drafter proposed this step, before any cut (``sizes`` ``[R]``, ``depths`` ``[R, N]``):
        which nodes a row's tree holds and at what depth."""
        rows, width = depths.shape
        self._grow(width)
        depths = depths.cpu().numpy()
        exists = np.arange(width)[None, :] < sizes.cpu().numpy()[:, None]  # (R, N)
        self._spread_prior(exists, depths)
        self.exists[:width] += exists.sum(axis=0)
        self.depth_sum[:width] += (exists * depths).sum(axis=0)
        self.rows += rows
        self.width += (width - self.width) / min(self.steps + 1, HALF_LIFE)
        self.steps += 1
        self._cache = None

    def observe(self, sizes: torch.Tensor, paths: torch.Tensor, lengths: torch.Tensor) -> None:
        """The trees verified this step (``sizes`` ``[R]`` real nodes, a cut of the proposed ones) and
        what was accepted (``paths`` ``[R, L]`` node indices, ``lengths`` ``[R]`` with the root)."""
        sizes = sizes.cpu().numpy()
        width = int(sizes.max())
        self._grow(width)
        self.present[:width] += np.bincount(sizes - 1, minlength=width)[::-1].cumsum()[::-1][:width]
        paths, lengths = paths.cpu().numpy(), lengths.cpu().numpy()
        accepted = paths[np.arange(paths.shape[1])[None, :] < lengths[:, None]]
        self.on_path[:width] += np.bincount(accepted, minlength=width)[:width]
        self._cache = None

    def _spread_prior(self, exists: np.ndarray, depths: np.ndarray) -> None:
        """Give nodes seen for the first time their share of the prior acceptance of their depth."""
        new = exists[0] & (self.prior_seen[:exists.shape[1]] == 0)
        new[0] = False
        if not new.any():
            return
        row = depths[0][exists[0]]
        for index in np.flatnonzero(new).tolist():
            depth = int(depths[0, index])
            reach = (self.prior_by_depth[depth - 1] if depth - 1 < len(self.prior_by_depth)
                     else 0.0 if self.prior_by_depth else UNINFORMED ** depth)
            self.prior_on[index] = PRIOR_STEPS * reach / max(1, int((row == depth).sum()))
            self.prior_seen[index] = PRIOR_STEPS

    def _estimates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node index: chance it exists in a row's tree, its optimistic acceptance, its mean depth."""
        if self._cache is None:
            seen = self.present + self.prior_seen
            rate = (self.on_path + self.prior_on) / np.maximum(seen, 1e-9)
            spread = np.maximum(rate * (1 - rate), 0.01) / (seen + 1)
            optimistic = np.minimum(rate + CONFIDENCE * np.sqrt(spread), 1.0)
            exists = np.minimum(self.exists / max(self.rows, 1e-9), 1.0)
            depth = self.depth_sum / np.maximum(self.exists, 1e-9)
            if optimistic.size:
                optimistic[0] = exists[0] = 0.0  # the root is always committed, counted as the bonus token
            self._cache = (exists, optimistic, depth)
        return self._cache

    @property
    def known(self) -> bool:
        return self.steps > 0

    def prefix_gains(self, width: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """For ``n = 1 .. width`` (index ``n - 1``; n = 1: the root alone): the expected drafted tokens
        a row accepts from the first ``n`` nodes of its tree, and the expected padded width of
        ``rows`` such trees."""
        exists, optimistic, _ = self._estimates()
        count = min(width, exists.size)
        gain = np.zeros(width)
        padded = np.ones(width)
        if count > 1:
            gain[:count] = np.cumsum(exists[:count] * optimistic[:count])
            padded[:count] += np.cumsum(1.0 - (1.0 - exists[:count]) ** rows)
            gain[count:], padded[count:] = gain[count - 1], padded[count - 1]
        return gain, padded

    def tree_gains(self, sizes: np.ndarray, cuts: np.ndarray) -> np.ndarray:
        """``[C]``: expected drafted tokens accepted over rows whose trees have ``sizes`` ``[R]``
        nodes, each cut to its first ``n`` nodes, for each ``n`` of ``cuts`` ``[C]``."""
        _, optimistic, _ = self._estimates()
        width = int(sizes.max())
        prefix = np.zeros(width)
        count = min(width, optimistic.size)
        if count:
            prefix[:count] = np.cumsum(optimistic[:count])
            prefix[count:] = prefix[count - 1]
        return prefix[np.minimum(sizes[:, None], cuts[None, :]) - 1].sum(axis=0)

    def depth_cuts(self) -> list[tuple[int, float, int]]:
        """``(depth, expected drafted tokens a row accepts, expected padded width)`` for each depth
        cut of a typical tree (depth 1 .. the deepest node seen)."""
        exists, optimistic, depth = self._estimates()
        real = exists > 0
        real[:1] = False
        if not real.any():
            return []
        cuts = []
        for limit in range(1, int(np.ceil(depth[real].max() - 1e-9)) + 1):
            inside = real & (depth <= limit + 1e-9)
            cuts.append((limit, float((exists * optimistic)[inside].sum()), 1 + int(inside.sum())))
        return cuts

    def summary(self) -> dict:
        exists, optimistic, _ = self._estimates()
        shown = min(exists.size, 16)
        return {"steps": self.steps, "mean_width": round(self.width, 2),
                "node_acceptance": [round(float(value), 3) for value in optimistic[1:shown]],
                "node_presence": [round(float(value), 3) for value in exists[1:shown]]}
