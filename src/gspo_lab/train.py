"""gspo-train: one RL run from the Hydra config: validate, instantiate, fit, report.

    gspo-train                                   # the default experiment: GSPO on the tiny MoE, CPU
    gspo-train algorithm=grpo seed=1 train.steps=50
    gspo-train -m experiment=paper_main          # a whole study as a Hydra multirun
    gspo-train hydra.run.dir=<run dir> ckpt_path=last   # resume a stopped run in its own dir
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import DictConfig, OmegaConf

from gspo_lab import CONFIG_DIR, SOURCE_ROOT
from gspo_lab.callbacks import GracefulStop
from gspo_lab.cold_start import policy_from_config
from gspo_lab.eval_sets import build_eval
from gspo_lab.loggers import quiet_libraries
from gspo_lab.models.builders import ContextTooLong
from gspo_lab.models.lora import apply_lora
from gspo_lab.module import RLModule, TooManySkippedUpdates
from gspo_lab.objectives.micro_batches import check_splittable
from gspo_lab.report.run import plot_reward_curve, write_run_info
from gspo_lab.report.summary import format_summary, summarise
from gspo_lab.rewards import build_rewards, math_accuracy, unwrapped
from gspo_lab.rollout.backend import RunSettings, backend_class
from gspo_lab.routing.adapters import find_routers
from gspo_lab.sharding import full_state_dict, is_sharded
from gspo_lab.tasks import HFDataset

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A setting is invalid; the message names the key, the value and the rule."""


class Interrupted(RuntimeError):
    """The run stopped on a signal after writing a checkpoint."""

    def __init__(self, signum: int, checkpoint: Path, run_dir: Path, requeued: bool = False) -> None:
        self.signum = signum
        resume = (f"SLURM job requeued: started with hydra.run.dir={run_dir} again, it resumes from the hpc_ckpt "
                  "Lightning wrote there" if requeued else
                  f"Resume with: gspo-train <same overrides> hydra.run.dir={run_dir} ckpt_path=last")
        super().__init__(f"stopped by {signal.Signals(signum).name}; checkpoint {checkpoint}. {resume}")


@dataclass
class Plan:
    """Everything of a run that is cheap to build, built and checked before anything heavy starts."""

    run_dir: Path
    trainer: L.Trainer
    loggers: list
    callbacks: list
    rollout: object
    train: object
    routing: object
    task: object
    rewards: object
    prompt: object
    evaluation: object
    objective: object
    advantage: object
    optimizer: object
    model_source: object
    ckpt_path: str | None


def plan(cfg: DictConfig) -> Plan:
    """Validate the config by instantiating its light parts; raises ConfigError with key, value and rule."""
    try:
        check_advantage_settings(cfg.advantage)
        parts = {k: instantiate(cfg[k]) for k in ("rollout", "train", "routing", "task", "objective", "advantage",
                                                   "optimizer")}
        model_source = instantiate(cfg.model)  # the model source checks its own settings; weights load later
        parts["prompt"] = instantiate(cfg.prompt)
        parts["rewards"] = build_rewards(cfg.reward, parts["task"], parts["train"].on_reward_error)
        parts["evaluation"] = build_eval(cfg, parts["task"], parts["prompt"], parts["train"].on_reward_error)
        loggers = [instantiate(c) for c in cfg.get("logger", {}).values()]
        callbacks = [instantiate(c) for c in cfg.get("callbacks", {}).values()]
        trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks)
        check_precision(trainer)
        parts["train"].check_against(parts["rollout"], trainer.world_size)
        parts["routing"].check_against(parts["rollout"])
        check_rollout_correction(parts["objective"], parts["rollout"])
        warn_latex_only_reward(parts["rewards"], parts["task"])
        warn_inexact_old_logprobs(parts["rollout"].logprobs_from_generation,
                                  "cuda" if isinstance(trainer.accelerator, CUDAAccelerator) else "cpu",
                                  str(trainer.precision))
        if parts["train"].micro_batch_size is not None:
            check_splittable(parts["objective"])
        check_model(model_source, parts["routing"], trainer)
        backend_class(parts["rollout"].backend).check(RunSettings(
            parts["rollout"], parts["train"], parts["routing"], parts["evaluation"].settings, model_source,
            "cuda" if isinstance(trainer.accelerator, CUDAAccelerator) else "cpu",
            isinstance(trainer.strategy, ModelParallelStrategy), trainer.num_nodes))
    except InstantiationException as error:
        raise ConfigError(str(error.__cause__ or error)) from error
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from error
    run_dir = Path(cfg.paths.output_dir)
    return Plan(run_dir, trainer, loggers, callbacks, model_source=model_source,
                ckpt_path=resolve_checkpoint(cfg.get("ckpt_path"), run_dir), **parts)


def check_advantage_settings(advantage: DictConfig) -> None:
    """Every key of `advantage` is a setting of its estimator: an algorithm's setting for another estimator
    (algorithm=dr_grpo's advantage.scale=none) combined with advantage=rloo would otherwise end in a TypeError that
    names neither."""
    target = hydra.utils.get_class(advantage._target_)
    parameters = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for key in advantage:
        if key != "_target_" and key not in parameters:
            raise ValueError(
                f"advantage.{key}={advantage[key]!r} is not a setting of {target.__name__} "
                f"(advantage._target_={advantage._target_}), whose settings are {sorted(parameters)}: an algorithm "
                f"(algorithm=dr_grpo sets advantage.scale) or an override set it for another estimator; drop it "
                f"with ~advantage.{key}"
            )


