"""gspo-report --grid ROW,COLUMN: a study laid out on two of its swept keys (e.g. `train.lr,clip_scale`), one panel
per value of the keys left (e.g. `algorithm=gspo`, `algorithm=grpo`). Per panel and headline metric a table, each
cell the mean over seeds [nominal 95% CI]; per panel the paired difference in held-out accuracy of each cell
against its row's baseline column on shared seeds; and per metric a heatmap with a panel each
(grid_<metric>.png). A panel's columns need not match another's (GSPO's clip scales 1, 10, 100 beside GRPO's
0.5, 1, 2)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import patheffects  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from gspo_lab.report.runs import Study, natural_key  # noqa: E402
from gspo_lab.report.stats import mean_interval  # noqa: E402
from gspo_lab.report.tables import CI, formatted, number, paired_differences  # noqa: E402

GRID_METRICS = ("held-out accuracy", "accuracy gain", "clip/frac", "seq ratio spread")
LOG_SCALE = {"clip/frac"}  # spans orders of magnitude between objectives


class UnknownGridKey(ValueError):
    """--grid names a key some setting does not set; the message lists the keys the settings do set."""


@dataclass(frozen=True)
class Cell:
    panel: str  # the other keys' values, "key=value ..."; "" when no other key varies
    row: str
    column: str
    setting: str  # the study's setting the cell shows


def overrides_of(study: Study, setting: str) -> dict[str, str]:
    """key -> value of the overrides a setting's runs share (its own and the study's shared ones)."""
    return dict(item.split("=", 1) for item in study.of(setting)[0].overrides)


def cells(study: Study, row: str, column: str) -> list[Cell]:
    """Every setting as a cell of the grid; a setting without `row` or `column` among its overrides is refused."""
    found = []
    for setting in study.settings():
        overrides = overrides_of(study, setting)
        missing = [key for key in (row, column) if key not in overrides]
        if missing:
            keys = sorted({key for s in study.settings() for key in overrides_of(study, s)})
            raise UnknownGridKey(f"--grid={row},{column}: setting {setting!r} does not set {', '.join(missing)}; "
                                 f"the keys the settings set: {', '.join(keys)}")
        panel = " ".join(f"{k}={v}" for k, v in sorted(overrides.items())
                         if k not in (row, column) and f"{k}={v}" not in study.shared)
        found.append(Cell(panel, overrides[row], overrides[column], setting))
    return found


def check_baseline(study: Study, row: str, column: str, baseline: str | None) -> None:
    """Refuses a --grid-baseline that is no panel's column value, naming the values there are."""
    columns = ordered(c.column for c in cells(study, row, column))
    if baseline is not None and baseline not in columns:
        raise UnknownGridKey(f"--grid-baseline={baseline!r} is no value of {column}; its values: {', '.join(columns)}")


def ordered(values) -> list[str]:
    return sorted(set(values), key=natural_key)


def paired_delta(study: Study, setting: str, baseline: str, seed: int) -> str:
    """Mean held-out accuracy of `setting` minus `baseline` over their shared seeds [interval]."""
    differences = paired_differences(study, setting, baseline, "held-out accuracy")
    if not len(differences):
        return "n/a (no shared seed)"
    interval = mean_interval(differences, seed)
    low = (f"[{interval.low:+.3f}, {interval.high:+.3f}]" if interval.low is not None
           else f"[n/a ({len(differences)} seed)]")
    return f"{interval.value:+.3f} {low}"


def tables(study: Study, stats: pd.DataFrame, row: str, column: str, baseline: str | None, seed: int
           ) -> list[tuple[str, list[str], pd.DataFrame]]:
    """The report's grid sections: per panel, one table per GRID_METRICS entry a run logged, then the paired
    differences against `baseline` (a column value; default each panel's first column)."""
    grid = cells(study, row, column)
    sections = []
    for panel in ordered(c.panel for c in grid):
        mine = {(c.row, c.column): c.setting for c in grid if c.panel == panel}
        rows, columns = ordered(r for r, _ in mine), ordered(c for _, c in mine)
        name = f" ({panel})" if panel else ""
        for metric in GRID_METRICS:
            found = stats[stats.metric == metric] if len(stats) else stats
            by_setting = {r.setting: formatted(r, "mean") for _, r in found.iterrows()}
            if not any(s in by_setting for s in mine.values()):
                continue
            frame = pd.DataFrame([{row: r, **{f"{column}={c}": by_setting.get(mine.get((r, c)), "")
                                               for c in columns}} for r in rows])
            sections.append((f"Grid: {metric}{name}", [f"Mean over seeds [{CI}], rows `{row}`, columns "
                                                       f"`{column}`."], frame))
        reference = baseline if baseline is not None else columns[0]
        if reference not in columns:
            continue  # this panel has no such column: no paired table, said by its absence

        def delta(r: str, c: str) -> str:
            if c == reference or (r, c) not in mine or (r, reference) not in mine:
                return ""
            return paired_delta(study, mine[(r, c)], mine[(r, reference)], seed)

        frame = pd.DataFrame([{row: r, **{f"{column}={c}": delta(r, c) for c in columns}} for r in rows])
        sections.append((f"Grid: paired Δ held-out accuracy against {column}={reference}{name}", [
            f"Each cell minus the cell of its row at `{column}={reference}`, on the seeds both ran: mean [{CI}]."],
            frame))
    return sections


def slug(metric: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", metric.lower()).strip("_")


def heatmaps(study: Study, row: str, column: str, out: Path) -> list[str]:
    """grid_<metric>.png per GRID_METRICS entry a run logged: a panel per panel of the grid on one colour scale,
    each cell the mean over seeds, written in it; returns the files drawn."""
    grid = cells(study, row, column)
    panels = ordered(c.panel for c in grid)
    drawn = []
    for metric in GRID_METRICS:
        means = {c: np.mean([v for v in (r.value(metric) for r in study.of(c.setting)) if not math.isnan(v)] or
                            [math.nan]) for c in grid}
        if all(math.isnan(v) for v in means.values()):
            continue
        finite = np.array([v for v in means.values() if math.isfinite(v)])  # one colour scale for every panel
        positive = finite[finite > 0]
        norm = (LogNorm(positive.min(), positive.max()) if metric in LOG_SCALE and positive.size > 1
                else plt.Normalize(finite.min(), finite.max()))
        figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            mine = {(c.row, c.column): means[c] for c in grid if c.panel == panel}
            rows, columns = ordered(r for r, _ in mine), ordered(c for _, c in mine)
            values = np.array([[mine.get((r, c), math.nan) for c in columns] for r in rows])
            image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", norm=norm, aspect="auto")
            for i, j in np.ndindex(values.shape):
                if np.isfinite(values[i, j]):
                    ax.text(j, i, number(values[i, j]), ha="center", va="center", fontsize=8, color="white",
                            path_effects=[patheffects.withStroke(linewidth=1.5, foreground="black")])
            ax.set_xticks(range(len(columns)), columns)
            ax.set_yticks(range(len(rows)), rows)
            ax.set_xlabel(column)
            ax.set_ylabel(row)
            ax.set_title(panel or "all runs", fontsize=9)
            figure.colorbar(image, ax=ax, shrink=0.8)
        figure.suptitle(f"{metric}: mean over seeds", fontsize=10)
        figure.tight_layout()
        name = f"grid_{slug(metric)}.png"
        figure.savefig(out / name, dpi=110)
        plt.close(figure)
        drawn.append(name)
    return drawn
