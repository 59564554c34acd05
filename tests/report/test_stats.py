"""The statistics behind gspo-report, on cases worked out by hand: the interquartile mean, the coverage of
the bootstrap interval, the probability of improvement (paired and unpaired), the performance profile and the
binomial noise of a held-out accuracy."""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from gspo_lab.report.stats import (accuracy_noise, band, improvement_interval, iqm, iqm_interval, mean_interval,
                                   paired_improvement_interval, paired_probability_of_improvement,
                                   percentile_coverage, performance_profile, probability_of_improvement)


def test_iqm_is_the_mean_of_the_middle_half():
    # 8 scores: int(0.25 * 8) = 2 trimmed from each end, (3 + 4 + 5 + 6) / 4 = 4.5; the outlier 100 is gone
    assert iqm([100, 1, 7, 2, 6, 3, 5, 4]) == pytest.approx(4.5)
    # 5 scores (a 5-seed study): 1 trimmed from each end, (0.4 + 0.5 + 0.6) / 3 = 0.5
    assert iqm([0.9, 0.4, 0.0, 0.5, 0.6]) == pytest.approx(0.5)
    # 3 scores: int(0.75) = 0 trimmed, so the IQM is the mean
    assert iqm([0.1, 0.2, 0.6]) == pytest.approx(0.3)


@pytest.mark.parametrize("seeds", [50, 5])
def test_the_95_percent_interval_holds_the_true_mean_in_the_expected_share_of_samples(seeds):
    """400 samples from a normal population with mean 0.5: the share of intervals holding 0.5 lies within 3
    binomial standard errors of the expected coverage (0.942 ± 0.035 for 50 seeds, 0.846 ± 0.054 for 5), the
    figure gspo-report prints beside its nominal 95% intervals (stats.percentile_coverage).
    A ±1 standard-error band, which gspo-report used to print, would hold it in about 68% (50 seeds) or 63%
    (5 seeds) of samples and fail here."""
    rng = np.random.default_rng(0)
    draws, true_mean = 400, 0.5
    held = 0
    for draw in range(draws):
        interval = mean_interval(rng.normal(true_mean, 0.1, size=seeds), seed=draw)
        held += interval.low <= true_mean <= interval.high
    expected = percentile_coverage(seeds)
    assert abs(held / draws - expected) <= 3 * np.sqrt(expected * (1 - expected) / draws), held


def test_one_seed_gives_no_interval_and_says_why():
    interval = mean_interval([0.42], seed=0)
    assert interval.value == pytest.approx(0.42) and interval.low is None and interval.reason == "1 seed"
    assert improvement_interval([0.5], [0.4], seed=0).low is None


def test_an_interval_is_reproducible_from_its_seed():
    scores = np.random.default_rng(0).uniform(size=12)  # 12 distinct scores: the resampled means hardly repeat
    assert mean_interval(scores, seed=3) == mean_interval(scores, seed=3)
    assert mean_interval(scores, seed=3) != mean_interval(scores, seed=4)  # the seed is what it depends on
    interval = mean_interval(scores, seed=3)
    assert min(scores) <= interval.low < np.mean(scores) < interval.high <= max(scores)
    five = [0.31, 0.45, 0.52, 0.38, 0.60]
    assert iqm_interval(five, seed=3).value == pytest.approx(np.mean([0.38, 0.45, 0.52]))


def test_probability_of_improvement_of_identical_sets_is_one_half():
    scores = np.array([0.3, 0.5, 0.5, 0.7])
    assert probability_of_improvement(scores, scores) == pytest.approx(0.5)
    interval = improvement_interval(scores, scores, seed=0)
    assert interval.value == pytest.approx(0.5) and interval.low < 0.5 < interval.high


def test_probability_of_improvement_of_a_dominating_set_is_one():
    better, worse = np.array([0.6, 0.7, 0.8]), np.array([0.1, 0.2, 0.5])
    assert probability_of_improvement(better, worse) == 1.0 and probability_of_improvement(worse, better) == 0.0
    interval = improvement_interval(better, worse, seed=0)
    assert interval.low == interval.high == 1.0  # every resample still dominates


def test_probability_of_improvement_counts_ties_as_one_half_over_all_pairs():
    # x = [1, 2], y = [1, 0]: pairs (1,1) tie, (1,0) win, (2,1) win, (2,0) win -> (0.5 + 3) / 4
    assert probability_of_improvement(np.array([1.0, 2.0]), np.array([1.0, 0.0])) == pytest.approx(0.875)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 5, 7).astype(float), rng.integers(0, 5, 6).astype(float)  # many ties
    wins = sum((a > b) + 0.5 * (a == b) for a in x for b in y) / (len(x) * len(y))
    assert probability_of_improvement(x, y) == pytest.approx(wins)


