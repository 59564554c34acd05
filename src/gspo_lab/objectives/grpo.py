"""GRPO's token-level clipped objective (Shao et al., DeepSeekMath, arXiv 2402.03300), as written in the
GSPO paper (arXiv 2507.18071, section 2, eqs. 2-3). Routing replay for MoE models is not part of the loss:
it changes how logp is computed (see gspo_lab.routing), so `algorithm=grpo_rr` uses this same class.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lab.objectives.base import MaskedBatch, Objective, Ratio


class GRPO(Objective):
    """Group Relative Policy Optimization, token-level importance ratio (arXiv 2507.18071 eqs. 2-3).

    w_i,t = π_θ(y_i,t | x, y_i,<t) / π_old(y_i,t | x, y_i,<t)
    J = E_i[ (1/|y_i|) Σ_t min(w_i,t A_i,t, clip(w_i,t, 1 - clip_low, 1 + clip_high) A_i,t) ]

    Args:
        length_norm: True (the paper) averages over each sequence's tokens, then over sequences; False uses
            Dr. GRPO's constant normaliser: the sum of all token terms divided by B × max_len.
        max_len: the constant T of that normaliser, normally the generation budget; None uses the mask's
            width (then extra padded columns change the loss).
        clip_low, clip_high, beta, log_ratio_clamp, rollout_correction(_cap): see `Objective`. The paper's GRPO
            clip: 0.2 / 0.27.
    """

    name = "grpo"

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.27,
        length_norm: bool = True,
        max_len: int | None = None,
        beta: float = 0.0,
        log_ratio_clamp: float | None = None,
        rollout_correction: str = "none",
        rollout_correction_cap: float = 2.0,
    ) -> None:
        super().__init__(clip_low, clip_high, beta, log_ratio_clamp, rollout_correction, rollout_correction_cap)
        if max_len is not None and not max_len >= 1:
            raise ValueError(f"GRPO: objective.max_len={max_len!r} must be >= 1 or null")
        self.length_norm = bool(length_norm)
        self.max_len = max_len

    def token_ratio(self, batch: MaskedBatch) -> Ratio:
        log_w, fired = self.clamp_log_ratio(batch.logp - batch.old_logp)  # log w_i,t  [B, T]
        w = torch.exp(log_w)  # w_i,t = π_θ / π_old  [B, T]
        valid = batch.mask.bool()
        return Ratio(w, w.detach()[valid], fired[valid])

    def aggregate(self, per_token: Tensor, batch: MaskedBatch) -> Tensor:
        if self.length_norm:
            return super().aggregate(per_token, batch)
        width = self.max_len if self.max_len is not None else batch.mask.shape[-1]
        rows = batch.valid_rows.sum().clamp(min=1)
        return (per_token * batch.mask).sum() / (rows * width)  # Dr. GRPO: Σ_i,t terms / (B · T)
