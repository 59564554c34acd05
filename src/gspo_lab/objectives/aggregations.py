"""The aggregation axis: per-token loss terms [B, T] -> the scalar loss (verl's `agg_loss`, kept apart from the
surrogates as there). Padding never counts; rows without a valid token are left out of every count of
sequences, as verl's `agg_loss` does (TRL's grpo, sapo, dr_grpo, luspo and GMPO count them in B; an empty row
carries no data, so it must not shrink the loss).

    SeqMeanTokenMean    (1/B) Σ_i (1/|y_i|) Σ_t ℓ_i,t    GRPO, GSPO, SAPO, GMPO   (verl seq-mean-token-mean)
    TokenMean           Σ_i,t ℓ_i,t / Σ_i |y_i|          DAPO, CISPO, VESPO       (verl token-mean)
    ConstantNormaliser  Σ_i,t ℓ_i,t / (B · max_len)      Dr. GRPO                 (TRL dr_grpo)
    SeqMeanTokenSum     (1/B) Σ_i |y_i| · (1/|y_i|) Σ_t ℓ_i,t = (1/B) Σ_i,t ℓ_i,t, the length-weighted
                        sequence mean                    LUSPO                    (verl seq-mean-token-sum)

B counts the rows with at least one valid token. The token means run over the mini-batch the objective is
given, which is one optimizer step here (TRL's dapo divides by the tokens of the whole accumulated batch).

Each aggregation is a sum divided by a count that adds up over rows (`denominator(mask)`: valid tokens, valid
rows, or valid rows x max_len), so a mini-batch split into micro-batches (train.micro_batch_size) gets exactly
its loss back as Σ_m loss_m · denominator_m / denominator (gspo_lab.objectives.micro_batches).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gspo_lab.objectives.interface import MaskedBatch
from gspo_lab.tensors import masked_mean


@dataclass(frozen=True)
class SeqMeanTokenMean:
    """Mean over the tokens of each sequence, then mean over sequences (GRPO and GSPO papers)."""

    def __call__(self, per_token: Tensor, batch: MaskedBatch) -> Tensor:
        per_sequence = masked_mean(per_token, batch.mask, dim=-1)  # [B]
        return masked_mean(per_sequence, batch.valid_rows.to(per_sequence.dtype))

    def denominator(self, mask: Tensor) -> Tensor:
        return valid_rows(mask)  # B


@dataclass(frozen=True)
class TokenMean:
    """Mean over every valid token of the batch: a long sequence weighs more (DAPO, arXiv 2503.14476)."""

    def __call__(self, per_token: Tensor, batch: MaskedBatch) -> Tensor:
        return masked_mean(per_token, batch.mask)  # Σ_i,t ℓ_i,t / Σ_i |y_i|

    def denominator(self, mask: Tensor) -> Tensor:
        return mask.bool().sum().double()  # Σ_i |y_i|


@dataclass(frozen=True)
class ConstantNormaliser:
    """Dr. GRPO's constant normaliser (arXiv 2503.20783): Σ_i,t ℓ_i,t / (B × max_len).

    Args:
        max_len: the constant T, normally the generation budget (`${rollout.max_new_tokens}`); None uses the
            mask's width (then extra padded columns change the loss).
    """

    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_len is not None and not self.max_len >= 1:
            raise ValueError(f"ConstantNormaliser: objective.aggregation.max_len={self.max_len!r} must be >= 1 or null")

    def __call__(self, per_token: Tensor, batch: MaskedBatch) -> Tensor:
        width = self.max_len if self.max_len is not None else batch.mask.shape[-1]
        rows = batch.valid_rows.sum().clamp(min=1)
        return (per_token * batch.mask).sum() / (rows * width)  # Dr. GRPO: Σ_i,t terms / (B · T)

    def denominator(self, mask: Tensor) -> Tensor:
        return valid_rows(mask) * (self.max_len if self.max_len is not None else mask.shape[-1])  # B · T


@dataclass(frozen=True)
class SeqMeanTokenSum:
    """LUSPO's length-weighted sequence mean (arXiv 2602.05261): each sequence's mean term times |y_i|, then the
    mean over sequences, which is the sum of its token terms averaged over sequences. With GSPO's sequence
    ratio this undoes the 1/|y_i| that biases GSPO against long answers."""

    def __call__(self, per_token: Tensor, batch: MaskedBatch) -> Tensor:
        per_sequence = (per_token * batch.mask).sum(-1)  # |y_i| · (1/|y_i|) Σ_t ℓ_i,t  [B]
        return masked_mean(per_sequence, batch.valid_rows.to(per_sequence.dtype))

    def denominator(self, mask: Tensor) -> Tensor:
        return valid_rows(mask)  # B


def valid_rows(mask: Tensor) -> Tensor:
    """Rows with at least one valid token (the B of every sequence mean), as a float64 count. mask [B, T] -> []"""
    return mask.bool().any(-1).sum().double()
