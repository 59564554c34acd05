"""The numbers the study README tests its hypotheses with, from a task's committed runs: per arm, the paired gain
in held-out greedy success (last evaluation minus the cold start's, per seed), the step means of the clip and
tool metrics (and guess_number's held-out environment reward gain), and H4's per-run contrast (the mean |log w| of the model's first token after a tool result minus
that of all its tokens); each a mean over seeds with the 95% percentile-bootstrap interval gspo-report draws.

    python experiments/multi_turn/hypotheses.py experiments/multi_turn/calculator/runs
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import numpy as np
import yaml

from gspo_lab.report.run import has_metrics, open_metrics
from gspo_lab.report.stats import mean_interval

ENVIRONMENT_REWARD = "eval/heldout/reward/environment_reward/greedy"
STEP_MEANS = ("reward/mean", "clip/frac", "clip/seq_frac", "tools/call_frequency", "tools/failure_frequency",
              "turns/mean", "tokens/tool_fraction", "completion/len_mean")


def interval(values: list[float]) -> str:
    """The mean over seeds with gspo-report's bootstrap interval (gspo_lab.report.stats)."""
    found = mean_interval([v for v in values if not math.isnan(v)], seed=0)
    if found.low is None:
        return "n/a"
    return f"{found.value:+.4f} [{found.low:+.4f}, {found.high:+.4f}]"


def column(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def run_numbers(run: Path) -> dict[str, float]:
    with open_metrics(run) as file:
        rows = list(csv.DictReader(file))
    evals = column(rows, "eval/accuracy")
    out = {"gain": evals[-1] - evals[0], "first": evals[0], "last": evals[-1]}
    # guess_number: the environment's reward on the same greedy games, which counts guesses
    graded = column(rows, ENVIRONMENT_REWARD)
    out["reward_gain"] = graded[-1] - graded[0] if graded else math.nan
    for key in STEP_MEANS:
        values = column(rows, key)
        out[key] = float(np.mean(values)) if values else math.nan
    # H4: per step, the first tokens' mean |log w| (their sum per model token over their share) minus all tokens'
    after = [(float(r["ratio/after_tool/abs_log"]) / float(r["turns/after_tool_frac"]),
              float(r["ratio/token/abs_log_mean"])) for r in rows
             if r.get("turns/after_tool_frac") not in (None, "") and float(r["turns/after_tool_frac"]) > 0
             and float(r["ratio/token/abs_log_mean"]) > 0]
    out["h4_after"] = float(np.mean([a for a, _ in after])) if after else math.nan
    out["h4_all"] = float(np.mean([b for _, b in after])) if after else math.nan
    out["h4_steps_above"] = sum(a > b for a, b in after) / len(after) if after else math.nan
    return out


def main(root: str) -> None:
    arms: dict[str, dict[int, dict]] = {}
    for run in sorted(Path(root).iterdir()):
        if not has_metrics(run):
            continue
        overrides = yaml.safe_load(open(run / ".hydra/overrides.yaml"))
        seed = int(next(o for o in overrides if o.startswith("seed=")).split("=")[1])
        arm = next(o for o in overrides if o.startswith("algorithm=")).split("=")[1]
        arms.setdefault(arm, {})[seed] = run_numbers(run)
    for arm, seeds in arms.items():
        runs = [seeds[s] for s in sorted(seeds)]
        print(f"== {arm} ({len(runs)} seeds)")
        last = ", ".join(f"{r['last']:.2f}" for r in runs)
        print(f"  held-out success: first {runs[0]['first']:.2f}, last per seed {last}; "
              f"paired gain {interval([r['gain'] for r in runs])}")
        if not math.isnan(runs[0]["reward_gain"]):
            print(f"  held-out environment reward: paired gain {interval([r['reward_gain'] for r in runs])}")
        for key in STEP_MEANS:
            print(f"  {key} (step mean): {interval([r[key] for r in runs])}")
        print(f"  H4 first-after-tool |log w| minus all: {interval([r['h4_after'] - r['h4_all'] for r in runs])}; "
              f"means {np.nanmean([r['h4_after'] for r in runs]):.5f} vs {np.nanmean([r['h4_all'] for r in runs]):.5f}; "
              f"share of steps above {np.nanmean([r['h4_steps_above'] for r in runs]):.2f}")
    if "gspo" in arms:
        for arm in arms:
            if arm != "gspo" and set(arms[arm]) == set(arms["gspo"]):
                for key in ("gain", "reward_gain", "clip/frac", "clip/seq_frac"):
                    d = [arms[arm][s][key] - arms["gspo"][s][key] for s in sorted(arms[arm])]
                    print(f"{arm} minus gspo, {key}: {interval(d)}")


if __name__ == "__main__":
    main(sys.argv[1])
