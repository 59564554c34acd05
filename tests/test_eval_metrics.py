"""pass@k, mean@n and maj@k by hand and by enumeration."""

import itertools
import random

import pytest

from gspo_lab.eval_metrics import maj_at_k, mean_at_n, pass_at_k


def test_pass_at_k_by_hand():
    # n = 5, c = 2: pass@1 = 1 - (1 - 1/4)(1 - 1/5) = 1 - 0.6 = 0.4; pass@2 = 1 - (1 - 2/4)(1 - 2/5) = 1 - 0.3 = 0.7;
    # pass@5: n - c = 3 < 5, every 5-subset holds a correct sample
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    assert pass_at_k(5, 2, 5) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25, abs=1e-15)  # pass@1 is c / n


def test_pass_at_k_equals_enumerating_every_k_subset():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        c, k = rng.randint(0, n), rng.randint(1, n)
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_k_beyond_n_and_impossible_counts_are_refused():
    with pytest.raises(ValueError, match=r"pass@6 needs 1 <= k <= n=5 samples"):
        pass_at_k(5, 2, 6)
    with pytest.raises(ValueError, match=r"0 <= c <= n"):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match=r"maj@3 needs"):
        maj_at_k(["1", "2"], {"1"}, 3)


def test_maj_at_k_majority_ties_and_unanswered_samples():
    assert maj_at_k(["4", "3", "4"], {"4"}, 3) == 1.0
    assert maj_at_k(["4", "3", "4"], {"4"}, 2) == 1.0  # tie of 4 and 3 in the first two: 4 came first
    assert maj_at_k(["3", "4", "4", "3"], {"4"}, 4) == 0.0  # tie: 3 came first
    assert maj_at_k([None, None, "4"], {"4"}, 3) == 1.0  # unanswered samples do not vote
    assert maj_at_k([None, None], {"4"}, 2) == 0.0


def test_mean_at_n():
    assert mean_at_n([1.0, 0.0, 0.5, 0.5]) == 0.5
    with pytest.raises(ValueError):
        mean_at_n([])
