"""The reward axis: weighted reward functions with TRL's contract, scored into one reward per completion.

A reward function is any callable `fn(prompts, completions, completion_ids=..., **columns) -> list[float | None]`
(TRL's contract, so a TRL reward function works unchanged): `prompts` are the examples' prompts as the data
holds them (text, or a list of chat messages), `completions` the decoded texts (or, for conversational data,
`[{"role": "assistant", "content": text}]` each), `completion_ids` the token ids of each completion up to and
including its stop token, and every other column of the data (the reference `answer` and the rest) arrives as
a keyword with one entry per completion. A function must take `**kwargs`; `None` means "does not apply".

The total reward of a completion is Σ_f w_f r_f over the functions that applied (TRL's nansum); a completion
where none applied scores 0, gets advantage 0 and is left out of the advantages' statistics (`Scores.applies`). A
function that raises or times out scores 0 for that completion and is counted; one that breaks the contract (a
list of the wrong length, a non-number, NaN or ±inf) stops the run with its name.

>>> def short(completions, **kwargs): return [1.0 if len(c) < 3 else None for c in completions]
>>> rewards = WeightedRewards([RewardFunction(short, weight=2.0)])
>>> scores = rewards.score(["1+1="] * 3, ["2", "two", "22"], [[5], [6, 7], [5, 5]], {"answer": ["2"] * 3})
>>> scores.total.tolist(), scores.applies.tolist()
([2.0, 0.0, 2.0], [True, False, True])
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from gspo_lab.grading.pool import Outcome, call_inline

log = logging.getLogger(__name__)


class RewardContractError(RuntimeError):
    """A reward function returned something the contract does not allow (wrong length, NaN, a non-number)."""


def unwrapped(fn: Callable) -> Callable:
    """The function a partial (of a partial ...) wraps; any other callable as it is."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def keeps_state(fn: Callable) -> bool:
    """Whether a reward function keeps counts a checkpoint saves (state_dict / load_state_dict, as the judge's grading
    failures); a torch module's weights are not such a state, and are not saved with the run's counts."""
    return hasattr(fn, "state_dict") and hasattr(fn, "load_state_dict") and not isinstance(fn, torch.nn.Module)


def reward_name(fn: Callable) -> str:
    """The name TRL gives a reward function: its `__name__`, a partial's wrapped function's, else its class's.

    >>> reward_name(functools.partial(reward_name)), reward_name(WeightedRewards([]))
    ('reward_name', 'WeightedRewards')
    """
    fn = unwrapped(fn)
    return getattr(fn, "__name__", None) or type(fn).__name__


def is_batched(fn: Callable) -> bool:
    """Whether a reward function asks to be called once with all the completions (`batched`: a reward model)."""
    return bool(getattr(unwrapped(fn), "batched", False))


def check_signature(fn: Callable, where: str) -> None:
    """A reward function must take `**kwargs`: every data column reaches it as a keyword (TRL's contract)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise ValueError(f"{where} ({reward_name(fn)}) must accept **kwargs: every column of the data (answer and "
                         "the rest) is passed to a reward function as a keyword, as in TRL; add **kwargs to its "
                         "signature")


@dataclass(frozen=True)
class RewardFunction:
    """One weighted reward function; `name` defaults to TRL's name for it (`reward_name`)."""

    fn: Callable
    weight: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", reward_name(self.fn))
        if not (isinstance(self.weight, numbers.Real) and math.isfinite(self.weight)):
            raise ValueError(f"reward weight of {self.name}={self.weight!r} must be a finite number")


@dataclass
class Failures:
    """The completions one reward function failed on (raised or timed out) in one `score` call, and the first
    failure's message with its traceback."""

    count: int
    first: str


@dataclass
class Scores:
    """The rewards of N completions."""

    total: Tensor  # [N] Σ_f w_f r_f over the functions that applied (0 where none did)
    applies: Tensor  # [N] bool, some function applied (else the completion's advantage is 0)
    per_function: dict[str, Tensor]  # name -> [N] that function's rewards, NaN where it did not apply
    metrics: dict[str, float] = field(default_factory=dict)
    failures: dict[str, Failures] = field(default_factory=dict)  # name -> its errors and timeouts in this call

    @property
    def components(self) -> Tensor:
        """[N, F] `per_function` as columns, in the functions' order (NaN where a function did not apply)."""
        if not self.per_function:
            return self.total.new_empty(len(self.total), 0)
        return torch.stack(list(self.per_function.values()), -1)


