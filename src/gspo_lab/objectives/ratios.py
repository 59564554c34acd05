"""The ratio axis: how the importance ratio of every token is built from log π_θ and log π_old.

    TokenRatio          w_i,t = π_θ(y_i,t) / π_old(y_i,t)                                GRPO, DAPO, CISPO, SAPO
    SequenceRatio       s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|) on every token            GSPO, LUSPO
                        (length_norm=false: the full product π_θ(y_i) / π_old(y_i))       VESPO
    SequenceTokenRatio  s_i,t = sg[s_i] · π_θ(y_i,t) / sg[π_θ(y_i,t)]                      GSPO-token
    GeometricMeanRatio  exp(mean_t clip_A(log w_i,t)), clipped on the trust-region side   GMPO
    TurnRatio           s_i,k = (π_θ(y_i,k) / π_old(y_i,k))^(1/|y_i,k|) on the tokens of turn k   GSPO per turn

Each is a frozen dataclass called as `ratio(batch) -> Ratio` (gspo_lab.objectives.base); its settings are
checked on construction, with the key under `objective.ratio`. Its `level` (token, sequence or turn) says what one
ratio covers; the decoupled correction's behaviour weight covers the same (objective.decoupled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from gspo_lab.objectives.interface import MaskedBatch, Ratio, check_positive, clip_fractions
from gspo_lab.tensors import turn_mean


def check_log_ratio_clamp(where: str, log_ratio_clamp: float | None) -> None:
    """`where` is how the message names the key's parent, e.g. "GSPO: objective"."""
    if log_ratio_clamp is not None and not log_ratio_clamp > 0:
        raise ValueError(f"{where}.log_ratio_clamp={log_ratio_clamp!r} must be > 0 or null")


def clamp_log_ratio(log_ratio: Tensor, log_ratio_clamp: float | None) -> tuple[Tensor, Tensor]:
    """Apply the optional clamp to [-c, c]; returns the clamped log-ratio and where it fired."""
    if log_ratio_clamp is None:
        return log_ratio, torch.zeros_like(log_ratio, dtype=torch.bool)
    c = log_ratio_clamp
    return log_ratio.clamp(-c, c), log_ratio.detach().abs() > c


def sequence_log_ratio(batch: MaskedBatch, length_norm: bool) -> Tensor:
    """log s_i for every row [B]: the mean (length_norm) or the sum of the token log-ratios."""
    log_ratio_sum = ((batch.logp - batch.old_logp) * batch.mask).sum(-1)  # Σ_t log π_θ/π_old  [B]
    if length_norm:
        return log_ratio_sum / batch.lengths.clamp(min=1)  # log s_i = (1/|y_i|) Σ_t log π_θ/π_old
    return log_ratio_sum  # log of the raw sequence likelihood ratio


def check_one_advantage_per_sequence(batch: MaskedBatch) -> None:
    valid, adv = batch.mask.bool(), batch.advantages
    spread = torch.where(valid, adv, -torch.inf).amax(-1) - torch.where(valid, adv, torch.inf).amin(-1)
    if (torch.where(batch.valid_rows, spread, 0.0) > 0).any():
        raise ValueError(
            "SequenceRatio (GSPO): advantages must be one value per sequence ([B], or [B, T] constant along each "
            "row); use GSPOToken (algorithm=gspo_token, the sequence-token ratio) for per-token advantages"
        )


@dataclass(frozen=True)
class TokenRatio:
    """w_i,t = π_θ(y_i,t | x, y_i,<t) / π_old(y_i,t | x, y_i,<t) (GRPO, arXiv 2507.18071 eq. 2).

    Args:
        log_ratio_clamp: clamp log w to [-c, c] before exp(); None (default) keeps it exact.
    """

    level: ClassVar[str] = "token"
    log_ratio_clamp: float | None = None

    def __post_init__(self) -> None:
        check_log_ratio_clamp("TokenRatio: objective.ratio", self.log_ratio_clamp)

    def __call__(self, batch: MaskedBatch) -> Ratio:
        log_w, fired = clamp_log_ratio(batch.logp - batch.old_logp, self.log_ratio_clamp)  # log w_i,t  [B, T]
        w = torch.exp(log_w)  # w_i,t = π_θ / π_old  [B, T]
        return Ratio(w, fired)


@dataclass(frozen=True)
class SequenceRatio:
    """s_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|), carried by every token of sequence i (GSPO, arXiv 2507.18071
    eq. 7). Needs one advantage per sequence; `SequenceTokenRatio` takes per-token advantages.

    Args:
        length_norm: True (the paper) raises the sequence likelihood ratio to 1/|y_i|; False keeps the full
            product Π_t π_θ/π_old (the length-normalisation ablation, and VESPO's w).
        log_ratio_clamp: clamp log s_i to [-c, c] before exp(); None (default) keeps it exact.
    """

    level: ClassVar[str] = "sequence"
    length_norm: bool = True
    log_ratio_clamp: float | None = None

    def __post_init__(self) -> None:
        check_log_ratio_clamp("SequenceRatio: objective.ratio", self.log_ratio_clamp)

    def __call__(self, batch: MaskedBatch) -> Ratio:
        check_one_advantage_per_sequence(batch)
        log_s, fired = clamp_log_ratio(sequence_log_ratio(batch, self.length_norm), self.log_ratio_clamp)
        s = torch.exp(log_s)  # s_i  [B]
        per_token = s[:, None].expand_as(batch.logp)  # every token of sequence i carries s_i  [B, T]
        return Ratio(per_token, fired[:, None].expand_as(batch.logp))


