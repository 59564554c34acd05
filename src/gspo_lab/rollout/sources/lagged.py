"""rollout.async_mode=lagged: bounded staleness by construction, for studies. The rollout of RL step t comes from
weights up to k updates old (rollout.max_staleness = k), as in the peers' asynchronous pipelines (TRL AsyncGRPO's
max_staleness, prime-rl's max_off_policy_steps, AReaL's max_head_offpolicyness).

A weight version counts weight syncs, one per RL step: the trainer holds version t at the start of step t. Which
version writes which token:
- **fixed** (rollout.lag_spread=fixed, the default): every row of step t from version max(t - k, 0), so every row
  is exactly min(t, k) versions old: what a pipeline that generates k steps ahead produces at its bound;
- **uniform** (lag_spread=uniform): each group from a version drawn uniformly from max(t - k, 0)..t, seeded by
  (seed, step): a spread of ages whose mean at k is k / 2, to set against a fixed age of k / 2;
- **partial** (rollout.partial=true, rollout.segment_tokens = s): a row starts at its version as above and advances
  one version every s tokens, capped at t: a sequence written by several policy versions, as a partial rollout
  writes it when new weights interrupt it (Kimi k1.5, AReaL, slime), here at fixed points so that the same seed
  gives the same run. Each segment continues from the row's own tokens, from the row's seed for that segment
  (gspo_lab.rollout.multi_turn.turn_seeds); no token is generated twice. A row's first token is at most k
  versions old, so no token is.

`LaggedWeights` keeps the trained parameters of the last k + 1 versions on the host and, around the backend's own
`sync`, puts a lagged version into the trainer's model, then the current one back, so any backend that takes the
weights through its sync (hf's engine copy, vLLM) generates from the lagged ones.

Memory: k + 1 copies of the trained parameters on the host (LoRA: the adapters only). For a 2B model in bfloat16 at
k = 8 that is 9 x 4 GB; one device-to-host copy per step, two host-to-device copies per lagged sync (and per
version a partial or spread step visits). Checkpoints carry the versions, so a resumed run generates from the same
weights as one that never stopped.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol

import torch
from torch import Tensor

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout.completions import Generated, from_token_lists, stop_ids
from gspo_lab.rollout.multi_turn import turn_seeds
from gspo_lab.rollout.sampling import draw_row_seeds
from gspo_lab.rollout.sources.base import InProcess
from gspo_lab.seeding import stream_seed
from gspo_lab.tasks.base import Example

LAG_AGES = "lag_ages"  # the stream of each step's groups' versions under lag_spread=uniform (gspo_lab.seeding)


class Syncs(Protocol):
    def sync(self) -> None: ...


class LaggedWeights:
    """The versions of `model`'s trained parameters that a lag of `max_staleness` steps still needs, and the sync
    that hands one of them to a backend."""

    def __init__(self, model: torch.nn.Module, max_staleness: int) -> None:
        if max_staleness < 1:
            raise ValueError(f"rollout.max_staleness={max_staleness!r}: LaggedWeights needs a lag >= 1")
        self.model, self.max_staleness = model, max_staleness
        self.versions: dict[int, dict[str, Tensor]] = {}  # version -> trained parameters, on the host

    def version_for(self, step: int) -> int:
        """The oldest version RL step `step` may generate with: max(step - k, 0)."""
        return max(step - self.max_staleness, 0)

    @torch.no_grad()
    def record(self, step: int) -> None:
        """Keep the trainer's current weights as version `step`; forget the versions no later step needs."""
        if step not in self.versions:
            self.versions[step] = {name: p.detach().to("cpu", copy=True) for name, p in self.trained()}
        for old in [v for v in self.versions if v < self.version_for(step)]:
            del self.versions[old]

    @torch.no_grad()
    def sync_to(self, backend: Syncs, step: int, version: int) -> None:
        """Sync `backend` to `version` (recorded) at RL step `step`; the trainer's model holds its current weights
        again on return."""
        if version == step:
            backend.sync()
            return
        if version not in self.versions:
            raise RuntimeError(f"rollout.max_staleness={self.max_staleness}: version {version} of the weights, "
                               f"needed at RL step {step}, was never recorded (held: {sorted(self.versions)})")
        self.load(self.versions[version])
        try:
            backend.sync()
        finally:
            self.load(self.versions[step])

    def sync(self, backend: Syncs, step: int) -> int:
        """Record version `step` and sync `backend` to version_for(step); returns that version."""
        self.record(step)
        version = self.version_for(step)
        self.sync_to(backend, step, version)
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


def start_versions(step: int, max_staleness: int, groups: int, group_size: int, spread: str, seed: int) -> Tensor:
    """[groups * group_size] the version each row starts from at RL step `step`: max(step - k, 0) under
    lag_spread=fixed; under uniform, each group's drawn uniformly from max(step - k, 0)..step by (seed, step).

    >>> start_versions(5, 2, groups=2, group_size=2, spread="fixed", seed=0).tolist()
    [3, 3, 3, 3]
    >>> v = start_versions(5, 2, groups=400, group_size=1, spread="uniform", seed=0)
    >>> sorted(set(v.tolist())), abs(v.float().mean().item() - 4) < 0.15
    ([3, 4, 5], True)
    """
    oldest = max(step - max_staleness, 0)
    if spread == "fixed":
        return torch.full((groups * group_size,), oldest, dtype=torch.long)
    generator = torch.Generator().manual_seed(stream_seed(seed, LAG_AGES, step))
    drawn = torch.randint(oldest, step + 1, (groups,), generator=generator)
    return drawn.repeat_interleave(group_size)


