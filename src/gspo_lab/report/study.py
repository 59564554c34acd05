"""gspo-report DIR [DIR ...]: compare the runs of a multirun (or any run dirs) across settings and seeds.

A run is a folder holding run_info.json (written when a run starts) or failed.txt (a job that failed). Its
setting is its Hydra overrides without `seed`; runs of one setting on different seeds are its replicates.
For each setting and metric: mean, interquartile mean and nominal 95% bootstrap intervals over seeds (with few
seeds they hold the true value less often: about 85% with 5 seeds); the runs that collapsed; paired differences
and the probability of improvement against a baseline on shared seeds (Agarwal et al. 2021, the statistics of
rliable; report/stats.py). Writes into the first DIR (or --out):
report.md, report.html (self-contained), statistics.csv, paired.csv and the figures; prints the tables.

    gspo-report multirun/2026-11-21/10-00-00
    gspo-report outputs/run_a outputs/run_b --baseline algorithm=gspo --collapse-drop 0.05
    gspo-report multirun/gspo multirun/grpo --grid train.lr,clip_scale --grid-baseline 1.0
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from gspo_lab.report import html
from gspo_lab.report.figures import CURVES, PROFILE, curves, eval_set_curves, profile
from gspo_lab.report.grid import UnknownGridKey, check_baseline, heatmaps
from gspo_lab.report.grid import tables as grid_tables
# Run and load_run are re-exported: callers of gspo_lab.report.study read runs through it
from gspo_lab.report.runs import (REWARD_FLOOR, REWARD_WINDOW, MixedEvalEngines, Run, Study,  # noqa: F401
                                  UnknownBaseline, discover, load_run)
from gspo_lab.report.samples import CHARS, PROMPTS, SAMPLES, sample_tables
from gspo_lab.report.stats import CONFIDENCE, NOISE_Z, RESAMPLES, percentile_coverage
from gspo_lab.report.tables import (CI, HEADLINE, PAIRED_OVER, UNPAIRED_OVER, markdown, paired, paired_text,
                                    settings_table, statistics, statistics_text)

FIGURES = [*CURVES, PROFILE]  # and eval_<set>.png per evaluation set


class UnknownMetric(ValueError):
    """--metric names a metric no finished run logged; the message lists the evaluation metrics they did."""


def choose_baseline(settings: list[str], baseline: str | None) -> str | None:
    """The setting paired differences are taken against: `baseline` if given (it must be one of `settings`,
    spelled as the table's first column), else the first setting."""
    if baseline is None:
        return settings[0] if settings else None
    if baseline not in settings:
        valid = ", ".join(repr(s) for s in settings)
        raise UnknownBaseline(f"--baseline={baseline!r} matches no setting; the settings are: {valid}")
    return baseline


def search_results(dirs: list[Path]) -> list[str]:
    """Lines on the Optuna search whose sweep dir is among `dirs` (its optimization_results.yaml), if any."""
    lines = []
    for directory in dirs:
        results = directory / "optimization_results.yaml"
        if results.is_file():
            found = yaml.safe_load(results.read_text())
            params = " ".join(f"{key}={value}" for key, value in (found.get("best_params") or {}).items())
            lines.append(f"Optuna search in {directory}: best trial `{params}`, value {found.get('best_value')} "
                         "(optimization_results.yaml; one seed per trial, so re-run the best settings over seeds "
                         "before trusting the ranking).")
    return lines


@dataclass
class Sections:
    """The report's parts, each a heading, a few lines of explanation and a table; markdown and HTML both
    render them."""

    intro: list[str]
    tables: list[tuple[str, list[str], pd.DataFrame]]

    def to_markdown(self, title: str) -> str:
        parts = [f"# {title}", "", *self.intro]
        for heading, lines, frame in self.tables:
            parts += ["", f"## {heading}", "", *lines, "", markdown(frame)]
        return "\n".join(parts)

    def to_html(self, title: str, figures: list[Path]) -> str:
        blocks = [("", html.paragraphs(self.intro))]
        blocks += [(heading, html.paragraphs(lines) + html.table(frame)) for heading, lines, frame in self.tables]
        blocks.append(("Figures", "".join(html.figure(path) for path in figures)))
        return html.page(title, blocks)


def interval_note(study: Study, seed: int) -> str:
    """What the intervals are: nominal 95%, and how often they hold the true mean with this study's seeds."""
    counts = sorted(({len(study.of(setting)) for setting in study.settings()} - {1}) | {5})  # 5: the default
    coverage = ", ".join(f"{percentile_coverage(n):.0%} with {n} seeds" for n in counts)
    return (f"Intervals are nominal {CONFIDENCE:.0%} percentile-bootstrap intervals over seeds "
            f"(scipy.stats.bootstrap, {RESAMPLES} resamples, --bootstrap-seed {seed}); one seed gives none. With few "
            f"seeds they are too narrow: for the mean of normally distributed scores the nominal {CONFIDENCE:.0%} "
            f"interval holds the true mean only this often: {coverage} (normal theory, checked by simulation in "
            "tests/report/test_stats.py).")


def collapse_note(study: Study, drop: float) -> str:
    """The collapse rules, with how many runs fell back to --collapse-drop for want of an eval size."""
    unsized = sum(run.eval_size is None for run in study.complete)
    fallback = f"; --collapse-drop where a run recorded none ({unsized} of {len(study.complete)} runs)"
    return (f"A run collapsed when its final held-out accuracy is below its own best by more than --collapse-drop "
            f"({drop}) and more than the noise, or below its first evaluation (the cold start) by more than the "
            f"noise; the noise is {NOISE_Z:g} binomial standard errors of the difference, {NOISE_Z:g} sqrt((a (1 - a) "
            f"+ b (1 - b)) / n) for accuracies a and b on the run's n held-out prompts (task.eval_size in its "
            f"config.yaml){fallback if unsized else ''}. Its reward collapsed when the mean sampled reward of its "
            f"last {REWARD_WINDOW} steps fell below {REWARD_FLOOR} times that of its first {REWARD_WINDOW}.")


def sections(study: Study, dirs: list[Path], baseline: str | None, collapse_drop: float, seed: int,
             notes: list[str], metric: str = HEADLINE[0], grid: tuple[str, str] | None = None,
             grid_baseline: str | None = None) -> tuple[Sections, dict[str, pd.DataFrame]]:
    """The report's text and tables, and the numeric frames behind them (written as CSV); with `grid` (row key,
    column key), the grid's tables after the settings table."""
    stats = statistics(study, seed, metric)
    pairs = paired(study, baseline, seed) if baseline is not None else pd.DataFrame()
    intro = [f"{len(study.complete)} finished runs in {len(study.settings())} settings. {interval_note(study, seed)}",
             "", collapse_note(study, collapse_drop)]
    if study.shared:
        intro += ["", f"Overrides shared by every run: `{' '.join(study.shared)}`"]
    if notes:
        intro += ["", f"Left out ({len(notes)}):", *notes]
    intro += [line for found in search_results(dirs) for line in ("", found)]
    tables = [("Settings", [f"Mean over seeds [{CI} of the mean]; `collapsed` counts the setting's collapsed runs, "
                            "`reward collapsed` those whose sampled reward collapsed; an eval/* metric is its value "
                            "at the run's last evaluation."],
               settings_table(study, stats, collapse_drop, metric))]
    if grid is not None:
        tables += grid_tables(study, stats, *grid, grid_baseline, seed)
    if len(pairs):
        tables.append(("Paired comparisons", [
            f"Paired differences against `{baseline}` (same seeds): the mean of setting minus baseline over the "
            f"shared seeds [{CI}]. P(improvement) is P(setting > baseline) in held-out accuracy, ties counting 1/2 "
            f"[{CI}], and `P(improvement) over` says what it counts: `{PAIRED_OVER}`, the share of shared seeds on "
            "which the setting's run is higher, each seed's pair of runs resampled together; or, only for a "
            f"setting that shares no seed with the baseline, `{UNPAIRED_OVER}`, the share of all (setting run, "
            "baseline run) pairs (rliable's definition), each side resampled independently."], paired_text(pairs)))
    tables.append(("Statistics over seeds", [
        "Per metric and setting: mean and interquartile mean (IQM, the mean of the middle 50% of runs; equal to "
        f"the mean below 4 seeds), each with its {CI}. Routing and mismatch metrics are each run's mean over "
        "steps, evaluation metrics (eval/<set>/...) each run's last evaluation, shown where logged."],
        statistics_text(stats)))
    for setting, frame in sample_tables(study):
        tables.append((f"Samples: {setting}", [
            f"The first {PROMPTS} prompts of each evaluation set at the run's first and last evaluation "
            f"(samples/step_<k>.jsonl): the greedy completion and the first {SAMPLES} samples, ✓ correct, ✗ not, "
            f"cut to {CHARS} characters."], frame))
    return Sections(intro, tables), {"statistics": stats, "paired": pairs}


def report(dirs: list[Path], out: Path, baseline: str | None = None, collapse_drop: float = 0.1,
           bootstrap_seed: int = 0, metric: str = HEADLINE[0], grid: tuple[str, str] | None = None,
           grid_baseline: str | None = None, setting_figures: bool = True, mixed_eval_engines: bool = False) -> str:
    """Writes report.md, report.html, statistics.csv, paired.csv and the figures (with `grid`, the grid's
    heatmaps; without `setting_figures`, none of those with a line per setting) into `out`; returns the text it
    prints. A setting whose runs evaluated on different engines is refused unless `mixed_eval_engines`."""
    study = discover(dirs)
    if not study.runs:
        raise SystemExit(
            f"gspo-report: no runs under {', '.join(map(str, dirs))}: expected run dirs holding run_info.json "
            "(written by gspo-train when a run starts) or failed.txt"
        )
    notes = [f"- {r.path}: {'failed (see failed.txt)' if r.failed else 'no summary.json (still running, or killed)'}"
             for r in study.runs if r.summary is None]
    if not study.complete:
        raise SystemExit("gspo-report: no finished run (none has summary.json):\n" + "\n".join(notes))
    if not mixed_eval_engines:
        study.check_eval_engines()
    baseline = choose_baseline(study.settings(), baseline)  # before anything is written: a bad one leaves no files
    logged = {key for run in study.complete for row in run.rows for key in row}
    if metric not in HEADLINE and metric not in logged:
        known = ", ".join(sorted(k for k in logged if k.startswith("eval/"))) or "none"
        raise UnknownMetric(f"--metric={metric!r} is not logged by any finished run; its evaluation metrics: {known}")
    if grid is not None:  # a key some setting lacks, or a baseline no column has: refused before anything is written
        check_baseline(study, *grid, grid_baseline)
    text, frames = sections(study, dirs, baseline, collapse_drop, bootstrap_seed, notes, metric, grid, grid_baseline)
    out.mkdir(parents=True, exist_ok=True)
    collapsed = {run.path for run in study.complete if run.collapsed(collapse_drop)}
    drawn = []
    if setting_figures:
        wanted = {**CURVES, **eval_set_curves(study, metric)}
        drawn += [name for name, spec in wanted.items() if curves(study, *spec, out / name, bootstrap_seed, collapsed)]
        drawn += [PROFILE] if profile(study, out / PROFILE, bootstrap_seed) else []
    drawn += heatmaps(study, *grid, out) if grid is not None else []
    for name, frame in frames.items():
        frame.to_csv(out / f"{name}.csv", index=False)
    title = f"Report on {', '.join(map(str, dirs))}"
    figures = [f"![{name}]({name})" for name in drawn]
    (out / "report.md").write_text(text.to_markdown(title) + "\n\n" + "\n".join(figures) + "\n")
    (out / "report.html").write_text(text.to_html(title, [out / name for name in drawn]))
    return text.to_markdown(title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gspo-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="a multirun dir, or run dirs")
    parser.add_argument("--out", type=Path, help="where the report and figures go (default: the first DIR)")
    parser.add_argument("--baseline", help="the setting paired comparisons are taken against, spelled as in the "
                        "table's first column (default: the first setting)")
    parser.add_argument("--collapse-drop", type=float, default=0.1, help="a run collapsed when its final held-out "
                        f"accuracy is below its own best by more than this and more than {NOISE_Z:g} binomial "
                        "standard errors of the difference (on the run's task.eval_size prompts), or below its "
                        "first evaluation by more than those standard errors; a run with no recorded eval size "
                        "uses this for both (default: 0.1)")
    parser.add_argument("--metric", default=HEADLINE[0], help="a column the settings table adds, with intervals: "
                        "any logged metric, e.g. eval/heldout/pass@1 or eval/math/maj@8 (evaluation metrics: the "
                        "last evaluation; others: the mean over steps), also drawn per evaluation set "
                        f"(default: {HEADLINE[0]!r})")
    parser.add_argument("--bootstrap-seed", type=int, default=0, help="seeds every bootstrap, so a report is "
                        "reproducible (default: 0)")
    parser.add_argument("--grid", help="ROW,COLUMN: two swept keys (e.g. train.lr,clip_scale) to lay the settings "
                        "out on, a panel per value of the other keys: tables and heatmaps (grid_<metric>.png) of "
                        "the headline metrics, and paired differences against a column")
    parser.add_argument("--grid-baseline", help="the COLUMN value the grid's paired differences are taken against, "
                        "in every row (default: each panel's first column)")
    parser.add_argument("--no-setting-figures", dest="setting_figures", action="store_false", help="leave out the "
                        "figures with a line per setting (the curves and the performance profile), which many "
                        "settings make unreadable; with --grid its heatmaps show them instead")
    parser.add_argument("--mixed-eval-engines", action="store_true", help="report a setting whose runs evaluated "
                        "on different engines (vLLM's, the trainer's; each run's summary.json eval/engine) in one "
                        "column; refused by default")
    args = parser.parse_args(argv)
    grid = tuple(args.grid.split(",")) if args.grid else None
    if args.grid_baseline is not None and grid is None:
        parser.exit(2, "gspo-report: --grid-baseline needs --grid ROW,COLUMN\n")
    if grid is not None and (len(grid) != 2 or not all(grid)):
        parser.exit(2, f"gspo-report: --grid={args.grid!r}: expected two keys, ROW,COLUMN (e.g. train.lr,clip_scale)\n")
    try:
        text = report(args.dirs, args.out or args.dirs[0], args.baseline, args.collapse_drop, args.bootstrap_seed,
                      args.metric, grid, args.grid_baseline, args.setting_figures, args.mixed_eval_engines)
    except (UnknownBaseline, UnknownMetric, UnknownGridKey, MixedEvalEngines) as error:
        parser.exit(2, f"gspo-report: {error}\n")
    print(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
