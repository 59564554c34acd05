"""Countdown: reach a target from given numbers with + - * / and parentheses, each number used at most once.

`nums 18 20 5 target 2:` -> `20-18` (or `(20-18)*5/5` ...: many answers are correct, which is where RL can
beat imitation). Completions are parsed by a small recursive-descent parser and evaluated exactly with
fractions; nothing is ever passed to Python's `eval`.

>>> task = Countdown()
>>> example = Example("nums 18 20 5 target 2:", "20-18", {"numbers": (18, 20, 5), "target": 2})
>>> [task.reward(example, c) for c in ("20-18", " (20-18) ", "18-20", "20-18-0")]
[1.0, 1.0, 0.0, 0.0]
>>> [task.reward(example, c) for c in ("(20-18)*5/5", "9**9**9", "5/(20-20)", "((20-18)", "", "2")]
[0.0, 0.0, 0.0, 0.0, 0.0, 0.0]

The rejects: 5 used twice, a power, division by zero, unbalanced parentheses, empty, a number not given.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction
from functools import lru_cache

from gspo_lab.tasks.base import Example, Task

TOKEN = re.compile(r"[ ]*([0-9]+|[-+*/()])")  # ASCII digits only: int() also accepts other scripts
MAX_COMPLETION_CHARS = 64
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


class ParseError(ValueError):
    """The completion is not an expression over the given numbers."""


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """Evaluate `text` exactly; returns its value and the integer literals it used.

    >>> parse_expression("(20-18)*5")
    (Fraction(10, 1), [20, 18, 5])
    """
    if len(text) > MAX_COMPLETION_CHARS:
        raise ParseError(f"longer than {MAX_COMPLETION_CHARS} characters")
    tokens, position = [], 0
    text = text.strip()
    while position < len(text):
        match = TOKEN.match(text, position)
        if match is None:
            raise ParseError(f"unexpected character {text[position]!r}")
        tokens.append(match.group(1))
        position = match.end()
    parser = _Parser(tokens)
    value = parser.expression()
    if parser.position != len(tokens):
        raise ParseError(f"unexpected {tokens[parser.position]!r}")
    return value, parser.literals


class _Parser:
    """expression := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := INT | '(' expression ')'"""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.position, self.literals = tokens, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ParseError("unexpected end")
        self.position += 1
        return token

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op, right = self.take(), self.factor()
            if op == "/" and right == 0:
                raise ParseError("division by zero")
            value = value * right if op == "*" else value / right
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if token == "(":
            value = self.expression()
            if self.take() != ")":
                raise ParseError("unbalanced parentheses")
            return value
        if not token[0].isdigit():
            raise ParseError(f"unexpected {token!r}")
        self.literals.append(int(token))
        return Fraction(int(token))


@lru_cache(maxsize=65536)
def solutions(numbers: tuple[int, ...]) -> dict[Fraction, str]:
    """Every value reachable from a subset of `numbers`, with its shortest expression (ties: smallest string).

    >>> solutions((3, 4))[Fraction(12)], solutions((3, 4))[Fraction(-1)]
    ('3*4', '3-4')
    """
    best: dict[Fraction, str] = {}

    def keep(value: Fraction, expr: str) -> None:
        if value not in best or (len(expr), expr) < (len(best[value]), best[value]):
            best[value] = expr

    def search(items: list[tuple[Fraction, str, int]]) -> None:  # (value, expression, precedence)
        for value, expr, _ in items:
            keep(value, expr)
        for i, (a, a_expr, a_prec) in enumerate(items):
            for j, (b, b_expr, b_prec) in enumerate(items):
                if i == j:
                    continue
                rest = [item for k, item in enumerate(items) if k not in (i, j)]
                for op, prec in PRECEDENCE.items():
                    if op == "/" and b == 0:
                        continue
                    left = f"({a_expr})" if a_prec < prec else a_expr
                    right = f"({b_expr})" if b_prec < prec or (b_prec == prec and op in "-/") else b_expr
                    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
                    search(rest + [(value, f"{left}{op}{right}", prec)])

    search([(Fraction(n), str(n), 3) for n in numbers])
    return best


class Countdown(Task):
    """Countdown with `count` numbers in [1, max_number] and a reachable integer target in [1, max_target].

    Args:
        count: how many numbers a prompt gives (2 to 4).
        max_number: the largest number drawn.
        max_target: the largest target; targets equal to one of the numbers are not drawn.
        Other arguments: see `Task`.
    """

    name = "countdown"

    def __init__(self, count: int = 3, max_number: int = 30, max_target: int = 100, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 2 <= count <= 4:
            raise ValueError(f"task.count={count!r} must be between 2 and 4")
        if not max_number >= 2:
            raise ValueError(f"task.max_number={max_number!r} must be >= 2")
        if not max_target >= 1:
            raise ValueError(f"task.max_target={max_target!r} must be >= 1")
        self.count, self.max_number, self.max_target = count, max_number, max_target

    def sample(self, rng: random.Random) -> Example:
        while True:
            numbers = tuple(rng.randint(1, self.max_number) for _ in range(self.count))
            reachable = solutions(tuple(sorted(numbers)))
            targets = sorted(
                int(v) for v in reachable if v.denominator == 1 and 1 <= v <= self.max_target and v not in numbers
            )
            if targets:
                target = rng.choice(targets)
                prompt = f"nums {' '.join(map(str, numbers))} target {target}:"
                return Example(prompt, reachable[Fraction(target)], {"numbers": numbers, "target": target})

    def demonstration(self, example: Example) -> str:
        return example.answer

    def _evaluate(self, example: Example, completion: str) -> Fraction | None:
        try:
            value, literals = parse_expression(completion)
        except ParseError:
            return None
        if Counter(literals) - Counter(example.meta["numbers"]):  # a number used more often than given
            return None
        return value

    def answer_of(self, completion: str, example: Example | None = None) -> str | None:
        """The expression's exact value (different expressions of the same value vote together); None when it does
        not parse or, given the example, uses a number more often than the example gives it (the checker's rule)."""
        if example is not None:
            value = self._evaluate(example, completion)
        else:
            try:
                value = parse_expression(completion)[0]
            except ParseError:
                value = None
        return None if value is None else str(value)

    def is_correct(self, example: Example, completion: str) -> bool:
        value = self._evaluate(example, completion)
        return value is not None and value == example.meta["target"]

    def is_well_formed(self, example: Example, completion: str) -> bool:
        return self._evaluate(example, completion) is not None
