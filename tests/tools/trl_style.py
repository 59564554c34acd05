"""A tool function and an environment class written for TRL's GRPOTrainer (`tools=[multiply]`,
`environment_factory=CounterEnv`), with nothing of gspo-lab: they must work unchanged through task.tools and
task.environment. Plus misbehaving ones for the failure tests."""

import asyncio
import os
import random
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


class ResetFails:
    """An environment whose reset always raises (refused before training)."""

    def reset(self, **kwargs) -> None:
        raise ConnectionError("the environment server refused the connection")

    def get_reward(self) -> float:
        return 1.0


RESETS = []  # in a tool worker: the resets it ran


class ResetFailsAfterFirst:
    """An environment whose reset works once per worker process (the check before training), then always raises."""

    def reset(self, **kwargs) -> None:
        RESETS.append(1)
        if len(RESETS) > 1:
            raise ConnectionError(f"reset number {len(RESETS)} lost its server")

    def get_reward(self) -> float:
        return 1.0


class RewardFails:
    """An environment whose get_reward raises on rows whose answer is odd (`odd_only`) or on every row."""

    def __init__(self, odd_only: bool = False):
        self.odd_only, self.answer = odd_only, None

    def reset(self, answer=None, **kwargs) -> None:
        self.answer = answer

    def get_reward(self) -> float:
        if not self.odd_only or int(self.answer) % 2:
            raise ZeroDivisionError(f"scoring answer {self.answer} divided by zero")
        return 1.0


class OddRewardFails(RewardFails):
    def __init__(self):
        super().__init__(odd_only=True)


def undocumented(a, b):
    return a + b


class StaticTools:
    """An environment with a static-method tool (no self: every parameter is the model's)."""

    def reset(self, **kwargs) -> None:
        return None

    @staticmethod
    def lookup(word: str, limit: int) -> str:
        """Look a word up.

        Args:
            word: the word
            limit: how many senses
        """
        return word[:limit]


class RandomStart:
    """A counter that starts where `random.randint` says (TRL's IncrementEnv doc example draws so in reset), and a
    reward that draws again: only seeded workers give two runs of one seed the same numbers."""

    def reset(self, **kwargs) -> str:
        self.count = random.randint(0, 1000)
        return f" (the counter is at {self.count})"

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.count += step
        return str(self.count)

    def get_reward(self) -> float:
        return random.random() + self.count / 1000


class Resets:
    """Counts the resets of this instance, and writes `<marker>/closed-<n>` in close(): built by a partial
    (Hydra's `_partial_: true`) that gives it the marker folder."""

    def __init__(self, marker: str):
        self.marker, self.resets = marker, 0

    def reset(self, **kwargs) -> str:
        self.resets += 1
        return str(self.resets)

    def close(self) -> None:
        with open(os.path.join(self.marker, f"closed-{os.getpid()}-{id(self)}"), "w") as file:
            file.write(str(self.resets))


def make_counter() -> CounterEnv:
    """A factory function (TRL's environment_factory takes any callable)."""
    return CounterEnv()


class Shouter:
    """An async client whose reset starts a background reader task and whose tool talks to it through queues, as a
    websocket client's reader does: the task must live across calls."""

    async def reset(self, **kwargs) -> None:
        self.inbox, self.outbox = asyncio.Queue(), asyncio.Queue()
        self.reader = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            text = await self.inbox.get()
            await self.outbox.put(text.upper())

    async def shout(self, text: str) -> str:
        """Say something loudly.

        Args:
            text: what to say
        """
        await self.inbox.put(text)
        return await self.outbox.get()


def spawn_and_stall(seconds: str) -> str:
    """Starts `sleep <seconds>` and waits for it.

    Args:
        seconds: how long the child sleeps
    """
    import subprocess

    subprocess.run(["sleep", seconds], check=False)
    return "slept"


def flood(chars: int) -> str:
    """Returns `chars` characters.

    Args:
        chars: how many
    """
    return "x" * chars


def counter_reward(environments, **kwargs) -> list[float]:
    """A reward function that reads its rows' environments, as TRL's echo.py's does (`env.reward`)."""
    return [float(env.count) / 3 for env in environments]


def counter_reward_by_method(environments, **kwargs) -> list[float]:
    """The same through a method of the environment."""
    return [env.get_reward() for env in environments]


def write_file(path: str, text: str) -> str:
    """Writes a file (tools are user code with the user's rights).

    Args:
        path: where
        text: what
    """
    with open(path, "w") as file:
        file.write(text)
    return "written"


def held_environments() -> str:
    """How many environment instances this worker holds (a probe for the tests, run as a tool)."""
    from gspo_lab.tools import runner

    return str(len(runner._ENVIRONMENTS))


class NoArguments:
    """An environment whose reset takes no arguments (TRL's echo_env_factory.py and IncrementEnv write it so)."""

    def reset(self) -> None:
        self.steps = 0

    def step(self, message: str) -> str:
        """Echo a message.

        Args:
            message: what to echo
        """
        self.steps += 1
        return message
