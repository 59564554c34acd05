"""Group-relative advantages: each completion's reward against the other completions of its prompt.

A_i = (r_i - mean(r_group)) / (std + eps), with the std taken over the group (GRPO, GSPO), over the whole
rollout batch, or not at all (Dr. GRPO, arXiv 2503.20783).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gspo_lab.tensors import as_groups, frac_zero_std, zero_std_groups  # noqa: F401 - re-exported

SCALES = ("group", "batch", "none")


@dataclass(frozen=True)
class GroupAdvantage:
    """Turns rewards [G * group_size] (groups contiguous) into advantages of the same shape.

    Args:
        scale: "group" divides by each group's std, "batch" by the whole batch's std, "none" does not
            divide (Dr. GRPO). The std is the population std (divisor n).
        eps: added to the std before dividing.

    >>> adv = GroupAdvantage()(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    >>> [round(a, 3) for a in adv.tolist()]  # group (1, 0): mean 0.5, std 0.5; group (1, 1): std 0
    [1.0, -1.0, 0.0, 0.0]
    """

    scale: str = "group"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"advantage.scale={self.scale!r} must be one of {SCALES}")
        if not self.eps >= 0:
            raise ValueError(f"advantage.eps={self.eps!r} must be >= 0")

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        groups = as_groups(rewards, group_size)  # [G, group_size]
        centred = groups - groups.mean(-1, keepdim=True)
        if self.scale == "group":
            centred = centred / (groups.std(-1, unbiased=False, keepdim=True) + self.eps)
        elif self.scale == "batch":
            centred = centred / (rewards.std(unbiased=False) + self.eps)
        return centred.reshape(rewards.shape)
