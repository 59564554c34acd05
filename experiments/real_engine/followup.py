"""The 2026-11-28 follow-up's numbers (README, "Follow-up"), from its committed runs: per arm (A-G: which engine
sampled, which gave π_old), the final held-out accuracy and its change from step 0, and the step means of the clip
fraction, the engine mismatch and the rescoring's shift; then the paired differences the hypotheses name (C - D,
A - B, E - B, E - A, F - G), each a mean over the seeds both arms ran, with gspo-report's 95% percentile-bootstrap
interval, and the per-seed values.

    python experiments/real_engine/followup.py experiments/real_engine/followup/runs
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import numpy as np
import yaml

from gspo_lab.report.run import open_metrics
from gspo_lab.report.stats import mean_interval

# sweep folder -> arm, or (arm when rollout.logprobs_from_generation=true, arm when false)
ARMS = {"seeds0_4": ("A", "B"), "seeds5_9": ("A", "B"), "fp32": ("C", "D"), "vllm_samples_sim_logp": "E",
        "sim_samples_vllm_logp": "F", "simulated": "G"}
NAMES = {"A": "vLLM bf16 samples, vLLM's π_old", "B": "vLLM bf16 samples, trainer π_old",
         "C": "vLLM fp32 samples, vLLM's π_old", "D": "vLLM fp32 samples, trainer π_old",
         "E": "vLLM bf16 samples, simulated engine's π_old", "F": "simulated samples, vLLM's π_old",
         "G": "simulated samples, simulated engine's π_old"}
CONTRASTS = (("C", "D"), ("A", "B"), ("E", "B"), ("E", "A"), ("F", "G"))
STEP_MEANS = ("clip/frac", "mismatch/seq_log_ratio_abs", "rescore/seq_log_ratio_abs")


def interval(values: list[float], digits: int = 3) -> str:
    """The mean with gspo-report's bootstrap interval (gspo_lab.report.stats)."""
    found = mean_interval(values, seed=0)
    if found.low is None:
        return f"{np.mean(values):+.{digits}f}" if values else "n/a"
    return f"{found.value:+.{digits}f} [{found.low:+.{digits}f}, {found.high:+.{digits}f}]"


def run_numbers(run: Path) -> tuple[str, int, dict[str, float]]:
    """The run's arm, seed, final accuracy, its change from step 0, and the step means of STEP_MEANS."""
    overrides = dict(o.split("=", 1) for o in yaml.safe_load(open(run / ".hydra" / "overrides.yaml")))
    arm = ARMS[run.parent.name]
    if isinstance(arm, tuple):
        arm = arm[0] if overrides["rollout.logprobs_from_generation"].lower() == "true" else arm[1]
    summary = json.load(open(run / "summary.json"))
    numbers = {"final": summary["eval/accuracy_after"],
               "change": summary["eval/accuracy_after"] - summary["eval/accuracy_before"]}
    with open_metrics(run) as f:
        rows = list(csv.DictReader(f))
    for key in STEP_MEANS:
        values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
        numbers[key] = float(np.mean(values)) if values else math.nan
    return arm, int(overrides["seed"]), numbers


def main(root: Path) -> None:
    arms: dict[str, dict[int, dict[str, float]]] = {}
    for summary in sorted(root.glob("*/*/summary.json")):
        arm, seed, numbers = run_numbers(summary.parent)
        arms.setdefault(arm, {})[seed] = numbers
    print("| arm | samples, π_old | seeds | final held-out | change from step 0 | clip/frac | "
          "mismatch/seq_log_ratio_abs | rescore/seq_log_ratio_abs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for arm in sorted(arms):
        runs = arms[arm].values()
        means = [np.mean([r[key] for r in runs]) for key in STEP_MEANS]
        print(f"| {arm} | {NAMES[arm]} | {len(runs)} | {interval([r['final'] for r in runs])} | "
              f"{interval([r['change'] for r in runs])} | {means[0]:.3f} | {means[1]:.2e} | "
              + ("" if math.isnan(means[2]) else f"{means[2]:.2e}") + " |")
    print("\n| contrast | seeds | Δ final held-out | per seed | seeds below 0 |")
    print("| --- | --- | --- | --- | --- |")
    for a, b in CONTRASTS:
        if a not in arms or b not in arms:
            continue
        seeds = sorted(set(arms[a]) & set(arms[b]))
        deltas = [arms[a][s]["final"] - arms[b][s]["final"] for s in seeds]
        print(f"| {a} − {b} | {len(seeds)} | {interval(deltas)} | {', '.join(f'{d:+.4f}' for d in deltas)} | "
              f"{sum(d < 0 for d in deltas)} of {len(deltas)} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "followup" / "runs"))
