"""gspo-train: one RL run from the Hydra config: validate, instantiate, fit, report.

    gspo-train                                   # the default experiment: GSPO on the tiny MoE, CPU
    gspo-train algorithm=grpo seed=1 train.steps=50
    gspo-train -m experiment=paper_main          # a whole study as a Hydra multirun
    gspo-train hydra.run.dir=<run dir> ckpt_path=last   # resume a stopped run in its own dir
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gspo_lab import CONFIG_DIR, SOURCE_ROOT
from gspo_lab.callbacks import GracefulStop
from gspo_lab.cold_start import policy_from_config
from gspo_lab.loggers import quiet_libraries
from gspo_lab.models.builders import ContextTooLong
from gspo_lab.models.lora import apply_lora
from gspo_lab.module import RLModule, RunStopped
from gspo_lab.plan import (ConfigError, Plan, check_precision, plan, resolve_checkpoint, warn_inexact_old_logprobs,
                           warn_latex_only_reward)
from gspo_lab.report.run import plot_reward_curve, write_run_info
from gspo_lab.report.summary import format_summary, summarise
from gspo_lab.sharding import full_state_dict, is_sharded

# the plan and its checks live in gspo_lab.plan; tests and users import them from here as before
__all__ = ["ConfigError", "Interrupted", "Plan", "algorithm_label", "build", "check_precision", "main", "plan",
           "resolve_checkpoint", "train", "warn_inexact_old_logprobs", "warn_latex_only_reward"]

log = logging.getLogger(__name__)


class Interrupted(RuntimeError):
    """The run stopped on a signal after writing a checkpoint."""

    def __init__(self, signum: int, checkpoint: Path, run_dir: Path, requeued: bool = False) -> None:
        self.signum = signum
        resume = (f"SLURM job requeued: started with hydra.run.dir={run_dir} again, it resumes from the hpc_ckpt "
                  "Lightning wrote there" if requeued else
                  f"Resume with: gspo-train <same overrides> hydra.run.dir={run_dir} ckpt_path=last")
        super().__init__(f"stopped by {signal.Signals(signum).name}; checkpoint {checkpoint}. {resume}")


def build(cfg: DictConfig) -> tuple[Plan, RLModule, dict]:
    """The validated plan, the module holding the starting policy (cold start loaded or trained), and the
    cold start's info."""
    os.environ.setdefault("WANDB_MODE", "offline")  # a user's WANDB_MODE wins
    quiet_libraries()
    run = plan(cfg)
    try:
        model, tokenizer, cold_start = policy_from_config(cfg, run.task)
        run.evaluation.fit(model, tokenizer, run.rollout.max_new_tokens, fitted=(run.task,))
        lora = apply_lora(model, run.model_source.lora, cfg.seed) if run.model_source.lora.enabled else None
    except (ContextTooLong, ValueError) as error:
        raise ConfigError(str(error)) from error
    module = RLModule(model, tokenizer, run.task, run.objective, run.advantage, run.optimizer, run.rollout,
                      run.train, run.routing, cfg.seed, lora, run.rewards, run.prompt, run.evaluation)
    try:
        module.collector.preflight()  # an environment whose reset() fails is refused before anything trains
    except ValueError as error:
        module.close()
        raise ConfigError(str(error)) from error
    return run, module, cold_start


def algorithm_label(objective: str, replay: str, shuffle_rewards: bool, correction: str = "none") -> str:
    """The algorithm a run really is, named from what runs (not from the `algorithm=` choice, which
    `objective=grpo` on its own leaves at its default): the objective, its routing replay mode (GRPO with r2
    is the paper's `grpo_rr`), its rollout correction and the shuffled-reward control.

    >>> algorithm_label("grpo", "off", False), algorithm_label("grpo", "r2", False), algorithm_label("gspo", "r3", False)
    ('grpo', 'grpo_rr', 'gspo+r3')
    >>> algorithm_label("gspo", "off", True), algorithm_label("grpo", "off", False, "tis_token")
    ('gspo_shuffled_rewards', 'grpo+tis_token')
    """
    label = objective
    if replay != "off":
        label = "grpo_rr" if (objective, replay) == ("grpo", "r2") else f"{objective}+{replay}"
    if correction != "none":
        label = f"{label}+{correction}"
    return f"{label}_shuffled_rewards" if shuffle_rewards else label