def check_precision(trainer: L.Trainer) -> None:
    """The RL step checks, logs and clips the true gradient norm before each optimizer step, so a GradScaler
    (float16 mixed precision on a GPU), which multiplies the gradients by its loss scale, is refused. bf16-mixed
    has none; on CPU Lightning runs 16-mixed as bf16-mixed."""
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ValueError(
            f"trainer.precision={trainer.precision!r} is invalid: its GradScaler scales the gradients, and the RL "
            "step checks and clips their true norm; use bf16-mixed or 32-true"
        )


def check_rollout_correction(objective, rollout) -> None:
    """A rollout correction reweights π_old (a trainer forward) toward the engine that sampled; with π_old
    taken from the engine itself there is nothing to correct."""
    correction = getattr(objective, "rollout_correction", "none")
    if correction != "none" and rollout.logprobs_from_generation:
        raise ValueError(
            f"objective.rollout_correction={correction!r} is invalid with rollout.logprobs_from_generation=true: "
            "it corrects a trainer-computed π_old toward the engine's samples, and π_old is then the engine's own; "
            "set rollout.logprobs_from_generation=false"
        )


def warn_latex_only_reward(rewards, task) -> bool:
    """reward=math_verify reads LaTeX answers only by default (TRL's accuracy reward), while task=hf's checker,
    which scores eval/accuracy, reads plain answers too: "The answer is 42" would score 0 in training and count as
    correct in evaluation. Warns (and returns True) where such a pair trains; latex_only=false makes them agree."""
    def reads_latex_only(fn) -> bool:
        settings = fn.keywords if isinstance(fn, functools.partial) else {}
        return unwrapped(fn) is math_accuracy and settings.get("latex_only", True)

    latex_only = [f.name for f in rewards.functions if reads_latex_only(f.fn)]
    if not (latex_only and isinstance(task, HFDataset) and task.match == "math_verify"):
        return False
    log.warning("reward function %s reads LaTeX answers only (latex_only=true), while task=hf's checker, which scores "
                "eval/accuracy, reads plain answers too (\"The answer is 42\"): training rewards less than evaluation "
                "counts. Set reward.functions.<i>.latex_only=false to measure the same thing.", latex_only[0])
    return True


def warn_inexact_old_logprobs(from_generation: bool, device: str, precision: str) -> bool:
    """On a GPU under 16-bit precision, π_old taken from generate's logits is not the training forward's: the
    decode kernels (one position at a time over the KV cache) round differently from the full forward's. On an
    H100 with bench_gpu (bf16) the per-sequence log-ratio reached 1.1e-3 to 1.7e-3 before any update, above GSPO's
    clip range of 3e-4 / 4e-4, while a forward of its own gave 0 (scripts/old_logprob_exactness.py trainer=gpu,
    docs/performance.md). On CPU it is exact under bf16 autocast too. Warns (and returns True) on a GPU in
    16-bit precision with rollout.logprobs_from_generation=true: the paper's §5.4 mode, kept as chosen."""
    if not (from_generation and device == "cuda" and precision.startswith(("bf16", "16"))):
        return False
    log.warning(
        "rollout.logprobs_from_generation=true on a GPU under trainer.precision=%s: the old log-probs come from "
        "the decode kernels, which round differently from the training forward (on an H100 in bf16 the sequence "
        "log-ratio reached 1.7e-3 before any update, above GSPO's clip range of 3e-4 / 4e-4), so sequences clip "
        "from rounding alone. Set rollout.logprobs_from_generation=false for a forward of their own (exact; one "
        "no-grad forward per rollout), or keep it for the GSPO paper's §5.4 mode (engine likelihoods).", precision)
    return True


def check_model(model_source, routing, trainer: L.Trainer) -> None:
    """What the model and the strategy must support, checked on the architecture alone (`skeleton()`, on the
    meta device) before the cold start or any weights: routing replay needs an MoE with a routing adapter, and
    trainer=fsdp (sharded weights) takes no LoRA. The rollout backend checks its own (`RolloutBackend.check`)."""
    if routing.replay != "off":
        find_routers(model_source.skeleton(), f"routing.replay={routing.replay}")  # raises for dense / unsupported
    if isinstance(trainer.strategy, ModelParallelStrategy) and model_source.lora.enabled:
        raise ValueError("model.lora.enabled=true is not supported with trainer=fsdp (untested); use "
                         "trainer=ddp or full training")


def resolve_checkpoint(ckpt_path: str | None, run_dir: Path) -> str | None:
    """`last` -> <run dir>/checkpoints/last.ckpt; any checkpoint must exist and load without running
    pickled code (torch.load weights_only), else a ConfigError naming the file."""
    if ckpt_path is None:
        return None
    path = run_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path).expanduser()
    if not path.is_file():
        where = f"no checkpoints/last.ckpt in {run_dir} (set hydra.run.dir to the run to resume)" if ckpt_path == "last" else "no such file"
        raise ConfigError(f"ckpt_path={ckpt_path!r}: {where}")
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # checked, not read into memory
    except Exception as error:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ConfigError(f"ckpt_path={ckpt_path!r}: {path} is not a readable checkpoint (corrupt or truncated?): {error}")
    return str(path)


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
        if isinstance(error, TooManySkippedUpdates):
            print(f"gspo-train: {error}", file=sys.stderr)
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
