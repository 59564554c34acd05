"""Where a step's rollouts come from: one contract, one source per way of getting them, one factory.

    base.py         the contract (`RolloutSource`), the rows a step asks for (`StepRows`), the in-process engine
                    the synchronous and lagged sources share (`InProcess`), and the per-token versions' metrics
    synchronous.py  rollout.max_staleness = 0: the backend takes the trainer's weights, then generates
    lagged.py       async_mode=lagged: the weights k versions back (`LaggedWeights`); a spread of ages
                    (rollout.lag_spread) and the deterministic partial rollout (rollout.partial, segment_tokens)
    overlap.py      async_mode=overlap: a vLLM engine process generating the next steps' rollouts ahead
    build_source    (below) the one the settings name
"""

from __future__ import annotations

import torch

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout.sources.base import InProcess, RolloutSource, StepRows, version_metrics

__all__ = ["InProcess", "RolloutSource", "StepRows", "build_source", "version_metrics"]


def build_source(model: torch.nn.Module, rollout: RolloutConfig, engine: InProcess, rows: StepRows,
                 seed: int) -> RolloutSource:
    """The source rollout.max_staleness and rollout.async_mode name: synchronous (k = 0), lagged or overlap."""
    if rollout.max_staleness == 0:
        from gspo_lab.rollout.sources.synchronous import SynchronousSource

        return SynchronousSource(engine)
    if rollout.async_mode == "overlap":
        from gspo_lab.rollout.sources.overlap import OverlapSource

        return OverlapSource(model, rollout, rows, seed, engine.agent)
    from gspo_lab.rollout.sources.lagged import LaggedSource

    return LaggedSource(engine, model, rollout, seed)
