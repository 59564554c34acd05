"""gspo-report's tables as pandas DataFrames: per setting and metric the mean, IQM and nominal 95% bootstrap
intervals over seeds; the collapsed runs; paired comparisons against a baseline. Numbers stay numbers in the frames
(written as CSV); `formatted` turns a row's estimate and interval into the text report.md and report.html
show."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gspo_lab.report.runs import Run, Study
from gspo_lab.report.stats import (Interval, improvement_interval, iqm_interval, mean_interval,
                                   paired_improvement_interval)

HEADLINE = ("held-out accuracy", "accuracy gain", "final reward", "clip/frac")  # the settings table's columns
PER_STEP = ("routing/changed_frac", "routing/changed_tokens_frac", "routing/override_frac",
            "routing/rollout_disagreement", "routing/rollout_disagreement_tokens", "mismatch/kl",
            "mismatch/extreme_frac", "mismatch/seq_log_ratio_abs", "mismatch/pi_old_kl", "seq ratio spread", "grad_norm",
            "entropy", "cispo/capped_frac", "sapo/gate_mean", "vespo/weight_mean", "rollout/sampling_rounds",
            "rollout/unfilled_groups")  # run value: mean over steps, where logged (the last five: the limiters
# of the objectives without clip/frac, and dynamic sampling)
PAIRED = ("held-out accuracy", "final reward")
PAIRED_OVER, UNPAIRED_OVER = "shared seeds (paired)", "all run pairs (unpaired)"  # what P(improvement) counted
CI = "nominal 95% CI"  # with few seeds the real coverage is lower: stats.percentile_coverage


def scores(study: Study, setting: str, metric: str) -> list[float]:
    """The metric's value in each run of `setting` that logged it (two runs on one seed count twice)."""
    return [value for value in (run.value(metric) for run in study.of(setting)) if not math.isnan(value)]


def _columns(prefix: str, interval: Interval) -> dict:
    return {prefix: interval.value, f"{prefix} low": interval.low, f"{prefix} high": interval.high}


def headline(metric: str = HEADLINE[0]) -> tuple[str, ...]:
    """The settings table's columns: HEADLINE, and `metric` (gspo-report --metric) after them when it is another."""
    return HEADLINE if metric in HEADLINE else (*HEADLINE, metric)


def statistics(study: Study, seed: int, metric: str = HEADLINE[0]) -> pd.DataFrame:
    """One row per (metric, setting) that has a value: seeds, mean and IQM, each with its interval. The
    routing and mismatch metrics appear where some run logged them, every evaluation set's metrics (eval/*,
    their last evaluation) where logged."""
    evaluated = sorted({key for run in study.complete for key in run.eval_metrics})
    rows = []
    for name in dict.fromkeys(headline(metric) + PER_STEP + tuple(evaluated)):
        for setting in study.settings():
            values = scores(study, setting, name)
            if values:
                rows.append({"metric": name, "setting": setting, "seeds": len(values),
                             **_columns("mean", mean_interval(values, seed)),
                             **_columns("IQM", iqm_interval(values, seed))})
    return pd.DataFrame(rows)


def settings_table(study: Study, stats: pd.DataFrame, collapse_drop: float, metric: str = HEADLINE[0]
                   ) -> pd.DataFrame:
    """One row per setting: seeds, collapsed runs, and the mean [nominal 95% CI] of each headline metric (with
    `metric`, gspo-report --metric)."""
    rows = []
    for setting in study.settings():
        runs = study.of(setting)
        row = {"setting": setting, "seeds": len(runs), "collapsed": sum(bool(r.collapsed(collapse_drop)) for r in runs),
               "reward collapsed": sum(bool(r.reward_collapsed()) for r in runs)}
        for column in headline(metric):
            found = stats[(stats.metric == column) & (stats.setting == setting)] if len(stats) else stats
            row[column] = formatted(found.iloc[0], "mean") if len(found) else "n/a (not logged)"
        rows.append(row)
    return pd.DataFrame(rows)