def train(cfg: DictConfig) -> dict:
    """Run one RL experiment; returns its summary (also written to summary.json in the run dir)."""
    run, module, cold_start = build(cfg)
    trainer = run.trainer
    algorithm = algorithm_label(run.objective.name, run.routing.replay, run.train.shuffle_rewards,
                                run.objective.rollout_correction)
    if trainer.is_global_zero:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        write_run_info(run.run_dir, SOURCE_ROOT, {"algorithm": algorithm, "cold_start": cold_start})
        for logger in run.loggers:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    try:
        return _fit(run, module, algorithm)
    finally:  # the module's teardown does on success; Lightning skips it when fit raises, and the next job of a
        module.close()  # multirun runs in this process


def _fit(run: Plan, module: RLModule, algorithm: str) -> dict:
    """Fit, then write final/, summary.json and the reward curve; returns the summary."""
    trainer, tokenizer = run.trainer, module.tokenizer
    started = time.perf_counter()
    trainer.fit(module, ckpt_path=run.ckpt_path, weights_only=True)
    stop = next((c for c in run.callbacks if isinstance(c, GracefulStop) and c.received), None)
    if stop is not None:
        raise Interrupted(stop.received, stop.checkpoint, run.run_dir, stop.requeued)
    summary = summarise(module.history, time.perf_counter() - started, algorithm, str(run.run_dir))
    weights = full_state_dict(module.model) if is_sharded(module.model) else None  # collective under FSDP
    if trainer.is_global_zero:
        if module.lora is not None:  # final/adapter/ and the merged model in final/
            module.lora.save_final(run.run_dir / "final")
        else:
            module.model.save_pretrained(run.run_dir / "final", state_dict=weights)  # model=hf model.path=<run>/final
        tokenizer.save_pretrained(run.run_dir / "final")
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_reward_curve(module.history, run.run_dir / "reward_curve.png", title=run.run_dir.name)
        print(format_summary(summary))
    return summary


def set_threads(cfg: DictConfig) -> None:
    """torch threads: `threads` if set; under a parallel Hydra launcher (joblib's n_jobs, -1 = one job per
    core), the cores divided among its jobs, so two jobs on two cores do not fight over threads."""
    threads = cfg.get("threads")
    if threads is None and HydraConfig.initialized():
        cores = os.cpu_count() or 1
        jobs = HydraConfig.get().launcher.get("n_jobs")
        jobs = cores if jobs == -1 else jobs
        if isinstance(jobs, int) and jobs > 1:
            threads = max(1, cores // jobs)
    if threads is not None:
        torch.set_num_threads(threads)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Returns the final held-out accuracy, the value a Hydra sweeper would optimise. A bad setting or a
    stop on a signal ends the command with a one-paragraph message and a non-zero exit; in a multirun a
    failed job is recorded in its run dir (failed.txt) and the sweep goes on."""
    set_threads(cfg)
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        return train(cfg)["eval/accuracy_after"]
    except Exception as error:
        if multirun:  # one bad job must not end a sweep of many
            run_dir = Path(cfg.paths.output_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "failed.txt").write_text(traceback.format_exc())
            log.error("job %s failed (%s); the sweep continues", run_dir.name, error)
            return None
        if isinstance(error, ConfigError):
            print(f"gspo-train: invalid configuration: {error}", file=sys.stderr)
            sys.exit(2)
        if isinstance(error, Interrupted):
            print(f"gspo-train: {error}", file=sys.stderr)
            sys.exit(128 + error.signum)
        if isinstance(error, RunStopped):  # too many skipped updates, a step with no signal left
            print(f"gspo-train: {error}", file=sys.stderr)
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
