"""Lightning's CSVLogger, writing `metrics.csv` straight into the Hydra run dir and safe to resume into;
and `quiet_libraries`, which keeps the console to the run's own progress bar and summary.

Stock CSVLogger deletes an existing metrics.csv when its folder is not empty. This one keeps it, and on the
first row it logs drops any rows at or after that step, so a run resumed from a checkpoint continues the
file without duplicate or missing steps.
"""

from __future__ import annotations

import csv
import logging
import os
import warnings

import transformers
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _ResumableWriter(ExperimentWriter):
    def __init__(self, log_dir: str) -> None:
        self._resumed = False
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        """Keep an existing metrics.csv; `log_metrics` trims it to the resumed step."""

    def log_metrics(self, metrics_dict, step=None) -> None:
        if not self._resumed and step is not None:
            self._keep_rows_before(step)
        self._resumed = True
        super().log_metrics(metrics_dict, step)

    def _keep_rows_before(self, step: int) -> None:
        if not os.path.isfile(self.metrics_file_path):
            return
        with open(self.metrics_file_path, newline="") as file:
            reader = csv.DictReader(file)
            header, rows = list(reader.fieldnames or []), [r for r in reader if int(r["step"]) < step]
        with open(self.metrics_file_path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=header)
            writer.writeheader()
            writer.writerows(rows)
        self.metrics_keys = sorted(header)


class RunCSVLogger(CSVLogger):
    """CSVLogger whose metrics.csv lies in `save_dir` itself and survives a resume; flushes every row."""

    def __init__(self, save_dir: str, flush_logs_every_n_steps: int = 1, **kwargs) -> None:
        super().__init__(save_dir, name="", version="", flush_logs_every_n_steps=flush_logs_every_n_steps, **kwargs)

    @property
    def experiment(self) -> _ResumableWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ResumableWriter(log_dir=self.log_dir)
        return self._experiment


def quiet_libraries() -> None:
    """Keep the console to our own progress bar and summary: no hardware banner, tips or loading bars."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # checkpoints are taken between RL steps, so the post-update state Lightning warns about is the right one
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
