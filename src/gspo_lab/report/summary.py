"""The end-of-run summary: reward and held-out accuracy before and after, clip fraction, time."""

from __future__ import annotations

import math

from gspo_lab.report.run import series


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarise(history: list[dict[str, float]], seconds: float, algorithm: str | None, run_dir: str,
              window: int = 10) -> dict:
    """Figures of one run from its logged rows; `window` RL steps average the reward at each end."""
    _, rewards = series(history, "reward/mean")
    _, accuracies = series(history, "eval/accuracy")
    _, clip = series(history, "clip/frac")
    return {
        "algorithm": algorithm,
        "steps": len(rewards),
        "reward/mean_first": _mean(rewards[:window]),
        "reward/mean_last": _mean(rewards[-window:]),
        "eval/accuracy_before": accuracies[0] if accuracies else math.nan,
        "eval/accuracy_after": accuracies[-1] if accuracies else math.nan,
        "clip/frac_mean": _mean(clip),
        "seconds": round(seconds, 1),
        "run_dir": run_dir,
    }


def format_summary(summary: dict) -> str:
    return "\n".join([
        f"gspo-train finished: {summary['algorithm']}, {summary['steps']} RL steps in {summary['seconds']} s",
        f"  reward (sampled, mean of first/last 10 steps): {summary['reward/mean_first']:.3f} -> "
        f"{summary['reward/mean_last']:.3f}",
        f"  held-out accuracy (greedy): {summary['eval/accuracy_before']:.3f} -> {summary['eval/accuracy_after']:.3f}",
        f"  clip/frac (mean over steps): {summary['clip/frac_mean']:.4f}",
        f"  outputs: {summary['run_dir']}",
    ])
