"""A mini-batch in micro-batches (train.micro_batch_size): the loss weights that make the accumulated gradient the
mini-batch's, and the metrics of the micro-batches combined into the mini-batch's.

Every aggregation is Σ terms / D with a count D that adds up over rows (`denominator`), so with D_m the count of
micro-batch m and D = Σ_m D_m, Σ_m (D_m / D) loss_m = Σ_m S_m / D = the mini-batch's loss, and the gradients
accumulated from (D_m / D) loss_m are the mini-batch's gradient: exactly, up to float rounding. Normalising each
micro-batch by its own count instead (the classic bug) weighs a short micro-batch's tokens more. The entropy bonus
c · H̄ is a token mean whatever the aggregation, so its part of loss_m is weighted by N_m / N, the micro-batch's
share of the valid tokens, instead (`weighted_loss`).

Metrics combine by what they are: a token mean weighted by the micro-batches' valid tokens, a sequence mean
by their valid rows, a loss by D_m / D, a count by summing, */max and */min by max and min; is/ess, a ratio of
token means, and loss/total with an entropy bonus are rebuilt from the combined parts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lab.objectives.rollout_correction import SEQUENCE_CORRECTIONS

# means over valid rows (objectives.base, objectives.rollout_correction)
ROW_MEANS = ("clip/seq_frac", "ratio/seq/mean", "is/chi2_seq", "is/ppl_ratio", "off_policy/masked_frac")
SUMS = ("mask/empty_rows", "mask/valid_tokens")
AGGREGATED = ("loss/policy", "loss/total", "kl/ref")  # aggregated like the loss: weight D_m / D


def denominator(objective, mask: Tensor) -> Tensor:
    """The objective's aggregation count D of a batch with this mask (float64); ValueError for an aggregation
    without `denominator` (a user's), which cannot be split into micro-batches."""
    count = getattr(objective.aggregation, "denominator", None)
    if count is None:
        raise ValueError(f"train.micro_batch_size: the aggregation {type(objective.aggregation).__name__} of "
                         f"{objective.label} has no denominator(mask), the count its sum is divided by, so a "
                         "mini-batch cannot be split into micro-batches exactly; add one, or set "
                         "train.micro_batch_size=null")
    return count(mask)


def check_splittable(objective) -> None:
    """At plan time, with train.micro_batch_size set: raise the `denominator` error, or refuse a surrogate that
    selects tokens over the whole mini-batch (`whole_batch`: Clip-Cov, KL-Cov) or a top-entropy mask
    (objective.top_entropy_quantile < 1), as micro-batches select others."""
    surrogate = getattr(objective, "surrogate", None)
    if getattr(surrogate, "whole_batch", False):
        raise ValueError(f"train.micro_batch_size is set, but objective={objective.label} "
                         f"({type(surrogate).__name__}) selects tokens by their covariance over the whole mini-batch "
                         "(objective.surrogate.select_frac of its valid tokens), which micro-batches cannot "
                         "reproduce; set train.micro_batch_size=null or choose another objective")
    if getattr(objective, "top_entropy_quantile", 1.0) < 1:
        raise ValueError(f"objective.top_entropy_quantile={objective.top_entropy_quantile!r} is invalid with "
                         "train.micro_batch_size set: the policy loss keeps the tokens whose entropy is in the top "
                         "quantile of one forward's tokens (TRL: of its micro-batch), so micro-batches would keep "
                         "other tokens than their mini-batch and the update would depend on a memory setting; set "
                         "train.micro_batch_size=null")
    if getattr(objective.aggregation, "denominator", None) is None:
        denominator(objective, torch.ones(1, 1))


def weighted_loss(out, share: Tensor, token_share: Tensor) -> Tensor:
    """A micro-batch's part of its mini-batch's loss, from its ObjectiveOutput: the aggregated terms × D_m / D
    (`share`), and the entropy bonus c · H̄_m, a token mean, × N_m / N (`token_share`), so that the parts add up
    to the mini-batch's c · H̄."""
    share = share.to(out.loss.dtype)
    if out.entropy_bonus is None:
        return out.loss * share
    return (out.loss + out.entropy_bonus) * share - out.entropy_bonus * token_share.to(out.loss.dtype)


def metric_kind(objective, key: str) -> str:
    """max, min, sum, aggregated, rows or tokens: how micro-batches' values of `key` make the mini-batch's."""
    if key.endswith("/max"):
        return "max"
    if key.endswith("/min"):
        return "min"
    if key in SUMS:
        return "sum"
    if key in AGGREGATED:
        return "aggregated"
    sequence_correction = getattr(objective, "rollout_correction", "none") in SEQUENCE_CORRECTIONS
    if key in ROW_MEANS or (sequence_correction and key in ("is/capped_frac", "is/masked_frac")):
        return "rows"  # a sequence-level correction counts each sequence once
    return "tokens"


def combine(objective, parts: list[tuple[dict[str, float], float, float, float]]) -> dict[str, float]:
    """Micro-batches' (metrics, valid tokens, valid rows, D_m / D) -> the mini-batch's metrics. A micro-batch
    without a valid token reports placeholders (ratio 1 on-policy values): it counts in no mean, max or min."""
    if len(parts) == 1:
        return dict(parts[0][0])
    combined = {}
    for key in parts[0][0]:
        kind = metric_kind(objective, key)
        values = [(metrics[key], tokens, rows, share) for metrics, tokens, rows, share in parts]
        with_data = [v for v in values if v[1] > 0] or values
        if kind in ("max", "min"):
            combined[key] = (max if kind == "max" else min)(v[0] for v in with_data)
        elif kind == "sum":
            combined[key] = sum(v[0] for v in values)
        elif kind == "aggregated":
            combined[key] = sum(v[0] * v[3] for v in values)
        else:
            weights = [v[1] if kind == "tokens" else v[2] for v in values]
            total = sum(weights)
            combined[key] = sum(v[0] * w for v, w in zip(values, weights)) / total if total else values[0][0]
    if "is/ess" in combined:
        combined["is/ess"] = effective_sample_size(parts, combined["is/weight_mean"])
    if "loss/entropy_bonus" in combined:  # the aggregated part by D_m / D, the bonus (a token mean) by tokens
        aggregated = sum((metrics["loss/total"] + metrics["loss/entropy_bonus"]) * share
                         for metrics, _, _, share in parts)
        combined["loss/total"] = aggregated - combined["loss/entropy_bonus"]
    return combined


def effective_sample_size(parts: list[tuple[dict[str, float], float, float, float]], weight_mean: float) -> float:
    """The mini-batch's is/ess = m1² / m2 (m1, m2: token means of the weights and of their squares) from the micro-
    batches': each one's m2 is m1_m² / ess_m (0 where all its weights are 0), then m2 is their token mean."""
    tokens = sum(part[1] for part in parts)
    square_sum = sum(metrics["is/weight_mean"] ** 2 / metrics["is/ess"] * count
                     for metrics, count, _, _ in parts if metrics["is/ess"] > 0)
    return weight_mean**2 / (square_sum / tokens) if square_sum > 0 else 0.0


def micro_slices(rows: int, size: int | None) -> list[slice]:
    """Row slices of at most `size` rows (None: one slice of all).

    >>> micro_slices(5, 2), micro_slices(4, None)
    ([slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)], [slice(0, 4, None)])
    """
    size = rows if size is None else size
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)] or [slice(0, 0)]
