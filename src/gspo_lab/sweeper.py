"""hydra-optuna-sweeper made resumable: `hydra.sweeper.n_trials` is the study's total of completed trials.

hparams_search=gspo_optuna selects it (through hydra_plugins/gspo_lab_optuna, where Hydra looks for plugins).
The plugin runs n_trials new trials at every launch; here a launch runs only what the study still lacks, so a
search stored in a database is resumed by running its command again:

    gspo-train hparams_search=gspo_optuna hydra.sweeper.storage=sqlite:///search.db hydra.sweeper.study_name=lr

- A process that died leaves its trials RUNNING in the storage. With an RDB storage the sweeper records a
  heartbeat for its running trials, and before each batch fails the trials whose heartbeat is older than the
  grace period (Optuna's `fail_stale_trials`; a URL gets HEARTBEAT_INTERVAL_S and twice that), and those that
  this process has seen without any heartbeat for longer than that (`fail_trials_without_heartbeat`). Neither
  compares one machine's clock with another's: heartbeats are stamped and judged by the database's clock, the
  sightings by this process's. Only COMPLETE trials count, so a failed trial is run again, within a budget of
  n_trials trials per launch.
- A trial whose objective is NaN (gspo-train's, for a run that never evaluated) is failed and the search goes
  on; a search whose runs never evaluate (train.eval_every=0) is refused before its first trial.
- Run dirs are numbered by trial number, so a resumed search can write into the sweep dir it started, and
  processes sharing a study and a sweep dir never write into one run dir.
- A study that already holds trials (a resume, or a second process joining) reseeds the sampler, which would
  otherwise propose its seeded first trials again.
- Several processes (machines) given one storage and study name share its trials: each asks for trials until
  the study holds n_trials completed, so together they run n_trials, plus at most the trials the others still
  had running when that count was reached (as Optuna's MaxTrialsCallback). Processes started together on an
  empty study need different `hydra.sweeper.sampler.seed`s.

Search space, sampler, launcher, failure handling and optimization_results.yaml stay the plugin's: each batch
is one call of the plugin's own sweep, for that batch's trials.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl
from omegaconf import DictConfig, OmegaConf
from optuna.exceptions import ExperimentalWarning
from optuna.trial import TrialState

# seconds between two heartbeats of a running trial when the storage is a URL; its trial is stale after twice
# this. Other intervals: the storage as a node, {_target_: optuna.storages.RDBStorage, url: ...,
# heartbeat_interval: 10, grace_period: 30}
HEARTBEAT_INTERVAL_S = 60

log = logging.getLogger(__name__)


def study_storage(storage: Any) -> optuna.storages.BaseStorage | str:
    """The storage every study of one sweep opens: None as one in-memory storage (the sweeper counts the trials
    that the plugin's study runs), an RDB URL as an RDBStorage that records heartbeats, the rest as given."""
    if storage is None:
        return optuna.storages.InMemoryStorage()
    if not isinstance(storage, str) or storage.startswith("redis"):
        return storage
    return optuna.storages.RDBStorage(storage, heartbeat_interval=HEARTBEAT_INTERVAL_S)


def fail_trials_without_heartbeat(study: optuna.Study, first_seen: dict[int, float],
                                  now: float | None = None) -> list[int]:
    """Fail the RUNNING trials that this process has seen without a heartbeat for longer than the grace period;
    returns their ids. `first_seen` (kept between calls) maps a trial id to when this process first saw it without
    one, on its monotonic clock (`now`, time.monotonic() if None). Optuna's fail_stale_trials skips trials without a
    heartbeat, so a process killed between asking for a trial and its first heartbeat (a few milliseconds, longer
    on a loaded machine) left that trial RUNNING for ever. The trial's datetime_start would not do: it is the local
    time of the machine that asked for it, which another machine's clock or time zone may put hours away. Uses
    optuna 2.10's RDB storage internals (the plugin pins optuna<3)."""
    cached = study._storage  # optuna 2.10's Study has no public storage; an RDB one comes wrapped in a cache
    storage = getattr(cached, "_backend", cached)
    if not isinstance(storage, optuna.storages.RDBStorage) or not storage.is_heartbeat_enabled():
        return []
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    grace = storage.grace_period or 2 * storage.heartbeat_interval
    now, failed = time.monotonic() if now is None else now, []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        with _create_scoped_session(storage.scoped_session) as session:
            beaten = models.TrialHeartbeatModel.where_trial_id(trial._trial_id, session) is not None
        if beaten or now - first_seen.setdefault(trial._trial_id, now) <= grace:
            continue
        if cached.set_trial_state(trial._trial_id, TrialState.FAIL):
            failed.append(trial._trial_id)
    return failed


def check_objective(config: DictConfig) -> None:
    """Refuse a search whose runs never measure what it maximises: gspo-train returns the final held-out accuracy,
    NaN under train.eval_every=0, which would fail every trial. `config` is the sweep's composed config."""
    if OmegaConf.select(config, "train.eval_every") == 0:
        raise ValueError(
            "train.eval_every=0 is invalid with hparams_search=gspo_optuna: the search maximises the final held-out "
            "accuracy (eval/accuracy_after), which a run that never evaluates does not measure; set train.eval_every "
            "to a positive number of RL steps"
        )


def is_nan(value: Any) -> bool:
    """Whether an objective (a number, or a list of them for several directions) holds a NaN.

    >>> is_nan(float("nan")), is_nan([0.5, float("nan")]), is_nan(0.5), is_nan(None)
    (True, True, False, False)
    """
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, float) and math.isnan(v) for v in values)


