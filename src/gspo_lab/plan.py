"""The plan of a run: every setting validated and every light part built before anything heavy starts (weights,
the cold start, an engine). gspo_lab.train runs `plan` first; a bad setting ends there with a `ConfigError` that
names the key, the value and the rule.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import DictConfig, OmegaConf

from gspo_lab.eval_sets import build_eval
from gspo_lab.objectives.micro_batches import check_splittable
from gspo_lab.rewards import build_rewards, math_accuracy, reads_environments, unwrapped
from gspo_lab.rollout.backend import RunSettings, backend_class, check_capabilities
from gspo_lab.routing.adapters import find_routers
from gspo_lab.tasks import HFDataset

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A setting is invalid; the message names the key, the value and the rule."""


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
        check_clip_scale(cfg.get("clip_scale", 1.0))
        parts = {k: instantiate(cfg[k]) for k in ("rollout", "train", "routing", "task", "objective", "advantage",
                                                   "optimizer")}
        check_optimizer(parts["optimizer"], cfg.optimizer)
        backend = backend_class(parts["rollout"].backend)  # a name the registry has, its module imported
        model_source = instantiate(cfg.model)  # the model source checks its own settings; weights load later
        parts["prompt"] = instantiate(cfg.prompt)
        parts["rewards"] = build_rewards(cfg.reward, parts["task"], parts["train"].on_reward_error,
                                         parts["train"].failure_stop_frac)
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
        if parts["train"].micro_batch_size is not None or parts["train"].micro_batch_tokens is not None:
            check_splittable(parts["objective"], "train.micro_batch_size" if parts["train"].micro_batch_size
                             else "train.micro_batch_tokens")
        check_multi_turn(parts["task"], parts["rollout"], parts["rewards"])
        check_versions(parts["rollout"], parts["routing"])
        check_answers(parts["task"], cfg, model_source, parts["train"], parts["evaluation"])
        if parts["routing"].replay != "off":  # raises for a dense or unsupported MoE
            find_routers(model_source.skeleton(), f"routing.replay={parts['routing'].replay}")
        settings = RunSettings(parts["rollout"], parts["train"], parts["routing"], parts["evaluation"].settings,
                               model_source, "cuda" if isinstance(trainer.accelerator, CUDAAccelerator) else "cpu",
                               isinstance(trainer.strategy, ModelParallelStrategy), trainer.num_nodes)
        check_capabilities(backend, settings, multi_turn=parts["task"].toolset is not None)
        backend.check(settings)
        if parts["rollout"].rescore not in (None, parts["rollout"].backend):  # the scoring engine's own refusals
            backend_class(parts["rollout"].rescore).check(settings)
        check_strategy(model_source, trainer, parts["rollout"])
        if parts["rollout"].async_mode == "overlap":
            check_overlap(parts["rollout"], parts["routing"], settings.device, trainer.world_size)
    except InstantiationException as error:
        raise ConfigError(str(error.__cause__ or error)) from error
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from error
    run_dir = Path(cfg.paths.output_dir)
    return Plan(run_dir, trainer, loggers, callbacks, model_source=model_source,
                ckpt_path=resolve_checkpoint(cfg.get("ckpt_path"), run_dir), **parts)


def check_clip_scale(clip_scale) -> None:
    """clip_scale multiplies the clip ranges of the objectives that have one; the others ignore it, so a bad value
    would run silently there."""
    if isinstance(clip_scale, bool) or not (isinstance(clip_scale, (int, float)) and 0 < clip_scale < math.inf):
        raise ValueError(f"clip_scale={clip_scale!r} is invalid: must be a finite number > 0 (it multiplies the "
                         "objective's clip range)")