@dataclass(frozen=True)
class SequenceTokenRatio:
    """s_i,t = sg[s_i] · π_θ(y_i,t) / sg[π_θ(y_i,t)], equal to s_i in value (GSPO-token, arXiv 2507.18071 eqs.
    13-17); per-token advantages allowed. With one advantage per sequence its loss and gradient equal
    `SequenceRatio`'s, also where `log_ratio_clamp` fires: a clamped log s_i has no gradient there, so the
    tokens of such a sequence carry none here either (the paper's form would still pass s_i ∇ log π).

    With `length_norm=False`, s_i is the raw sequence ratio and each token's log-prob enters with weight
    |y_i| (s_i,t = sg[s_i] (π / sg[π])^|y_i|), so value and gradient still equal un-normalised GSPO's.
    """

    level: ClassVar[str] = "sequence"
    length_norm: bool = True
    log_ratio_clamp: float | None = None

    def __post_init__(self) -> None:
        check_log_ratio_clamp("SequenceTokenRatio: objective.ratio", self.log_ratio_clamp)

    def __call__(self, batch: MaskedBatch) -> Ratio:
        log_s, fired = clamp_log_ratio(sequence_log_ratio(batch, self.length_norm), self.log_ratio_clamp)
        s = torch.exp(log_s)  # s_i  [B]
        # without length normalisation ∇ log s_i = Σ_t ∇ log π, so each token weighs |y_i| in the token mean
        weight = 1.0 if self.length_norm else batch.lengths[:, None]  # [B, 1]
        weight = weight * (~fired)[:, None]  # a clamped sequence: the gradient of clamp(log s_i), 0, on each token
        # s_i,t = sg[s_i] · π(y_i,t) / sg[π(y_i,t)]: value s_i, gradient s_i ∇ log π(y_i,t)
        per_token = s.detach()[:, None] * torch.exp(weight * (batch.logp - batch.logp.detach()))  # [B, T]
        return Ratio(per_token, fired[:, None].expand_as(batch.logp))


@dataclass(frozen=True)
class GeometricMeanRatio:
    """GMPO's ratio (Zhao et al., "Geometric-Mean Policy Optimization", arXiv 2507.20673): the geometric mean
    over each sequence's tokens of token ratios clipped in log space on the trust-region side of A:
        log w̃_t = min(log w_t, clip(log w_t, -clip_low, clip_high))  where A > 0
                  max(log w_t, clip(log w_t, -clip_low, clip_high))  where A <= 0
        r_i = exp((1/|y_i|) Σ_t log w̃_t), carried by every token of sequence i.
    Used with `surrogates.Unclipped` (the clip is already here) and the mean over sequences, this is TRL's
    experimental GMPOTrainer and verl's `geo_mean`; TRL's form (max for A <= 0) is used, verl's sign(A) gives
    r = 1 where A = 0, a term that is 0 either way. Reports the clip/* metrics of the token clip (TRL's rule:
    log w_t above clip_high with A > 0, below -clip_low with A < 0).

    Args:
        clip_low, clip_high: log-space bounds (> 0); the paper's range (section 4) is (e^-0.4, e^0.4).
    """

    level: ClassVar[str] = "sequence"
    clip_low: float = 0.4
    clip_high: float = 0.4

    def __post_init__(self) -> None:
        check_positive("GeometricMeanRatio: objective.ratio", clip_low=self.clip_low, clip_high=self.clip_high)

    def __call__(self, batch: MaskedBatch) -> Ratio:
        log_w, adv = batch.logp - batch.old_logp, batch.advantages  # [B, T]
        clamped = log_w.clamp(-self.clip_low, self.clip_high)
        # the clipped branch only binds where it lowers the objective: above for A > 0, below for A <= 0
        log_w_clipped = torch.where(adv > 0, torch.minimum(log_w, clamped), torch.maximum(log_w, clamped))
        log_r = (log_w_clipped * batch.mask).sum(-1) / batch.lengths.clamp(min=1)  # (1/|y_i|) Σ_t log w̃_t  [B]
        r = torch.exp(log_r)  # [B]
        with torch.no_grad():
            metrics = clip_fractions((log_w < -self.clip_low) & (adv < 0), (log_w > self.clip_high) & (adv > 0), batch)
        return Ratio(r[:, None].expand_as(log_w), torch.zeros_like(log_w, dtype=torch.bool), metrics)


@dataclass(frozen=True)
class TurnRatio:
    """The turn-level ratio of a multi-turn trajectory: GSPO's length-normalised ratio over the model's tokens
    of each turn k alone, s_i,k = exp((1/|y_i,k|) Σ_{t in turn k} log π_θ(y_i,t) / π_old(y_i,t)), carried by
    every token of that turn, so the surrogate clips each turn on its own (the per-turn analogue of GSPO's
    sequence ratio, as ST-PPO, arXiv 2511.20718, defines it). The tool results between turns are not the model's
    and take no part. A single-turn batch (`turns` None) is one turn per row: `SequenceRatio` exactly.

    Args:
        log_ratio_clamp: clamp log s_i,k to [-c, c] before exp(); None (default) keeps it exact.
    """

    level: ClassVar[str] = "turn"
    log_ratio_clamp: float | None = None

    def __post_init__(self) -> None:
        check_log_ratio_clamp("TurnRatio: objective.ratio", self.log_ratio_clamp)

    def __call__(self, batch: MaskedBatch) -> Ratio:
        turns = batch.turns if batch.turns is not None else batch.mask.long()  # [B, T], 0 off the model's tokens
        log_s = turn_mean(batch.logp - batch.old_logp, turns, batch.mask)  # each token's log s_i,k  [B, T]
        log_s, fired = clamp_log_ratio(log_s, self.log_ratio_clamp)
        return Ratio(torch.exp(log_s), fired & batch.mask.bool())
