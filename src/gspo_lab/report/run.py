"""Reading and writing one run dir: metrics.csv rows, run_info.json, summary.json, the reward-curve PNG."""

from __future__ import annotations

import csv
import gzip
import json
import math
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import IO

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LIBRARIES = ("gspo-lab", "torch", "transformers", "lightning", "hydra-core", "omegaconf", "wandb", "bitsandbytes",
             "tokenizers")


METRICS_FILES = ("metrics.csv", "metrics.csv.gz")  # as the run writes it; as a study commits it (study_data.py)


def has_metrics(run_dir: str | Path) -> bool:
    """Whether a run dir holds its metrics, in either form."""
    return any((Path(run_dir) / name).is_file() for name in METRICS_FILES)


def metrics_file(run_dir: str | Path) -> Path:
    """A run dir's metrics: metrics.csv as the run writes it, or metrics.csv.gz as a study commits it
    (scripts/study_data.py)."""
    for name in METRICS_FILES:
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    raise FileNotFoundError(f"{Path(run_dir) / 'metrics.csv'}: no metrics.csv (the run has not logged a step yet), "
                            "nor a study's metrics.csv.gz")


def open_metrics(run_dir: str | Path) -> IO[str]:
    """A run dir's metrics as a text file for csv (metrics_file), decompressed where it is gzipped."""
    path = metrics_file(run_dir)
    return gzip.open(path, "rt", newline="") if path.suffix == ".gz" else path.open(newline="")


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """metrics.csv (or a study's metrics.csv.gz) as a list of rows, numbers parsed, empty cells as NaN, sorted by
    step."""
    with open_metrics(run_dir) as file:
        rows = [{k: float(v) if v != "" else math.nan for k, v in row.items()} for row in csv.DictReader(file)]
    return sorted(rows, key=lambda row: row["step"])


def step_rows(run_dir: str | Path, skip: int = 0) -> list[dict[str, float]]:
    """The rows of RL steps (not the final evaluation row), after the first `skip` (warm-up)."""
    return [r for r in read_metrics(run_dir) if not math.isnan(r.get("time/update_s", math.nan))][skip:]


def is_set_metric(key: str) -> bool:
    """Whether `key` is an evaluation set's metric, eval/<set>/<metric> (eval/accuracy is not).

    >>> is_set_metric("eval/heldout/pass@4"), is_set_metric("eval/accuracy")
    (True, False)
    """
    return key.startswith("eval/") and key.count("/") >= 2


def series(rows: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` where it was logged."""
    points = [(r["step"], r[key]) for r in rows if not math.isnan(r.get(key, math.nan))]
    return [p[0] for p in points], [p[1] for p in points]


def git_sha(repo: Path | None) -> str:
    """HEAD of the checkout `repo` (with -dirty if tracked files changed); "unknown" for no checkout (an
    installed wheel), and for a folder that is not the top of a checkout, so a venv that happens to lie inside
    some other repository never lends it its SHA."""
    if repo is None or not (repo / ".git").exists():  # .git is a file in a worktree
        return "unknown"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """Each distribution's installed version; None where it is not installed."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_run_info(run_dir: Path, repo: Path | None, extra: dict) -> dict:
    info = {"git_sha": git_sha(repo), "python": platform.python_version(), "platform": platform.platform(),
            "versions": library_versions(), **extra}
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=2, default=str))
    return info


def plot_reward_curve(rows: list[dict[str, float]], out: str | Path, title: str = "") -> Path:
    """reward/mean (sampled, training prompts) and eval/accuracy (greedy, held-out) against RL step."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*series(rows, "reward/mean"), label="reward/mean (sampled, training prompts)", alpha=0.8)
    ax.plot(*series(rows, "eval/accuracy"), "o-", label="eval/accuracy (greedy, held-out)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
