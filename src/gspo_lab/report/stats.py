"""Statistics over seeds, as Agarwal et al. recommend for RL ("Deep RL at the edge of the statistical
precipice", NeurIPS 2021; their `rliable` package): interquartile mean, percentile-bootstrap confidence
intervals, probability of improvement (paired on shared seeds, else over all pairs of runs) and performance
profiles; and the binomial noise of a held-out accuracy, which decides when a drop counts as a collapse. The
resampling is scipy.stats.bootstrap's; each call draws from a fresh generator seeded with `seed`, so a number
does not depend on what was computed before it and a report is reproducible.

The intervals are nominal 95%: with few seeds the percentile bootstrap is too narrow, and `percentile_coverage`
gives how often it holds the true mean of normal scores (85% with 5 seeds; tests/report/test_stats.py checks it
by simulation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95  # nominal: see percentile_coverage for what it is with few seeds
RESAMPLES = 9999  # scipy's default
NOISE_Z = 2.0  # an accuracy drop is noise unless larger than this many binomial standard errors


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


def paired_probability_of_improvement(scores_x, scores_y, axis=-1):
    """P(X > Y) on shared seeds: the share of seeds on which X's run scores above Y's, ties counting 1/2.

    >>> float(paired_probability_of_improvement(np.array([0.5, 0.3, 0.4, 0.9]), np.array([0.4, 0.6, 0.4, 0.2])))
    0.625
    """
    return np.mean((np.sign(np.subtract(scores_x, scores_y)) + 1) / 2, axis=axis)  # win 1, tie 1/2, loss 0


def percentile_coverage(seeds: int) -> float:
    """The share of samples of `seeds` normal scores whose nominal 95% percentile-bootstrap interval holds the
    true mean, in the large-resample limit: the interval is about mean ± z s sqrt((n - 1) / n) / sqrt(n), and
    (mean - true mean) / (s / sqrt(n)) follows Student's t with n - 1 degrees of freedom.

    >>> [round(float(percentile_coverage(n)), 3) for n in (2, 5, 50)]  # too narrow with few seeds
    [0.602, 0.846, 0.942]
    """
    z = stats.norm.ppf(0.5 + CONFIDENCE / 2)
    return 2 * stats.t.cdf(z * np.sqrt((seeds - 1) / seeds), seeds - 1) - 1


def accuracy_noise(first: float, second: float, prompts: int) -> float:
    """NOISE_Z binomial standard errors of the difference of two accuracies, each the share of `prompts`
    held-out prompts answered correctly: NOISE_Z sqrt((a (1 - a) + b (1 - b)) / n).

    >>> round(accuracy_noise(0.3, 0.3, 400), 4)  # 2 sqrt(2 * 0.21 / 400); one prompt is 0.0025
    0.0648
    """
    return NOISE_Z * float(np.sqrt((first * (1 - first) + second * (1 - second)) / prompts))


def _bootstrap(samples: tuple, statistic, seed: int, axis: int = -1, paired: bool = False):
    """Percentile intervals, as rliable draws them, in batches of 1000 resamples so that a curve of many steps
    stays small in memory; samples are resampled independently of each other, or, `paired`, by the same
    indices (a seed's pair of runs is drawn together)."""
    return stats.bootstrap(samples, statistic, axis=axis, confidence_level=CONFIDENCE, n_resamples=RESAMPLES,
                           batch=1000, method="percentile", paired=paired, rng=np.random.default_rng(seed))


def _interval(samples: tuple, statistic, seed: int, paired: bool = False) -> Interval:
    """`statistic` of `samples` with its percentile-bootstrap interval over each sample's runs."""
    value = float(statistic(*samples, axis=-1))
    smallest = min(len(s) for s in samples)
    if smallest < 2:
        return Interval(value, reason=f"{smallest} seed")
    ci = _bootstrap(samples, statistic, seed, paired=paired).confidence_interval
    return Interval(value, float(ci.low), float(ci.high))


def mean_interval(scores, seed: int) -> Interval:
    """The mean over seeds with its 95% bootstrap interval; no interval for one seed."""
    return _interval((np.asarray(scores, dtype=float),), np.mean, seed)


def iqm_interval(scores, seed: int) -> Interval:
    return _interval((np.asarray(scores, dtype=float),), iqm, seed)


def improvement_interval(scores_x, scores_y, seed: int) -> Interval:
    """P(X > Y) over all pairs of runs with its 95% interval, X's and Y's runs resampled independently
    (rliable's StratifiedIndependentBootstrap for one task): for runs that share no seed."""
    samples = (np.asarray(scores_x, dtype=float), np.asarray(scores_y, dtype=float))
    return _interval(samples, probability_of_improvement, seed)


def paired_improvement_interval(scores_x, scores_y, seed: int) -> Interval:
    """P(X > Y) on shared seeds (`scores_x[i]` and `scores_y[i]` from seed i) with its 95% interval, the
    seeds resampled with their pair of runs."""
    samples = (np.asarray(scores_x, dtype=float), np.asarray(scores_y, dtype=float))
    return _interval(samples, paired_probability_of_improvement, seed, paired=True)


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
