"""gspo-report DIR [DIR ...]: compare the runs of a multirun (or any run dirs) across settings and seeds.

A run is a folder holding run_info.json (written when a run starts) or failed.txt (a job that failed). Its setting is its Hydra overrides
without `seed`; runs of one setting on different seeds are its replicates. Writes into the first DIR (or
--out): report.md (the table), reward_curves.png, eval_curves.png, clip_frac.png, routing_change.png, and
prints the table. Mean ± standard error over seeds; paired differences use the seeds both settings share.

    gspo-report multirun/2026-11-21/10-00-00
    gspo-report outputs/run_a outputs/run_b --baseline algorithm=gspo
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from gspo_lab.report.run import read_metrics, series  # noqa: E402

FIGURES = {  # file -> (metric, y label, log scale, smoothing window)
    "reward_curves.png": ("reward/mean", "reward/mean (sampled)", False, 10),
    "eval_curves.png": ("eval/accuracy", "held-out accuracy (greedy)", False, 1),
    "clip_frac.png": ("clip/frac", "clip/frac (log)", True, 10),
    "routing_change.png": ("routing/changed_frac", "routing/changed_frac (log)", True, 10),
}
NUMBER = re.compile(r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)")
COLUMNS = {  # table column -> summary.json key, or the metrics.csv column averaged over steps
    "final reward": "reward/mean_last",
    "held-out accuracy": "eval/accuracy_after",
    "accuracy gain": None,  # after - before
    "clip/frac": "clip/frac_mean",
    "routing change": "routing/changed_frac",  # mean over steps; n/a for dense models
}


@dataclass
class Run:
    path: Path
    overrides: frozenset[str]  # the run's Hydra overrides without seed, experiment and hydra.*
    seed: int | None
    summary: dict | None
    failed: bool
    setting: str = ""  # the overrides in which runs differ, set by `discover`

    def value(self, column: str) -> float:
        if column == "accuracy gain":
            return self.summary["eval/accuracy_after"] - self.summary["eval/accuracy_before"]
        key = COLUMNS[column]
        if key in self.summary:
            return self.summary[key]
        _, values = series(read_metrics(self.path), key)
        return statistics.fmean(values) if values else math.nan


@dataclass
class Study:
    runs: list[Run] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)  # overrides every run has

    @property
    def complete(self) -> list[Run]:
        return [r for r in self.runs if r.summary is not None]

    def settings(self) -> list[str]:
        """Sorted with numbers compared as numbers (group_size=2 before group_size=16)."""
        return sorted({r.setting for r in self.complete}, key=natural_key)

    def of(self, setting: str) -> list[Run]:
        return sorted((r for r in self.complete if r.setting == setting), key=lambda r: (r.seed is None, r.seed))


class UnknownBaseline(ValueError):
    """--baseline names no setting of the study; the message lists the settings it could name."""


def natural_key(text: str) -> list:
    return [(0, float(part), "") if NUMBER.fullmatch(part) else (1, 0.0, part) for part in NUMBER.split(text)]


def load_run(path: Path) -> Run:
    overrides_file = path / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
    seed, kept = None, set()
    for item in overrides or []:
        key, _, value = item.partition("=")
        if key.lstrip("+~") == "seed":
            seed = int(value)
        elif not key.startswith("hydra") and key != "experiment":
            kept.add(item)
    if seed is None:
        config = path / "config.yaml"
        seed = yaml.safe_load(config.read_text()).get("seed") if config.is_file() else None
    info_file = path / "run_info.json"  # absent when a job failed before its run started
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    if not kept and info.get("algorithm"):
        kept.add(f"algorithm={info['algorithm']}")
    summary_file = path / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    return Run(path, frozenset(kept), seed, summary, (path / "failed.txt").is_file())


def discover(dirs: list[Path]) -> Study:
    """Every run under `dirs`; a run's setting is the overrides not shared by all runs (seed aside)."""
    runs = []
    for directory in dirs:
        if not directory.is_dir():
            raise SystemExit(f"gspo-report: {directory} is not a directory")
        found = {p.parent for name in ("run_info.json", "failed.txt") for p in directory.rglob(name)}
        runs.extend(load_run(path) for path in sorted(found))
    shared = frozenset.intersection(*(r.overrides for r in runs)) if runs else frozenset()
    for run in runs:
        run.setting = " ".join(sorted(run.overrides - shared)) or "all runs alike"
    return Study(runs, sorted(shared))


def mean_se(values: list[float]) -> tuple[float, float]:
    if any(math.isnan(v) for v in values):
        return math.nan, math.nan
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return mean, se


def fmt(mean: float, se: float) -> str:
    if math.isnan(mean):
        return "n/a"
    digits = 3 if abs(mean) >= 0.01 or mean == 0 else 5  # routing change and GRPO's clip fraction are small
    return f"{mean:.{digits}f}" if math.isnan(se) else f"{mean:.{digits}f} ± {se:.{digits}f}"


