"""GSPO and GSPO-token (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071).

Both use the length-normalised sequence likelihood ratio s_i; they differ only in how the per-token ratio
that enters the clipped surrogate is built from it:
    GSPO        every token of sequence i carries s_i itself                        (eqs. 5-7)
    GSPO-token  s_i,t = sg[s_i] * π(y_i,t) / sg[π(y_i,t)], equal to s_i in value     (eqs. 13-17)
With one advantage per sequence their losses and gradients are identical; GSPO-token additionally accepts
per-token advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lab.objectives.base import MaskedBatch, Objective, Ratio


class GSPO(Objective):
    """Group Sequence Policy Optimization, arXiv 2507.18071 section 4.1 (eqs. 5-7).

    J = E_i[ min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i) ],
    s_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|).

    Args:
        length_norm: True (the paper) raises the sequence likelihood ratio to 1/|y_i|; False keeps the raw
            ratio, the length-normalisation ablation.
        clip_low, clip_high, beta, log_ratio_clamp, rollout_correction(_cap): see `Objective`. Paper defaults:
            3e-4 / 4e-4.
    """

    name = "gspo"

    def __init__(
        self,
        clip_low: float = 3e-4,
        clip_high: float = 4e-4,
        length_norm: bool = True,
        beta: float = 0.0,
        log_ratio_clamp: float | None = None,
        rollout_correction: str = "none",
        rollout_correction_cap: float = 2.0,
    ) -> None:
        super().__init__(clip_low, clip_high, beta, log_ratio_clamp, rollout_correction, rollout_correction_cap)
        self.length_norm = bool(length_norm)

    def _check_advantages(self, batch: MaskedBatch) -> None:
        valid, adv = batch.mask.bool(), batch.advantages
        spread = torch.where(valid, adv, -torch.inf).amax(-1) - torch.where(valid, adv, torch.inf).amin(-1)
        if (torch.where(batch.valid_rows, spread, 0.0) > 0).any():
            raise ValueError(
                "GSPO: advantages must be one value per sequence ([B], or [B, T] constant along each row); "
                "use GSPOToken (algorithm=gspo_token) for per-token advantages"
            )

    def sequence_log_ratio(self, batch: MaskedBatch) -> tuple[Tensor, Tensor]:
        """log s_i for every row, and where the optional clamp fired. Both [B]."""
        log_ratio_sum = ((batch.logp - batch.old_logp) * batch.mask).sum(-1)  # Σ_t log π_θ/π_old  [B]
        if self.length_norm:
            log_s = log_ratio_sum / batch.lengths.clamp(min=1)  # log s_i = (1/|y_i|) Σ_t log π_θ/π_old
        else:
            log_s = log_ratio_sum  # log of the raw sequence likelihood ratio
        return self.clamp_log_ratio(log_s)

    def token_ratio(self, batch: MaskedBatch) -> Ratio:
        self._check_advantages(batch)
        log_s, fired = self.sequence_log_ratio(batch)
        s = torch.exp(log_s)  # s_i  [B]
        per_token = s[:, None].expand_as(batch.logp)  # every token of sequence i carries s_i  [B, T]
        rows = batch.valid_rows
        return Ratio(per_token, s[rows], fired[rows])


class GSPOToken(GSPO):
    """GSPO-token, arXiv 2507.18071 section 4.3 (eqs. 13-17): GSPO's ratio with per-token advantages.

    s_i,t = sg[s_i] * π_θ(y_i,t | x, y_i,<t) / sg[π_θ(y_i,t | x, y_i,<t)]
    J = E_i[ (1/|y_i|) Σ_t min(s_i,t A_i,t, clip(s_i,t) A_i,t) ]

    With `length_norm=False`, s_i is the raw sequence ratio and each token's log-prob enters with weight
    |y_i| (s_i,t = sg[s_i] (π / sg[π])^|y_i|), so value and gradient still equal un-normalised GSPO's.
    """

    name = "gspo_token"

    def _check_advantages(self, batch: MaskedBatch) -> None:
        """Per-token advantages are what GSPO-token is for."""

    def token_ratio(self, batch: MaskedBatch) -> Ratio:
        log_s, fired = self.sequence_log_ratio(batch)
        s = torch.exp(log_s)  # s_i  [B]
        # without length normalisation ∇ log s_i = Σ_t ∇ log π, so each token weighs |y_i| in the token mean
        weight = 1.0 if self.length_norm else batch.lengths[:, None]  # [B, 1]
        # s_i,t = sg[s_i] · π(y_i,t) / sg[π(y_i,t)]: value s_i, gradient s_i ∇ log π(y_i,t)
        per_token = s.detach()[:, None] * torch.exp(weight * (batch.logp - batch.logp.detach()))  # [B, T]
        rows = batch.valid_rows
        return Ratio(per_token, s.detach()[rows], fired[rows])