def consecutive_runs(numbers: list[int]) -> list[tuple[int, int]]:
    """The (start, stop) index ranges of `numbers` that hold consecutive integers.

    >>> consecutive_runs([3, 4, 6, 7, 9])
    [(0, 2), (2, 4), (4, 5)]
    """
    starts = [i for i, number in enumerate(numbers) if i == 0 or number != numbers[i - 1] + 1]
    return list(zip(starts, starts[1:] + [len(numbers)]))


class TrialLauncher:
    """Hydra's launcher as the plugin's loop uses it for one batch of trials (`trial_numbers`, set as the batch is
    configured).

    - Each job (its run dir) takes its trial's number. A launcher numbers a batch's jobs consecutively from
      initial_job_idx, and a batch's trials are not consecutive when another process asked for trials between
      them: such a batch is launched in runs of consecutive numbers, each run in parallel as the launcher allows.
    - A NaN objective comes back as None, which the plugin records as a failed trial. Given the NaN, it told the
      trial COMPLETE, optuna refused the NaN, and telling FAIL with the same value then ended the whole search.
    """

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher
        self.trial_numbers: list[int] = []

    def launch(self, job_overrides: list[list[str]], initial_job_idx: int) -> list[JobReturn]:
        """Runs the batch's jobs; initial_job_idx (the plugin's count) gives way to the trials' numbers."""
        numbers, returns = self.trial_numbers, []
        for start, stop in consecutive_runs(numbers):
            returns += self.launcher.launch(job_overrides[start:stop], initial_job_idx=numbers[start])
        for number, job in zip(numbers, returns):
            if job.status == JobStatus.COMPLETED and is_nan(job.return_value):
                log.warning("trial %d: its objective is NaN; recorded as a failed trial", number)
                job.return_value = None
        return returns


class Heartbeats:
    """A thread that records a heartbeat for the running batch's trials every heartbeat interval of the storage;
    `with Heartbeats(storage) as beats:` ... `beats.running(trial_ids)` as each batch starts."""

    def __init__(self, storage: optuna.storages.BaseStorage) -> None:
        self.storage = storage
        self.enabled = storage.is_heartbeat_enabled()
        self.trial_ids: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.beat, name="optuna-heartbeat", daemon=True)

    def running(self, trial_ids: list[int]) -> None:
        self.trial_ids = trial_ids
        self.record()

    def record(self) -> None:
        for trial_id in self.trial_ids if self.enabled else []:
            self.storage.record_heartbeat(trial_id)

    def beat(self) -> None:
        while not self.stop.wait(self.storage.get_heartbeat_interval()):
            self.record()

    def __enter__(self) -> Heartbeats:
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop.set()
        if self.enabled:
            self.thread.join()


class ResumableOptunaSweeperImpl(OptunaSweeperImpl):
    """OptunaSweeperImpl whose n_trials counts the study's completed trials, stored ones included."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage = study_storage(self.storage)
        self.heartbeats: Heartbeats | None = None
        self.unbeaten_since: dict[int, float] = {}  # fail_trials_without_heartbeat's first sightings

    def sweep(self, arguments: list[str]) -> None:
        check_objective(self.config)
        if not isinstance(self.launcher, TrialLauncher):
            self.launcher = TrialLauncher(self.launcher)
        study = optuna.create_study(study_name=self.study_name, storage=self.storage,
                                    directions=self._get_directions(), load_if_exists=True)
        self.study_name = study.study_name  # so a storage without a study name gives the plugin this study
        if study.get_trials(deepcopy=False) and hasattr(self.sampler, "reseed_rng"):
            self.sampler.reseed_rng()
        # one launch runs at most n_trials, as the plugin's does, however many of them fail
        total = launch_budget = self.n_trials
        with Heartbeats(study._storage) as self.heartbeats:  # optuna 2.10's Study has no public storage
            while True:
                with warnings.catch_warnings():  # marked experimental in optuna 2.10
                    warnings.simplefilter("ignore", ExperimentalWarning)
                    optuna.storages.fail_stale_trials(study)
                fail_trials_without_heartbeat(study, self.unbeaten_since)
                completed = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
                self.n_trials = max(0, min(self.n_jobs, launch_budget, total - completed))
                super().sweep(arguments)  # runs self.n_trials trials, then writes optimization_results.yaml
                if self.n_trials == 0:
                    return
                launch_budget -= self.n_trials

    def _configure_trials(self, trials: list[optuna.Trial], *args: Any) -> Any:
        """The plugin's overrides for a batch of asked trials, whose heartbeats start now. Their jobs (run dirs)
        take their trials' numbers (TrialLauncher), so a resumed search can keep its sweep dir."""
        assert self.heartbeats is not None and isinstance(self.launcher, TrialLauncher)
        self.heartbeats.running([trial._trial_id for trial in trials])
        self.launcher.trial_numbers = [trial.number for trial in trials]
        return super()._configure_trials(trials, *args)
