"""The contract every rollout source keeps, the rows a step asks it for, and what its versions say.

A source (`RolloutSource`) turns one round of a step's rows, each prompt `group_size` times with groups contiguous,
into completions: `generated(step, examples) -> (Generated, metrics)`. Where the generating weights come from is
the source's own business: the trainer's current ones (synchronous), k versions back (lagged), an engine process
generating ahead (overlap). A stale source marks each completion token with the weight version that wrote it
(`Completions.versions`, [N, C]); the synchronous source marks none (every token is the step's own).

`StepRows` says which rows a step generates and how a row is rendered and seeded: the collector takes each round
from it, and a source that generates ahead takes later steps' from the same object.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import Tensor

from gspo_lab.rollout.backend import RolloutBackend, Sampling
from gspo_lab.rollout.completions import Generated
from gspo_lab.rollout.multi_turn import MultiTurn, generate_rows
from gspo_lab.rollout.prompts import PromptSchedule
from gspo_lab.rollout.rescore import Rescorer
from gspo_lab.seeding import stream_seed
from gspo_lab.tasks.base import Example


class RolloutSource(Protocol):
    """Where the step's completions come from."""

    # true where it generates with the step's backend in the trainer's process (evaluation may then use that engine)
    in_process: ClassVar[bool]

    def generated(self, step: int, examples: list[Example]) -> tuple[Generated, dict[str, float]]:
        """Completions of `examples` (one per example, in order) for RL step `step`, with the engine's log-probs of
        the sampled tokens, and the source's time/* and off_policy/* metrics."""

    def state_dict(self) -> dict:
        """What a checkpoint must carry for a resumed run to generate as one that never stopped."""

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None:
        """Stop what the source runs beside the trainer."""


class StepRows:
    """Which rows RL step `step` generates: its prompts from the schedule, each `group_size` times (groups
    contiguous), rendered by `render`; and the seeds of a source that draws them from (seed, step) rather than from
    the step's random state (`stream_seeds`)."""

    def __init__(self, prompts: PromptSchedule, render, tokenizer, group_size: int) -> None:
        self.prompts, self.render, self.tokenizer, self.group_size = prompts, render, tokenizer, group_size

    def examples(self, step: int, rank: int = 0, world: int = 1, sampling_round: int = 0) -> list[Example]:
        return [example for example in self.prompts.for_step(step, rank, world, sampling_round)
                for _ in range(self.group_size)]

    def first(self) -> Example:
        """The first training prompt (an environment's preflight)."""
        return self.prompts.for_step(0, 0, 1, 0)[0]

    def token_ids(self, examples: list[Example]) -> list[list[int]]:
        """The rows' prompts as token ids, each group's rendered once."""
        rendered: dict[int, list[int]] = {}
        for example in examples:
            if id(example) not in rendered:
                rendered[id(example)] = self.tokenizer(self.render.text(example), add_special_tokens=
                                                       self.render.add_special_tokens)["input_ids"]
        return [rendered[id(example)] for example in examples]

    @staticmethod
    def stream_seeds(seed: int, stream: str, step: int, rows: int) -> Tensor:
        """[rows] int64 row seeds from (seed, stream, step) alone: the same whenever they are asked for."""
        generator = torch.Generator().manual_seed(stream_seed(seed, stream, step))
        return torch.randint(0, 2**62, (rows,), dtype=torch.int64, generator=generator)


class InProcess:
    """The step's backend in the trainer's process, and rollout.rescore's engine synced beside it: how the
    synchronous and lagged sources generate. `sync` is what a lagged version of the weights goes through
    (gspo_lab.rollout.sources.lagged.LaggedWeights)."""

    def __init__(self, backend: RolloutBackend, rows: StepRows, sampling: Sampling, batch_size: int | None,
                 routing, agent: MultiTurn | None = None, rescorer: Rescorer | None = None) -> None:
        self.backend, self.rows, self.sampling, self.batch_size = backend, rows, sampling, batch_size
        self.routing, self.agent, self.rescorer = routing, agent, rescorer

    def sync(self) -> None:
        self.backend.sync()
        if self.rescorer is not None:
            self.rescorer.sync()

    def generate(self, examples: list[Example], seeds: Tensor) -> Generated:
        """One completion per example, row n from `seeds[n]`, in calls of rollout.generation_batch_size rows
        (through the multi-turn loop for a task with tools)."""
        rows = self.rows
        return generate_rows(self.backend, rows.tokenizer, rows.render, examples, self.sampling, seeds,
                             self.batch_size, self.routing, self.agent)

    def rescored(self, generated: Generated, metrics: dict[str, float]) -> tuple[Generated, dict[str, float]]:
        """Under rollout.rescore, `generated` with the second engine's log-probs; `metrics` with its own."""
        if self.rescorer is None:
            return generated, metrics
        generated, scored = self.rescorer.rescored(self.rows.tokenizer, generated)
        return generated, {**metrics, **scored}

    def close(self) -> None:
        if self.rescorer is not None:
            self.rescorer.close()


def version_metrics(versions: Tensor, mask: Tensor, step: int, max_staleness: int) -> dict[str, float]:
    """What the per-token versions [B, C] of the model's tokens (`mask` [B, C]) say at RL step `step`:
    off_policy/staleness_mean and _max (a row's age: its oldest token's; the max over tokens), token_staleness_mean
    (over tokens), versions_per_sequence (mean and max distinct versions in a row) and mixed_frac (the share of rows
    written by more than one version). A token older than `max_staleness` is a bug, never trained on: RuntimeError.

    >>> versions, mask = torch.tensor([[3, 3, 4, 0], [4, 4, 4, 4]]), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    >>> m = version_metrics(versions, mask, step=4, max_staleness=2)
    >>> m["off_policy/staleness_mean"], m["off_policy/token_staleness_mean"], m["off_policy/mixed_frac"]
    (0.5, 0.4, 0.5)
    >>> m["off_policy/versions_per_sequence_mean"], m["off_policy/versions_per_sequence_max"]
    (1.5, 2.0)
    """
    real = mask.bool()  # [B, C]
    age = (step - versions).masked_fill(~real, 0)  # [B, C]
    oldest = int(age.max())
    if oldest > max_staleness:
        raise RuntimeError(f"RL step {step}: a token {oldest} weight versions old reached the trainer; "
                           f"rollout.max_staleness={max_staleness}")
    newest = versions.masked_fill(~real, -1).max(-1).values  # [B]
    first = versions.masked_fill(~real, step + 1).min(-1).values  # [B]; a row without tokens: step + 1
    row_age = (step - first).clamp(min=0)  # [B]
    # distinct versions per row, over its model tokens (a multi-turn row's tool tokens between them do not count)
    distinct = torch.stack([((age == a) & real).any(-1) for a in range(oldest + 1)]).sum(0).float()  # [B]
    tokens = max(int(real.sum()), 1)
    return {
        "off_policy/staleness_mean": row_age.float().mean().item(),
        "off_policy/staleness_max": float(oldest),
        "off_policy/token_staleness_mean": int(age.sum()) / tokens,
        "off_policy/versions_per_sequence_mean": distinct.mean().item(),
        "off_policy/versions_per_sequence_max": distinct.max().item(),
        "off_policy/mixed_frac": (newest > first).float().mean().item(),
    }
