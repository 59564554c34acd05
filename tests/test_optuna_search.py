"""hparams_search=gspo_optuna stores its study and resumes it: `hydra.sweeper.n_trials` is the study's total of
completed trials, a crashed trial is failed (heartbeats) and run again, a resumed or joining sampler does not
replay the seeded proposals, and processes sharing one storage run the study's trials between them. The sweeper
(gspo_lab/sweeper.py) runs in-process against a launcher that scores instantly; the last test kills a real
gspo-train search and resumes it from its sqlite file."""

import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest
import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf
from optuna.trial import TrialState

from gspo_lab import CONFIG_DIR
from gspo_lab.sweeper import ResumableOptunaSweeperImpl, fail_trials_without_heartbeat
from tests.test_sweeps import TINY, finished_runs, gspo_train

COMPLETE, RUNNING, FAIL = TrialState.COMPLETE, TrialState.RUNNING, TrialState.FAIL


class Crash(Exception):
    """What a killed process would stop at: raised in the middle of a trial, so the trial is never told."""


class ScoringLauncher:
    """A launcher whose jobs score x (their override) at once and record (job number, x); it raises Crash
    instead of running its own job `crash_at`, as a process killed during that trial, its job `fail_at`
    returns None, as gspo-train's main does for a job that failed (failed.txt), and its job `nan_at` returns NaN,
    as gspo-train does for a run that never measured its held-out accuracy."""

    def __init__(self, crash_at: int | None = None, fail_at: int | None = None, seconds_per_job: float = 0.0,
                 nan_at: int | None = None):
        self.jobs: list[tuple[int, float]] = []
        self.crash_at, self.fail_at, self.seconds_per_job = crash_at, fail_at, seconds_per_job
        self.nan_at = nan_at

    def launch(self, job_overrides, initial_job_idx):
        returns = []
        for number, overrides in enumerate(job_overrides, start=initial_job_idx):
            if len(self.jobs) == self.crash_at:
                raise Crash
            time.sleep(self.seconds_per_job)
            x = float(dict(o.split("=", 1) for o in overrides)["x"])
            score = None if len(self.jobs) == self.fail_at else math.nan if len(self.jobs) == self.nan_at else x
            self.jobs.append((number, x))
            returns.append(JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=score))
        return returns


def sweeper(storage, n_trials: int, launcher: ScoringLauncher, sweep_dir: Path, seed: int = 1234, n_jobs: int = 1):
    """The resumable sweeper maximising x in [0, 1] with TPE (seeded, 10 random start-up trials), as
    hparams_search=gspo_optuna builds it; `storage` a URL, a storage object or None."""
    search = ResumableOptunaSweeperImpl(
        sampler=optuna.samplers.TPESampler(seed=seed), direction="maximize", storage=storage,
        study_name=None if storage is None else "search", n_trials=n_trials, n_jobs=n_jobs, max_failure_rate=0.0,
        search_space=None, custom_search_space=None, params=OmegaConf.create({"x": "interval(0, 1)"}))
    # what setup() takes from a Hydra run
    search.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}})
    search.launcher, search.hydra_context = launcher, "a Hydra run"
    sweep_dir.mkdir(parents=True, exist_ok=True)
    return search


def heartbeat_storage(url: str) -> optuna.storages.RDBStorage:
    """A storage whose trials go stale 1 s after their last heartbeat (a URL alone waits 120 s)."""
    return optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=1)


def best_value(sweep_dir: Path) -> float:
    return yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())["best_value"]


def test_the_search_config_selects_the_resumable_sweeper_and_hydra_finds_it():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=["hparams_search=gspo_optuna"], return_hydra_config=True)
    assert cfg.hydra.sweeper._target_ == "hydra_plugins.gspo_lab_optuna.ResumableOptunaSweeper"
    assert cfg.hydra.sweeper.storage is None and cfg.hydra.sweeper.study_name is None
    # Hydra instantiates only the plugins it found under hydra_plugins (an editable install included)
    found = {f"{plugin.__module__}.{plugin.__name__}" for plugin in Plugins.instance().discover(Sweeper)}
    assert cfg.hydra.sweeper._target_ in found


