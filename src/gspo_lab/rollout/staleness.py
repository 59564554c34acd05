"""Bounded staleness: the rollout of RL step t comes from weights up to k updates old (rollout.max_staleness = k),
as in the peers' asynchronous pipelines (TRL AsyncGRPO's max_staleness, prime-rl's max_off_policy_steps, AReaL's
max_head_offpolicyness).

A weight version counts weight syncs, one per RL step: the trainer holds version t at the start of step t (t
updates' worth of steps done). rollout.async_mode=lagged is the deterministic form, for studies: at step t the
engine generates with version max(t - k, 0), so every row of step t is exactly min(t, k) versions old, what a
pipeline that generates k steps ahead of the trainer produces at its bound. `LaggedWeights` keeps the trained
parameters of the last k + 1 versions (on the host) and, around the backend's own `sync`, puts the lagged version
into the trainer's model, then the current one back, so any backend (hf's engine copy, vLLM) takes the lagged
weights through the sync it already has. k = 0 builds none of this: the synchronous step, unchanged.

Memory: k + 1 copies of the trained parameters on the host (LoRA: the adapters only). For a 2B model in bfloat16
at k = 8 that is 9 x 4 GB; the copies cost one device-to-host copy of the weights per step and two
host-to-device copies per lagged sync. Checkpoints carry the versions, so a resumed run generates from the same
weights as one that never stopped.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class Syncs(Protocol):
    def sync(self) -> None: ...


class LaggedWeights:
    """rollout.async_mode=lagged: the versions of `model`'s trained parameters that a lag of `max_staleness` steps
    still needs, and the sync that hands the lagged one to a backend."""

    def __init__(self, model: torch.nn.Module, max_staleness: int) -> None:
        if max_staleness < 1:
            raise ValueError(f"rollout.max_staleness={max_staleness!r}: LaggedWeights needs a lag >= 1")
        self.model, self.max_staleness = model, max_staleness
        self.versions: dict[int, dict[str, Tensor]] = {}  # version -> trained parameters, on the host

    def version_for(self, step: int) -> int:
        """The version the engine generates RL step `step`'s rollout with: max(step - k, 0)."""
        return max(step - self.max_staleness, 0)

    @torch.no_grad()
    def sync(self, backend: Syncs, step: int) -> int:
        """Record the trainer's current weights as version `step` and sync `backend` to version_for(step); the
        trainer's model holds its current weights again on return. Returns the version synced."""
        if step not in self.versions:
            self.versions[step] = {name: p.detach().to("cpu", copy=True) for name, p in self.trained()}
        version = self.version_for(step)
        for old in [v for v in self.versions if v < version]:
            del self.versions[old]
        if version == step:
            backend.sync()
            return version
        if version not in self.versions:
            raise RuntimeError(f"rollout.max_staleness={self.max_staleness}: version {version} of the weights, "
                               f"needed at RL step {step}, was never recorded (held: {sorted(self.versions)})")
        self.load(self.versions[version])
        try:
            backend.sync()
        finally:
            self.load(self.versions[step])
        return version

    def trained(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters that change between versions: those the optimizer trains (LoRA: the adapters)."""
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]

    def load(self, weights: dict[str, Tensor]) -> None:
        for name, parameter in self.trained():
            parameter.data.copy_(weights[name])

    def state_dict(self) -> dict[int, dict[str, Tensor]]:
        """The recorded versions, for a checkpoint."""
        return self.versions

    def load_state_dict(self, versions: dict[int, dict[str, Tensor]]) -> None:
        self.versions = {int(v): dict(weights) for v, weights in versions.items()}
