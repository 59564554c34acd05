"""Built-in reward functions, each with TRL's contract (`fn(prompts, completions, **columns) -> list`).

Select them with `reward=<option>` (conf/reward/) or list them under `reward.functions`, each with its
`_target_` and `weight`; settings other than `weight` and `name` are bound as keyword arguments.

>>> exact_match(["1+1="] * 2, ["2", " 3 "], answer=["2", "2"])
[1.0, 0.0]
>>> numeric_match(None, ["The sum is 1,000.", "no number"], answer=["1000", "7"])
[1.0, 0.0]
>>> boxed_match(None, [r"so \\boxed{12}", "12"], answer=["12", "12"])
[1.0, 0.0]
>>> think_format(None, ["<think>\\nadd them\\n</think>\\n2", "2"])
[1.0, 0.0]
>>> soft_overlong_punishment(None, None, completion_ids=[[1] * 6, [1] * 9, [1] * 12], max_length=10, cache_length=4)
[0.0, -0.75, -1.0]
"""

from __future__ import annotations

import re

from gspo_lab.grading.answers import last_boxed, last_number, math_equal, text_of
from gspo_lab.grading.guard import guarded
from gspo_lab.tasks.base import Example, Task

# a completion that opens a think block, closes it, then answers
THINK = re.compile(r"^\s*<think>.*?</think>\s*\S", re.DOTALL)
# a completion that starts inside a block its prompt opened: closes it (opening no other), then answers
THINK_OPENED = re.compile(r"^(?:(?!<think>).)*?</think>\s*\S", re.DOTALL)


def environment_reward(prompts, completions, environment_reward=None, **kwargs) -> list[float | None]:
    """A multi-turn rollout's environment reward: what its environment's get_reward() returned at the end of
    the trajectory (TRL's environment contract; gspo_lab.rollout.multi_turn), None where there is none. Where
    get_reward() raised, the rollout passes the error (EnvironmentRewardFailed), raised here: the reward's errors
    count it.

    >>> environment_reward(["p", "p"], ["a", "b"], environment_reward=[0.7, None])
    [0.7, None]
    """
    if environment_reward is None:
        return [None] * len(completions)
    for value in environment_reward:
        if isinstance(value, BaseException):
            raise value
    return list(environment_reward)


def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
    """1 where the stripped completion equals the stripped reference answer."""
    return [float(text_of(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def numeric_match(prompts, completions, answer, tolerance: float = 1e-6, **kwargs) -> list[float]:
    """1 where the last number of the completion is within `tolerance` of the reference's value; None where the
    reference is not a number (the function does not apply)."""
    rewards = []
    for completion, reference in zip(completions, answer):
        want, got = last_number(str(reference)), last_number(text_of(completion))
        rewards.append(None if want is None else float(got is not None and abs(got - want) <= tolerance))
    return rewards


def boxed_match(prompts, completions, answer, **kwargs) -> list[float]:
    r"""1 where the completion's last `\boxed{}` holds the reference answer (stripped strings equal)."""
    rewards = []
    for completion, reference in zip(completions, answer):
        boxed = last_boxed(text_of(completion))
        want = last_boxed(str(reference)) or str(reference)  # a boxed reference, or the bare one
        rewards.append(float(boxed is not None and boxed.strip() == want.strip()))
    return rewards


def think_format(prompts, completions, prefilled: bool = False, **kwargs) -> list[float]:
    """1 where the completion opens with a closed `<think>...</think>` block followed by an answer (open-r1's
    format reward, without its exact newlines). Where the generation prompt already opened the block, the
    completion starts inside it and scores 1 when it closes it, opening no other, then answers: when the prompt
    (as the data holds it) ends with `<think>`, or with `prefilled=true`, for a chat template that adds `<think>`
    to the generation prompt out of the data's sight (DeepSeek-R1's distills). TRL's think_format_reward scores
    such completions 0 (TRL issue #6966).

    >>> think_format(["1+1=<think>\\n"], ["add them\\n</think>\\n2"])
    [1.0]
    >>> think_format(None, ["add them</think> 2"], prefilled=True)
    [1.0]
    """
    if not isinstance(prefilled, bool):
        raise ValueError(f"think_format: prefilled={prefilled!r} must be true or false")
    prompts = [None] * len(completions) if prompts is None else prompts
    return [float((THINK_OPENED if prefilled or opens_think(p) else THINK).match(text_of(c)) is not None)
            for p, c in zip(prompts, completions)]


def opens_think(prompt) -> bool:
    """Whether a prompt (text, or chat messages) ends with an opened `<think>`."""
    return prompt is not None and (text_of(prompt) or "").rstrip().endswith("<think>")


def soft_overlong_punishment(prompts, completions, completion_ids, max_length: int, cache_length: int,
                             **kwargs) -> list[float]:
    """DAPO's soft overlong punishment (arXiv 2503.14476 eq. 13): 0 up to `max_length - cache_length` tokens,
    then falling linearly to -1 at `max_length`, -1 beyond."""
    if not 0 < cache_length <= max_length:
        raise ValueError(f"soft_overlong_punishment: cache_length={cache_length!r} must satisfy 0 < cache_length <= "
                         f"max_length={max_length!r}")
    free = max_length - cache_length
    return [0.0 if len(ids) <= free else (free - len(ids)) / cache_length if len(ids) <= max_length else -1.0
            for ids in completion_ids]


def math_accuracy(prompts, completions, answer, latex_only: bool = True, **kwargs) -> list[float | None]:
    r"""1 where math-verify finds the completion's answer equal to the reference (`\frac{1}{2}` = 0.5, units,
    boxed), 0 where not, None where the reference does not parse. The gold answer is parsed as TRL's and
    open-r1's accuracy reward parse it (default extraction, first match); the completion with LaTeX extraction,
    `\boxed{}` first, only anchored answers, unless `latex_only=false` adds plain expressions ("the answer is
    42", as GSM8K-style completions end)."""
    return [math_equal(str(reference), text_of(completion), latex_only)
            for completion, reference in zip(completions, answer)]


math_accuracy.may_hang = True  # sympy on model output: reward.num_workers=null grades it in a killable worker


class TaskReward:
    """A task's own checker as a reward function (`Task.reward`: 1 correct, `task.format_weight` well-formed,
    else 0), named after the task. The example is rebuilt from the prompt, the `answer` column and the
    task's other columns (its `Example.meta`)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.__name__ = task.name

    @property
    def may_hang(self) -> bool:
        return self.task.checker_may_hang

    def __call__(self, prompts, completions, answer, **columns) -> list[float]:
        columns.pop("completion_ids", None)
        rewards = []
        with guarded():  # in a grading worker: no side effects (gspo_lab.grading.guard)
            for i, (prompt, completion) in enumerate(zip(prompts, completions)):
                example = Example(prompt, answer[i], {key: values[i] for key, values in columns.items()})
                rewards.append(float(self.task.reward(example, text_of(completion))))
        return rewards