def test_without_storage_a_search_runs_its_n_trials(tmp_path):
    launcher = ScoringLauncher()
    sweeper(None, 3, launcher, tmp_path).sweep([])
    assert [number for number, _ in launcher.jobs] == [0, 1, 2]
    assert best_value(tmp_path) == max(x for _, x in launcher.jobs)


def test_a_failed_trial_is_run_again_within_a_launchs_budget(tmp_path):
    url = f"sqlite:///{tmp_path / 'search.db'}"
    first = ScoringLauncher(fail_at=1)
    sweeper(url, 3, first, tmp_path).sweep([])
    assert len(first.jobs) == 3  # one launch runs at most n_trials, whatever fails
    study = optuna.load_study(study_name="search", storage=url)
    assert [t.state for t in study.trials] == [COMPLETE, FAIL, COMPLETE]
    second = ScoringLauncher()
    sweeper(url, 3, second, tmp_path).sweep([])
    assert [number for number, _ in second.jobs] == [3]  # the one completed trial the study lacked


def test_a_trial_whose_objective_is_nan_is_failed_and_the_search_goes_on(tmp_path):
    """The plugin told a NaN as COMPLETE, optuna refused it, and the plugin's fallback then told FAIL with the NaN:
    `ValueError: Values were told` ended the whole search at the first NaN."""
    url = f"sqlite:///{tmp_path / 'search.db'}"
    launcher = ScoringLauncher(nan_at=1)
    sweeper(url, 3, launcher, tmp_path).sweep([])
    study = optuna.load_study(study_name="search", storage=url)
    assert [t.state for t in study.trials] == [COMPLETE, FAIL, COMPLETE]  # one launch runs at most n_trials
    assert best_value(tmp_path) == max(x for number, x in launcher.jobs if number != 1)


def test_a_search_whose_runs_never_evaluate_is_refused_before_its_first_trial(tmp_path):
    """gspo-train returns the final held-out accuracy, NaN under train.eval_every=0: every trial would fail."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=["hparams_search=gspo_optuna", "train.eval_every=0"],
                            return_hydra_config=True)
    cfg.hydra.sweep.dir = str(tmp_path)
    launcher = ScoringLauncher()
    search = sweeper(None, 3, launcher, tmp_path)
    search.config = cfg  # what Hydra's setup() gives the sweeper: the composed config, command-line values in it
    with pytest.raises(ValueError, match=r"train.eval_every=0 is invalid with hparams_search=gspo_optuna"):
        search.sweep([])
    assert launcher.jobs == []


def test_run_dirs_take_their_trials_numbers_when_another_process_asks_between_them(tmp_path, monkeypatch):
    """A launcher numbers a batch's jobs consecutively from its first; with n_jobs=2 and another process asking
    trial 1 between this batch's trials 0 and 2, trial 2 ran in run dir 1_..., the other process's trial 1's."""
    url = f"sqlite:///{tmp_path / 'search.db'}"
    ask = optuna.Study.ask

    def ask_then_another_process_asks(study, *args, **kwargs):
        trial = ask(study, *args, **kwargs)
        if trial.number == 0:
            ask(optuna.load_study(study_name="search", storage=url))  # trial 1, the other process's
        return trial

    monkeypatch.setattr(optuna.Study, "ask", ask_then_another_process_asks)
    launcher = ScoringLauncher()
    sweeper(url, 2, launcher, tmp_path, n_jobs=2).sweep([])
    assert [number for number, _ in launcher.jobs] == [0, 2]


