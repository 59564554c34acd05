"""Tool calls and environments run in killable worker processes, as the graders do (gspo_lab.grading.pool).

Tools and environments are user code: a call that raises returns its error to the model, a call still running
after `timeout_s` is a timeout (its worker is killed and replaced), and neither stops the run. An environment
instance lives in one worker for its row's whole rollout: row r's environment, and its tool calls, go to worker
r mod `num_workers`, in a pool of its own. A worker that dies or is killed loses the environments it held: those
rows end there, counted as lost, and are not trained on (their reward is None).

As TRL keeps them, instances are built once and reset for each new row: a slot (a rollout's row n, `key`) keeps
its instance across steps, the instance is rebuilt only where its worker was replaced or its reset raised, and
each instance's `close()`, where it has one, runs when its worker stops (`ToolRunner.close()`, at the end of the
run; a worker killed at a timeout closes nothing). Each worker runs one asyncio event loop for its whole life, in a
thread of its own, so an async tool's background tasks (a websocket client's reader) live across calls. Every
call is seeded: `random`, and numpy's and torch's global generators where the worker has imported them, start
from the call's seed (gspo_lab.rollout.multi_turn.environment_seed), so a row's draws depend on the run's seed,
the step and the row, not on the worker or the rows before it.

The functions below run in the workers; they import nothing heavy.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import pickle
import random
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gspo_lab.grading.pool import GradingPool, Outcome

_ENVIRONMENTS: dict[str, Any] = {}  # in a worker: slot key -> its environment instance
_LOOP: asyncio.AbstractEventLoop | None = None  # in a worker: the event loop every coroutine runs on


class EnvironmentLost(LookupError):
    """The row's environment is not in this worker: the worker that held it died."""


class EnvironmentRewardFailed(RuntimeError):
    """The row's environment's `get_reward()` raised: what `environment_reward` raises for the row, so the reward's
    errors count it (the rollout logged the first such error with its traceback)."""


class ByValue:
    """A factory that crosses to the workers by value (cloudpickle), where plain pickle sends only a reference
    that the worker cannot import: a lambda, a function defined in a function or in `__main__`."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        import cloudpickle

        return _by_value, (cloudpickle.dumps(self.fn),)


def _by_value(payload: bytes) -> ByValue:
    return ByValue(pickle.loads(payload))


def portable(factory: Callable) -> Callable:
    """`factory` as it can be sent to a worker: itself where plain pickle takes it (a class, a module's function, a
    functools.partial of one), else wrapped to go by value."""
    try:
        pickle.loads(pickle.dumps(factory))
    except Exception:  # noqa: BLE001 - pickling raises many types
        return ByValue(factory)
    return factory


def _value(result: Any) -> Any:
    """`result`, awaited on this worker's event loop where it is awaitable (the loop, and what its tasks do, lives
    between calls)."""
    if not inspect.isawaitable(result):
        return result
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, name="tool-event-loop", daemon=True).start()

    async def awaited():
        return await result

    return asyncio.run_coroutine_threadsafe(awaited(), _LOOP).result()


def seeded(seed: int | None) -> None:
    """Seed `random`, and numpy's and torch's global generators where this process has imported them."""
    if seed is None:
        return
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def reset_columns(example) -> dict:
    """What an environment's reset gets of a row (TRL: `reset(**row)`): its prompt, answer and other columns."""
    return {"prompt": example.prompt, "answer": example.answer, **example.meta}


def start_environment(key: str, factory: Callable, columns: dict, seed: int | None = None) -> Any:
    """Reset slot `key`'s environment (built with `factory()` where the slot has none) with the row's columns
    (TRL: `reset(**row)`; a reset without **kwargs gets the columns it names, `def reset(self)` none), from `seed`;
    returns what reset returns (None or a string that extends the prompt). An instance whose reset raised is closed
    and dropped: the slot builds a new one next time."""
    if key not in _ENVIRONMENTS:
        _ENVIRONMENTS[key] = factory()
    seeded(seed)
    reset = _ENVIRONMENTS[key].reset
    try:
        parameters = inspect.signature(reset).parameters
    except (TypeError, ValueError):  # no signature to read: every column, as TRL passes them
        parameters = None
    if parameters is not None and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        columns = {name: value for name, value in columns.items() if name in parameters}  # `def reset(self)`: none
    try:
        return _value(reset(**columns))
    except BaseException:  # the row is lost, and the instance's state unknown: it is not kept
        drop_environment(key)
        raise


