"""Goodness-of-fit helpers for the sampling tests."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy import stats

FALSE_ALARM = 1e-3  # each exactness test wrongly fails with probability 0.1% (seeds are fixed, so never in CI)


def chi_square_pvalue(samples: list, probabilities: dict, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``samples`` against exact ``probabilities`` (outcome -> p).

    Outcomes with expected count below ``min_expected`` are pooled into one bin; an outcome
    sampled but given probability 0 makes the p-value 0.
    """
    count = len(samples)
    observed = Counter(samples)
    if any(probabilities.get(outcome, 0.0) == 0.0 for outcome in observed):
        return 0.0
    big = [o for o, p in probabilities.items() if p * count >= min_expected]
    expected = [probabilities[o] * count for o in big]
    seen = [observed.get(o, 0) for o in big]
    rest_expected = count - sum(expected)
    if rest_expected >= min_expected:
        expected.append(rest_expected)
        seen.append(count - sum(seen))
    expected = np.array(expected)
    seen = np.array(seen)
    expected *= seen.sum() / expected.sum()
    return float(stats.chisquare(seen, expected).pvalue)
