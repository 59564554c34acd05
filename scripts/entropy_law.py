"""The entropy law R = -a·exp(H) + b (The Entropy Mechanism, arXiv 2505.22617) fitted on each run's first steps
and asked for the rest (gspo_lab.report.entropy_law): one markdown table per run, then per setting the mean over
seeds of the fit's R² and of the prediction's skill against the first part's mean reward and against its trend
(the reward's straight line over the first part's steps, extended).

    python scripts/entropy_law.py /tmp/studies/entropy                 # every run under the folder(s)
    python scripts/entropy_law.py /tmp/studies/entropy --fraction 0.5 --out experiments/entropy/entropy_law.md
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path

from gspo_lab.report.entropy_law import run_law
from gspo_lab.report.runs import discover


def mean(values: list[float]) -> float:
    """The mean of the finite values; NaN without one."""
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="a multirun dir, or run dirs")
    parser.add_argument("--fraction", type=float, default=0.5, help="the share of each run's steps fitted")
    parser.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    args = parser.parse_args()
    study = discover(args.dirs)
    lines = ["| setting | seed | a | b | R² (fit) | steps fitted / predicted | MAE law | MAE constant | skill | "
             "MAE trend | skill vs trend |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by_setting = defaultdict(list)
    for run in sorted((r for r in study.runs if not r.failed), key=lambda r: (r.setting, r.seed or 0)):
        fit = run_law(run.path, args.fraction)
        by_setting[run.setting].append(fit)
        lines.append(f"| {run.setting} | {run.seed} | {fit.a:.3g} | {fit.b:.3g} | {fit.r2:.2f} | "
                     f"{fit.fitted} / {fit.predicted} | {fit.mae_law:.3f} | {fit.mae_constant:.3f} | {fit.skill:.2f} | "
                     f"{fit.mae_trend:.3f} | {fit.skill_trend:.2f} |")
    lines += ["", "| setting | runs | mean R² (fit) | mean skill | runs with skill > 0 | mean skill vs trend | "
              "runs with skill vs trend > 0 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for setting, fits in by_setting.items():
        better = sum(f.skill > 0 for f in fits)
        lines.append(f"| {setting} | {len(fits)} | {mean([f.r2 for f in fits]):.2f} | "
                     f"{mean([f.skill for f in fits]):.2f} | {better} | {mean([f.skill_trend for f in fits]):.2f} | "
                     f"{sum(f.skill_trend > 0 for f in fits)} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
