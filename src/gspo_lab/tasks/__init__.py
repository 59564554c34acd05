"""Tasks with verifiable rewards; each owns its prompt generator and its pure reward function."""

from gspo_lab.tasks.arithmetic import Arithmetic
from gspo_lab.tasks.base import Example, Task
from gspo_lab.tasks.calculator import Calculator
from gspo_lab.tasks.countdown import Countdown
from gspo_lab.tasks.guess_number import GuessNumberTask
from gspo_lab.tasks.hf import HFDataset
from gspo_lab.tasks.jsonl import JsonlTask
from gspo_lab.tasks.reasoning_gym import ReasoningGym

__all__ = ["Arithmetic", "Calculator", "Countdown", "Example", "GuessNumberTask", "HFDataset", "JsonlTask",
           "ReasoningGym", "Task"]
