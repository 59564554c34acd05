"""The numbers experiments/staleness tests its hypotheses with, from its committed runs: per arm (algorithm,
correction, rollout.max_staleness, clip_scale), the final held-out accuracy and its gain over the cold start, the
step means of the clip, staleness, mismatch and behaviour-weight metrics; and the paired differences the
hypotheses name (k = 8 against k = 0, decoupled against bypass, GRPO against GSPO, wide clip against the paper's),
each a mean over seeds with gspo-report's 95% percentile-bootstrap interval.

    python experiments/staleness/hypotheses.py experiments/staleness/runs
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import numpy as np

from gspo_lab.report.run import open_metrics
from gspo_lab.report.runs import load_run, run_dirs
from gspo_lab.report.stats import mean_interval

STEP_MEANS = ("clip/frac", "off_policy/staleness_mean", "mismatch/seq_log_ratio_abs", "ratio/seq/max",
              "behave/weight_mean", "behave/masked_frac", "reward/mean", "clip/frac_low", "clip/frac_high",
              "ratio/seq/mean")
KEYS = ("algorithm", "correction", "rollout.max_staleness", "clip_scale", "rollout.backend")
DEFAULTS = {"clip_scale": "1", "rollout.backend": "hf"}


def interval(values: list[float], digits: int = 3) -> str:
    """The mean over seeds with gspo-report's bootstrap interval (gspo_lab.report.stats)."""
    found = mean_interval([v for v in values if not math.isnan(v)], seed=0)
    if found.low is None:
        return "n/a"
    return f"{found.value:+.{digits}f} [{found.low:+.{digits}f}, {found.high:+.{digits}f}]"


def column(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def run_numbers(run: Path) -> dict[str, float]:
    with open_metrics(run) as file:
        rows = list(csv.DictReader(file))
    evals = column(rows, "eval/accuracy")
    out = {"final": evals[-1], "gain": evals[-1] - evals[0]}
    for key in STEP_MEANS:
        values = column(rows, key)
        out[key] = float(np.mean(values)) if values else math.nan
    return out


def arms_of(root: Path) -> dict[tuple, dict[int, dict]]:
    """arm (the KEYS' values) -> seed -> run_numbers, for every run dir under `root` (at any depth)."""
    arms: dict[tuple, dict[int, dict]] = {}
    for run in map(load_run, run_dirs(root)):
        if run.failed:
            continue
        overrides = dict(o.split("=", 1) for o in run.overrides)  # the run's, seed aside (gspo_lab.report.runs)
        arm = tuple(overrides.get(k, DEFAULTS.get(k, "")) for k in KEYS)
        arms.setdefault(arm, {})[run.seed] = run_numbers(run.path)
    return arms


def paired(arms: dict, a: tuple, b: tuple, key: str) -> str:
    """a minus b on the seeds both have."""
    if a not in arms or b not in arms:
        return "n/a"
    seeds = sorted(set(arms[a]) & set(arms[b]))
    return interval([arms[a][s][key] - arms[b][s][key] for s in seeds])


def main(root: str) -> None:
    arms = arms_of(Path(root))
    print("| algorithm | correction | k | clip_scale | backend | seeds | final | gain | " + " | ".join(STEP_MEANS)
          + " |")
    for arm in sorted(arms, key=lambda a: (a[0], a[1], int(a[2]), float(a[3]))):
        runs = [arms[arm][s] for s in sorted(arms[arm])]
        means = " | ".join(f"{np.nanmean([r[k] for r in runs]):.4g}" for k in STEP_MEANS)
        print(f"| {' | '.join(arm)} | {len(runs)} | {interval([r['final'] for r in runs])} | "
              f"{interval([r['gain'] for r in runs])} | {means} |")
    print()
    for algorithm in ("gspo", "grpo"):
        for correction in ("bypass", "decoupled"):
            for k in ("1", "2", "4", "8"):
                arm, base = (algorithm, correction, k, "1", "hf"), (algorithm, correction, "0", "1", "hf")
                print(f"H1 {algorithm} {correction} k={k} - k=0, final: {paired(arms, arm, base, 'final')}")
        for k in ("0", "1", "2", "4", "8"):
            arm, base = (algorithm, "decoupled", k, "1", "hf"), (algorithm, "bypass", k, "1", "hf")
            print(f"H3 {algorithm} k={k} decoupled - bypass, final: {paired(arms, arm, base, 'final')}; "
                  f"clip/frac: {paired(arms, arm, base, 'clip/frac')}")
    for correction in ("bypass", "decoupled"):
        print(f"H4 k=8 {correction} grpo - gspo, gain: "
              f"{paired(arms, ('grpo', correction, '8', '1', 'hf'), ('gspo', correction, '8', '1', 'hf'), 'gain')}")
        print(f"H5 k=8 {correction} gspo clip x10 - x1, final: "
              f"{paired(arms, ('gspo', correction, '8', '10', 'hf'), ('gspo', correction, '8', '1', 'hf'), 'final')}")
    # the follow-ups (2026-12-06): GSPO at k = 0, bypass - decoupled, by engine and band; seeds both arms have
    for backend, scale in (("hf", "1"), ("hf", "30"), ("vllm", "1")):
        arm, base = ("gspo", "bypass", "0", scale, backend), ("gspo", "decoupled", "0", scale, backend)
        print(f"F {backend} clip_scale={scale} k=0 gspo bypass - decoupled, final: {paired(arms, arm, base, 'final')}; "
              + "; ".join(f"{key}: {paired(arms, arm, base, key)}" for key in
                          ("clip/frac_low", "clip/frac_high", "ratio/seq/mean")))


if __name__ == "__main__":
    main(sys.argv[1])
