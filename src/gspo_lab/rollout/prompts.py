"""Which prompts each RL step uses: a function of (seed, step) only, so resumed and paired runs agree.

Every rank derives the step's `prompts_per_step` prompts from the same seed and keeps its own contiguous
share, so each group stays on one rank and no prompt is seen twice in a step. The seed is the RL-prompt
stream's own (`gspo_lab.seeding`), so RL does not replay the cold start's demonstrations. Dynamic sampling's
further rounds of a step (`sampling_round` >= 1) draw from streams of their own, so round 0 is the same prompts
with the option on or off.
"""

from __future__ import annotations

from torch.utils.data import Dataset

from gspo_lab.seeding import RL_PROMPTS, stream_seed
from gspo_lab.tasks.base import Example, Task


class PromptSchedule:
    def __init__(self, task: Task, prompts_per_step: int, seed: int) -> None:
        self.task, self.prompts_per_step, self.seed = task, prompts_per_step, seed

    def for_step(self, step: int, rank: int = 0, world_size: int = 1, sampling_round: int = 0) -> list[Example]:
        stream = RL_PROMPTS if sampling_round == 0 else f"{RL_PROMPTS}/round_{sampling_round}"
        examples = self.task.examples("train", self.prompts_per_step, seed=stream_seed(self.seed, stream, step))
        share = self.prompts_per_step // world_size
        return examples[rank * share : (rank + 1) * share]


class StepTicks(Dataset):
    """One item per RL step; the module reads its own step counter, so the loader only paces the loop."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> int:
        return index
