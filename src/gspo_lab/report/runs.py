"""Reading run dirs: a run (its overrides, seed, summary, metrics and collapse tests) and a study (the runs
under some folders, grouped into settings). Tables, figures and the report build on this; it depends only on
report.run (metrics files) and report.stats.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import yaml

from gspo_lab.rollout.backend import backend_class
from gspo_lab.report.run import is_set_metric, read_metrics, series
from gspo_lab.report.stats import accuracy_noise

NUMBER = re.compile(r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)")
REWARD_WINDOW, REWARD_FLOOR = 10, 0.5  # reward collapse: the last 10 steps' mean reward below half the first 10's
SUMMARY_KEYS = {  # metric -> its summary.json key; other metrics are the mean over steps of metrics.csv's column
    "held-out accuracy": "eval/accuracy_after",
    "final reward": "reward/mean_last",
    "clip/frac": "clip/frac_mean",
}


@dataclass
class Run:
    path: Path
    overrides: frozenset[str]  # the run's Hydra overrides without seed, experiment, hparams_search and hydra.*
    seed: int | None
    summary: dict | None
    failed: bool
    eval_size: int | None = None  # held-out prompts per evaluation (task.eval_size in its config), if recorded
    eval_engine: str | None = None  # what generated its evaluations ("vllm bfloat16"; `evaluating_engine`)
    setting: str = ""  # the overrides in which runs differ, set by `discover`

    @cached_property
    def rows(self) -> list[dict[str, float]]:
        return read_metrics(self.path)

    def value(self, metric: str) -> float:
        """The run's figure for `metric` (NaN where it was not logged): an eval/* metric's last evaluation, another
        metric's mean over steps; "accuracy gain" is after - before, "seq ratio spread" the mean over steps of
        ratio/seq/max - ratio/seq/min (the sequence ratios every objective logs)."""
        if metric == "accuracy gain":
            return self.summary["eval/accuracy_after"] - self.summary["eval/accuracy_before"]
        if metric == "seq ratio spread":
            spreads = [r["ratio/seq/max"] - r["ratio/seq/min"] for r in self.rows
                       if not math.isnan(r.get("ratio/seq/max", math.nan))]
            return sum(spreads) / len(spreads) if spreads else math.nan
        key = SUMMARY_KEYS.get(metric, metric)
        if key in self.summary:
            return self.summary[key]
        _, values = series(self.rows, key)
        if key.startswith("eval/"):  # an evaluation metric: its last evaluation, after the last step
            return values[-1] if values else math.nan
        return sum(values) / len(values) if values else math.nan

    @cached_property
    def eval_metrics(self) -> list[str]:
        """The evaluation sets' metrics the run logged: metrics.csv's eval/<set>/<metric> columns (every row
        holds every column)."""
        return [key for key in (self.rows[0] if self.rows else {}) if is_set_metric(key)]

    def eval_sets(self) -> list[str]:
        """The evaluation sets the run logged, in column order."""
        return list(dict.fromkeys(key.split("/")[1] for key in self.eval_metrics))

    def collapsed(self, drop: float) -> bool | None:
        """The final held-out accuracy is below the run's own best by more than both `drop` and the binomial
        noise of the difference, or below its first evaluation (the cold start) by more than that noise; the
        noise is stats.accuracy_noise on the run's eval_size prompts, or `drop` where no eval_size was
        recorded. None for a run never evaluated."""
        _, accuracy = series(self.rows, "eval/accuracy")
        if not accuracy:
            return None
        start, best, final = accuracy[0], max(accuracy), accuracy[-1]

        def noise(reference: float) -> float:
            return accuracy_noise(reference, final, self.eval_size) if self.eval_size else drop

        return best - final > max(drop, noise(best)) or start - final > noise(start)

    def reward_collapsed(self) -> bool | None:
        """The mean sampled reward of the last REWARD_WINDOW steps is below REWARD_FLOOR times that of the
        first REWARD_WINDOW (each window at most half the run's steps); None for a run that logged no reward."""
        _, reward = series(self.rows, "reward/mean")
        window = min(REWARD_WINDOW, len(reward) // 2)
        if window == 0:
            return None
        return sum(reward[-window:]) / window < REWARD_FLOOR * sum(reward[:window]) / window


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

    def check_eval_engines(self) -> None:
        """Refuse a setting whose runs evaluated on different engines (vLLM's bfloat16 engine and the float32
        trainer measure different accuracies of the same weights): its column would mix them."""
        for setting in self.settings():
            engines = {run.eval_engine for run in self.of(setting)}
            if len(engines) > 1:
                runs = ", ".join(f"{run.path.name}: {run.eval_engine}" for run in self.of(setting))
                raise MixedEvalEngines(f"the runs of setting {setting!r} evaluated on different engines ({runs}); "
                                       "evaluate them alike (gspo-eval eval.engine=trainer), or pass "
                                       "--mixed-eval-engines to report them in one column anyway")


class UnknownBaseline(ValueError):
    """--baseline names no setting of the study; the message lists the settings it could name."""


class MixedEvalEngines(ValueError):
    """A setting's runs evaluated on different engines; the message names each run's."""


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
        elif not key.startswith("hydra") and key not in ("experiment", "hparams_search"):
            kept.add(item)
    config_file = next((f for f in (path / "config.yaml", path / ".hydra" / "config.yaml") if f.is_file()), None)
    config = (yaml.safe_load(config_file.read_text()) or {}) if config_file else {}
    if seed is None:
        seed = config.get("seed")
    eval_size = (config.get("task") or {}).get("eval_size")  # jsonl tasks evaluate on fewer if the pool is smaller
    info_file = path / "run_info.json"  # absent when a job failed before its run started
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    if not kept and info.get("algorithm"):
        kept.add(f"algorithm={info['algorithm']}")
    summary_file = path / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    return Run(path, frozenset(kept), seed, summary, (path / "failed.txt").is_file(),
               eval_size if isinstance(eval_size, int) else None, evaluating_engine(summary, config))


def evaluating_engine(summary: dict | None, config: dict) -> str:
    """What generated a run's evaluations: summary.json's eval/engine, or for a run from before it was recorded,
    what its config implies (the backend's engine in its dtype, rollout.<backend>.dtype, where the backend serves
    evaluation, as vLLM's does; else transformers on the trainer's weights, in bfloat16 under a bf16
    trainer.precision).

    >>> evaluating_engine(None, {"rollout": {"backend": "vllm", "vllm": {"dtype": "bfloat16"}}})
    'vllm bfloat16'
    >>> evaluating_engine(None, {"trainer": {"precision": "bf16-mixed"}, "model": {"dtype": "float32"}})
    'transformers bfloat16'
    """
    if (summary or {}).get("eval/engine"):
        return summary["eval/engine"]
    model_dtype = (config.get("model") or {}).get("dtype") or "float32"
    rollout = config.get("rollout") or {}
    on_trainer = (config.get("eval") or {}).get("engine") == "trainer"
    backend = rollout.get("backend") or "hf"
    if not on_trainer and serves_evaluation(backend):
        return f"{backend} {(rollout.get(backend) or {}).get('dtype') or model_dtype}"
    bf16 = str((config.get("trainer") or {}).get("precision", "")).startswith("bf16")
    return f"transformers {'bfloat16' if bf16 else model_dtype}"


def serves_evaluation(backend: str) -> bool:
    """Whether rollout.backend=`backend` evaluates through its own engine (False for a backend no longer
    importable)."""
    try:
        return backend_class(backend).serves_evaluation
    except ValueError:
        return False


def run_dirs(directory: Path) -> list[Path]:
    """The run dirs under `directory`: those with a run_info.json, or a failed.txt (a job that failed first)."""
    return sorted({p.parent for name in ("run_info.json", "failed.txt") for p in directory.rglob(name)})


def discover(dirs: list[Path]) -> Study:
    """Every run under `dirs`; a run's setting is the overrides not shared by all runs (seed aside)."""
    runs = []
    for directory in dirs:
        if not directory.is_dir():
            raise SystemExit(f"gspo-report: {directory} is not a directory")
        runs.extend(load_run(path) for path in run_dirs(directory))
    shared = frozenset.intersection(*(r.overrides for r in runs)) if runs else frozenset()
    for run in runs:
        run.setting = " ".join(sorted(run.overrides - shared)) or "all runs alike"
    return Study(runs, sorted(shared))
