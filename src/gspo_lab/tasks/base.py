"""What every task shares: examples, a held-out split fixed by hashing, and the reward contract.

A task owns its prompt generator and its reward function. `examples(split, n, seed)` returns examples of
the "train" or "eval" split; a prompt belongs to "eval" when a hash of its text falls in `eval_fraction`,
so the two splits never share a prompt, whatever the seeds. `reward(example, completion)` is pure and
never raises on model output: a malformed completion scores 0, a well-formed wrong one `format_weight`,
a correct one 1.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from gspo_lab.tools.toolset import Toolset

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Example:
    prompt: str  # what the model is given, e.g. "123+456="
    answer: str  # the reference answer, e.g. "579"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # task-specific data (numbers, target)
    solution: str | None = field(default=None, compare=False)  # a worked solution to imitate, where the data has one


class Task(ABC):
    """Base class: subclasses implement `sample`, `demonstration`, `is_correct` and `is_well_formed`.

    Args:
        eval_fraction: share of the prompt space held out for evaluation.
        eval_seed: the seed of the fixed evaluation set used by `eval_examples`.
        eval_size: how many held-out prompts evaluation uses.
        format_weight: reward of a well-formed but wrong completion (0 disables the format reward).
        tools: functions the model may call, as import paths (TRL's `tools`; gspo_lab.tools.toolset).
        environment: a class built once per rollout row, as an import path (TRL's `environment_factory`).
    """

    name = "task"
    # whether the checker (`is_correct`, `answer_of`, `reward`) can run without end on some model output (sympy
    # under math-verify or a third-party verifier, eval() of the completion): its calls then go to killable grading
    # workers (gspo_lab.grading.pool) in training (reward.num_workers) and evaluation (eval.grading_workers), so
    # model output that it runs as Python never runs in the trainer
    checker_may_hang = False

    def __init__(self, eval_fraction=0.1, eval_seed=1234, eval_size=400, format_weight=0.0, tools=(),
                 environment=None) -> None:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"task.eval_fraction={eval_fraction!r} must satisfy 0 < eval_fraction < 1")
        if not 0 <= format_weight < 1:
            raise ValueError(f"task.format_weight={format_weight!r} must satisfy 0 <= format_weight < 1")
        if not eval_size >= 1:
            raise ValueError(f"task.eval_size={eval_size!r} must be >= 1")
        self.eval_fraction, self.eval_seed = eval_fraction, eval_seed
        self.eval_size, self.format_weight = eval_size, format_weight
        # the tools and environment of a multi-turn task (gspo_lab.rollout.multi_turn); None: single-turn
        self.toolset = Toolset.of(tools, environment)

    @abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """One random example from the whole prompt space (either split)."""

    @abstractmethod
    def demonstration(self, example: Example) -> str:
        """A correct completion to imitate in the cold-start SFT stage."""

    @abstractmethod
    def is_correct(self, example: Example, completion: str) -> bool:
        """The task's checker; must not raise on any string."""

    @abstractmethod
    def is_well_formed(self, example: Example, completion: str) -> bool:
        """Whether the completion has the answer's format; must not raise on any string."""

    def answer_of(self, completion: str, example: Example | None = None) -> str | None:
        """The answer a completion of `example` gives, as maj@k compares them (gspo_lab.evaluation): by default the
        stripped text, None when empty. Tasks whose checker extracts an answer override it."""
        return completion.strip() or None

    # whether examples carry a reference answer; a data set without one (task=hf, task.answer_column=null) serves
    # rewards that need none (an environment, a reward model, a judge), and what needs one is refused by name
    has_answers = True

    def columns(self) -> list[str]:
        """The data columns every reward call receives as keywords: `answer`, then an example's `meta` keys."""
        return ["answer", *self.sample(random.Random("columns")).meta]

    def split_of(self, prompt: str) -> str:
        digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
        return "eval" if int.from_bytes(digest, "big") / 2**64 < self.eval_fraction else "train"

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """`n` distinct examples of `split`, the same for the same seed."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r} must be one of {SPLITS}")
        rng, found, seen = random.Random(f"{self.name}/{split}/{seed}"), [], set()
        for _ in range(200 * n + 1000):
            example = self.sample(rng)
            if example.prompt not in seen and self.split_of(example.prompt) == split:
                seen.add(example.prompt)
                found.append(example)
                if len(found) == n:
                    return found
        raise ValueError(
            f"{type(self).__name__}: could not find {n} distinct {split!r} prompts; the prompt space is too "
            "small for this request (widen the task's ranges or ask for fewer)"
        )

    def eval_examples(self) -> list[Example]:
        """The fixed held-out set every evaluation uses."""
        return self.examples("eval", self.eval_size, self.eval_seed)

    def reward(self, example: Example, completion: str) -> float:
        """1 for a correct completion, `format_weight` for a well-formed wrong one, else 0."""
        if self.is_correct(example, completion):
            return 1.0
        if self.format_weight and self.is_well_formed(example, completion):
            return self.format_weight
        return 0.0
