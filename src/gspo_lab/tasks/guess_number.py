"""Find a hidden number with higher/lower answers: an environment with feedback (TRL's environment contract).

Each game has an id in its prompt (`game 4821, 1-16:`), and the hidden number is drawn from it; held-out games
are other ids, so what a policy learns there is the search, not the numbers. `GuessNumber` is the environment:
`reset` reads the game's hidden number from the row's `answer`, `guess` answers "correct", or "higher" or "lower"
with the numbers still possible ("higher 9-16"), and `get_reward` rewards success, and fewer guesses:
1 - 0.1 (guesses - 1), 0 when not found within `MAX_GUESSES`. The range in the answer is what a 1.8M-parameter
model can use: without it (the first design), it had to recover the range from every earlier guess and answer,
and its cold start guessed outside it (experiments/multi_turn). Train on it with reward=environment; the task's
checker (held-out accuracy) is whether the last turn names the number. `demonstration` is a noisy search: each
guess drawn at random from the range (seeded by the game), so the cold start finds the number, in more guesses
than bisection needs: what RL can gain is the search.

>>> env = GuessNumber(); env.reset(answer="11")
>>> env.guess(8), env.guess(12), env.guess(11), env.get_reward()
('higher 9-16', 'lower 9-11', 'correct', 0.8)
>>> binary_search(11, 1, 16)
[8, 12, 10, 11]
>>> demo = GuessNumberTask(high=16).demonstration(Example("game 7, 1-16:", "11", {"high": 16}))
>>> guesses = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in demo[:-1:2]]
>>> guesses[-1], all(1 <= g <= 16 for g in guesses), demo[-2]["content"]
(11, True, 'correct')
"""

from __future__ import annotations

import random

from gspo_lab.tasks.arithmetic import INTEGER
from gspo_lab.tasks.base import Example, Task

MAX_GUESSES = 6


class GuessNumber:
    """One game: the hidden number is the row's `answer`, in 1..`high` (the row's column; 16 by default)."""

    def reset(self, answer: str, high: int = 16, **columns) -> None:
        self.hidden, self.guesses, self.found = int(answer), 0, False
        self.low, self.high = 1, int(high)

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: your guess
        """
        if self.found:
            return "already found"
        if self.guesses >= MAX_GUESSES:
            return "no guesses left"
        self.guesses += 1
        number = int(number)
        if number == self.hidden:
            self.found = True
            return "correct"
        if self.hidden > number:
            self.low = max(self.low, number + 1)
            return f"higher {self.low}-{self.high}"
        self.high = min(self.high, number - 1)
        return f"lower {self.low}-{self.high}"

    def get_reward(self) -> float:
        return round(1.0 - 0.1 * (self.guesses - 1), 6) if self.found else 0.0


def binary_search(hidden: int, low: int, high: int, rng: random.Random | None = None) -> list[int]:
    """The guesses that find `hidden` in low..high: the middle of what is still possible, or (with `rng`) a number
    drawn from it."""
    guesses = []
    while True:
        guess = (low + high) // 2 if rng is None else rng.randint(low, high)
        guesses.append(guess)
        if guess == hidden:
            return guesses
        low, high = (guess + 1, high) if hidden > guess else (low, guess - 1)


class GuessNumberTask(Task):
    """Guess a number in 1..`high` (task.environment is `GuessNumber`).

    Args:
        high: the largest hidden number (binary search needs at most about log2(high) + 1 guesses).
        Other arguments: see `Task`.
    """

    name = "guess_number"

    def __init__(self, high: int = 16, environment="gspo_lab.tasks.guess_number.GuessNumber", **kwargs) -> None:
        super().__init__(environment=environment, **kwargs)
        if not 2 <= high <= 1000:
            raise ValueError(f"task.high={high!r} must be between 2 and 1000")
        self.high = high

    def sample(self, rng: random.Random) -> Example:
        game = rng.randint(0, 99_999)
        hidden = random.Random(f"guess_number/{game}").randint(1, self.high)
        return Example(prompt=f"game {game}, 1-{self.high}:", answer=str(hidden), meta={"high": self.high})

    def demonstration(self, example: Example) -> list[dict]:
        messages = []
        hidden = int(example.answer)
        rng = random.Random(example.prompt)
        searches = (binary_search(hidden, 1, self.high, rng) for _ in range(100))  # one that finds it in time
        env = GuessNumber()
        env.reset(example.answer, self.high)
        for guess in next((s for s in searches if len(s) <= MAX_GUESSES), binary_search(hidden, 1, self.high)):
            reply = env.guess(guess)
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": "guess", "arguments": {"number": guess}}}]},
                         {"role": "tool", "name": "guess", "content": reply}]
        return messages + [{"role": "assistant", "content": example.answer}]

    def is_correct(self, example: Example, completion: str) -> bool:
        return completion.strip() == example.answer

    def is_well_formed(self, example: Example, completion: str) -> bool:
        return INTEGER.fullmatch(completion.strip()) is not None