def drop_environment(key: str) -> None:
    """Let slot `key`'s environment go (its `close()` called where it has one), if this worker holds it."""
    instance = _ENVIRONMENTS.pop(key, None)
    if callable(getattr(instance, "close", None)):
        _value(instance.close())


def close_environments() -> None:
    """Close every environment this worker holds (at its exit)."""
    for key in list(_ENVIRONMENTS):
        try:
            drop_environment(key)
        except Exception as error:  # noqa: BLE001 - one close that raises does not keep the others open
            print(f"closing environment {key}: {error!r}", file=sys.stderr)


atexit.register(close_environments)  # a worker that stops closes what it holds (elsewhere it holds nothing)


def call_environment(key: str, method: str, arguments: dict, seed: int | None = None, limit: int | None = None
                     ) -> str:
    """Tool `method` of slot `key`'s environment, seeded `seed`; its result cut at `limit` characters here, before
    it is pickled back (a result of 2 million characters took seconds to cross)."""
    if key not in _ENVIRONMENTS:
        raise EnvironmentLost(key)
    seeded(seed)
    return str(_value(getattr(_ENVIRONMENTS[key], method)(**arguments)))[:limit]


def finish_environment(key: str, seed: int | None = None) -> float | None:
    """The row's reward from its environment's `get_reward()` (None where it has none); the instance stays in
    its slot for the next row."""
    if key not in _ENVIRONMENTS:
        raise EnvironmentLost(key)
    get_reward = getattr(_ENVIRONMENTS[key], "get_reward", None)
    seeded(seed)
    return None if get_reward is None else float(_value(get_reward()))


def environment_attribute(key: str, name: str) -> tuple[str, Any]:
    """Slot `key`'s environment's attribute `name`: ("method", None) for a method, else ("value", its value)."""
    if key not in _ENVIRONMENTS:
        raise EnvironmentLost(key)
    value = getattr(_ENVIRONMENTS[key], name)
    return ("method", None) if callable(value) else ("value", value)


def call_environment_method(key: str, name: str, args: tuple, kwargs: dict) -> Any:
    """Slot `key`'s environment's method `name` called (awaited where async), its value returned as it is."""
    if key not in _ENVIRONMENTS:
        raise EnvironmentLost(key)
    return _value(getattr(_ENVIRONMENTS[key], name)(*args, **kwargs))


class RemoteEnvironment:
    """A row's environment as a reward function sees it (TRL's `reward_func(environments, **kwargs)`): the instance
    lives in a tool worker, and this handle reads its attributes and calls its methods there, one round trip each
    (`environments[i].reward`, `environments[i].score()`). Valid until the loop's next rollout resets the slot;
    it does not cross to other processes (a function that takes `environments` scores in the trainer)."""

    def __init__(self, runner: ToolRunner, row: int, key: str) -> None:
        self._runner, self._row, self._key = runner, row, key

    def _run(self, fn: Callable, args: tuple) -> Any:
        (outcome,), _ = self._runner.run([(self._row, fn, args)])
        if outcome.failure is not None:
            raise RuntimeError(f"the environment of rollout row {self._row} ({self._key}): {outcome.failure}: "
                               f"{outcome.detail}")
        return outcome.value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        kind, value = self._run(environment_attribute, (self._key, name))
        if kind == "method":
            return lambda *args, **kwargs: self._run(call_environment_method, (self._key, name, args, kwargs))
        return value

    def __reduce__(self):
        raise TypeError("a RemoteEnvironment reads its instance through the trainer's tool workers and cannot be "
                        "sent to another process; a reward function that takes `environments` needs "
                        "reward.num_workers=0")

    def __repr__(self) -> str:
        return f"RemoteEnvironment(row={self._row}, key={self._key!r})"


def call_tool(fn: Callable, arguments: dict, seed: int | None = None, limit: int | None = None) -> str:
    """Tool `fn`, seeded `seed`; its result cut at `limit` characters here, before it is pickled back."""
    seeded(seed)
    return str(_value(fn(**arguments)))[:limit]


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

        if len(by_pool) == 1:  # one worker's calls (a preflight, a RemoteEnvironment's read): no thread to start
            run_pool(next(iter(by_pool)))
        else:
            with ThreadPoolExecutor(max_workers=len(by_pool) or 1) as threads:
                list(threads.map(run_pool, by_pool))
        return outcomes, replaced  # type: ignore[return-value]

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
