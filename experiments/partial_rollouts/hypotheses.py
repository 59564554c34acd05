"""The numbers experiments/partial_rollouts tests its hypotheses with, from its committed runs: per arm (algorithm,
correction, synchronous / stale / partial), the final held-out accuracy and its gain over the cold start, and the
step means (from step 2, where every arm has its full lag) of the clip fractions split by advantage sign, the
per-token staleness and the share of mixed rows; then the paired differences H1-H4 name, each a mean over seeds
with gspo-report's 95% percentile-bootstrap interval.

    python experiments/partial_rollouts/hypotheses.py experiments/partial_rollouts/runs
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

STEP_MEANS = ("clip/frac", "clip/frac_low", "clip/frac_high", "off_policy/token_staleness_mean",
              "off_policy/staleness_mean", "off_policy/mixed_frac", "mismatch/seq_log_ratio_abs",
              "behave/masked_frac")
ARMS = ("synchronous", "stale", "partial")


def interval(values: list[float]) -> str:
    found = mean_interval([v for v in values if not math.isnan(v)], seed=0)
    return "n/a" if found.low is None else f"{found.value:+.3f} [{found.low:+.3f}, {found.high:+.3f}]"


def run_numbers(run: Path) -> dict[str, float]:
    with open_metrics(run) as file:
        rows = list(csv.DictReader(file))
    evals = [float(r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") not in (None, "")]
    out = {"final": evals[-1], "gain": evals[-1] - evals[0]}
    for key in STEP_MEANS:
        values = [float(r[key]) for r in rows if r.get(key) not in (None, "") and int(r["step"]) >= 2]
        out[key] = float(np.mean(values)) if values else 0.0  # a metric the arm does not log: none stale or mixed
    return out


def arm_of(overrides: dict[str, str]) -> str:
    if overrides.get("rollout.max_staleness", "0") == "0":
        return "synchronous"
    return "stale" if overrides.get("rollout.segment_tokens", "null") == "null" else "partial"


def arms_of(root: Path) -> dict[tuple, dict[int, dict]]:
    """(algorithm, correction, arm) -> seed -> run_numbers, for every finished run dir under `root`."""
    arms: dict[tuple, dict[int, dict]] = {}
    for run in map(load_run, run_dirs(root)):
        if run.failed:
            continue
        overrides = dict(o.split("=", 1) for o in run.overrides)  # the run's, seed aside (gspo_lab.report.runs)
        arm = (overrides["algorithm"], overrides["correction"], arm_of(overrides))
        arms.setdefault(arm, {})[run.seed] = run_numbers(run.path)
    return arms


def paired(arms: dict, a: tuple, b: tuple, key: str = "final") -> str:
    """a minus b on the seeds both have."""
    seeds = sorted(set(arms.get(a, {})) & set(arms.get(b, {})))
    return interval([arms[a][s][key] - arms[b][s][key] for s in seeds]) if seeds else "n/a"


def main(root: str) -> None:
    arms = arms_of(Path(root))
    print("| algorithm | correction | arm | seeds | final | gain | " + " | ".join(STEP_MEANS) + " |")
    for arm in sorted(arms, key=lambda a: (a[0], a[1], ARMS.index(a[2]))):
        runs = [arms[arm][s] for s in sorted(arms[arm])]
        means = " | ".join(f"{np.mean([r[k] for r in runs]):.4g}" for k in STEP_MEANS)
        print(f"| {' | '.join(arm)} | {len(runs)} | {interval([r['final'] for r in runs])} | "
              f"{interval([r['gain'] for r in runs])} | {means} |")
    print()
    for algorithm in ("gspo", "grpo"):
        for correction in ("bypass", "decoupled"):
            partial, stale, sync = ((algorithm, correction, a) for a in ("partial", "stale", "synchronous"))
            print(f"{algorithm} {correction}: partial - stale {paired(arms, partial, stale)}; partial - synchronous "
                  f"{paired(arms, partial, sync)}; stale - synchronous {paired(arms, stale, sync)}; clip/frac_low "
                  f"partial - stale {paired(arms, partial, stale, 'clip/frac_low')}")
        for arm in ARMS:
            print(f"{algorithm} {arm}: decoupled - bypass "
                  f"{paired(arms, (algorithm, 'decoupled', arm), (algorithm, 'bypass', arm))}")


if __name__ == "__main__":
    main(sys.argv[1])
