"""The reward axis: weighted reward functions with TRL's contract (gspo_lab.rewards.base), the built-in ones
(gspo_lab.rewards.functions) and grading in killable worker processes (gspo_lab.rewards.pool).

`build_rewards(cfg.reward, task)` turns the `reward` config group into a WeightedRewards:

    reward:
      functions:
        - {_target_: gspo_lab.rewards.math_accuracy, weight: 1.0}
        - {_target_: my_project.rewards.short_answer, weight: 0.2, max_words: 50}   # a user's TRL function
      num_workers: 2
      timeout_s: 10.0
"""

from __future__ import annotations

import functools
import inspect

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from gspo_lab.rewards.base import (
    RewardContractError,
    RewardFunction,
    Scores,
    WeightedRewards,
    check_signature,
    reward_name,
)
from gspo_lab.rewards.functions import (
    TaskReward,
    boxed_match,
    exact_match,
    math_accuracy,
    numeric_match,
    soft_overlong_punishment,
    think_format,
)
from gspo_lab.rewards.pool import GradingPool

__all__ = [
    "GradingPool", "RewardContractError", "RewardFunction", "Scores", "TaskReward", "WeightedRewards",
    "boxed_match", "build_rewards", "check_signature", "exact_match", "math_accuracy", "numeric_match",
    "reward_name", "soft_overlong_punishment", "think_format",
]


def build_rewards(cfg: DictConfig | dict, task, on_error: str = "zero") -> WeightedRewards:
    """The reward group's functions, each checked (importable, takes **kwargs), weighted, with a grading pool
    when `num_workers` >= 1. A class target is instantiated (given the task if its constructor takes `task`);
    a function target gets its other keys bound as keyword arguments."""
    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    unknown = sorted(set(cfg) - {"functions", "num_workers", "timeout_s"})
    if unknown:
        raise ValueError(f"reward.{unknown[0]} is not a key of the reward group (functions, num_workers, timeout_s)")
    items = cfg.get("functions") or []
    if not isinstance(items, list) or not items:
        raise ValueError(f"reward.functions={items!r} must be a non-empty list of {{_target_: ..., weight: ...}}")
    functions = [_function(dict(item), task, f"reward.functions[{i}]") for i, item in enumerate(items)]
    num_workers, timeout_s = cfg.get("num_workers", 0), cfg.get("timeout_s", 10.0)
    if not (isinstance(num_workers, int) and num_workers >= 0):
        raise ValueError(f"reward.num_workers={num_workers!r} must be an integer >= 0 (0: grade in this process)")
    runner = GradingPool(num_workers, timeout_s) if num_workers else None
    return WeightedRewards(functions, runner, on_error)


def _function(item: dict, task, where: str) -> RewardFunction:
    if "_target_" not in item:
        raise ValueError(f"{where}={item!r} needs a _target_ (a reward function's or class's import path)")
    target, weight, name = item.pop("_target_"), item.pop("weight", 1.0), item.pop("name", "")
    try:
        obj = get_object(target)
    except Exception as error:  # noqa: BLE001 - Hydra raises ImportError or its own error types
        raise ValueError(f"{where}._target_={target!r} cannot be imported: {error}") from None
    if inspect.isclass(obj):
        if "task" in inspect.signature(obj).parameters:
            item.setdefault("task", task)
        fn = obj(**item)
    elif callable(obj):
        fn = functools.partial(obj, **item) if item else obj
    else:
        raise ValueError(f"{where}._target_={target!r} is not callable")
    check_signature(fn, where)
    return RewardFunction(fn, weight, name)  # an empty name becomes TRL's (reward_name)
