"""The reward axis: weighted reward functions with TRL's contract (gspo_lab.rewards.base), the built-in ones
(gspo_lab.rewards.functions) and grading in killable worker processes (gspo_lab.grading.pool).

`build_rewards(cfg.reward, task)` turns the `reward` config group into a WeightedRewards:

    reward:
      functions:
        - {_target_: gspo_lab.rewards.math_accuracy, weight: 1.0}
        - {_target_: my_project.rewards.short_answer, weight: 0.2, max_words: 50}   # a user's TRL function
        - /path/to/reward_model      # TRL's form: a sequence-classification model (gspo_lab.rewards.reward_model)
      num_workers: 2
      timeout_s: 10.0
"""

from __future__ import annotations

import functools
import inspect
import logging

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from gspo_lab.grading import GradingPool
from gspo_lab.rewards.base import (
    Failures,
    RewardContractError,
    RewardFunction,
    Scores,
    WeightedRewards,
    check_signature,
    reward_name,
    unwrapped,
)
from gspo_lab.rewards.functions import (
    TaskReward,
    boxed_match,
    environment_reward,
    exact_match,
    math_accuracy,
    numeric_match,
    soft_overlong_punishment,
    think_format,
)
from gspo_lab.rewards.judge import Judge
from gspo_lab.rewards.reward_model import RewardModel

log = logging.getLogger(__name__)

__all__ = [
    "Failures", "GradingPool", "Judge", "RewardContractError", "RewardFunction", "RewardModel", "Scores", "TaskReward",
    "WeightedRewards",
    "boxed_match", "build_rewards", "check_signature", "environment_reward", "exact_match", "gold_reward",
    "math_accuracy", "may_hang", "numeric_match", "reads_environments", "reward_name", "soft_overlong_punishment",
    "think_format",
    "unwrapped",
]


CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")  # what every call passes besides the columns


def build_rewards(cfg: DictConfig | dict, task, on_error: str = "zero", failure_stop_frac: float = 1.0
                  ) -> WeightedRewards:
    """The reward group's functions, each checked (importable, takes **kwargs, its settings its own parameters,
    its required parameters among the task's columns), weighted, with a grading pool when `num_workers` >= 1, or
    when it is null and a function can hang (`may_hang`). A class target is instantiated (given the task if its
    constructor takes `task`); a function target gets its other keys bound as keyword arguments."""
    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    unknown = sorted(set(cfg) - {"functions", "num_workers", "timeout_s"})
    if unknown:
        raise ValueError(f"reward.{unknown[0]} is not a key of the reward group (functions, num_workers, timeout_s)")
    items = cfg.get("functions") or []
    if not isinstance(items, list) or not items:
        raise ValueError(f"reward.functions={items!r} must be a non-empty list of {{_target_: ..., weight: ...}}")
    # TRL's form: a model path or id in the reward list is a reward model (AutoModelForSequenceClassification)
    items = [{"_target_": "gspo_lab.rewards.RewardModel", "path": item} if isinstance(item, str) else item
             for item in items]
    columns = None if task is None else task.columns()
    if columns is not None and not task.has_answers:  # task.answer_column=null: a function that needs it is refused
        columns.remove("answer")
    environment = getattr(getattr(task, "toolset", None), "environment", None) is not None
    if environment:  # a multi-turn rollout's: TRL's `environments` (its rows' instances) and get_reward's value
        columns += ["environments", "environment_reward"]
    functions = [_function(dict(item), task, columns, f"reward.functions.{i}") for i, item in enumerate(items)]
    added = environment_reward_item(functions, task)
    if added is not None:
        functions.append(_function(added, task, columns, f"reward.functions.{len(functions)}"))
    num_workers, timeout_s = cfg.get("num_workers", 0), cfg.get("timeout_s", 10.0)
    hanging = [f.name for f in functions if may_hang(f.fn)]
    if num_workers is None:  # auto: a worker where a function can hang, else grading in this process
        num_workers = int(bool(hanging))
    if not (isinstance(num_workers, int) and num_workers >= 0):
        raise ValueError(f"reward.num_workers={num_workers!r} must be null or an integer >= 0 (0: grade in this "
                         "process; null: one worker where a function can hang)")
    if num_workers == 0 and hanging:
        log.warning("reward.num_workers=0 grades %s in the training process, where a call that never returns "
                    "(sympy on model output) cannot be stopped; null or >= 1 grades in killable workers",
                    ", ".join(hanging))
    reading = [f"reward.functions.{i}" for i, f in enumerate(functions) if reads_environments(f)]
    if reading and num_workers:
        raise ValueError(f"{reading[0]} takes `environments`, the rows' environment instances, which live in the "
                         "tool workers and are read from the trainer; reward.num_workers="
                         f"{cfg.get('num_workers')!r} would grade it in another process: set reward.num_workers=0")
    if reading and not environment:
        raise ValueError(f"{reading[0]} takes `environments`, and the task has no task.environment to give it")
    runner = GradingPool(num_workers, timeout_s) if num_workers else None
    return WeightedRewards(functions, runner, on_error, failure_stop_frac)


