"""Clip-Cov and KL-Cov: the surrogates of The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models (Cui et al., arXiv 2505.22617), which restrain the few tokens that drive the entropy down.

Under the policy gradient, a softmax policy's entropy moves by about minus the covariance between a token's
log-prob and its advantage; both surrogates pick tokens of large covariance among the mini-batch's N valid tokens:
    cov_i,t = (A_i,t - mean A) (log π_θ(y_i,t) - mean log π_θ)      means over the valid tokens, detached
    ClipCov  PPO's clipped term, set to 0 (no loss, no gradient) on max(⌊select_frac · N⌋, 1) tokens drawn at
             random among the unclipped tokens with cov_low < cov < cov_high
    KLCov    -r A on every token (no clip), plus kl_coef |log r| on the max(⌊select_frac · N⌋, 1) tokens of
             largest cov

Both are verl's `clip_cov` and `kl_cov` (verl-project/verl 0.10.0.dev, commit 1dda039, verl/trainer/ppo/
core_algos.py; the same as the authors' PRIME-RL/Entropy-Mechanism-of-RL, commit 8850579, whose k_percent is a
percentage where verl's kl_cov_ratio and select_frac here are fractions). Clip-Cov draws from torch's global
generator (`torch.randperm` on the CPU), as verl does, so a seeded run repeats its draws. The YAMLs hold the
authors' 7B recipe (recipe/dapo/7b_clip_cov.sh, 7b_kl_cov.sh): Clip-Cov with the ratio clip widened to [0, 2];
KL-Cov with select_frac 2e-3 and kl_coef 1 (verl's config defaults, 2e-4 and 0.1, are nearer the 32B recipe).

The selection is over the whole mini-batch the objective is given (verl selects within each of its
micro-batches): micro-batches would select other tokens, so the plan refuses train.micro_batch_size with these
(`whole_batch`; objectives/micro_batches.py). Metrics: cov/mean, the covariance of A and log π over the valid
tokens (the driver of the entropy change); cov/selected_frac, the valid tokens selected; Clip-Cov adds
cov/candidate_frac (the tokens it draws from) and clip/* for its ratio clip. The selection does not depend on
the ratio, so it selects on-policy too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from gspo_lab.objectives.interface import MaskedBatch, check_positive, clip_fractions
from gspo_lab.tensors import masked_mean
from gspo_lab.objectives.surrogates import clipped_min


def token_covariance(batch: MaskedBatch) -> Tensor:
    """cov_i,t = (A_i,t - mean A)(log π_i,t - mean log π), means over the valid tokens; detached, [B, T]."""
    mask, adv, logp = batch.mask, batch.advantages, batch.logp.detach()
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


def selection_size(select_frac: float, valid: Tensor) -> int:
    """max(⌊select_frac · N⌋, 1) for the N valid tokens of bool [B, T] (verl's int(ratio · N), at least one)."""
    return max(int(select_frac * valid.sum().item()), 1)


def check_select_frac(where: str, select_frac: float) -> None:
    if not 0 < select_frac <= 1:
        raise ValueError(f"{where}.select_frac={select_frac!r} must be in (0, 1]")


def draw(candidates: Tensor, count: int) -> Tensor:
    """`count` of the candidates (bool [B, T]; all of them if fewer), uniformly without replacement, as verl draws
    them: torch.randperm on the global CPU generator over the candidates in row-major order. -> bool [B, T]"""
    where = torch.nonzero(candidates)  # [n, 2] (row, column), row-major
    selected = torch.zeros_like(candidates)
    if len(where) > 0:  # verl draws nothing when there is no candidate
        chosen = where[torch.randperm(len(where))[:count].to(where.device)]
        selected[chosen[:, 0], chosen[:, 1]] = True
    return selected


@dataclass(frozen=True)
class ClipCov:
    """Clip-Cov: PPO's clipped term -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), times 0 on
    max(⌊select_frac · N⌋, 1) tokens drawn at random among the valid, unclipped tokens with
    cov_low < cov < cov_high (verl's `clip_cov`; module docstring).

    Args:
        clip_low, clip_high: the ratio clip (0 < clip_low <= 1, clip_high > 0); the recipe's 1 and 1 leave
            [0, 2], so the covariance clip does the work.
        select_frac: the fraction of valid tokens set to 0 (verl's clip_cov_ratio, the paper's r), in (0, 1].
        cov_low, cov_high: the open band of covariances drawn from (verl's clip_cov_lb and clip_cov_ub).
    """

    clip_low: float = 1.0
    clip_high: float = 1.0
    select_frac: float = 2e-4
    cov_low: float = 1.0
    cov_high: float = 5.0
    whole_batch: ClassVar[bool] = True  # selects over the whole mini-batch: no micro-batches

    def __post_init__(self) -> None:
        if not 0 < self.clip_low <= 1:
            raise ValueError(f"ClipCov: objective.surrogate.clip_low={self.clip_low!r} must satisfy 0 < clip_low <= 1")
        check_positive("ClipCov: objective.surrogate", clip_high=self.clip_high)
        check_select_frac("ClipCov: objective.surrogate", self.select_frac)
        if not self.cov_low < self.cov_high:
            raise ValueError(f"ClipCov: objective.surrogate.cov_low={self.cov_low!r} must be below "
                             f"cov_high={self.cov_high!r}")

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        valid = batch.mask.bool()
        per_token, low, high = clipped_min(ratio, batch.advantages, self.clip_low, self.clip_high)  # [B, T]
        with torch.no_grad():
            cov = token_covariance(batch)  # [B, T]
            in_band = (cov > self.cov_low) & (cov < self.cov_high)
            candidates = valid & ~(low | high) & in_band  # verl leaves the tokens its ratio clip binds on alone
            selected = draw(candidates, selection_size(self.select_frac, valid))
        per_token = per_token * (~selected).to(per_token.dtype)  # a product, as verl: a NaN term stays NaN
        with torch.no_grad():
            metrics = clip_fractions(low, high, batch)
            metrics.update(cov_metrics(cov, selected, batch))
            metrics["cov/candidate_frac"] = masked_mean(candidates.to(cov.dtype), batch.mask)
        return per_token, metrics


@dataclass(frozen=True)
class KLCov:
    """KL-Cov: -r A on every token, plus kl_coef |log π_θ/π_old| on the max(⌊select_frac · N⌋, 1) valid tokens of
    largest cov (verl's `kl_cov`; module docstring). No ratio clip: the penalty is the trust region.

    Args:
        select_frac: the fraction of valid tokens penalised (verl's kl_cov_ratio, the paper's k), in (0, 1].
        kl_coef: β > 0 of the penalty (verl's ppo_kl_coef).
    """

    select_frac: float = 2e-3
    kl_coef: float = 1.0
    whole_batch: ClassVar[bool] = True  # selects over the whole mini-batch: no micro-batches

    def __post_init__(self) -> None:
        check_select_frac("KLCov: objective.surrogate", self.select_frac)
        check_positive("KLCov: objective.surrogate", kl_coef=self.kl_coef)

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        valid = batch.mask.bool()
        with torch.no_grad():
            cov = token_covariance(batch)  # [B, T]
            selected = torch.zeros_like(valid)
            if valid.any():
                ranked = torch.where(valid, cov, -torch.inf).flatten()  # [B·T], padding ranked last
                selected.view(-1)[torch.topk(ranked, selection_size(self.select_frac, valid)).indices] = True
        abs_log_ratio = (batch.logp - batch.old_logp).abs()  # |log r| of each token, whatever the ratio axis
        per_token = -ratio * batch.advantages + self.kl_coef * abs_log_ratio * selected  # [B, T]
        return per_token, cov_metrics(cov, selected, batch)


def cov_metrics(cov: Tensor, selected: Tensor, batch: MaskedBatch) -> dict[str, Tensor]:
    """cov/mean (Cov(A, log π) over the valid tokens) and cov/selected_frac, from the detached cov [B, T]."""
    return {"cov/mean": masked_mean(cov, batch.mask),
            "cov/selected_frac": masked_mean(selected.to(cov.dtype), batch.mask)}