def test_a_crashed_search_resumes_from_its_storage_and_completes_its_trial_count(tmp_path):
    url = f"sqlite:///{tmp_path / 'search.db'}"
    before = ScoringLauncher(crash_at=2)
    with pytest.raises(Crash):
        sweeper(heartbeat_storage(url), 4, before, tmp_path / "first").sweep([])
    study = optuna.load_study(study_name="search", storage=url)
    assert [t.state for t in study.trials] == [COMPLETE, COMPLETE, RUNNING]  # the crashed trial, never told

    time.sleep(3)  # past the 1 s grace period, counted in whole seconds of sqlite's clock
    after = ScoringLauncher()  # a new process: a new storage and a sampler with the same seed
    sweeper(heartbeat_storage(url), 4, after, tmp_path / "resumed").sweep([])
    study = optuna.load_study(study_name="search", storage=url)
    assert [t.state for t in study.trials] == [COMPLETE, COMPLETE, FAIL, COMPLETE, COMPLETE]
    # the resume ran the two trials the study lacked, numbered as the study numbers them (their run dirs)
    assert [number for number, _ in after.jobs] == [3, 4]
    # and did not replay the seeded sampler's first proposals, the trials that had already run
    assert not {x for _, x in after.jobs} & {x for _, x in before.jobs}
    assert best_value(tmp_path / "resumed") == max(x for _, x in before.jobs + after.jobs)

    again = ScoringLauncher()
    sweeper(url, 4, again, tmp_path / "again").sweep([])
    assert again.jobs == [] and len(optuna.load_study(study_name="search", storage=url).trials) == 5
    assert best_value(tmp_path / "again") == best_value(tmp_path / "resumed")


