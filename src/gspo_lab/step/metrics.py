"""How every metric of an RL step combines, in one place: across the micro-batches of a mini-batch
(`combine_micro_batches`), across mini-batches (`combine`) and across ranks (`across_ranks`).

Within a mini-batch, metrics combine by what they are: a token mean weighted by the micro-batches' valid tokens, a
sequence mean by their valid rows, a loss by D_m / D (gspo_lab.objectives.micro_batches), a count by summing,
*/max and */min by max and min; is/ess, a ratio of token means, and loss/total with an entropy bonus are rebuilt
from the combined parts. Across mini-batches and ranks (`reduction`): */max by max, */min by min, the reward
functions' error and timeout counts by sum (each rank counts its own completions), else the mean.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from gspo_lab.objectives.rollout_correction import SEQUENCE_CORRECTIONS


# means over valid rows (objectives.base, objectives.rollout_correction)
ROW_MEANS = ("clip/seq_frac", "ratio/seq/mean", "is/chi2_seq", "is/ppl_ratio", "off_policy/masked_frac")


SUMS = ("mask/empty_rows", "mask/valid_tokens")


AGGREGATED = ("loss/policy", "loss/total", "kl/ref")  # aggregated like the loss: weight D_m / D


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
    if key == "behave/masked_frac" and getattr(getattr(objective, "ratio", None), "level", "token") == "sequence":
        return "rows"  # the decoupled loss's sequence-level weights: a share of sequences
    return "tokens"


def combine_micro_batches(objective, parts: list[tuple[dict[str, float], float, float, float]]) -> dict[str, float]:
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


def across_ranks(metrics: dict[str, float], strategy, device: torch.device) -> dict[str, float]:
    """Every rank's `metrics` (the same keys on each) reduced to one row by the Lightning `strategy`, each key as
    `reduction` says; collective: every rank calls it."""
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], device=device, dtype=torch.float64)  # [K]
    reduced = {
        "mean": strategy.reduce(values.clone(), reduce_op="mean"),
        "sum": strategy.reduce(values.clone(), reduce_op="sum"),
        "max": strategy.reduce(values.clone(), reduce_op=ReduceOp.MAX),
        "min": strategy.reduce(values.clone(), reduce_op=ReduceOp.MIN),
    }
    return {k: reduced[reduction(k)][i].item() for i, k in enumerate(keys)}


def reduction(key: str) -> str:
    """How a metric combines across mini-batches and ranks: */max by max, */min by min, the reward functions'
    error and timeout counts (reward/errors, reward/<name>/timeouts, ...; only in rollout metrics, so only across
    ranks) by sum, for each rank counts its own completions; else mean."""
    if key.endswith(("/max", "/min")):
        return key.rsplit("/", 1)[1]
    return "sum" if key.startswith("reward/") and key.endswith(("/errors", "/timeouts")) else "mean"


def combine(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per-mini-batch metrics -> the step's, one value each (see `reduction`)."""
    if not rows:
        return {}
    combined = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        kind = reduction(key)
        combined[key] = max(values) if kind == "max" else min(values) if kind == "min" else sum(values) / len(values)
    return combined


def add_round(metrics: dict[str, float], more: dict[str, float]) -> None:
    """A further sampling round's metrics into the step's: timings (time/*) add up over the rounds; every other
    value (the reward functions' running error counts) is the latest."""
    for key, value in more.items():
        metrics[key] = metrics.get(key, 0.0) + value if key.startswith("time/") else value


def reward_counts_across_ranks(rewards, strategy, world_size: int, device: torch.device) -> dict[str, dict]:
    """The reward functions' running error and timeout counts (`WeightedRewards.state_dict`) summed over the ranks,
    each of which counts its own completions, as they are logged, and the functions' own states (a judge's failures)
    as this rank holds them; collective: every rank calls it."""
    state = rewards.state_dict()
    if world_size == 1:
        return state
    counts = {kind: state[kind] for kind in ("errors", "timeouts")}  # the functions' own states: this rank's
    summed = across_ranks({f"reward/{name}/{kind}": float(n) for kind, named in counts.items()
                           for name, n in named.items()}, strategy, device)
    return dict(state, **{kind: {name: int(summed[f"reward/{name}/{kind}"]) for name in named}
                          for kind, named in counts.items()})


def rank_spread(model: torch.nn.Module, all_gather) -> float:
    """The largest difference of any parameter tensor's sum between ranks (0 where DDP keeps the replicas identical);
    `all_gather`: Lightning's (collective: every rank calls it)."""
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])  # [n_tensors]
    gathered = all_gather(sums)  # [world, n_tensors]
    return (gathered - gathered[0]).abs().max().item()