def choose_baseline(settings: list[str], baseline: str | None) -> str | None:
    """The setting paired differences are taken against: `baseline` if given (it must be one of `settings`,
    spelled as the table's first column), else the first setting."""
    if baseline is None:
        return settings[0] if settings else None
    if baseline not in settings:
        valid = ", ".join(repr(s) for s in settings)
        raise UnknownBaseline(f"--baseline={baseline!r} matches no setting; the settings are: {valid}")
    return baseline


def table(study: Study, baseline: str | None) -> str:
    settings = study.settings()
    baseline = choose_baseline(settings, baseline)
    lines = ["| setting | seeds | " + " | ".join(COLUMNS) + " |", "|" + " --- |" * (len(COLUMNS) + 2)]
    for setting in settings:
        runs = study.of(setting)
        cells = [fmt(*mean_se([r.value(c) for r in runs])) for c in COLUMNS]
        lines.append(f"| {setting} | {len(runs)} | " + " | ".join(cells) + " |")
    paired = paired_table(study, baseline)
    return "\n".join(lines) + ("\n\n" + paired if paired else "")


def paired_table(study: Study, baseline: str | None) -> str:
    """Held-out accuracy and final reward of each setting minus the baseline's, on the seeds both have."""
    if baseline is None:
        return ""
    base = {r.seed: r for r in study.of(baseline)}
    lines = [f"Paired differences against `{baseline}` (same seeds; mean ± standard error):", "",
             "| setting | shared seeds | Δ held-out accuracy | Δ final reward |", "| --- | --- | --- | --- |"]
    for setting in study.settings():
        if setting == baseline:
            continue
        pairs = [(r, base[r.seed]) for r in study.of(setting) if r.seed in base]
        if not pairs:
            lines.append(f"| {setting} | 0 | no shared seed | |")
            continue
        acc = mean_se([a.value("held-out accuracy") - b.value("held-out accuracy") for a, b in pairs])
        reward = mean_se([a.value("final reward") - b.value("final reward") for a, b in pairs])
        lines.append(f"| {setting} | {len(pairs)} | {fmt(*acc)} | {fmt(*reward)} |")
    return "\n".join(lines)


def smooth(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot(study: Study, metric: str, ylabel: str, log_scale: bool, window: int, out: Path) -> bool:
    """Mean over seeds with a ±1 standard-error band, one line per setting; False if no run logged it."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = False
    for setting in study.settings():
        curves = [series(read_metrics(r.path), metric) for r in study.of(setting)]
        curves = [(steps, smooth(values, window)) for steps, values in curves if values]
        if not curves:
            continue
        length = min(len(values) for _, values in curves)
        steps = curves[0][0][:length]
        stacked = [[values[i] for _, values in curves] for i in range(length)]
        means = [statistics.fmean(v) for v in stacked]
        errors = [statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0.0 for v in stacked]
        line, = ax.plot(steps, means, label=f"{setting} (n={len(curves)})")
        ax.fill_between(steps, [m - e for m, e in zip(means, errors)], [m + e for m, e in zip(means, errors)],
                        color=line.get_color(), alpha=0.2)
        drawn = True
    if log_scale and drawn:
        ax.set_yscale("log")
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def report(dirs: list[Path], out: Path, baseline: str | None = None) -> str:
    study = discover(dirs)
    if not study.runs:
        raise SystemExit(
            f"gspo-report: no runs under {', '.join(map(str, dirs))}: expected run dirs holding run_info.json "
            "(written by gspo-train when a run starts) or failed.txt"
        )
    missing = [r for r in study.runs if r.summary is None]
    notes = [f"- {r.path}: {'failed (see failed.txt)' if r.failed else 'no summary.json (still running, or killed)'}"
             for r in missing]
    if not study.complete:
        raise SystemExit("gspo-report: no finished run (none has summary.json):\n" + "\n".join(notes))
    text = table(study, baseline)  # before anything is written: a bad --baseline leaves no files
    out.mkdir(parents=True, exist_ok=True)
    drawn = [name for name, spec in FIGURES.items() if plot(study, *spec, out / name)]
    header = [f"# Report on {', '.join(map(str, dirs))}", "",
              f"{len(study.complete)} finished runs in {len(study.settings())} settings.", ""]
    if study.shared:
        header += [f"Overrides shared by every run: `{' '.join(study.shared)}`", ""]
    if notes:
        header += [f"Left out ({len(missing)}):", *notes, ""]
    figures = [f"![{name}]({name})" for name in drawn]
    (out / "report.md").write_text("\n".join(header + [text, ""] + figures) + "\n")
    return "\n".join(header + [text])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gspo-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="a multirun dir, or run dirs")
    parser.add_argument("--out", type=Path, help="where report.md and the figures go (default: the first DIR)")
    parser.add_argument("--baseline", help="the setting paired differences are taken against, spelled as in the "
                        "table's first column (default: the first setting)")
    args = parser.parse_args(argv)
    try:
        text = report(args.dirs, args.out or args.dirs[0], args.baseline)
    except UnknownBaseline as error:
        parser.exit(2, f"gspo-report: {error}\n")
    print(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
