"""The objective interface shared by GSPO, GSPO-token and GRPO.

An objective is a pure function of tensors: `obj(logp, old_logp, advantages, mask)` returns an
`ObjectiveOutput` holding the scalar loss to minimise and detached, namespaced metrics. It never touches
trainer state. Subclasses only say how the per-token importance ratio is built (`token_ratio`) and how
per-token terms are reduced to one loss (`aggregate`); clipping, the KL penalty, masking, dtype promotion
and the metrics live here, once.

Shapes: B sequences, T completion positions.
    logp, old_logp  [B, T]  log-probs of the sampled completion tokens (logp carries the gradient)
    advantages      [B] or [B, T]
    mask            [B, T]  1 on completion tokens, 0 on padding
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from gspo_lab.objectives.rollout_correction import CORRECTIONS, correction_weights


class NonFiniteLossError(FloatingPointError):
    """Raised when an objective's loss is NaN or infinite; the message names the objective."""


@dataclass(frozen=True)
class ObjectiveOutput:
    loss: Tensor  # [] scalar to minimise
    metrics: dict[str, Tensor]  # detached 0-dim tensors, names like "clip/frac"


@dataclass(frozen=True)
class MaskedBatch:
    """Inputs after validation: compute dtype, padding zeroed, advantages broadcast to [B, T]."""

    logp: Tensor  # [B, T]
    old_logp: Tensor  # [B, T]
    advantages: Tensor  # [B, T]
    mask: Tensor  # [B, T] float, 1 on valid tokens
    lengths: Tensor  # [B] valid tokens per row
    valid_rows: Tensor  # [B] bool, rows with at least one valid token


@dataclass(frozen=True)
class Ratio:
    """What `token_ratio` returns: the ratio used in the surrogate and the values reported as ratio/*."""

    per_token: Tensor  # [B, T] ratio entering min(r A, clip(r) A)
    reported: Tensor  # [N] sequence ratios (GSPO) or token ratios (GRPO) of valid rows/tokens
    clamp_fired: Tensor  # [N] bool, where the optional log-ratio clamp changed a value


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is 1; an all-zero mask gives 0 instead of NaN."""
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def k3(logp: Tensor, other_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(π_other || π) on samples from π_other: r - 1 - log r, r = π / π_other."""
    log_r = logp - other_logp
    return torch.exp(log_r) - 1 - log_r


