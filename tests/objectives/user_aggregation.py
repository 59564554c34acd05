"""A user's aggregation written before micro-batches existed: no `denominator`, so it cannot be split."""

from dataclasses import dataclass

from gspo_lab.objectives.base import MaskedBatch, masked_mean


@dataclass(frozen=True)
class SquaredMean:
    """(token mean)²: not a sum over rows divided by a count, so no micro-batch weights recover it."""

    def __call__(self, per_token, batch: MaskedBatch):
        return masked_mean(per_token, batch.mask) ** 2
