"""The `eval` config group -> evaluation sets: each a data source, its prompt format and its reward functions.

    eval:
      sets:
        heldout: {}                                 # the run's task's held-out split, the run's prompt
        countdown: {task: countdown}                # an option of conf/task (its held-out split)
        test: {task: {eval_split: test}, size: 200} # the run's task config with these keys changed
        math: {task: {_target_: gspo_lab.tasks.HFDataset, path: ...}, prompt: default, reward: math_verify}

`task`, `prompt` and `reward` each take null (the run's task or prompt; no reward functions, correctness only),
the name of an option of that config group (conf/task/countdown.yaml), or a config: a mapping with a `_target_`
is one whole, a mapping without one changes keys of the run's. `size` keeps the first `size` held-out prompts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf, open_dict

from gspo_lab import CONFIG_DIR
from gspo_lab.config import RolloutConfig
from gspo_lab.evaluation import HELDOUT, EvalSet, EvalSettings, Evaluator, write_jsonl
from gspo_lab.grading import GradingPool
from gspo_lab.models.builders import check_context, fit_task
from gspo_lab.prompts import PromptFormat
from gspo_lab.report.summary import eval_engine_columns
from gspo_lab.rewards import WeightedRewards, build_rewards
from gspo_lab.rollout.backend import RolloutBackend
from gspo_lab.rollout.engine import RolloutEngine
from gspo_lab.tasks.base import Task

SET_KEYS = ("task", "prompt", "reward", "size")
SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class SetSpec:
    """One set before a tokenizer exists; `EvalPlan.evaluator` binds its prompt format to the tokenizer."""

    name: str
    task: Task
    prompt: PromptFormat
    rewards: WeightedRewards | None
    size: int | None


@dataclass
class EvalPlan:
    """The validated `eval` group: the settings and each set's parts; `evaluator(tokenizer, ...)` binds them. The
    sets whose checker can hang share one grading pool (`grader`; eval.grading_workers), started on first use."""

    settings: EvalSettings
    specs: list[SetSpec]
    grader: GradingPool | None = field(init=False)

    def __post_init__(self) -> None:
        hangs = any(spec.task.checker_may_hang for spec in self.specs)
        workers, timeout_s = self.settings.grading_workers, self.settings.grading_timeout_s
        self.grader = GradingPool(workers, timeout_s) if hangs and workers else None

    def fit(self, model, tokenizer, max_new_tokens: int, fitted: tuple[Task, ...] = ()) -> None:
        """Every set's task made to fit the model (`fit_task`: task.max_prompt_tokens, then the context), as the
        run's own task is before training: training and gspo-eval then hold out the same prompts. A task of
        `fitted` (training's own, fitted with the rollout budget) has its context checked against an eval budget of
        its own only, not its prompts dropped and checked again."""
        own = self.settings.max_new_tokens
        budget = {"eval.max_new_tokens": own} if own else {"rollout.max_new_tokens": max_new_tokens}
        for spec in self.specs:
            if not any(spec.task is task for task in fitted):
                fit_task(model, tokenizer, spec.task, budget, spec.prompt.bind(tokenizer))
            elif own:
                check_context(model, tokenizer, spec.task, budget, spec.prompt.bind(tokenizer))

    def evaluator(self, tokenizer, max_new_tokens: int, stop_token_ids, seed: int, agent_of=None) -> Evaluator:
        """The evaluator of these sets for `tokenizer`; `agent_of(task)`: the multi-turn loop a set's task runs
        (gspo_lab.rollout.multi_turn.MultiTurn, None for a single-turn task)."""
        sets = []
        for spec in self.specs:
            examples = spec.task.eval_examples()
            examples = examples[: spec.size] if spec.size else examples
            grader = self.grader if spec.task.checker_may_hang else None
            agent = agent_of(spec.task) if agent_of is not None else None
            sets.append(EvalSet(spec.name, spec.task, examples, spec.prompt.bind(tokenizer), spec.rewards, grader,
                                agent))
        return Evaluator(sets, self.settings, max_new_tokens, stop_token_ids, seed)

    def close(self) -> None:
        """Stop the grading pools: the checkers' and the sets' reward functions'."""
        if self.grader is not None:
            self.grader.close()
        for spec in self.specs:
            if spec.rewards is not None:
                spec.rewards.close()


def build_eval(cfg: DictConfig, task: Task, prompt: PromptFormat, on_error: str = "zero") -> EvalPlan:
    """The `eval` group checked and built against the run's task (`cfg.task`, instantiated as `task`) and prompt;
    raises ValueError naming the key, the value and the rule."""
    group = cfg.get("eval") or OmegaConf.create({"sets": {HELDOUT: {}}})  # a config from before the eval group
    values = {k: v for k, v in OmegaConf.to_container(group, resolve=True).items() if k != "sets"}
    known = [f.name for f in fields(EvalSettings)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"eval.{unknown[0]} is not a key of the eval group (sets, {', '.join(known)})")
    if not isinstance(values.get("k", []), list):
        raise ValueError(f"eval.k={values['k']!r} is invalid: must be a list of integers, e.g. [1, 4]")
    settings = EvalSettings(**values)
    sets = group.get("sets")
    if not isinstance(sets, DictConfig) or not sets:
        raise ValueError(f"eval.sets={sets!r} is invalid: must map at least one set name to its settings (heldout: "
                         "{} is the run's task's held-out split)")
    specs = []
    for name, spec in sets.items():
        where = f"eval.sets.{name}"
        if not SET_NAME.fullmatch(str(name)):
            raise ValueError(f"{where}: the name {name!r} is invalid: metric names eval/<set>/... take letters, "
                             "digits, '_', '.' and '-'")
        spec = spec or OmegaConf.create({})
        if not isinstance(spec, DictConfig) or set(spec) - set(SET_KEYS):
            raise ValueError(f"{where}={spec!r} is invalid: must be a mapping with keys among {list(SET_KEYS)}")
        size = spec.get("size")
        if size is not None and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            raise ValueError(f"{where}.size={size!r} is invalid: must be an integer >= 1, or null for all")
        set_task = task if spec.get("task") is None else instantiate(option("task", spec.task, cfg, where))
        set_prompt = prompt if spec.get("prompt") is None else instantiate(option("prompt", spec.prompt, cfg, where))
        rewards = None
        if spec.get("reward") is not None:
            rewards = build_rewards(option("reward", spec.reward, cfg, where), set_task, on_error)
        specs.append(SetSpec(str(name), set_task, set_prompt, rewards, size))
    return EvalPlan(settings, specs)


def option(group: str, value, cfg: DictConfig, where: str) -> DictConfig:
    """A set's `task`, `prompt` or `reward`: an option's name (conf/<group>/<name>.yaml), a whole config (has a
    `_target_`, or is a reward group's `functions`), or keys changed on the run's config; interpolations
    (${rollout.max_new_tokens}) resolve against the run's config `cfg`."""
    if isinstance(value, str):
        node = load_option(group, value, where)
    elif isinstance(value, DictConfig):
        whole = "_target_" in value or (group == "reward" and "functions" in value)
        node = value if whole else OmegaConf.merge(cfg[group], value)
    else:
        raise ValueError(f"{where}.{group}={value!r} is invalid: must be null, an option of conf/{group} or a mapping")
    root = cfg.copy()  # the run's config, to resolve the option in
    with open_dict(root):
        root["_eval_option"] = node
    return OmegaConf.create(OmegaConf.to_container(root["_eval_option"], resolve=True))


def load_option(group: str, name: str, where: str = "eval.sets") -> DictConfig:
    """conf/<group>/<name>.yaml with its `defaults` (other options of the same group, then _self_) merged in."""
    path = Path(CONFIG_DIR) / group / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"{where}.{group}={name!r} is not an option of conf/{group} (one of {known})")
    cfg = OmegaConf.load(path)
    merged = OmegaConf.create({})
    entries = list(cfg.pop("defaults", []))
    for entry in entries if "_self_" in entries else [*entries, "_self_"]:
        merged = OmegaConf.merge(merged, cfg if entry == "_self_" else load_option(group, entry, where))
    return merged


