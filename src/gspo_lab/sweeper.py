"""hydra-optuna-sweeper made resumable: `hydra.sweeper.n_trials` is the study's total of completed trials.

hparams_search=gspo_optuna selects it (through hydra_plugins/gspo_lab_optuna, where Hydra looks for plugins).
The plugin runs n_trials new trials at every launch; here a launch runs only what the study still lacks, so a
search stored in a database is resumed by running its command again:

    gspo-train hparams_search=gspo_optuna hydra.sweeper.storage=sqlite:///search.db hydra.sweeper.study_name=lr

- A process that died leaves its trials RUNNING in the storage. With an RDB storage the sweeper records a
  heartbeat for its running trials, and before each batch fails the trials whose heartbeat is older than the
  grace period (Optuna's `fail_stale_trials`; a URL gets HEARTBEAT_INTERVAL_S and twice that), and those that
  started longer ago than that and never recorded one (`fail_trials_without_heartbeat`). Only COMPLETE
  trials count, so a failed trial is run again, within a budget of n_trials trials per launch.
- Run dirs are numbered by trial number, so a resumed search can write into the sweep dir it started.
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

import threading
import warnings
from datetime import datetime
from typing import Any

import optuna
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl
from optuna.exceptions import ExperimentalWarning
from optuna.trial import TrialState

# seconds between two heartbeats of a running trial when the storage is a URL; its trial is stale after twice
# this. Other intervals: the storage as a node, {_target_: optuna.storages.RDBStorage, url: ...,
# heartbeat_interval: 10, grace_period: 30}
HEARTBEAT_INTERVAL_S = 60


def study_storage(storage: Any) -> optuna.storages.BaseStorage | str:
    """The storage every study of one sweep opens: None as one in-memory storage (the sweeper counts the trials
    that the plugin's study runs), an RDB URL as an RDBStorage that records heartbeats, the rest as given."""
    if storage is None:
        return optuna.storages.InMemoryStorage()
    if not isinstance(storage, str) or storage.startswith("redis"):
        return storage
    return optuna.storages.RDBStorage(storage, heartbeat_interval=HEARTBEAT_INTERVAL_S)


def fail_trials_without_heartbeat(study: optuna.Study) -> list[int]:
    """Fail the RUNNING trials that never recorded a heartbeat and started more than the grace period ago; returns
    their ids. Optuna's fail_stale_trials skips trials without a heartbeat, so a process killed between asking for
    a trial and its first heartbeat (a few milliseconds, longer on a loaded machine) left that trial RUNNING for
    ever. Uses optuna 2.10's RDB storage internals (the plugin pins optuna<3)."""
    cached = study._storage  # optuna 2.10's Study has no public storage; an RDB one comes wrapped in a cache
    storage = getattr(cached, "_backend", cached)
    if not isinstance(storage, optuna.storages.RDBStorage) or not storage.is_heartbeat_enabled():
        return []
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    grace = storage.grace_period or 2 * storage.heartbeat_interval
    now, failed = datetime.now(), []  # datetime_start is this clock's (optuna's datetime.now())
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.datetime_start is None or (now - trial.datetime_start).total_seconds() <= grace:
            continue
        with _create_scoped_session(storage.scoped_session) as session:
            beaten = models.TrialHeartbeatModel.where_trial_id(trial._trial_id, session) is not None
        if not beaten and cached.set_trial_state(trial._trial_id, TrialState.FAIL):
            failed.append(trial._trial_id)
    return failed


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

    def sweep(self, arguments: list[str]) -> None:
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
                fail_trials_without_heartbeat(study)
                completed = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
                self.n_trials = max(0, min(self.n_jobs, launch_budget, total - completed))
                super().sweep(arguments)  # runs self.n_trials trials, then writes optimization_results.yaml
                if self.n_trials == 0:
                    return
                launch_budget -= self.n_trials

    def _configure_trials(self, trials: list[optuna.Trial], *args: Any) -> Any:
        """The plugin's overrides for a batch of asked trials, whose heartbeats start now. Their jobs (run dirs)
        are numbered from the first one's trial number, so a resumed search can keep its sweep dir."""
        assert self.heartbeats is not None
        self.heartbeats.running([trial._trial_id for trial in trials])
        self.job_idx = trials[0].number
        return super()._configure_trials(trials, *args)
