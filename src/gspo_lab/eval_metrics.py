"""Metrics of n sampled completions per prompt, as papers report them: pass@k, mean@n and maj@k.

pass@k is the unbiased estimator of Chen et al. (2021, arXiv 2107.03374): of n samples with c correct, the
chance that k drawn without replacement hold at least one correct, 1 - C(n-c, k) / C(n, k), computed stably as
1 - prod_{i=n-c+1}^{n} (1 - k/i), and 1 when n - c < k (lighteval's and lm-eval's `pass_at_k`). Not verl's
best@k, which resamples with replacement and under-reports it (verl PR #7240).

    >>> [round(pass_at_k(5, 2, k), 4) for k in (1, 2, 5)]
    [0.4, 0.7, 1.0]
    >>> maj_at_k(["3", "4", "4", "3", None], {"4"}, k=5)  # a tie of 3 and 4: the first to appear, 3, wins
    0.0
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` of `n` samples correct."""
    if not 0 <= c <= n or n < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and n >= 1, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n={n} samples: eval.k must not exceed eval.n")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_at_n(scores: Sequence[float]) -> float:
    """mean@n (lighteval's avg@n): the mean score of a prompt's n samples."""
    if not scores:
        raise ValueError("mean@n of no samples")
    return sum(scores) / len(scores)


def maj_at_k(answers: Sequence[str | None], correct: Collection[str], k: int) -> float:
    """maj@k: 1 if the most frequent extracted answer among the first `k` samples is correct, else 0. Samples
    without an answer (None) do not vote; none at all scores 0. A tie goes to the answer that appears first in
    sample order (deterministic, and independent of how answers sort)."""
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@{k} needs 1 <= k <= n={len(answers)} samples")
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return 0.0
    most = max(votes.values())
    winner = next(a for a in answers[:k] if a is not None and votes[a] == most)
    return float(winner in correct)
