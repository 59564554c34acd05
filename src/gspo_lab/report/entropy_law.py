"""The entropy law of The Entropy Mechanism (Cui et al. 2025, arXiv 2505.22617, eq. 1): across an RL run the
reward R and the policy entropy H follow R = -a·exp(H) + b, and a fit on the early steps predicts the later
reward. Here it is tested on one run at a time: fitted by least squares on the first `fraction` of the steps, then
asked for the rest from their entropies alone.

The paper fits validation accuracy at each evaluation; a run here evaluates held-out accuracy a few times only, so
the fit takes each step's mean sampled reward (`reward/mean`) against the step's mean token entropy (`entropy`),
both logged by every run. A prediction is judged against the constant that knows no law: the first part's mean
reward. `skill` = 1 - MAE(law) / MAE(constant): above 0 the law predicts better than no law, 1 is perfect. A
reward that rises over the run beats the constant with any rising curve, so the law is also judged against the
trend that knows no entropy: the least-squares line of reward against step on the first part, extended
(`skill_trend` = 1 - MAE(law) / MAE(trend)); above 0 the entropy says more about the later reward than time does.

    python scripts/entropy_law.py /tmp/studies/entropy --fraction 0.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from gspo_lab.report.run import read_metrics, series

ENTROPY, REWARD = "entropy", "reward/mean"


@dataclass(frozen=True)
class LawFit:
    """One run's law: R = -a·exp(H) + b fitted on `fitted` steps, its R² there, and its predictions of the next
    `predicted` steps (mean absolute errors of the law and of the first part's mean reward, and the skill)."""

    a: float
    b: float
    r2: float
    fitted: int
    predicted: int
    mae_law: float
    mae_constant: float
    mae_trend: float

    @property
    def skill(self) -> float:
        """1 - MAE(law) / MAE(constant); NaN where the constant is exact."""
        return 1 - self.mae_law / self.mae_constant if self.mae_constant > 0 else math.nan

    @property
    def skill_trend(self) -> float:
        """1 - MAE(law) / MAE(trend); NaN where the trend is exact."""
        return 1 - self.mae_law / self.mae_trend if self.mae_trend > 0 else math.nan


def fit_law(entropy: list[float], reward: list[float]) -> tuple[float, float, float]:
    """(a, b, R²) of the least-squares fit of reward = -a·exp(entropy) + b. Needs two points with different
    entropies; R² is NaN where the rewards do not vary.

    >>> a, b, r2 = fit_law([0.0, math.log(2), math.log(3)], [1.0, 0.5, 0.0])  # R = -0.5·e^H + 1.5
    >>> round(a, 12), round(b, 12), round(r2, 12)
    (0.5, 1.5, 1.0)
    """
    if len(entropy) != len(reward):
        raise ValueError(f"fit_law: {len(entropy)} entropies against {len(reward)} rewards")
    x = [math.exp(h) for h in entropy]
    n = len(x)
    mean_x, mean_r = sum(x) / max(n, 1), sum(reward) / max(n, 1)
    sxx = sum((xi - mean_x) ** 2 for xi in x)
    if n < 2 or sxx == 0:
        raise ValueError(f"fit_law: needs two steps with different entropies, got {n} with entropies {entropy[:4]}")
    slope = sum((xi - mean_x) * (ri - mean_r) for xi, ri in zip(x, reward)) / sxx  # = -a
    a, b = -slope, mean_r - slope * mean_x
    residual = sum((ri - (b - a * xi)) ** 2 for xi, ri in zip(x, reward))
    total = sum((ri - mean_r) ** 2 for ri in reward)
    return a, b, (1 - residual / total) if total > 0 else math.nan


def fit_and_predict(entropy: list[float], reward: list[float], fraction: float = 0.5) -> LawFit:
    """Fit on the first `fraction` of the steps (at least 2), predict the rest (at least 1) from their entropies."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction={fraction!r} must satisfy 0 < fraction < 1")
    cut = max(2, int(len(entropy) * fraction))
    if len(entropy) - cut < 1:
        raise ValueError(f"fit_and_predict: {len(entropy)} steps leave none to predict after fitting on {cut}")
    a, b, r2 = fit_law(entropy[:cut], reward[:cut])
    later = list(zip(entropy[cut:], reward[cut:]))
    constant = sum(reward[:cut]) / cut
    mae_law = sum(abs(r - (b - a * math.exp(h))) for h, r in later) / len(later)
    mae_constant = sum(abs(r - constant) for _, r in later) / len(later)
    steps = range(cut)  # the trend: reward against the step's index, least squares on the first part
    mean_step = sum(steps) / cut
    slope = sum((i - mean_step) * (r - constant) for i, r in zip(steps, reward)) / sum((i - mean_step) ** 2
                                                                                       for i in steps)
    mae_trend = sum(abs(r - (constant + slope * (i - mean_step)))
                    for i, r in enumerate(reward[cut:], start=cut)) / len(later)
    return LawFit(a, b, r2, cut, len(later), mae_law, mae_constant, mae_trend)


def run_law(run_dir: Path, fraction: float = 0.5) -> LawFit:
    """The law of one run dir, from the steps of its metrics.csv that log both the entropy and the reward."""
    rows = read_metrics(run_dir)
    entropy_steps, entropies = series(rows, ENTROPY)
    reward_steps, rewards = series(rows, REWARD)
    by_step = dict(zip(reward_steps, rewards))
    pairs = [(h, by_step[s]) for s, h in zip(entropy_steps, entropies) if s in by_step]
    if not pairs:
        raise ValueError(f"{run_dir}: metrics.csv has no step logging both {ENTROPY!r} and {REWARD!r}")
    return fit_and_predict([h for h, _ in pairs], [r for _, r in pairs], fraction)