def check_optimizer(optimizer, settings: DictConfig) -> None:
    """Build the optimizer on one stand-in parameter, so a setting it refuses (weight_decay=-1) is refused now,
    named by its key, not at the first step in torch's words."""
    try:
        optimizer([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError) as error:
        given = {k: v for k, v in OmegaConf.to_container(settings, resolve=True).items() if not k.startswith("_")}
        named = [k for k in given if k in str(error) or k.rstrip("s") in str(error)] or list(given)  # betas: "beta"
        keys = ", ".join(f"optimizer.{k}={given[k]!r}" for k in named)
        raise ValueError(f"{keys} is invalid: {settings.get('_target_')} refused it ({error})") from None


def check_multi_turn(task, rollout, rewards) -> None:
    """A task with tools or an environment (multi-turn, gspo_lab.rollout.multi_turn) whose rows each come from one
    version; under overlap the loop runs in the engine process, where its environments stay (the backend's own part:
    gspo_lab.rollout.backend.check_capabilities)."""
    if task.toolset is None:
        return
    reading = [f.name for f in rewards.functions if reads_environments(f)]
    if rollout.async_mode == "overlap" and rollout.max_staleness > 0 and reading:
        raise ValueError(f"reward function {reading[0]} takes `environments` with rollout.async_mode=overlap: the "
                         "rows' environment instances live in the engine process's tool workers, which the trainer "
                         "does not reach; read get_reward()'s value (environment_reward) instead, or use "
                         "async_mode=lagged")
    for key, value, default in (("partial", rollout.partial, False), ("lag_spread", rollout.lag_spread, "fixed")):
        if value != default:
            raise ValueError(f"rollout.{key}={value!r} with task.tools or task.environment is not built yet: the "
                             "multi-turn loop generates a step's rows together, from one weight version; leave "
                             f"rollout.{key}={default!r}")


def check_versions(rollout, routing) -> None:
    """rollout.partial and lag_spread=uniform generate a row's segments, or a step's groups, in calls of their own:
    the engine's experts of those calls are not stitched into one trace, so r3 has none to replay."""
    if routing.replay == "r3" and (rollout.partial or rollout.lag_spread != "fixed"):
        raise ValueError(f"routing.replay=r3 with rollout.partial={rollout.partial} and rollout.lag_spread="
                         f"{rollout.lag_spread!r}: the engine's experts of a row's several calls are not stitched into "
                         "one trace yet; use routing.replay=r2 (the trainer's own experts under π_old)")


def check_answers(task, cfg: DictConfig, model_source, train, evaluation) -> None:
    """A data set without reference answers (task.answer_column=null) where nothing reads one: the rewards are
    checked where they are built; the cold start imitates the answers (or task.solution_column), and held-out
    accuracy grades against them."""
    if task.has_answers:
        return
    from gspo_lab.sft import SFTConfig

    sft = SFTConfig(**OmegaConf.to_container(cfg.sft, resolve=True))
    if sft.runs_on(model_source) and getattr(task, "solution_column", None) is None:
        raise ValueError(f"sft.enabled={sft.enabled!r}: the cold start imitates the reference answers, and the data "
                         "has none (task.answer_column=null); give task.solution_column, or set sft.enabled=false")
    graded = [spec.name for spec in evaluation.specs if spec.task is task]
    if train.eval_every and graded:
        raise ValueError(f"train.eval_every={train.eval_every}: eval.sets.{graded[0]} grades held-out accuracy "
                         "against the reference answers, and the data has none (task.answer_column=null); set "
                         "train.eval_every=0, or evaluate a task that has answers (eval.sets.<name>.task)")


def check_overlap(rollout, routing, device: str, world_size: int) -> None:
    """rollout.async_mode=overlap as built: one trainer process on CPU beside one engine process, each on cores of
    its own (gspo_lab.rollout.sources.overlap; the multi-GPU design is in docs/concepts/staleness.md, not built), which
    returns no experts and takes whole weight versions, never adapters."""
    if routing.replay == "r3":
        raise ValueError("routing.replay=r3 with rollout.async_mode=overlap: the engine process returns no experts yet "
                         "(the colocated engine captures them: gspo_lab.rollout.vllm.experts); use routing.replay=r2 "
                         "or async_mode=lagged")
    if rollout.vllm.lora_sync == "adapter":
        raise ValueError("rollout.vllm.lora_sync=adapter with rollout.async_mode=overlap: the engine process takes "
                         "whole weight versions (the LoRA-wrapped weights merged), not adapters; use "
                         "rollout.vllm.lora_sync=merged or async_mode=lagged")
    if device != "cpu" or world_size != 1:
        raise ValueError(f"rollout.async_mode=overlap runs one trainer process on CPU beside its engine process (here: "
                         f"{world_size} process(es) on {device}); the design for engine ranks on GPUs of their own is in "
                         "docs/concepts/staleness.md, not built. Use async_mode=lagged")
    from gspo_lab.rollout.sources.overlap import split_cores

    split_cores(rollout.overlap.engine_cores)


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
    """A rollout correction or the decoupled loss reweights a recomputed π_old toward the policy that sampled,
    which needs π_old recomputed; and a stale rollout (rollout.max_staleness > 0) trained against a recomputed π_old
    needs one of them, or the clip is anchored to a policy that never generated the trajectory (radixark/miles
    PR #1829)."""
    correction = getattr(objective, "rollout_correction", "none")
    decoupled = getattr(objective, "decoupled", False)
    if correction != "none" and rollout.logprobs_from_generation:
        raise ValueError(
            f"objective.rollout_correction={correction!r} is invalid with rollout.logprobs_from_generation=true: "
            "it corrects a trainer-computed π_old toward the engine's samples, and π_old is then the engine's own; "
            "set rollout.logprobs_from_generation=false"
        )
    if decoupled and rollout.logprobs_from_generation:
        raise ValueError(
            "objective.decoupled=true is invalid with rollout.logprobs_from_generation=true: the decoupled loss "
            "anchors the clip to a recomputed π_old (π_prox) and weights it by π_prox / π_behave, and π_old is then "
            "the engine's own (the bypass correction); set rollout.logprobs_from_generation=false"
        )
    if rollout.max_staleness > 0 and not rollout.logprobs_from_generation and not decoupled and correction == "none":
        raise ValueError(
            f"rollout.max_staleness={rollout.max_staleness} with a recomputed π_old "
            "(rollout.logprobs_from_generation=false) and no correction anchors the clip to a policy that never "
            "generated the rows. Choose one: rollout.logprobs_from_generation=true (bypass: the engine's log-probs "
            "are π_old), objective.decoupled=true (decoupled PPO: π_prox / π_behave weights), or "
            "rollout.max_staleness=0"
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


def check_strategy(model_source, trainer: L.Trainer, rollout) -> None:
    """trainer=fsdp (sharded weights) takes no LoRA and no stale rollouts. Checked, as routing replay's MoE and the rollout backend's
    needs, on the architecture alone before the cold start or any weights."""
    if isinstance(trainer.strategy, ModelParallelStrategy) and model_source.lora.enabled:
        raise ValueError("model.lora.enabled=true is not supported with trainer=fsdp (untested); use "
                         "trainer=ddp or full training")
    if isinstance(trainer.strategy, ModelParallelStrategy) and rollout.max_staleness > 0:
        raise ValueError(f"rollout.max_staleness={rollout.max_staleness} is not supported with trainer=fsdp: the "
                         "lagged weight versions are whole host copies of each parameter; use trainer=ddp")


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
