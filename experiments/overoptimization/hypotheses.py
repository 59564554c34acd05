"""The numbers experiments/overoptimization tests its hypotheses with, from its committed runs: per arm (algorithm,
objective.beta), the proxy (reward/mean), the gold reward (reward/gold) and d = sqrt(kl/to_initial) as 25-step
window means; which runs over-optimise by the README's criterion; the paired differences H2 and H3 name; and Gao et
al.'s fit gold(d) = g0 + d(alpha - beta_rm log d) per algorithm, with intervals from seeds resampled. Each interval is
a mean over seeds with gspo-report's 95% percentile-bootstrap interval.

    python experiments/overoptimization/hypotheses.py experiments/overoptimization/runs \
        [--figure experiments/overoptimization/gold_vs_d.png]
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np
import yaml

from gspo_lab.report.run import open_metrics
from gspo_lab.report.runs import run_dirs
from gspo_lab.report.stats import mean_interval

WINDOW = 25  # steps per window mean
FINE = 5  # steps per window of the exploratory look at the first steps (chosen after the grid) and the figure
DROP = 0.03  # the criterion's fall of the gold from its best window
KEYS = ("algorithm", "objective.beta")


def interval(values: list[float], digits: int = 3) -> str:
    found = mean_interval([v for v in values if not math.isnan(v)], seed=0)
    if found.low is None:
        return "n/a"
    return f"{found.value:+.{digits}f} [{found.low:+.{digits}f}, {found.high:+.{digits}f}]"


def steps_of(rows: list[dict], key: str) -> np.ndarray:
    """The per-step values of `key` (rows that log a step's reward), in step order."""
    return np.array([float(r[key]) for r in rows if r.get("reward/mean") not in (None, "")])


def windows(values: np.ndarray, width: int = WINDOW) -> np.ndarray:
    return values[: len(values) // width * width].reshape(-1, width).mean(axis=1)


def curves(steps: dict[str, np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(proxy, gold, d) as window means of `width` steps, d the square root of the window's mean KL."""
    return (windows(steps["proxy"], width), windows(steps["gold"], width),
            np.sqrt(np.clip(windows(steps["kl"], width), 0.0, None)))


def run_numbers(run: Path) -> dict:
    with open_metrics(run) as file:
        rows = list(csv.DictReader(file))
    steps = {key: steps_of(rows, metric) for key, metric in
             (("proxy", "reward/mean"), ("gold", "reward/gold"), ("kl", "kl/to_initial"))}
    proxy, gold, d = curves(steps, WINDOW)
    fine = dict(zip(("proxy_fine", "gold_fine", "d_fine"), curves(steps, FINE)))
    evals = [float(r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") not in (None, "")]
    peak = int(gold.argmax())
    return {"proxy": proxy, "gold": gold, "d": d, "peak_window": peak, **fine,
            "heldout_step25": evals[1] - evals[0], "peak_fine": int(fine["gold_fine"].argmax()),
            "over": bool(gold[-1] < gold[peak] - DROP and proxy[-1] > proxy[peak]),
            "proxy_rise": proxy[-1] - proxy[0], "gold_first": gold[0], "gold_best": gold[peak],
            "gold_final": gold[-1], "d_final": d[-1], "heldout_final": evals[-1], "heldout_gain": evals[-1] - evals[0],
            "clip": float(np.mean(steps_of(rows, "clip/frac")))}


def arms_of(root: Path) -> dict[tuple, dict[int, dict]]:
    """(algorithm, beta) -> seed -> run_numbers, for every finished run dir under `root`."""
    arms: dict[tuple, dict[int, dict]] = {}
    for run in run_dirs(root):
        if not (run / "summary.json").exists():  # a run still going, or failed
            continue
        overrides = dict(o.split("=", 1) for o in yaml.safe_load(open(run / ".hydra/overrides.yaml")))
        arm = (overrides["algorithm"], float(overrides["objective.beta"]))
        arms.setdefault(arm, {})[int(overrides["seed"])] = run_numbers(run)
    return arms


def paired(arms: dict, a: tuple, b: tuple, key: str) -> str:
    """a minus b on the seeds both have."""
    if a not in arms or b not in arms:
        return "n/a"
    return interval([arms[a][s][key] - arms[b][s][key] for s in sorted(set(arms[a]) & set(arms[b]))])


def fit(runs: list[dict]) -> np.ndarray:
    """(g0, alpha, beta_rm) of gold = g0 + alpha d - beta_rm d log d, least squares over the runs' windows."""
    d = np.concatenate([r["d"] for r in runs])
    gold = np.concatenate([r["gold"] for r in runs])
    dlogd = np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)
    features = np.stack([np.ones_like(d), d, -dlogd], axis=1)
    return np.linalg.lstsq(features, gold, rcond=None)[0]


def peak_d(alpha: float, beta_rm: float) -> float:
    """d* = exp(alpha / beta_rm - 1), where the fitted gold is highest (none where beta_rm <= 0)."""
    return math.exp(alpha / beta_rm - 1) if beta_rm > 0 and alpha / beta_rm < 50 else math.nan


def fit_with_intervals(runs: list[dict], draws: int = 1000) -> str:
    point = fit(runs)
    rng = np.random.default_rng(0)
    resampled = np.array([fit([runs[i] for i in rng.integers(0, len(runs), len(runs))]) for _ in range(draws)])
    low, high = np.percentile(resampled, [2.5, 97.5], axis=0)
    names = ("g0", "alpha", "beta_rm")
    parts = [f"{n} {p:+.3f} [{lo:+.3f}, {hi:+.3f}]" for n, p, lo, hi in zip(names, point, low, high)]
    stars = [peak_d(a, b) for a, b in resampled[:, 1:]]
    finite = [s for s in stars if not math.isnan(s)]
    star = f"d* {peak_d(*point[1:]):.3f}, finite in {len(finite)}/{draws} draws"
    if finite:
        star += f", their 2.5-97.5% {np.percentile(finite, 2.5):.3f}-{np.percentile(finite, 97.5):.3f}"
    return "; ".join(parts) + f"; {star}"


def figure(arms: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    colours = {0.0: "tab:red", 0.04: "tab:orange", 0.4: "tab:blue"}
    for (algorithm, beta), seeds in sorted(arms.items()):
        runs = list(seeds.values())
        d = np.mean([r["d_fine"] for r in runs], axis=0)
        style = "-" if algorithm == "gspo" else "--"
        for ax, key in zip(axes, ("gold", "proxy")):
            ax.plot(d, np.mean([r[f"{key}_fine"] for r in runs], axis=0), style, marker="o", ms=2,
                    color=colours.get(beta, "k"), label=f"{algorithm} β={beta:g}")
    axes[0].set(xlabel="d = sqrt(KL to the initial policy)", ylabel="gold reward (checker), window mean")
    axes[1].set(xlabel="d = sqrt(KL to the initial policy)", ylabel="proxy reward (reward model), window mean")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{FINE}-step windows, mean over seeds 0-4")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--figure", type=Path, default=None)
    args = parser.parse_args()
    arms = arms_of(args.runs)
    columns = ("proxy_rise", "gold_first", "gold_best", "gold_final", "d_final", "heldout_final", "heldout_gain",
               "clip")
    print("| algorithm | beta | seeds | over-optimised | peak window | " + " | ".join(columns) + " |")
    print("|" + " --- |" * (5 + len(columns)))
    for arm in sorted(arms):
        runs = [arms[arm][s] for s in sorted(arms[arm])]
        over = sum(r["over"] for r in runs)
        peaks = ",".join(str(r["peak_window"] + 1) for r in runs)
        cells = " | ".join(interval([r[k] for r in runs]) for k in columns)
        print(f"| {arm[0]} | {arm[1]:g} | {len(runs)} | {over}/{len(runs)} | {peaks} | {cells} |")
    print()
    for algorithm in ("gspo", "grpo"):
        for beta in (0.04, 0.4):
            arm, base = (algorithm, beta), (algorithm, 0.0)
            print(f"H2 {algorithm} beta={beta:g} - beta=0: d_final {paired(arms, arm, base, 'd_final')}; "
                  f"gold_final {paired(arms, arm, base, 'gold_final')}")
    for beta in (0.0, 0.04, 0.4):
        print(f"H3 beta={beta:g} gspo - grpo: d_final {paired(arms, ('gspo', beta), ('grpo', beta), 'd_final')}; "
              f"peak window {paired(arms, ('gspo', beta), ('grpo', beta), 'peak_window')}")
    print()
    for algorithm in ("gspo", "grpo"):
        if (algorithm, 0.0) in arms:
            print(f"H4 {algorithm} beta=0: {fit_with_intervals(list(arms[(algorithm, 0.0)].values()))}")
    print()
    for arm in sorted(arms):  # exploratory, chosen after the grid: does the gold rise in the first steps at all?
        runs = [arms[arm][s] for s in sorted(arms[arm])]
        first = np.mean([r["gold_fine"][:4] for r in runs], axis=0)
        print(f"E {arm[0]} beta={arm[1]:g}: gold in the first four {FINE}-step windows {np.round(first, 3).tolist()}, "
              f"peak window ({FINE} steps) {','.join(str(r['peak_fine'] + 1) for r in runs)}; held-out greedy "
              f"accuracy at step 25 - step 0 {interval([r['heldout_step25'] for r in runs])}")
        slopes = [np.polyfit(r["d_fine"], r["proxy_fine"], 1)[0] for r in runs]
        print(f"  proxy gained per unit of d (slope over the {FINE}-step windows, per seed) {interval(slopes)}")
    if args.figure is not None:
        figure(arms, args.figure)


if __name__ == "__main__":
    main()
