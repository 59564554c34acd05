"""A mini-batch in micro-batches (train.micro_batch_size): the loss weights that make the accumulated gradient the
mini-batch's (the micro-batches' metrics combine in gspo_lab.step.metrics).

Every aggregation is Σ terms / D with a count D that adds up over rows (`denominator`), so with D_m the count of
micro-batch m and D = Σ_m D_m, Σ_m (D_m / D) loss_m = Σ_m S_m / D = the mini-batch's loss, and the gradients
accumulated from (D_m / D) loss_m are the mini-batch's gradient: exactly, up to float rounding. Normalising each
micro-batch by its own count instead (the classic bug) weighs a short micro-batch's tokens more. The entropy bonus
c · H̄ is a token mean whatever the aggregation, so its part of loss_m is weighted by N_m / N, the micro-batch's
share of the valid tokens, instead (`weighted_loss`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def denominator(objective, mask: Tensor, key: str = "train.micro_batch_size") -> Tensor:
    """The objective's aggregation count D of a batch with this mask (float64); ValueError for an aggregation
    without `denominator` (a user's), which cannot be split into micro-batches."""
    count = getattr(objective.aggregation, "denominator", None)
    if count is None:
        raise ValueError(f"{key}: the aggregation {type(objective.aggregation).__name__} of "
                         f"{objective.label} has no denominator(mask), the count its sum is divided by, so a "
                         f"mini-batch cannot be split into micro-batches exactly; add one, or set {key}=null")
    return count(mask)


def check_splittable(objective, key: str = "train.micro_batch_size") -> None:
    """At plan time, with `key` (train.micro_batch_size or train.micro_batch_tokens) set: raise the `denominator`
    error, or refuse a surrogate that selects tokens over the whole mini-batch (`whole_batch`: Clip-Cov, KL-Cov) or
    a top-entropy mask (objective.top_entropy_quantile < 1), as micro-batches select others."""
    surrogate = getattr(objective, "surrogate", None)
    if getattr(surrogate, "whole_batch", False):
        raise ValueError(f"{key} is set, but objective={objective.label} "
                         f"({type(surrogate).__name__}) selects tokens by their covariance over the whole mini-batch "
                         "(objective.surrogate.select_frac of its valid tokens), which micro-batches cannot "
                         f"reproduce; set {key}=null or choose another objective")
    if getattr(objective, "top_entropy_quantile", 1.0) < 1:
        raise ValueError(f"objective.top_entropy_quantile={objective.top_entropy_quantile!r} is invalid with "
                         f"{key} set: the policy loss keeps the tokens whose entropy is in the top "
                         "quantile of one forward's tokens (TRL: of its micro-batch), so micro-batches would keep "
                         "other tokens than their mini-batch and the update would depend on a memory setting; set "
                         f"{key}=null")
    if getattr(objective.aggregation, "denominator", None) is None:
        denominator(objective, torch.ones(1, 1), key)


def weighted_loss(out, share: Tensor, token_share: Tensor) -> Tensor:
    """A micro-batch's part of its mini-batch's loss, from its ObjectiveOutput: the aggregated terms × D_m / D
    (`share`), and the entropy bonus c · H̄_m, a token mean, × N_m / N (`token_share`), so that the parts add up
    to the mini-batch's c · H̄."""
    share = share.to(out.loss.dtype)
    if out.entropy_bonus is None:
        return out.loss * share
    return (out.loss + out.entropy_bonus) * share - out.entropy_bonus * token_share.to(out.loss.dtype)


