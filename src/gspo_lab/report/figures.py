"""gspo-report's figures: per-setting curves (mean over seeds with a 95% bootstrap band, collapsed runs marked
with an x at their last point) and the performance profile of final held-out accuracy."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from gspo_lab.report.run import is_set_metric, series  # noqa: E402
from gspo_lab.report.runs import Study  # noqa: E402
from gspo_lab.report.stats import band, performance_profile  # noqa: E402
from gspo_lab.report.tables import scores  # noqa: E402

CURVES = {  # file -> (metric, y label, log scale, smoothing window)
    "reward_curves.png": ("reward/mean", "reward/mean (sampled)", False, 10),
    "eval_curves.png": ("eval/accuracy", "held-out accuracy (greedy)", False, 1),
    "clip_frac.png": ("clip/frac", "clip/frac (log)", True, 10),
    "routing_change.png": ("routing/changed_frac", "routing/changed_frac (log)", True, 10),
}
PROFILE = "performance_profile.png"


def eval_set_curves(study: Study, metric: str) -> dict[str, tuple]:
    """One curve per evaluation set the runs logged (eval_<set>.png): the metric gspo-report --metric names
    (eval/<set>/pass@1 -> pass@1 on every set), or greedy accuracy."""
    suffix = metric.split("/", 2)[2] if is_set_metric(metric) else "greedy"
    sets = dict.fromkeys(name for run in study.complete for name in run.eval_sets())
    return {f"eval_{name}.png": (f"eval/{name}/{suffix}", f"eval/{name}/{suffix}", False, 1) for name in sets}
COLLAPSED = {"marker": "x", "markersize": 9, "markeredgewidth": 2, "linestyle": "none"}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (fewer at the start)."""
    return [float(np.mean(values[max(0, i - window + 1) : i + 1])) for i in range(len(values))]


def _finish(fig, ax, drawn: bool, out: Path, xlabel: str, ylabel: str, marked: bool = False) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        handles, _ = ax.get_legend_handles_labels()
        if marked:
            handles.append(Line2D([], [], color="black", label="collapsed run (last point)", **COLLAPSED))
        ax.legend(handles=handles, fontsize=7, loc="best")
    fig.tight_layout()
    if drawn:
        fig.savefig(out, dpi=110)
    plt.close(fig)


def curves(study: Study, metric: str, ylabel: str, log_scale: bool, window: int, out: Path, seed: int,
           collapsed: set[Path]) -> bool:
    """Mean over seeds with a 95% bootstrap band, one line per setting, an x at the last point of each run in
    `collapsed`; False (and no file written) if no run logged `metric`."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = marked = False
    for setting in study.settings():
        logged = [(run, *series(run.rows, metric)) for run in study.of(setting)]
        logged = [(run, steps, smooth(values, window)) for run, steps, values in logged if values]
        if not logged:
            continue
        length = min(len(values) for _, _, values in logged)
        steps = logged[0][1][:length]
        stacked = np.array([values[:length] for _, _, values in logged])  # [runs, steps]
        low, high = band(stacked, seed)
        line, = ax.plot(steps, stacked.mean(axis=0), label=f"{setting} (n={len(logged)})")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
        for run, run_steps, values in logged:
            if run.path in collapsed:
                ax.plot(run_steps[-1], values[-1], color=line.get_color(), **COLLAPSED)
                marked = True
        drawn = True
    if log_scale and ax.dataLim.ymax > 0:  # a metric that stayed 0 (one update per step: no clipping) stays linear
        ax.set_yscale("log")
    _finish(fig, ax, drawn, out, "RL step", ylabel, marked)
    return drawn


def profile(study: Study, out: Path, seed: int) -> bool:
    """The fraction of each setting's runs whose final held-out accuracy is above τ, for τ in [0, 1], with a
    95% bootstrap band (rliable's performance profile); False (and no file) if no run has a held-out accuracy."""
    thresholds = np.linspace(0.0, 1.0, 201)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = False
    for setting in study.settings():
        finals = scores(study, setting, "held-out accuracy")
        if not finals:
            continue
        fractions, low, high = performance_profile(finals, thresholds, seed)
        line, = ax.step(thresholds, fractions, where="post", label=f"{setting} (n={len(finals)})")
        ax.fill_between(thresholds, low, high, step="post", color=line.get_color(), alpha=0.15)
        drawn = True
    ax.set_ylim(-0.02, 1.02)
    _finish(fig, ax, drawn, out, "held-out accuracy threshold τ", "fraction of runs with final accuracy > τ")
    return drawn
