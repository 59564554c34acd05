"""rollout.max_staleness = 0: the synchronous step. The backend takes the trainer's current weights, then generates
the step's rows, each from its own seed drawn from the step's random state (gspo_lab.rollout.sampling)."""

from __future__ import annotations

import time

from gspo_lab.rollout.completions import Generated
from gspo_lab.rollout.sampling import draw_row_seeds
from gspo_lab.rollout.sources.base import InProcess
from gspo_lab.tasks.base import Example


class SynchronousSource:
    """Every row from the weights the step starts with: nothing to version, nothing to keep in a checkpoint."""

    in_process = True

    def __init__(self, engine: InProcess) -> None:
        self.engine = engine

    def generated(self, step: int, examples: list[Example]) -> tuple[Generated, dict[str, float]]:
        started = time.perf_counter()
        self.engine.sync()
        synced = time.perf_counter()
        generated = self.engine.generate(examples, draw_row_seeds(len(examples)))
        metrics = {"time/engine_sync_s": synced - started, "time/generate_s": time.perf_counter() - synced}
        return self.engine.rescored(generated, metrics)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        self.engine.close()
