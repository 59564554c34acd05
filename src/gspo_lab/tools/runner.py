"""Tool calls and environments run in killable worker processes, as the graders do (gspo_lab.grading.pool).

Tools and environments are user code: a call that raises returns its error to the model, a call still running
after `timeout_s` is a timeout (its worker is killed and replaced), and neither stops the run. An environment
instance lives in one worker for its row's whole rollout: row r's environment, and its tool calls, go to worker
r mod `num_workers`, in a pool of its own. A worker that dies or is killed loses the environments it held: those
rows end there, counted as lost, and are not trained on (their reward is None).

The functions below run in the workers; they import nothing heavy.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gspo_lab.grading.pool import GradingPool, Outcome

_ENVIRONMENTS: dict[str, Any] = {}  # in a worker: row key -> its environment instance


class EnvironmentLost(LookupError):
    """The row's environment is not in this worker: the worker that held it died."""


class EnvironmentRewardFailed(RuntimeError):
    """The row's environment's `get_reward()` raised: what `environment_reward` raises for the row, so the reward's
    errors count it (the rollout logged the first such error with its traceback)."""


def _value(result: Any) -> Any:
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def start_environment(key: str, environment: type, columns: dict) -> Any:
    """Build a row's environment and reset it with the row's columns (TRL: `reset(**row)`); returns what reset
    returns (None or a string that extends the prompt)."""
    instance = environment()
    _ENVIRONMENTS[key] = instance
    try:
        return _value(instance.reset(**columns))
    except BaseException:  # the row is lost: its instance is not kept
        drop_environment(key)
        raise


def drop_environment(key: str) -> None:
    """Let a row's environment go (its `close()` called where it has one), if this worker holds it."""
    instance = _ENVIRONMENTS.pop(key, None)
    if callable(getattr(instance, "close", None)):
        _value(instance.close())


def call_environment(key: str, method: str, arguments: dict) -> str:
    if key not in _ENVIRONMENTS:
        raise EnvironmentLost(key)
    return str(_value(getattr(_ENVIRONMENTS[key], method)(**arguments)))


def finish_environment(key: str) -> float | None:
    """The row's reward from its environment's `get_reward()` (None where it has none), and the instance let go."""
    if key not in _ENVIRONMENTS:
        raise EnvironmentLost(key)
    instance = _ENVIRONMENTS.pop(key)
    get_reward = getattr(instance, "get_reward", None)
    return None if get_reward is None else float(_value(get_reward()))


def call_tool(fn: Callable, arguments: dict) -> str:
    return str(_value(fn(**arguments)))


class ToolRunner:
    """`num_workers` one-worker pools; `run(calls)` runs each call `(row, fn, args)` in row mod num_workers's
    worker, the workers at once, each call at most `timeout_s`. Workers start on first use and live until
    `close()`."""

    def __init__(self, num_workers: int, timeout_s: float) -> None:
        if not (isinstance(num_workers, int) and num_workers >= 1):
            raise ValueError(f"rollout.tool_workers={num_workers!r} must be an integer >= 1")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"rollout.tool_timeout_s={timeout_s!r} must be a number > 0")
        self.pools = [GradingPool(1, timeout_s) for _ in range(num_workers)]

    def worker_of(self, row: int) -> int:
        return row % len(self.pools)

    def run(self, calls: list[tuple[int, Callable, tuple]]) -> tuple[list[Outcome], set[int]]:
        """Each call's Outcome, in order, and the workers (`worker_of`) replaced meanwhile: the environments of
        their rows are gone."""
        by_pool: dict[int, list[int]] = {}
        for i, (row, _, _) in enumerate(calls):
            by_pool.setdefault(self.worker_of(row), []).append(i)
        outcomes: list[Outcome | None] = [None] * len(calls)
        replaced: set[int] = set()

        def run_pool(k: int) -> None:
            pool, indices = self.pools[k], by_pool[k]
            before = pool.replaced
            for i, outcome in zip(indices, pool([(calls[i][1], calls[i][2], {}) for i in indices])):
                outcomes[i] = outcome
            if pool.replaced != before:
                replaced.add(k)

        with ThreadPoolExecutor(max_workers=len(by_pool) or 1) as threads:
            list(threads.map(run_pool, by_pool))
        return outcomes, replaced  # type: ignore[return-value]

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