class LaggedSource:
    """async_mode=lagged: each token from the version its row and position name (see the module docstring)."""

    in_process = True

    def __init__(self, engine: InProcess, model: torch.nn.Module, rollout: RolloutConfig, seed: int) -> None:
        self.engine, self.rollout, self.seed = engine, rollout, seed
        self.lag = LaggedWeights(model, rollout.max_staleness)
        self.segment = rollout.segment_tokens if rollout.partial else None
        self.stop = [] if rollout.suppress_eos else stop_ids(engine.rows.tokenizer, model, rollout.stop_token_ids)

    def generated(self, step: int, examples: list[Example]) -> tuple[Generated, dict[str, float]]:
        started = time.perf_counter()
        self.lag.record(step)
        group = self.rollout.group_size
        starts = start_versions(step, self.rollout.max_staleness, len(examples) // group, group,
                                self.rollout.lag_spread, self.seed)  # [N]
        metrics = {"off_policy/dropped": 0.0, "time/wait_s": 0.0}  # lagged: nothing dropped, nothing waited for
        if self.segment is None and bool((starts == starts[0]).all()):  # one version: one sync, then generate
            self.lag.sync_to(self.engine, step, int(starts[0]))
            synced = time.perf_counter()
            generated = self.engine.generate(examples, draw_row_seeds(len(examples)))
            generated.completions.versions = torch.full_like(generated.completions.completion_ids, int(starts[0]))
            sync_s = synced - started
        else:
            generated, sync_s = self.segmented(step, examples, starts, draw_row_seeds(len(examples)))
        metrics.update({"time/engine_sync_s": sync_s, "time/generate_s": time.perf_counter() - started - sync_s})
        return self.engine.rescored(generated, metrics)

    def segmented(self, step: int, examples: list[Example], starts: Tensor, seeds: Tensor
                  ) -> tuple[Generated, float]:
        """Rows whose tokens come from more than one version (a spread, or partial segments): in each round, the
        active rows grouped by the version their next segment takes, each group generated from its own tokens
        after a sync to that version. Returns the rows and the seconds spent syncing."""
        prompts = self.engine.rows.token_ids(examples)
        budget = self.engine.sampling.max_new_tokens
        length = self.segment or budget
        tokens: list[list[int]] = [[] for _ in examples]
        logprobs: list[list[float]] = [[] for _ in examples]
        versions: list[list[int]] = [[] for _ in examples]
        done = [False] * len(examples)
        sync_s, segment = 0.0, 0
        while not all(done):
            active = [n for n in range(len(examples)) if not done[n]]
            by_version: dict[int, list[int]] = {}
            for n in active:
                by_version.setdefault(min(int(starts[n]) + (segment if self.segment else 0), step), []).append(n)
            for version, rows in sorted(by_version.items()):
                synced = time.perf_counter()
                self.lag.sync_to(self.engine, step, version)
                sync_s += time.perf_counter() - synced
                left = budget - len(tokens[rows[0]])  # every row of a round has as many tokens
                out = self.continued([prompts[n] + tokens[n] for n in rows], turn_seeds(seeds[rows], segment),
                                     min(length, left))
                lengths = out.completion_mask.sum(-1).tolist()
                for i, n in enumerate(rows):
                    new = out.completion_ids[i, : lengths[i]].tolist()
                    tokens[n] += new
                    logprobs[n] += out.logprobs[i, : lengths[i]].tolist()
                    versions[n] += [version] * len(new)
                    done[n] = bool(not out.truncated[i]) or len(tokens[n]) >= budget
            segment += 1
        completions = from_token_lists(self.engine.rows.tokenizer, prompts, tokens, logprobs, self.stop)
        completions.versions = torch.tensor([row + [0] * (completions.completion_ids.shape[1] - len(row))
                                             for row in versions])  # [N, C]
        return Generated(completions), sync_s

    def continued(self, prompts: list[list[int]], seeds: Tensor, max_new_tokens: int):
        """Up to `max_new_tokens` more tokens of each row from its token ids so far, in calls of
        rollout.generation_batch_size rows: the calls' `Completions`, as one."""
        engine = self.engine
        sampling = replace(engine.sampling, max_new_tokens=max_new_tokens)
        size = engine.batch_size or len(prompts)
        parts = [engine.backend.generate(engine.rows.tokenizer, prompts[start : start + size], sampling,
                                         seeds[start : start + size])
                 for start in range(0, len(prompts), size)]
        return Generated.cat(parts, engine.rows.tokenizer.pad_token_id).completions

    def state_dict(self) -> dict:
        return {"lagged_weights": self.lag.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.lag.load_state_dict(state.get("lagged_weights", {}))

    def close(self) -> None:
        self.engine.close()
