"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2), `rollout.filter_zero_std_groups`.

A group whose rewards are all equal gives every completion a zero advantage: it adds nothing to the policy
gradient and only dilutes the batch. With the option on, an RL step samples further rounds of prompts (each
rank its share, `PromptSchedule.for_step(..., sampling_round=r)`) until it holds `prompts_per_step` groups with
differing rewards, or `rollout.max_sampling_rounds` rounds were sampled. `merge_rounds` then keeps the first
informative groups in sampling order and, if the rounds ran out, fills the rest with the earliest zero-std
groups: the batch size, and so the mini-batch split and every rank's share, never changes. Rows of different
rounds are re-padded to one width (prompts left, completions right), their routing traces with them.
N completions per round, groups of `group_size` contiguous, P prompt and C completion positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gspo_lab.rollout.completions import Completions
from gspo_lab.routing.trace import RoutingTrace
from gspo_lab.tasks.base import Example
from gspo_lab.tensors import zero_std_groups


@dataclass
class SampledRound:
    examples: list[Example]  # [N] the prompt of each completion
    completions: Completions
    rewards: Tensor  # [N]
    applies: Tensor  # [N] bool: some reward function applied (else the completion's advantage is 0)
    components: Tensor  # [N, F] each reward function's rewards, NaN where it did not apply
    rollout_trace: RoutingTrace | None  # [layers, N, P + C, k] the engine's experts during generation, or None

    @property
    def scored_rewards(self) -> Tensor:
        """[N] the rewards, NaN where no reward function scored the completion (out of every mean and std)."""
        return torch.where(self.applies, self.rewards, torch.nan)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[N / group_size] bool: the groups whose rewards are not all equal (NaN, unscored, left out).

    >>> informative_groups(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5]), group_size=2)
    tensor([ True, False, False])
    """
    return ~zero_std_groups(rewards, group_size)


def informative_count(rounds: list[SampledRound], group_size: int) -> int:
    return sum(int(informative_groups(r.scored_rewards, group_size).sum()) for r in rounds)


def chosen_groups(informative: list[Tensor], needed: int) -> list[Tensor]:
    """Per round, the indices of its groups that the step keeps: informative groups in sampling order (round,
    then position) up to `needed`, then zero-std groups in the same order while the step is short.

    >>> chosen_groups([torch.tensor([False, True]), torch.tensor([True, True])], needed=2)
    [tensor([1]), tensor([0])]
    >>> chosen_groups([torch.tensor([False, True]), torch.tensor([False, False])], needed=2)
    [tensor([0, 1]), tensor([], dtype=torch.int64)]
    """
    order = [(not useful, r, g) for r, flags in enumerate(informative) for g, useful in enumerate(flags.tolist())]
    kept = sorted(sorted(order)[:needed], key=lambda item: (item[1], item[2]))  # back to sampling order
    return [torch.tensor([g for _, r, g in kept if r == i], dtype=torch.long) for i in range(len(informative))]


def merge_rounds(rounds: list[SampledRound], group_size: int, needed: int, pad_id: int) -> tuple[SampledRound, int]:
    """One round of `needed` groups chosen by `chosen_groups`, and how many of them have zero std."""
    chosen = chosen_groups([informative_groups(r.scored_rewards, group_size) for r in rounds], needed)
    rows = [(groups[:, None] * group_size + torch.arange(group_size)).flatten() for groups in chosen]  # [n_r]
    parts = [(r, index) for r, index in zip(rounds, rows) if len(index)]
    prompt_len = max(r.completions.prompt_ids.shape[1] for r, _ in parts)
    completion_len = max(r.completions.completion_ids.shape[1] for r, _ in parts)
    completions = [r.completions.rows(index).padded(prompt_len, completion_len, pad_id) for r, index in parts]
    traces = [r.rollout_trace.rows(index).realigned(prompt_len, prompt_len + completion_len)
              for r, index in parts if r.rollout_trace is not None]
    merged = SampledRound(
        examples=[r.examples[i] for r, index in parts for i in index.tolist()],
        completions=Completions.cat(completions),
        rewards=torch.cat([r.rewards[index] for r, index in parts]),
        applies=torch.cat([r.applies[index] for r, index in parts]),
        components=torch.cat([r.components[index] for r, index in parts]),
        rollout_trace=RoutingTrace.cat(traces) if traces else None,
    )
    unfilled = needed - int(informative_groups(merged.scored_rewards, group_size).sum())
    return merged, unfilled