def test_processes_sharing_a_storage_run_the_studys_trials_between_them(tmp_path):
    """Two workers on one study (as two machines on one database, each with its own seed): together they
    complete n_trials, at most one more (a trial in flight when the count was reached), each trial once."""
    url = f"sqlite:///{tmp_path / 'search.db'}"
    workers = [(sweeper(url, 6, launcher, tmp_path / f"worker{seed}", seed=seed), launcher)
               for seed, launcher in [(1, ScoringLauncher(seconds_per_job=0.05)),
                                      (2, ScoringLauncher(seconds_per_job=0.05))]]
    threads = [threading.Thread(target=search.sweep, args=([],)) for search, _ in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    study = optuna.load_study(study_name="search", storage=url)
    completed = [t for t in study.trials if t.state == COMPLETE]
    assert 6 <= len(completed) <= 7 and len(completed) == len(study.trials)
    jobs = [job for _, launcher in workers for job in launcher.jobs]
    assert all(launcher.jobs for _, launcher in workers)  # both workers ran trials
    assert sorted(number for number, _ in jobs) == [t.number for t in completed]
    assert len({x for _, x in jobs}) == len(jobs)


def trial_states(db: Path) -> list[str]:
    """The states of a study's trials in its sqlite file, read as the search writes it; [] before it has any."""
    try:
        with closing(sqlite3.connect(db, timeout=10)) as connection:
            return [state for (state,) in connection.execute("SELECT state FROM trials ORDER BY number")]
    except sqlite3.OperationalError:  # no file or no tables yet
        return []


def running_with_heartbeat(db: Path) -> int:
    """How many RUNNING trials of the sqlite file have recorded a heartbeat; 0 before it has any."""
    query = "SELECT COUNT(*) FROM trials JOIN trial_heartbeats USING (trial_id) WHERE state = 'RUNNING'"
    try:
        with closing(sqlite3.connect(db, timeout=10)) as connection:
            return connection.execute(query).fetchone()[0]
    except sqlite3.OperationalError:  # no file or no tables yet
        return 0


def kill_during_a_trial(args: list[str], db: Path, cwd: Path) -> list[str]:
    """Starts gspo-train with `args` and kills it (SIGKILL) once a trial has completed and the next is running with
    its first heartbeat recorded; returns the trial states it left. (A trial killed before its first heartbeat is
    failed only once the resuming process has watched it for the grace period, which two tiny trials may not last:
    test_a_trial_without_heartbeat_is_failed_once_this_process_has_waited_the_grace_period covers that case.)"""
    env = {**os.environ, "WANDB_MODE": "offline"}
    search = subprocess.Popen([sys.executable, "-m", "gspo_lab.train", *args], cwd=cwd, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not ((states := trial_states(db)).count("COMPLETE") >= 1 and running_with_heartbeat(db) == 1):
        assert search.poll() is None and time.monotonic() < deadline, f"the search ended first: {states}"
        time.sleep(0.02)
    os.killpg(search.pid, signal.SIGKILL)
    search.wait()
    return trial_states(db)


@pytest.mark.slow
def test_a_killed_gspo_train_search_resumes_from_its_sqlite_file(tmp_path):
    db, sweep = tmp_path / "search.db", tmp_path / "sweep"
    storage = (f"hydra.sweeper.storage={{_target_:optuna.storages.RDBStorage,url:'sqlite:///{db}',"
               "heartbeat_interval:1,grace_period:1}")
    args = ["hparams_search=gspo_optuna", storage, "hydra.sweeper.study_name=killed", "hydra.sweeper.n_trials=3",
            "sft.enabled=false", f"hydra.sweep.dir={sweep}", "model.config.num_hidden_layers=1", *TINY]
    killed = kill_during_a_trial(args, db, tmp_path)
    assert killed.count("RUNNING") == 1
    done_before = killed.count("COMPLETE")
    summaries = {run.name: (run / "summary.json").stat().st_mtime_ns for run in finished_runs(sweep)}
    assert len(summaries) == done_before

    time.sleep(3)  # past the grace period
    result = gspo_train(args, tmp_path)  # the same command, into the same sweep dir
    assert result.returncode == 0, result.stderr[-3000:]
    states = trial_states(db)
    assert states.count("COMPLETE") == 3 and states[killed.index("RUNNING")] == "FAIL"
    assert len(states) == len(killed) + 3 - done_before  # only the missing trials ran
    runs = finished_runs(sweep)
    assert sorted(int(run.name.split("_")[0]) for run in runs) == [n for n, s in enumerate(states) if s == "COMPLETE"]
    # the runs finished before the kill were neither run again nor overwritten
    assert {run.name: (run / "summary.json").stat().st_mtime_ns for run in runs if run.name in summaries} == summaries
    study = optuna.load_study(study_name="killed", storage=f"sqlite:///{db}")
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == study.best_value and results["best_params"] == study.best_params


def start_trial_at(db: Path, number: int, hours: float) -> None:
    """Sets trial `number`'s datetime_start to this clock's now plus `hours`: as written by a machine whose clock
    is that far ahead of this one's (or in another time zone; optuna writes local time)."""
    start = (datetime.now() + timedelta(hours=hours)).strftime("%Y-%m-%d %H:%M:%S.%f")
    with closing(sqlite3.connect(db)) as connection, connection:
        connection.execute("UPDATE trials SET datetime_start = ? WHERE number = ?", (start, number))


def test_a_trial_without_heartbeat_is_failed_once_this_process_has_waited_the_grace_period(tmp_path):
    """Optuna's fail_stale_trials skips trials without a heartbeat: a search killed between asking for a trial and
    recording its first heartbeat left it RUNNING for ever (CI caught it on a loaded machine). The wait is timed on
    this process's clock alone: a trial's datetime_start is the clock of the machine that asked for it, so comparing
    it with this one's kept an orphan from a machine ahead RUNNING and failed a live trial from one behind."""
    db = tmp_path / "search.db"
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}", heartbeat_interval=1, grace_period=1)
    elsewhere = optuna.create_study(study_name="s", storage=storage)  # the other machines' processes
    orphan = elsewhere.ask()  # its process, on a machine an hour ahead, died before any heartbeat
    start_trial_at(db, orphan.number, hours=1)
    beating = elsewhere.ask()
    storage.record_heartbeat(beating._trial_id)
    here, first_seen = optuna.load_study(study_name="s", storage=storage), {}
    assert fail_trials_without_heartbeat(here, first_seen, now=100.0) == []  # seen without one from now on
    fresh = elsewhere.ask()  # asked just now on a machine an hour behind: its heartbeat may be on its way
    start_trial_at(db, fresh.number, hours=-1)
    assert fail_trials_without_heartbeat(here, first_seen, now=101.5) == [orphan._trial_id]  # 1.5 s > grace 1 s
    states = {t.number: t.state for t in optuna.load_study(study_name="s", storage=storage).trials}
    assert states == {orphan.number: TrialState.FAIL, beating.number: TrialState.RUNNING,
                      fresh.number: TrialState.RUNNING}  # a stale heartbeat is fail_stale_trials' to judge