def test_paired_probability_of_improvement_counts_seeds_not_run_pairs():
    # seeds 0-3: x - y = +0.1, -0.3, 0, +0.1 -> win, loss, tie, win: (1 + 0 + 0.5 + 1) / 4
    x, y = np.array([0.5, 0.3, 0.4, 0.9]), np.array([0.4, 0.6, 0.4, 0.8])
    assert paired_probability_of_improvement(x, y) == pytest.approx(0.625)
    # over all 16 pairs: 0.5 beats 0.4 twice, 0.3 nothing, 0.4 ties 0.4 twice, 0.9 beats all 4: (6 + 2 / 2) / 16
    assert probability_of_improvement(x, y) == pytest.approx(7 / 16)


def test_a_setting_ahead_on_every_seed_improves_with_probability_one():
    """The baseline + 0.01 on each of 5 seeds: it wins on every seed, and every resample of seeds keeps that, so
    P = 1 [1, 1]. Over all 25 run pairs it wins only where its seed's baseline is not below the other's: 15 of
    25 = 0.6, the number gspo-report used to print beside a difference of +0.010 [0.010, 0.010]."""
    baseline = np.array([0.30, 0.35, 0.40, 0.45, 0.50])
    setting = baseline + 0.01
    paired = paired_improvement_interval(setting, baseline, seed=0)
    assert (paired.value, paired.low, paired.high) == (1.0, 1.0, 1.0)
    assert improvement_interval(setting, baseline, seed=0).value == pytest.approx(0.6)


def test_the_paired_interval_is_scipys_paired_bootstrap():
    x, y = np.array([0.5, 0.3, 0.4, 0.9, 0.35]), np.array([0.4, 0.6, 0.4, 0.2, 0.5])
    expected = scipy_stats.bootstrap((x, y), paired_probability_of_improvement, paired=True, method="percentile",
                                     rng=np.random.default_rng(7), batch=1000).confidence_interval
    interval = paired_improvement_interval(x, y, seed=7)
    assert (interval.low, interval.high) == pytest.approx((expected.low, expected.high))
    assert paired_improvement_interval(x[:1], y[:1], seed=7).reason == "1 seed"


def test_accuracy_noise_is_two_binomial_standard_errors_of_the_difference():
    # 0.3 and 0.3 on 400 prompts: 2 sqrt((0.21 + 0.21) / 400) = 2 * 0.0324 = 0.0648, about 26 prompts' worth
    assert accuracy_noise(0.3, 0.3, 400) == pytest.approx(0.0648074)
    # 0.5 and 0.625 on 32 prompts: 2 sqrt((0.25 + 0.234375) / 32) = 0.2460
    assert accuracy_noise(0.5, 0.625, 32) == pytest.approx(0.2460, abs=1e-4)
    assert accuracy_noise(0.0, 0.0, 400) == 0.0  # a run at 0 throughout has nothing to lose


def test_performance_profile_is_the_fraction_of_runs_above_each_threshold():
    fractions, low, high = performance_profile([0.2, 0.4, 0.4, 0.9], np.array([0.0, 0.3, 0.4, 0.95]), seed=0)
    assert fractions.tolist() == [1.0, 0.75, 0.25, 0.0]  # "above" is strict: 0.4 is not above 0.4
    assert np.all(low <= fractions) and np.all(fractions <= high)
    assert np.all(np.diff(fractions) <= 0)


def test_curve_band_brackets_the_mean_at_every_step():
    curves = np.array([[0.1, 0.2, 0.4], [0.2, 0.3, 0.3], [0.3, 0.5, 0.2]])  # [runs, steps]
    low, high = band(curves, seed=0)
    mean = curves.mean(axis=0)
    assert np.all(low <= mean) and np.all(mean <= high) and np.all(high - low > 0)
    low, high = band(curves[:1], seed=0)
    assert np.array_equal(low, curves[0]) and np.array_equal(high, curves[0])  # one run: no band


def test_the_interval_is_scipys_percentile_bootstrap():
    scores = np.array([0.31, 0.45, 0.52, 0.38, 0.60])
    expected = scipy_stats.bootstrap((scores,), np.mean, method="percentile", rng=np.random.default_rng(7),
                                     batch=1000).confidence_interval
    interval = mean_interval(scores, seed=7)
    assert (interval.low, interval.high) == pytest.approx((expected.low, expected.high))
