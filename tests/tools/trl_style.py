"""A tool function and an environment class written for TRL's GRPOTrainer (`tools=[multiply]`,
`environment_factory=CounterEnv`), with nothing of gspo-lab: they must work unchanged through task.tools and
task.environment. Plus misbehaving ones for the failure tests."""

import os
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


async def add(a: int, b: int) -> int:
    """Add two integers (an async tool, as TRL allows).

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def explode(reason: str) -> str:
    """Always raises.

    Args:
        reason: what to say
    """
    raise RuntimeError(f"boom: {reason}")


def stall(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


class CounterEnv:
    """A counter the model raises to 3; reset's text extends the prompt."""

    def __init__(self):
        self.count = 0

    def reset(self, **kwargs) -> str | None:
        self.count = int(kwargs.get("start", 0))
        return f" (the counter is at {self.count})" if "start" in kwargs else None

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.count += step
        return str(self.count)

    def crash(self) -> str:
        """Ends the process that holds this environment."""
        os._exit(3)

    def get_reward(self) -> float:
        return 1.0 if self.count == 3 else 0.0
