"""What an objective's three axes exchange (gspo_lab.objectives.base puts them together): the validated batch
(`MaskedBatch`), what a ratio axis returns (`Ratio`), each axis's call signature, the objective's output, and the
checks and clip/* metrics every axis shares.

Shapes: B sequences, T completion positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from gspo_lab.tensors import masked_mean


@dataclass(frozen=True)
class ObjectiveOutput:
    loss: Tensor  # [] scalar to minimise
    metrics: dict[str, Tensor]  # detached 0-dim tensors, names like "clip/frac"
    # [] c · H̄, the entropy bonus already subtracted from `loss` (with its gradient), or None: a token mean, which
    # a micro-batch weights by its share of the tokens, not of the aggregation's count (objectives/micro_batches.py)
    entropy_bonus: Tensor | None = None


@dataclass(frozen=True)
class MaskedBatch:
    """Inputs after validation: compute dtype, padding zeroed, advantages broadcast to [B, T]."""

    logp: Tensor  # [B, T]
    old_logp: Tensor  # [B, T]
    advantages: Tensor  # [B, T]
    mask: Tensor  # [B, T] float, 1 on valid tokens
    lengths: Tensor  # [B] valid tokens per row
    valid_rows: Tensor  # [B] bool, rows with at least one valid token
    # [B, T] long, multi-turn: t >= 1 on the model's tokens of its turn t, 0 elsewhere; None: one turn per row
    turns: Tensor | None = None


@dataclass(frozen=True)
class Ratio:
    """What a ratio axis returns: the ratio used in the surrogate, and where its clamp fired."""

    per_token: Tensor  # [B, T] ratio entering the surrogate
    clamp_fired: Tensor  # [B, T] bool, tokens whose ratio the optional log-ratio clamp changed (a sequence's: all)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # a ratio that clips itself (GMPO) reports clip/*


class RatioAxis(Protocol):
    def __call__(self, batch: MaskedBatch) -> Ratio:
        """The importance ratio of every token, as this axis defines it."""


class SurrogateAxis(Protocol):
    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-token loss terms [B, T] (to minimise) from the ratio [B, T], and the surrogate's own metrics."""


class AggregationAxis(Protocol):
    def __call__(self, per_token: Tensor, batch: MaskedBatch) -> Tensor:
        """Per-token terms [B, T] -> the scalar loss; padding and empty rows never count."""


def clip_fractions(low: Tensor, high: Tensor, batch: MaskedBatch) -> dict[str, Tensor]:
    """The clip/* metrics from where the clip binds below and above (bool [B, T]), for every clipping axis."""
    mask = batch.mask
    low, high = low.to(mask.dtype), high.to(mask.dtype)
    either = low + high
    rows = batch.valid_rows.to(mask.dtype)
    return {
        "clip/frac": masked_mean(either, mask),
        "clip/frac_low": masked_mean(low, mask),
        "clip/frac_high": masked_mean(high, mask),
        # sequences where the clip binds on any token: for GSPO (all tokens or none) the clipped sequences
        "clip/seq_frac": masked_mean((masked_mean(either, mask, dim=-1) > 0).to(mask.dtype), rows),
    }


def check_positive(where: str, **values: float) -> None:
    """Each value > 0, else a ValueError naming `where`.key, the value and the rule."""
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{where}.{key}={value!r} must be > 0")
