"""A task's checker on many completions, in killable grading workers (gspo_lab.grading) or in this process: what
evaluation and the cold start's held-out accuracy use (gspo_lab.evaluation)."""

from __future__ import annotations

from dataclasses import dataclass

from gspo_lab.grading.guard import guarded
from gspo_lab.grading.pool import GradingPool, call_inline
from gspo_lab.tasks.base import Example, Task


class Checker:
    """A task's checker as one picklable call on one completion: (correct, the answer maj@k votes on, or None
    when `extract` is false). A grading pool sends it, and so the task's data, to each worker once."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def __call__(self, example: Example, completion: str, extract: bool) -> tuple[bool, str | None]:
        with guarded():  # in a grading worker: no side effects (gspo_lab.grading.guard)
            answer = self.task.answer_of(completion, example) if extract else None
            return bool(self.task.is_correct(example, completion)), answer


@dataclass
class Graded:
    """The checks of some completions: correct, extracted answers, and which checks failed (timed out or raised;
    each counts as wrong with no answer)."""

    correct: list[bool]
    answers: list[str | None]
    failed: list[bool]
    detail: str = ""  # the first failure's reason


def grade(checker: Checker, examples: list[Example], texts: list[str], extract: bool,
          grader: GradingPool | None) -> Graded:
    """Check each completion of `examples` (one example per text) in `grader`'s workers, or here without one."""
    calls = [(checker, (e, t, extract), {}) for e, t in zip(examples, texts)]
    outcomes = grader(calls) if grader is not None else [call_inline(*call) for call in calls]
    values = [o.value if o.failure is None else (False, None) for o in outcomes]
    failed = [o.failure is not None for o in outcomes]
    first = next((o for o in outcomes if o.failure is not None), None)
    return Graded([c for c, _ in values], [a for _, a in values], failed,
                  "" if first is None else f"{first.failure}: {first.detail}")