class WeightedRewards:
    """A list of weighted reward functions, each called once per completion (lists of length 1), so an error or
    a timeout costs that function that completion only. `runner(calls)` runs the calls, by default in this
    process (`call_inline`); gspo_lab.grading.GradingPool runs them in worker processes with a timeout. A function
    marked `batched` (a reward model, gspo_lab.rewards.reward_model) is called once with all the completions, in
    this process: its error or timeout costs it all of them.

    Counts of errors and timeouts are running totals (saved in checkpoints through `state_dict`)."""

    def __init__(self, functions: Sequence[RewardFunction], runner=None, on_error: str = "zero",
                 failure_stop_frac: float = 1.0) -> None:
        names = [f.name for f in functions]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"reward.functions: two functions are named {duplicated[0]!r}; give one a `name:` so "
                             "their metrics reward/<name>/* stay apart")
        if on_error not in ("zero", "raise"):
            raise ValueError(f"train.on_reward_error={on_error!r} must be one of ['zero', 'raise']")
        self.functions = list(functions)
        self.keys = {f.name: f"reward.functions.{k}" for k, f in enumerate(self.functions)}  # name -> config key
        self.runner = runner
        self.on_error = on_error
        self.failure_stop_frac = failure_stop_frac  # train.failure_stop_frac (gspo_lab.step.failures)
        self.errors = {f.name: 0 for f in self.functions}
        self.timeouts = {f.name: 0 for f in self.functions}

    @property
    def weights(self) -> Tensor:
        """[F] the functions' weights, in their order (the columns of `Scores.components`)."""
        return torch.tensor([f.weight for f in self.functions], dtype=torch.float32)

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
              where: Callable[[int], str] = str) -> Scores:
        """Score N completions; `where(i)` names completion i in messages (e.g. "RL step 3, prompt 1, completion
        2"). Columns hold one entry per completion."""
        n = len(completions)
        for key, values in columns.items():
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} entries for {n} completions")
        def arguments(rows: Sequence[int]) -> dict:
            return {"prompts": [prompts[i] for i in rows], "completions": [completions[i] for i in rows],
                    "completion_ids": [completion_ids[i] for i in rows],
                    **{key: [values[i] for i in rows] for key, values in columns.items()}}

        calls = [(f.fn, (), arguments([i])) for f in self.functions if not is_batched(f.fn) for i in range(n)]
        done = iter(self.runner(calls) if self.runner is not None else [call_inline(*call) for call in calls])
        outcomes = []
        for f in self.functions:
            if is_batched(f.fn):
                outcomes += self._split(f, call_inline(f.fn, (), arguments(range(n))), n, where)
            else:
                outcomes += [next(done) for _ in range(n)]
        per_function, metrics, failures = {}, {}, {}
        for k, f in enumerate(self.functions):
            rewards = [self._value(f, outcomes[k * n + i], i, prompts, completions, where, failures)
                       for i in range(n)]
            values = torch.tensor([math.nan if r is None else r for r in rewards], dtype=torch.float32)  # [N]
            per_function[f.name] = values
            applied = values[~values.isnan()]
            metrics[f"reward/{f.name}/mean"] = applied.mean().item() if len(applied) else math.nan
            metrics[f"reward/{f.name}/std"] = applied.std(unbiased=False).item() if len(applied) else math.nan
            metrics[f"reward/{f.name}/errors"] = float(self.errors[f.name])
            metrics[f"reward/{f.name}/timeouts"] = float(self.timeouts[f.name])
            own = getattr(unwrapped(f.fn), "metrics", None)  # a function's counts of its own (a judge's failures)
            if callable(own):
                metrics.update({f"reward/{f.name}/{key}": value for key, value in own().items()})
        stacked = torch.stack(list(per_function.values())) if per_function else torch.full((1, n), math.nan)  # [F, N]
        weights = torch.tensor([f.weight for f in self.functions] or [0.0])[:, None]  # [F, 1]
        total = (stacked * weights).nansum(0)  # [N]; a function that did not apply adds nothing
        metrics["reward/errors"] = float(sum(self.errors.values()))
        metrics["reward/timeouts"] = float(sum(self.timeouts.values()))
        return Scores(total, ~stacked.isnan().all(0), per_function, metrics, failures)

    @staticmethod
    def _split(f: RewardFunction, outcome: Outcome, n: int, where: Callable[[int], str]) -> list[Outcome]:
        """A batched function's one outcome for `n` completions as one per completion."""
        if outcome.failure is not None:
            return [outcome] * n
        return [Outcome([item]) for item in WeightedRewards._listed(f, outcome.value, n, f"{where(0)} and on")]

    def _value(self, f: RewardFunction, outcome: Outcome, i: int, prompts, completions, where,
               failures: dict[str, Failures]) -> float | None:
        """Completion i's reward from `f`'s outcome; a failure scores 0, is counted (in `failures` too, with the
        first one's message) and, the first time for `f`, logged with its text and traceback."""
        if outcome.failure is None:
            return self._checked(f, outcome.value, where(i))
        counts = self.errors if outcome.failure == "error" else self.timeouts
        what = f"raised {outcome.detail}" if outcome.failure == "error" else "timed out"
        message = (f"reward function {f.name} {what} "
                   f"({where(i)}); prompt {prompts[i]!r}, completion {completions[i]!r}")
        if self.on_error == "raise":
            raise RuntimeError(f"{message} (train.on_reward_error=raise)\n{outcome.traceback}".rstrip())
        message = f"{message}\n{outcome.traceback}".rstrip()
        if counts[f.name] == 0:  # its first occurrence; the rest are counted in reward/<name>/errors or /timeouts
            log.warning("%s\nscored 0 (train.on_reward_error=zero); further ones are only counted", message)
        counts[f.name] += 1
        failures.setdefault(f.name, Failures(0, message)).count += 1
        return 0.0

    @staticmethod
    def _listed(f: RewardFunction, value: Any, n: int, where: str) -> list:
        """What a function returned for `n` completions, held to the contract's shape: a list (or tensor) of `n`."""
        if isinstance(value, Tensor):
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else repr(value)
            completions = "1 completion" if n == 1 else f"{n} completions"
            raise RewardContractError(f"reward function {f.name} returned {got} for {completions} ({where}); it must "
                                      "return a list with one float or None per completion")
        return list(value)

    @staticmethod
    def _checked(f: RewardFunction, value: Any, where: str) -> float | None:
        item = WeightedRewards._listed(f, value, 1, where)[0]
        if item is None:
            return None
        if not isinstance(item, numbers.Real) or not math.isfinite(item):
            raise RewardContractError(f"reward function {f.name} returned {item!r} ({where}); a reward must be a "
                                      "finite number, or None where the function does not apply")
        return float(item)

    def state_dict(self) -> dict[str, dict]:
        """The running counts, and the state of each function that keeps one (a judge's grading failures)."""
        kept = {f.name: unwrapped(f.fn).state_dict() for f in self.functions if keeps_state(unwrapped(f.fn))}
        return {"errors": dict(self.errors), "timeouts": dict(self.timeouts), "functions": kept}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        for key, counts in (("errors", self.errors), ("timeouts", self.timeouts)):
            counts.update({name: n for name, n in state.get(key, {}).items() if name in counts})
        for f in self.functions:
            if f.name in state.get("functions", {}) and keeps_state(unwrapped(f.fn)):
                unwrapped(f.fn).load_state_dict(state["functions"][f.name])

    def close(self) -> None:
        """Stop the grading workers and what the functions hold open (a judge's vLLM engine)."""
        if self.runner is not None:
            self.runner.close()
        for f in self.functions:
            if hasattr(unwrapped(f.fn), "close"):
                unwrapped(f.fn).close()
