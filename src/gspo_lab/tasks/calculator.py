"""Arithmetic with a calculator tool: `12*34+56*78=` -> `5076`, in three calls of one operation each.

A tiny model cannot multiply two-digit numbers in its head, but it can copy them into `calculate`, which does one
operation at a time: a*b, then c*d, then the sum, then the answer. The reward is the exact final answer (the
last assistant turn). `demonstration` is that trajectory, for the cold start.

>>> task = Calculator(digits=2)
>>> example = Example("12*34+56*78=", "4776", {"numbers": [12, 34, 56, 78]})
>>> calculate("12*34"), task.reward(example, "4776"), task.reward(example, "4777")
('408', 1.0, 0.0)
>>> [m["role"] for m in task.demonstration(example)]
['assistant', 'tool', 'assistant', 'tool', 'assistant', 'tool', 'assistant']
"""

from __future__ import annotations

import random
import re

from gspo_lab.tasks.arithmetic import INTEGER, OPS
from gspo_lab.tasks.base import Example, Task

ONE_OPERATION = re.compile(r"\s*(-?[0-9]{1,12})\s*([-+*])\s*(-?[0-9]{1,12})\s*")


def calculate(expression: str) -> str:
    """Compute one operation of two integers, such as 12*34 or 408+4368.

    Args:
        expression: two integers joined by one of +, - or *
    """
    found = ONE_OPERATION.fullmatch(expression)
    if found is None:
        raise ValueError(f"calculate takes one operation of two integers, such as 12*34; got {expression!r}")
    a, op, b = found.groups()
    return str(OPS[op](int(a), int(b)))


def call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}


class Calculator(Task):
    """a*b+c*d with `digits`-digit operands and the `calculate` tool (task.tools lists it).

    Args:
        digits: digits of each of the four operands.
        Other arguments: see `Task`.
    """

    name = "calculator"

    def __init__(self, digits: int = 2, tools=("gspo_lab.tasks.calculator.calculate",), **kwargs) -> None:
        super().__init__(tools=tools, **kwargs)
        if not 1 <= digits <= 6:
            raise ValueError(f"task.digits={digits!r} must be between 1 and 6")
        self.digits = digits

    def sample(self, rng: random.Random) -> Example:
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b, c, d = (rng.randint(low, high) for _ in range(4))
        return Example(prompt=f"{a}*{b}+{c}*{d}=", answer=str(a * b + c * d), meta={"numbers": [a, b, c, d]})

    def demonstration(self, example: Example) -> list[dict]:
        a, b, c, d = example.meta["numbers"]
        steps = [f"{a}*{b}", f"{c}*{d}", f"{a * b}+{c * d}"]
        messages = []
        for step in steps:
            messages += [{"role": "assistant", "content": "", "tool_calls": [call(step)]},
                         {"role": "tool", "name": "calculate", "content": calculate(step)}]
        return messages + [{"role": "assistant", "content": example.answer}]

    def is_correct(self, example: Example, completion: str) -> bool:
        return completion.strip() == example.answer

    def is_well_formed(self, example: Example, completion: str) -> bool:
        return INTEGER.fullmatch(completion.strip()) is not None
