"""Statistics over seeds, as Agarwal et al. recommend for RL ("Deep RL at the edge of the statistical
precipice", NeurIPS 2021; their `rliable` package): interquartile mean, percentile-bootstrap confidence
intervals, probability of improvement and performance profiles. The resampling is scipy.stats.bootstrap's;
each call draws from a fresh generator seeded with `seed`, so a number does not depend on what was
computed before it and a report is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
RESAMPLES = 9999  # scipy's default


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval; `low`/`high` are None where no interval can be drawn,
    and `reason` says why ("1 seed")."""

    value: float
    low: float | None = None
    high: float | None = None
    reason: str = ""


def iqm(scores, axis=None):
    """Interquartile mean: the mean of the middle 50% of `scores` (rliable's `aggregate_iqm`, a 25% trimmed
    mean). scipy trims int(0.25 n) scores from each end, so with fewer than 4 scores it is the mean.

    >>> float(iqm([1, 2, 3, 4, 5, 6, 7, 100]))  # drops 1, 2 and 7, 100: (3 + 4 + 5 + 6) / 4
    4.5
    """
    return stats.trim_mean(scores, 0.25, axis=axis)


def probability_of_improvement(scores_x, scores_y, axis=-1):
    """P(X > Y): the chance that a run of X scores above a run of Y, over all pairs of runs, ties counting
    1/2; the Mann-Whitney U statistic over the number of pairs (rliable's `probability_of_improvement`).

    >>> float(probability_of_improvement(np.array([1.0, 2.0]), np.array([1.0, 0.0])))  # 3 wins + 1 tie of 4
    0.875
    """
    u = stats.mannwhitneyu(scores_x, scores_y, alternative="greater", axis=axis).statistic
    return u / (np.shape(scores_x)[axis] * np.shape(scores_y)[axis])


def _bootstrap(samples: tuple, statistic, seed: int, axis: int = -1):
    """Percentile intervals, as rliable draws them; samples are resampled independently of each other, in
    batches of 1000 resamples so that a curve of many steps stays small in memory."""
    return stats.bootstrap(samples, statistic, axis=axis, confidence_level=CONFIDENCE, n_resamples=RESAMPLES,
                           batch=1000, method="percentile", rng=np.random.default_rng(seed))


def _interval(samples: tuple, statistic, seed: int) -> Interval:
    """`statistic` of `samples` with its percentile-bootstrap interval over each sample's runs."""
    value = float(statistic(*samples, axis=-1))
    smallest = min(len(s) for s in samples)
    if smallest < 2:
        return Interval(value, reason=f"{smallest} seed")
    ci = _bootstrap(samples, statistic, seed).confidence_interval
    return Interval(value, float(ci.low), float(ci.high))


def mean_interval(scores, seed: int) -> Interval:
    """The mean over seeds with its 95% bootstrap interval; no interval for one seed."""
    return _interval((np.asarray(scores, dtype=float),), np.mean, seed)


def iqm_interval(scores, seed: int) -> Interval:
    return _interval((np.asarray(scores, dtype=float),), iqm, seed)


def improvement_interval(scores_x, scores_y, seed: int) -> Interval:
    """P(X > Y) with its 95% interval, X's and Y's runs resampled independently (rliable's
    StratifiedIndependentBootstrap for one task)."""
    samples = (np.asarray(scores_x, dtype=float), np.asarray(scores_y, dtype=float))
    return _interval(samples, probability_of_improvement, seed)


def band(curves: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-step 95% bootstrap interval of the mean of `curves` [runs, steps] over its runs; one run gives
    a band of zero width."""
    if len(curves) < 2:
        return curves[0], curves[0]
    ci = _bootstrap((curves,), np.mean, seed, axis=0).confidence_interval
    return ci.low, ci.high


def performance_profile(scores, thresholds: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The fraction of runs scoring above each threshold τ (rliable's score distribution), with its 95%
    bootstrap band over runs: (fractions, low, high), each [len(thresholds)]."""
    scores = np.asarray(scores, dtype=float)

    def above(sample, axis=-1):  # [..., runs] -> [thresholds, ...]: statistics first, as scipy expects
        sample = np.moveaxis(sample, axis, -1)
        return np.moveaxis((sample[..., None] > thresholds).mean(axis=-2), -1, 0)

    fractions = above(scores)
    if len(scores) < 2:
        return fractions, fractions, fractions
    ci = _bootstrap((scores,), above, seed).confidence_interval
    return fractions, ci.low, ci.high