class Objective(ABC):
    """Clipped importance-weighted policy-gradient objective with an optional k3 KL penalty.

    Args:
        clip_low: the ratio is clipped below at 1 - clip_low (0 < clip_low < 1).
        clip_high: the ratio is clipped above at 1 + clip_high (> 0).
        beta: coefficient of the k3 KL penalty to a reference policy; 0 needs no reference.
        log_ratio_clamp: clamp the log-ratio entering exp() to [-c, c]; None (default) keeps it exact.
        rollout_correction: "none", or how each policy-loss term is weighted for the rollout engine's mismatch
            to the trainer (gspo_lab.objectives.rollout_correction): tis_token, tis_seq, mis_token, mis_seq.
        rollout_correction_cap: C, the cap of those weights (> 1).
    """

    name = "objective"

    def __init__(
        self,
        clip_low: float,
        clip_high: float,
        beta: float = 0.0,
        log_ratio_clamp: float | None = None,
        rollout_correction: str = "none",
        rollout_correction_cap: float = 2.0,
    ) -> None:
        prefix = type(self).__name__
        if not 0 < clip_low < 1:
            raise ValueError(f"{prefix}: objective.clip_low={clip_low!r} must satisfy 0 < clip_low < 1")
        if not clip_high > 0:
            raise ValueError(f"{prefix}: objective.clip_high={clip_high!r} must be > 0")
        if not beta >= 0:
            raise ValueError(f"{prefix}: objective.beta={beta!r} must be >= 0")
        if log_ratio_clamp is not None and not log_ratio_clamp > 0:
            raise ValueError(f"{prefix}: objective.log_ratio_clamp={log_ratio_clamp!r} must be > 0 or null")
        if rollout_correction not in CORRECTIONS:
            raise ValueError(f"{prefix}: objective.rollout_correction={rollout_correction!r} must be one of {list(CORRECTIONS)}")
        if not rollout_correction_cap > 1:
            raise ValueError(f"{prefix}: objective.rollout_correction_cap={rollout_correction_cap!r} must be > 1")
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)
        self.beta = float(beta)
        self.log_ratio_clamp = log_ratio_clamp
        self.rollout_correction, self.rollout_correction_cap = rollout_correction, float(rollout_correction_cap)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    @abstractmethod
    def token_ratio(self, batch: MaskedBatch) -> Ratio:
        """The importance ratio of every token, as this objective defines it."""

    def aggregate(self, per_token: Tensor, batch: MaskedBatch) -> Tensor:
        """Mean over the tokens of each sequence, then mean over sequences (empty rows left out)."""
        per_sequence = masked_mean(per_token, batch.mask, dim=-1)  # [B]
        return masked_mean(per_sequence, batch.valid_rows.to(per_sequence.dtype))

    def clamp_log_ratio(self, log_ratio: Tensor) -> tuple[Tensor, Tensor]:
        """Apply the optional clamp; returns the clamped log-ratio and where it fired."""
        if self.log_ratio_clamp is None:
            return log_ratio, torch.zeros_like(log_ratio, dtype=torch.bool)
        c = self.log_ratio_clamp
        return log_ratio.clamp(-c, c), log_ratio.detach().abs() > c

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        ref_logp: Tensor | None = None,
        rollout_logp: Tensor | None = None,
    ) -> ObjectiveOutput:
        batch = self._prepare(logp, old_logp, advantages, mask)
        ratio = self.token_ratio(batch)
        r, adv = ratio.per_token, batch.advantages  # [B, T]
        clipped_r = r.clamp(1 - self.clip_low, 1 + self.clip_high)
        # J = min(r A, clip(r, 1-ε_low, 1+ε_high) A); the loss is its negation
        per_token = -torch.minimum(r * adv, clipped_r * adv)  # [B, T]
        metrics: dict[str, Tensor] = {}
        if self.rollout_correction != "none":
            if rollout_logp is None:
                raise ValueError(f"{type(self).__name__}: objective.rollout_correction={self.rollout_correction!r} "
                                 "needs rollout_logp (the engine's log-probs)")
            engine = torch.where(batch.mask.bool(), rollout_logp.to(batch.logp.dtype), 0.0)
            weights, is_metrics = correction_weights(batch.old_logp, engine, batch.mask, self.rollout_correction,
                                                     self.rollout_correction_cap)
            per_token = per_token * weights  # each term × sg[w]: the engine sampled, π_old is the trainer's
            metrics.update(is_metrics)
        policy_loss = self.aggregate(per_token, batch)
        loss = policy_loss
        metrics["loss/policy"] = policy_loss
        if self.beta > 0:
            if ref_logp is None:
                raise ValueError(f"{type(self).__name__}: objective.beta={self.beta} > 0 needs ref_logp")
            ref = torch.where(batch.mask.bool(), ref_logp.to(batch.logp.dtype), 0.0)
            kl_ref = k3(ref, batch.logp)  # [B, T] k3 of KL(π_θ || π_ref), samples from π_θ
            kl_penalty = self.aggregate(kl_ref, batch)
            loss = loss + self.beta * kl_penalty
            metrics["kl/ref"] = kl_penalty
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"{type(self).__name__}: the loss is {loss.item()} (non-finite); "
                "check the log-probs for NaN/inf or set objective.log_ratio_clamp"
            )
        metrics.update(self._metrics(batch, ratio))
        metrics["loss/total"] = loss
        return ObjectiveOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})

    def _prepare(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> MaskedBatch:
        name = type(self).__name__
        if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
            raise ValueError(
                f"{name}: logp, old_logp and mask must share one [B, T] shape; got "
                f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
            )
        if advantages.shape not in (logp.shape[:1], logp.shape):
            raise ValueError(
                f"{name}: advantages must be [B] or [B, T] = {tuple(logp.shape)}; got {tuple(advantages.shape)}"
            )
        dtype = torch.promote_types(logp.dtype, torch.float32)  # at least float32, float64 stays float64
        valid = mask.bool()
        zero = torch.zeros((), dtype=dtype, device=logp.device)
        # padding may hold anything (even NaN); zero it so it cannot leak into sums or gradients
        logp = torch.where(valid, logp.to(dtype), zero)
        old_logp = torch.where(valid, old_logp.to(dtype), zero)
        adv = advantages.to(dtype)
        adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
        adv = torch.where(valid, adv, zero)
        fmask = valid.to(dtype)
        lengths = fmask.sum(-1)
        return MaskedBatch(logp, old_logp, adv, fmask, lengths, lengths > 0)

    def _metrics(self, batch: MaskedBatch, ratio: Ratio) -> dict[str, Tensor]:
        with torch.no_grad():
            r, adv, mask = ratio.per_token.detach(), batch.advantages, batch.mask
            low = ((r < 1 - self.clip_low) & (adv < 0)).to(mask.dtype)  # clipped branch binds below
            high = ((r > 1 + self.clip_high) & (adv > 0)).to(mask.dtype)  # ... and above
            either = low + high
            rows = batch.valid_rows.to(mask.dtype)
            reported, fired = ratio.reported.detach(), ratio.clamp_fired.to(mask.dtype)
            if reported.numel() == 0:  # no valid token at all: report the on-policy values
                reported, fired = mask.new_ones(1), mask.new_zeros(1)
            return {
                "clip/frac": masked_mean(either, mask),
                "clip/frac_low": masked_mean(low, mask),
                "clip/frac_high": masked_mean(high, mask),
                "clip/seq_frac": masked_mean(masked_mean(either, mask, dim=-1), rows),
                "ratio/mean": reported.mean(),
                "ratio/min": reported.min(),
                "ratio/max": reported.max(),
                "ratio/clamp_frac": fired.mean(),
                "kl/old": masked_mean(k3(batch.logp.detach(), batch.old_logp), mask),
                "mask/empty_rows": (~batch.valid_rows).sum().to(mask.dtype),
                "mask/valid_tokens": mask.sum(),
            }
