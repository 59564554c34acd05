"""The study README's numbers per arm: each control against its own algorithm's uncontrolled arm on the same seeds
(gspo-report takes one baseline for all settings, and here GRPO's and GSPO's arms each have their own), and the
entropy collapse criterion and hypotheses H1, H3, H4 and H5 as the README states them before the runs.

Per run: the mean `entropy` over its 30 steps, the means of its first and last 5 steps, its final held-out
accuracy (summary.json). Paired differences are means over seeds with 95% percentile-bootstrap intervals (9,999
resamples, seed 0, as gspo-report).

    python experiments/entropy/arms.py experiments/entropy/runs --plot experiments/entropy/entropy_curves.png

`--plot`: each arm's entropy over the steps, the mean over seeds, GRPO's arms beside GSPO's.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml
from scipy.stats import bootstrap

from gspo_lab.report.run import read_metrics, series

GSPO_FAMILY = {"gspo", "gspo_token", "gspo_clip_cov", "gspo_kl_cov"}
COV = {"clip_cov": "Clip-Cov", "gspo_clip_cov": "Clip-Cov", "kl_cov": "KL-Cov", "gspo_kl_cov": "KL-Cov"}
ARMS = ["none", "bonus", "adaptive", "top-20%", "Clip-Cov", "KL-Cov"]


def arm_of(overrides: dict[str, str]) -> tuple[str, str]:
    """(algorithm family, arm) of a run's overrides."""
    algorithm = overrides["algorithm"]
    family = "GSPO" if algorithm in GSPO_FAMILY else "GRPO"
    if algorithm in COV:
        return family, COV[algorithm]
    if "objective.top_entropy_quantile" in overrides:
        return family, "top-20%"
    if "objective.entropy_target" in overrides:
        return family, "adaptive"
    if "objective.entropy_coef" in overrides:
        return family, "bonus"
    return family, "none"


def load(roots: list[Path]) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """{(family, arm): {seed: the run's figures}} of every finished run under `roots`."""
    runs: dict[tuple[str, str], dict[int, dict[str, float]]] = defaultdict(dict)
    for summary in sorted(p for root in roots for p in root.rglob("summary.json")):
        folder = summary.parent
        overrides = dict(o.split("=", 1) for o in yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text()))
        _, entropy = series(read_metrics(folder), "entropy")
        runs[arm_of(overrides)][int(overrides["seed"])] = {"curve": entropy,
            "mean entropy": float(np.mean(entropy)), "first 5": float(np.mean(entropy[:5])),
            "last 5": float(np.mean(entropy[-5:])), "held-out": json.loads(summary.read_text())["eval/accuracy_after"],
        }
    return runs


def paired(setting: dict[int, dict], baseline: dict[int, dict], key: str) -> str:
    seeds = sorted(set(setting) & set(baseline))
    d = np.array([setting[s][key] - baseline[s][key] for s in seeds])
    ci = bootstrap((d,), np.mean, n_resamples=9999, method="percentile", random_state=0).confidence_interval
    return f"{d.mean():+.4f} [{ci.low:+.4f}, {ci.high:+.4f}] ({len(seeds)} seeds)"


def plot(runs: dict[tuple[str, str], dict[int, dict]], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, family in zip(axes, ("GRPO", "GSPO")):
        for arm in ARMS:
            found = runs.get((family, arm))
            if found:
                steps = min(len(r["curve"]) for r in found.values())
                ax.plot(np.mean([r["curve"][:steps] for r in found.values()], axis=0), label=arm)
        ax.set_title(f"{family}: mean entropy over {len(runs.get((family, 'none'), {}))} seeds")
        ax.set_xlabel("RL step")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("entropy (nats per completion token)")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="+", type=Path, help="folders holding the study's run dirs")
    parser.add_argument("--plot", type=Path, help="write the entropy curves to this image")
    args = parser.parse_args()
    runs = load(args.roots)
    if args.plot:
        plot(runs, args.plot)
    print("| algorithm | arm | seeds | mean entropy | first 5 -> last 5 steps | entropy collapsed | last 5 < first 5 "
          "| held-out | Δ mean entropy vs none | Δ held-out vs none |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for family in ("GRPO", "GSPO"):
        none = runs.get((family, "none"), {})
        for arm in ARMS:
            found = runs.get((family, arm))
            if not found:
                continue
            mean = {k: np.mean([r[k] for r in found.values()]) for k in ("mean entropy", "first 5", "last 5",
                                                                          "held-out")}
            collapsed = sum(r["last 5"] < r["first 5"] / 2 for r in found.values())
            falling = sum(r["last 5"] < r["first 5"] for r in found.values())
            versus = ("", "") if arm == "none" else (paired(found, none, "mean entropy"),
                                                     paired(found, none, "held-out"))
            print(f"| {family} | {arm} | {len(found)} | {mean['mean entropy']:.4f} | {mean['first 5']:.4f} -> "
                  f"{mean['last 5']:.4f} | {collapsed} | {falling} | {mean['held-out']:.3f} | {versus[0]} | "
                  f"{versus[1]} |")
    if ("GSPO", "none") in runs and ("GRPO", "none") in runs:
        print("\nH5, GSPO none minus GRPO none, mean entropy of the last 5 steps: "
              + paired(runs["GSPO", "none"], runs["GRPO", "none"], "last 5"))


if __name__ == "__main__":
    main()
