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


def turn_mean(values: Tensor, turns: Tensor, mask: Tensor) -> Tensor:
    """Each token's mean of `values` over the tokens of its turn ([B, T]; `turns` [B, T] long, t >= 1 on the
    model's tokens of turn t, 0 elsewhere; `mask` [B, T] float); 0 off the model's tokens.

    >>> turn_mean(torch.tensor([[1.0, 3.0, 9.0, 4.0]]), torch.tensor([[1, 1, 0, 2]]), torch.tensor([[1.0, 1, 0, 1]]))
    tensor([[2., 2., 0., 4.]])
    """
    mask = mask.to(values.dtype)
    slots = values.new_zeros(turns.shape[0], turns.shape[1] + 1)  # [B, T + 1]: a slot per turn number
    sums = slots.scatter_add(1, turns, values * mask)  # Σ_{t in turn k} values  [B, T + 1]
    counts = slots.scatter_add(1, turns, mask)  # |turn k|
    return (sums / counts.clamp(min=1)).gather(1, turns) * mask  # [B, T]


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


def after_tool_metrics(log_w: Tensor, turns: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Multi-turn: how the token ratio behaves on the model's first token after a tool result (the first token of
    each turn after the first) against all its tokens, as token means over the model's tokens, which combine
    exactly across micro-batches and ranks: turns/after_tool_frac (the share of those first tokens),
    ratio/after_tool/abs_log (|log w| summed over them, per model token; divided by turns/after_tool_frac it is
    their mean |log w|) and ratio/token/abs_log_mean (the mean |log w| of every model token).

    >>> turns = torch.tensor([[1, 1, 0, 2, 2]]); mask = (turns > 0).double()
    >>> m = after_tool_metrics(torch.tensor([[0.1, -0.1, 0.0, 0.4, 0.2]], dtype=torch.float64), turns, mask)
    >>> keys = ("turns/after_tool_frac", "ratio/after_tool/abs_log", "ratio/token/abs_log_mean")
    >>> [round(m[k].item(), 6) for k in keys]
    [0.25, 0.1, 0.2]
    """
    before = torch.nn.functional.pad(turns[:, :-1], (1, 0))  # [B, T] the turn of the position before (0: a tool's)
    first = ((turns > 1) & (before == 0)).to(mask.dtype) * mask  # [B, T]
    return {
        "turns/after_tool_frac": masked_mean(first, mask),
        "ratio/after_tool/abs_log": masked_mean(log_w.abs() * first, mask),
        "ratio/token/abs_log_mean": masked_mean(log_w.abs(), mask),
    }
