"""The clip_lr README's numbers that gspo-report's grid does not print: H3 (how GSPO's sequence-ratio spread grows
with the learning rate), H5 (GSPO with a widened clip against GRPO at its paper range) and the evidence for a
clip-fraction warning (does a GSPO run's clip/frac over its first steps tell that a wider clip learns more?).

Runs are read from `ROOT/<task>/runs/` (the committed layout; run.sh's `OUT/<task>/` works too). Paired differences
are means over shared seeds with 95% percentile-bootstrap intervals (gspo-report's, stats.mean_interval).

    python experiments/clip_lr/analysis.py experiments/clip_lr   # reads byo/runs, default/runs, low_start/runs
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from gspo_lab.report.run import series
from gspo_lab.report.runs import discover
from gspo_lab.report.stats import mean_interval

EARLY = 10  # RL steps: the warning's window


def load(root: Path) -> dict[tuple[str, str, float, float], dict[int, dict[str, float]]]:
    """{(task, algorithm, lr, clip_scale): {seed: figures}} of every finished run under root/<task>/(runs/)."""
    cells: dict[tuple, dict[int, dict[str, float]]] = defaultdict(dict)
    for task_dir in sorted(p for p in root.iterdir() if p.is_dir() and any(p.rglob("summary.json"))):
        for run in discover([task_dir / "runs" if (task_dir / "runs").is_dir() else task_dir]).complete:
            o = dict(item.split("=", 1) for item in run.overrides)
            _, clip = series(run.rows, "clip/frac")
            cells[(task_dir.name, o["algorithm"], float(o["train.lr"]), float(o["clip_scale"]))][run.seed] = {
                "held-out": run.value("held-out accuracy"), "spread": run.value("seq ratio spread"),
                "early clip": float(np.mean(clip[:EARLY])) if clip else math.nan}
    return cells


def interval(values: list[float]) -> str:
    found = mean_interval(values, 0)
    if found.low is None:
        return f"{found.value:+.3f}"
    return f"{found.value:+.3f} [{found.low:+.3f}, {found.high:+.3f}]"


def paired(a: dict[int, dict], b: dict[int, dict], key: str = "held-out") -> list[float]:
    return [a[s][key] - b[s][key] for s in sorted(set(a) & set(b))]


def slopes(cells: dict, task: str) -> str:
    """Log-log slope of GSPO's spread against lr at clip_scale 100: of the cell means, and per seed."""
    lrs = sorted(lr for (t, a, lr, c) in cells if t == task and a == "gspo" and c == 100.0)
    if len(lrs) < 2:
        return f"{task}: fewer than 2 learning rates at clip_scale=100"
    runs = [cells[(task, "gspo", lr, 100.0)] for lr in lrs]
    means = [np.mean([r["spread"] for r in cell.values()]) for cell in runs]
    slope = np.polyfit(np.log(lrs), np.log(means), 1)[0]
    seeds = sorted(set.intersection(*(set(cell) for cell in runs)))
    per_seed = [np.polyfit(np.log(lrs), np.log([cell[s]["spread"] for cell in runs]), 1)[0] for s in seeds]
    spread = ", ".join(f"{lr:g}: {m:.4f}" for lr, m in zip(lrs, means))
    return (f"{task}: spread at clip_scale=100 by lr ({spread}); log-log slope of the means {slope:.2f}, per seed "
            f"{interval(per_seed)} ({len(seeds)} seeds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    args = parser.parse_args()
    cells = load(args.root)
    tasks = sorted({t for t, *_ in cells})
    print("H3: GSPO's sequence-ratio spread (mean over steps of ratio/seq/max - min) against the learning rate")
    for task in tasks:
        print("  " + slopes(cells, task))
    print("\nH5: at lr 1e-4, GSPO widened minus GRPO at its paper range (held-out accuracy, shared seeds)")
    for task in tasks:
        grpo = cells.get((task, "grpo", 1e-4, 1.0))
        for clip in (10.0, 100.0):
            gspo = cells.get((task, "gspo", 1e-4, clip))
            if grpo and gspo:
                print(f"  {task}: GSPO clip_scale={clip:g} - GRPO clip_scale=1: {interval(paired(gspo, grpo))}")
    print("\nPer lr: each GSPO clip_scale minus GRPO at its paper range (held-out accuracy, shared seeds)")
    for task in tasks:
        for lr in sorted({lr for (t, a, lr, c) in cells if t == task}):
            grpo = cells.get((task, "grpo", lr, 1.0))
            found = [f"x{clip:g} {interval(paired(cells[(task, 'gspo', lr, clip)], grpo))}"
                     for clip in (1.0, 10.0, 100.0) if grpo and (task, "gspo", lr, clip) in cells]
            if found:
                print(f"  {task:8s} lr {lr:<7g} " + "; ".join(found))
    print(f"\nWarning: a GSPO cell's mean clip/frac over its first {EARLY} steps, and what the next wider clip "
          "gained over it (held-out accuracy, shared seeds)")
    print("  task     lr      clip  early clip/frac  wider  Δ held-out [95% CI]")
    rows = []
    for (task, algorithm, lr, clip), cell in sorted(cells.items()):
        wider = cells.get((task, algorithm, lr, clip * 10))
        if algorithm != "gspo" or wider is None:
            continue
        early = np.mean([r["early clip"] for r in cell.values()])
        gained = paired(wider, cell)
        found = mean_interval(gained, 0)
        rows.append((early, found.low is not None and found.low > 0))
        print(f"  {task:8s} {lr:<7g} {clip:<5g} {early:15.3f}  {clip * 10:<5g}  {interval(gained)}")
    above = [e for e, won in rows if won]
    below = [e for e, won in rows if not won]
    if above and below:
        print(f"\n  widening helped (interval above 0) at early clip/frac {min(above):.3f}-{max(above):.3f}; "
              f"not at {min(below):.3f}-{max(below):.3f}"
              + (": a threshold separates them" if min(above) > max(below) else ": no threshold separates them"))


if __name__ == "__main__":
    main()