def environment_reward_item(functions: list[RewardFunction], task) -> dict | None:
    """The reward item of the environment's get_reward(), at weight 1, named after its class (reward/<class>/...),
    where the task's environment has one and none of `functions` reads it already (TRL adds it by itself, so
    named); None otherwise. An `environment_reward` function of any weight, 0 included, takes its place."""
    toolset = getattr(task, "toolset", None)
    if toolset is None or not callable(getattr(toolset.environment_class, "get_reward", None)):
        return None
    if any(unwrapped(f.fn) is environment_reward for f in functions):
        return None
    log.info("task.environment=%s has get_reward(): added to the rewards as %s, weight 1 (as TRL adds it); an "
             "environment_reward entry in reward.functions, weight 0 included, replaces it",
             toolset.environment_name, toolset.environment_name)
    return {"_target_": "gspo_lab.rewards.environment_reward", "weight": 1.0, "name": toolset.environment_name}


def may_hang(fn) -> bool:
    """Whether a reward function says it can run without end on some model output (its `may_hang`, e.g.
    math_accuracy's, or a TaskReward's task's checker)."""
    return bool(getattr(unwrapped(fn), "may_hang", False))


def _function(item: dict, task, columns: list[str] | None, where: str) -> RewardFunction:
    if "_target_" not in item:
        raise ValueError(f"{where}={item!r} needs a _target_ (a reward function's or class's import path)")
    target, weight, name = item.pop("_target_"), item.pop("weight", 1.0), item.pop("name", "")
    try:
        obj = get_object(target)
    except Exception as error:  # noqa: BLE001 - Hydra raises ImportError or its own error types
        raise ValueError(f"{where}._target_={target!r} cannot be imported: {error}") from None
    if not callable(obj):
        raise ValueError(f"{where}._target_={target!r} is not callable")
    if inspect.isclass(obj) and "task" in _parameters(obj):
        item.setdefault("task", task)
    if inspect.isclass(obj) and "key" in _parameters(obj):  # a class that names its own settings in its errors
        item.setdefault("key", where)
    _check_settings(obj, item, target, where)
    if inspect.isclass(obj):
        fn = obj(**item)
    else:
        fn = functools.partial(obj, **item) if item else obj
        _check_columns_leave_settings(item, columns, where)
    check_signature(fn, where)
    if columns is not None:
        _check_required(fn, columns, where)
    return RewardFunction(fn, weight, name)  # an empty name becomes TRL's (reward_name)


def reads_environments(function: RewardFunction) -> bool:
    """Whether a reward function takes `environments`, a multi-turn row's environment instances (TRL's)."""
    return "environments" in _parameters(function.fn)


def _parameters(obj) -> dict[str, inspect.Parameter]:
    """obj's parameters by name ({} where it has no signature, as some builtins)."""
    try:
        return dict(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return {}


def _check_settings(obj, item: dict, target: str, where: str) -> None:
    """Each setting a function or class is given must be one of its named parameters: a misspelled one would
    vanish into **kwargs."""
    parameters = _parameters(obj)
    if not parameters:  # no signature to check against
        return
    named = [n for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for key in item:
        if key not in named:
            raise ValueError(f"{where}.{key} is not a parameter of {target} (its parameters: {', '.join(named)}); "
                             "a reward entry's keys besides _target_, weight and name are its settings")


def _check_columns_leave_settings(item: dict, columns: list[str] | None, where: str) -> None:
    """A data column reaches a function as a keyword and would replace the setting bound under its name."""
    for key in item:
        if columns is not None and key in columns:
            raise ValueError(f"{where}.{key}={item[key]!r}: the data has a column {key!r}, which every call passes "
                             f"as {key}= and which would silently replace this setting; rename the column (or "
                             "the function's parameter)")


def _check_required(fn, columns: list[str], where: str) -> None:
    """Every parameter a function needs must arrive in each call: the call's own arguments or a data column.
    A function that can never run would score 0 on every completion."""
    given = set(CALL_ARGUMENTS) | set(columns)
    for name, p in _parameters(fn).items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty or name in given:
            continue
        if name == "answer":  # task.answer_column=null
            raise ValueError(f"{where} ({reward_name(fn)}) needs the reference answer, and the data has none "
                             "(task.answer_column=null); use a reward that needs none (reward=environment, "
                             "reward_model, judge, or a function without an `answer` parameter) or name the answer "
                             "column")
        raise ValueError(f"{where} ({reward_name(fn)}) needs the parameter {name!r}, which no call passes: the "
                         f"data's columns are {', '.join(columns)} (besides {', '.join(CALL_ARGUMENTS)}); map a "
                         "column to it (task.answer_column, or a column of that name) or choose another function")


def gold_reward(task, rewards: WeightedRewards) -> WeightedRewards | None:
    """The task's own checker as reward/gold, beside rewards that do not include it (a reward model's proxy), graded
    as they are (their pool, if any); None where they include it."""
    if any(isinstance(unwrapped(f.fn), TaskReward) for f in rewards.functions) or not task.has_answers:
        return None
    return WeightedRewards([RewardFunction(TaskReward(task), name="gold")], rewards.runner)
