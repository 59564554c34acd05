"""gspo-train: one RL run from the Hydra config: instantiate, fit, report.

    gspo-train                                   # the default experiment: GSPO on the tiny MoE, CPU
    gspo-train algorithm=grpo seed=1 train.steps=50
    gspo-train -m experiment=paper_main          # a whole study as a Hydra multirun
    python -m gspo_lab.train ckpt_path=outputs/<run>/checkpoints/last.ckpt   # resume
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from gspo_lab import CONFIG_DIR
from gspo_lab.cold_start import policy_from_config
from gspo_lab.loggers import quiet_libraries
from gspo_lab.module import RLModule
from gspo_lab.report.run import plot_reward_curve, write_run_info
from gspo_lab.report.summary import format_summary, summarise

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict:
    """Run one RL experiment; returns its summary (also written to summary.json in the run dir)."""
    os.environ.setdefault("WANDB_MODE", "offline")  # a user's WANDB_MODE wins
    quiet_libraries()
    run_dir = Path(cfg.paths.output_dir)
    rollout, train_cfg, routing = instantiate(cfg.rollout), instantiate(cfg.train), instantiate(cfg.routing)
    loggers = [instantiate(c) for c in cfg.get("logger", {}).values()]
    callbacks = [instantiate(c) for c in cfg.get("callbacks", {}).values()]
    trainer: L.Trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks)
    train_cfg.check_against(rollout, trainer.world_size)
    routing.check_against(rollout)
    task = instantiate(cfg.task)
    model, tokenizer, cold_start = policy_from_config(cfg, task)
    module = RLModule(
        model, tokenizer, task, instantiate(cfg.objective), instantiate(cfg.advantage), instantiate(cfg.optimizer),
        rollout, train_cfg, routing, cfg.seed,
    )
    algorithm = HydraConfig.get().runtime.choices.get("algorithm") if HydraConfig.initialized() else None
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        write_run_info(run_dir, Path(CONFIG_DIR).parent, {"algorithm": algorithm, "cold_start": cold_start})
        for logger in loggers:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    started = time.perf_counter()
    trainer.fit(module, ckpt_path=cfg.get("ckpt_path"))
    summary = summarise(module.history, time.perf_counter() - started, algorithm or module.objective.name, str(run_dir))
    if trainer.is_global_zero:
        module.model.save_pretrained(run_dir / "final")  # the trained policy: model=hf model.path=<run>/final
        tokenizer.save_pretrained(run_dir / "final")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_reward_curve(module.history, run_dir / "reward_curve.png", title=run_dir.name)
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
    """Returns the final held-out accuracy, the value a Hydra sweeper would optimise. In a multirun a
    failed job is logged and recorded in its run dir (failed.txt) and the sweep goes on."""
    set_threads(cfg)
    if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
        return train(cfg)["eval/accuracy_after"]
    try:
        return train(cfg)["eval/accuracy_after"]
    except Exception:  # noqa: BLE001 - one bad job must not end a sweep of many
        run_dir = Path(cfg.paths.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "failed.txt").write_text(traceback.format_exc())
        log.error("job %s failed; the sweep continues. Traceback in %s", run_dir.name, run_dir / "failed.txt")
        return None


if __name__ == "__main__":
    main()