def evaluation_backend(engine: RolloutBackend | None, model: torch.nn.Module, setting: str
                       ) -> tuple[RolloutBackend, dict[str, float]]:
    """What an evaluation generates with under eval.engine=`setting`, and its record in metrics.csv
    (eval_engine_columns). "rollout": the run's backend where it serves evaluations (vLLM's), synced now;
    "trainer", or a backend that does not (hf): transformers' `generate` on `model`, never an engine copy, in the
    dtype the trainer computes in (autocast's where trainer.precision turns it on)."""
    if setting == "rollout" and engine is not None and engine.serves_evaluation:
        engine.sync()
        return engine, eval_engine_columns(True, engine.dtype)  # the backend's engine (vLLM's), not transformers
    weight = next(model.parameters())
    device = weight.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return RolloutEngine(model, RolloutConfig()), eval_engine_columns(False, str(dtype).removeprefix("torch."))


def write_samples(folder: Path, step: int, rows: list[dict[str, Any]], loggers: list) -> None:
    """An evaluation's sample rows as <folder>/step_<step>.jsonl, and one wandb Table per set when the wandb
    logger is among `loggers`."""
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / f"step_{step}.jsonl", rows)
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            columns = ["set", "index", "prompt", "reference", "mode", "sample", "completion", "answer", "correct"]
            for name in dict.fromkeys(row["set"] for row in rows):
                data = [[row[c] for c in columns] for row in rows if row["set"] == name]
                logger.log_table(key=f"samples/{name}", columns=columns, data=data, step=step)
