"""Tensor numerics shared by the objectives, the rollout and evaluation: masked means, the k3 KL estimator,
groups of rewards and row slices. Below all of them, so that none imports another for these.

>>> zero_std_groups(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5]), group_size=2)
tensor([False,  True,  True])
>>> frac_zero_std(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
tensor(0.5000)
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is 1; an all-zero mask gives 0 instead of NaN."""
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def k3(logp: Tensor, other_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(π_other || π) on samples from π_other: r - 1 - log r, r = π / π_other."""
    log_r = logp - other_logp
    return torch.exp(log_r) - 1 - log_r


def as_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Rewards [N] as [N / group_size, group_size] (groups contiguous); a clear error when they do not split."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of group_size={group_size}; "
            "expected a 1-D tensor whose length is a multiple of group_size"
        )
    return rewards.reshape(-1, group_size)


def zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[N / group_size] bool: the groups whose rewards are all equal (their advantages are all zero). A NaN reward
    (a completion no reward function scored) takes no part: a group with one scored completion or none is all
    equal.

    >>> zero_std_groups(torch.tensor([1.0, 0.0, 1.0, float("nan"), float("nan"), float("nan")]), 2).tolist()
    [False, True, True]
    """
    groups = as_groups(rewards, group_size)
    scored = ~groups.isnan()
    return torch.where(scored, groups, -torch.inf).amax(-1) <= torch.where(scored, groups, torch.inf).amin(-1)


def frac_zero_std(rewards: Tensor, group_size: int) -> Tensor:
    """Fraction of groups whose rewards are all equal (their advantages are all zero)."""
    return zero_std_groups(rewards, group_size).float().mean()


def micro_slices(rows: int, size: int | None) -> list[slice]:
    """Row slices of at most `size` rows (None: one slice of all).

    >>> micro_slices(5, 2), micro_slices(4, None)
    ([slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)], [slice(0, 4, None)])
    """
    size = rows if size is None else size
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)] or [slice(0, 0)]
