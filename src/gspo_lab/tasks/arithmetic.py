"""Integer arithmetic: `123+456=` -> `579`. Difficulty is the number of digits and the operators.

>>> task = Arithmetic(digits=3, ops=("+",))
>>> example = Example("123+456=", "579")
>>> task.reward(example, "579"), task.reward(example, " 579 "), task.reward(example, "578")
(1.0, 1.0, 0.0)
>>> task.reward(example, "9**9**9"), task.reward(example, "")
(0.0, 0.0)
"""

from __future__ import annotations

import random
import re

from gspo_lab.tasks.base import Example, Task

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
INTEGER = re.compile(r"-?[0-9]{1,40}")  # ASCII digits only: int() also accepts other scripts


class Arithmetic(Task):
    """n-digit addition, subtraction or multiplication with an exact-match reward.

    Args:
        digits: number of digits of each operand (operands lie in [10^(d-1), 10^d - 1]).
        ops: operators to draw from, any of "+", "-", "*".
        Other arguments: see `Task`.
    """

    name = "arithmetic"

    def __init__(self, digits: int = 3, ops=("+",), **kwargs) -> None:
        super().__init__(**kwargs)
        ops = tuple(ops)
        if not 1 <= digits <= 18:
            raise ValueError(f"task.digits={digits!r} must be between 1 and 18")
        if not ops or any(op not in OPS for op in ops):
            raise ValueError(f"task.ops={list(ops)!r} must be a non-empty list drawn from {sorted(OPS)}")
        self.digits, self.ops = digits, ops

    def sample(self, rng: random.Random) -> Example:
        low, high = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10**self.digits - 1
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(self.ops)
        return Example(prompt=f"{a}{op}{b}=", answer=str(OPS[op](a, b)))

    def demonstration(self, example: Example) -> str:
        return example.answer

    def is_correct(self, example: Example, completion: str) -> bool:
        return completion.strip() == example.answer

    def is_well_formed(self, example: Example, completion: str) -> bool:
        return INTEGER.fullmatch(completion.strip()) is not None