def _paired_values(pairs: list, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """The metric of each (setting run, baseline run) pair where both logged it: (setting's, baseline's)."""
    values = [(a.value(metric), b.value(metric)) for a, b in pairs]
    x, y = np.array([v for v in values if not any(map(math.isnan, v))]).reshape(-1, 2).T
    return x, y


def _improvement(study: Study, setting: str, baseline: str, pairs: list, seed: int) -> dict:
    """P(setting > baseline) in held-out accuracy: on the shared seeds, the share of seeds the setting wins
    (paired resampling); only where no seed is shared, over all pairs of the two settings' runs (independent
    resampling). `P(improvement) over` says which."""
    metric = PAIRED[0]
    if pairs:
        x, y = _paired_values(pairs, metric)
        estimate, over = paired_improvement_interval, PAIRED_OVER
    else:
        x, y = scores(study, setting, metric), scores(study, baseline, metric)
        estimate, over = improvement_interval, UNPAIRED_OVER
    if not len(x) or not len(y):
        return {}
    interval = estimate(x, y, seed)
    return {**_columns("P(improvement)", interval), "P(improvement) over": over,
            "P(improvement) no interval": interval.reason}


def seed_pairs(study: Study, setting: str, baseline: str) -> list[tuple[Run, Run]]:
    """(setting's run, baseline's run) for each seed both settings ran."""
    base = {run.seed: run for run in study.of(baseline) if run.seed is not None}
    return [(run, base[run.seed]) for run in study.of(setting) if run.seed in base]


def paired_differences(study: Study, setting: str, baseline: str, metric: str) -> np.ndarray:
    """Setting minus baseline in `metric` on each shared seed where both logged it."""
    x, y = _paired_values(seed_pairs(study, setting, baseline), metric)
    return x - y


def paired(study: Study, baseline: str, seed: int) -> pd.DataFrame:
    """Each other setting against `baseline` on the seeds both have: the mean paired difference of each PAIRED
    metric with its nominal 95% interval; and P(setting > baseline) in held-out accuracy with its interval."""
    rows = []
    for setting in study.settings():
        if setting == baseline:
            continue
        pairs = seed_pairs(study, setting, baseline)
        row = {"setting": setting, "shared seeds": len(pairs), "reason": "no shared seed" if not pairs else ""}
        for metric in PAIRED:
            x, y = _paired_values(pairs, metric)
            if len(x):
                row.update(_columns(f"Δ {metric}", mean_interval(x - y, seed)))
        row.update(_improvement(study, setting, baseline, pairs, seed))
        rows.append(row)
    return pd.DataFrame(rows)


def number(value: float) -> str:
    """3 decimals; 3 significant digits below 0.01 (routing change, GRPO's clip fraction, mismatch/kl).

    >>> number(0.4567), number(0.00807), number(7.2e-5), number(0.0)
    ('0.457', '0.00807', '7.2e-05', '0.000')
    """
    return f"{value:.3f}" if abs(value) >= 0.01 or value == 0 else f"{value:.3g}"


def interval_text(low: float | None, high: float | None, seeds: int) -> str:
    if low is None or pd.isna(low):
        return f"n/a ({seeds} seed)" if seeds == 1 else "n/a"
    return f"[{number(low)}, {number(high)}]"


def formatted(row: pd.Series, prefix: str, seeds_column: str = "seeds") -> str:
    """'value [low, high]', or 'value [n/a (1 seed)]'."""
    interval = interval_text(row[f"{prefix} low"], row[f"{prefix} high"], row[seeds_column])
    return f"{number(row[prefix])} {interval if interval.startswith('[') else f'[{interval}]'}"


def statistics_text(stats: pd.DataFrame) -> pd.DataFrame:
    """The statistics frame as report.md shows it: estimates and intervals in separate columns."""
    return pd.DataFrame({
        "metric": stats.metric, "setting": stats.setting, "seeds": stats.seeds,
        "mean": stats["mean"].map(number),
        f"{CI} (mean)": [interval_text(r["mean low"], r["mean high"], r.seeds) for _, r in stats.iterrows()],
        "IQM": stats["IQM"].map(number),
        f"{CI} (IQM)": [interval_text(r["IQM low"], r["IQM high"], r.seeds) for _, r in stats.iterrows()],
    })


def _cell(row: pd.Series, prefix: str) -> str:
    """A paired-table cell: 'value [low, high]', 'value [n/a (1 seed)]', or 'n/a (no shared seed)'."""
    if prefix not in row or pd.isna(row[prefix]):
        return f"n/a ({row['reason'] or 'not logged'})"
    if prefix == "P(improvement)" and pd.isna(row["P(improvement) low"]):  # a side with one run: say so
        return f"{number(row[prefix])} [n/a ({row['P(improvement) no interval']})]"
    return formatted(row, prefix, "shared seeds")


def paired_text(pairs: pd.DataFrame) -> pd.DataFrame:
    """The paired frame as report.md shows it: a setting with no shared seed says so, and P(improvement) says
    what it counted (shared seeds, or all run pairs)."""
    rows = []
    for _, row in pairs.iterrows():
        text = {"setting": row["setting"], "shared seeds": row["shared seeds"]}
        for prefix in (f"Δ {PAIRED[0]}", "P(improvement)", f"Δ {PAIRED[1]}"):
            text[prefix] = _cell(row, prefix)
            if prefix == "P(improvement)":
                over = row.get("P(improvement) over")
                text["P(improvement) over"] = "" if pd.isna(over) else over
        rows.append(text)
    return pd.DataFrame(rows)


def markdown(frame: pd.DataFrame) -> str:
    """A pipe table, one row per line, cells as they are (no padding), so rows can be searched for."""
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + " --- |" * len(frame.columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)
