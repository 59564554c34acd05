"""GRPO's token-level clipped objective (Shao et al., DeepSeekMath, arXiv 2402.03300), as written in the
GSPO paper (arXiv 2507.18071, section 2, eqs. 2-3). Routing replay for MoE models is not part of the loss:
it changes how logp is computed (see gspo_lab.routing), so `algorithm=grpo_rr` uses this same class.
"""

from __future__ import annotations

from typing import Any

from gspo_lab.objectives.aggregations import ConstantNormaliser, SeqMeanTokenMean
from gspo_lab.objectives.base import Objective
from gspo_lab.objectives.ratios import TokenRatio, check_log_ratio_clamp
from gspo_lab.objectives.surrogates import ClippedMin, check_clip_range


class GRPO(Objective):
    """Group Relative Policy Optimization, token-level importance ratio (arXiv 2507.18071 eqs. 2-3).

    w_i,t = π_θ(y_i,t | x, y_i,<t) / π_old(y_i,t | x, y_i,<t)
    J = E_i[ (1/|y_i|) Σ_t min(w_i,t A_i,t, clip(w_i,t, 1 - clip_low, 1 + clip_high) A_i,t) ]

    Args:
        clip_low, clip_high: the clip range [1 - clip_low, 1 + clip_high]; the paper's GRPO clip: 0.2 / 0.27.
        length_norm: True (the paper) averages over each sequence's tokens, then over sequences; False uses
            Dr. GRPO's constant normaliser: the sum of all token terms divided by B × max_len.
        max_len: the constant T of that normaliser, normally the generation budget; None uses the mask's
            width (then extra padded columns change the loss).
        log_ratio_clamp: clamp log w to [-c, c] before exp(); None (default) keeps it exact.
        **shared: the keys every objective has (beta, rollout_correction, ...): see `Objective`.
    """

    name = "grpo"

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.27,
        length_norm: bool = True,
        max_len: int | None = None,
        log_ratio_clamp: float | None = None,
        **shared: Any,
    ) -> None:
        check_clip_range("GRPO: objective", clip_low, clip_high)
        check_log_ratio_clamp("GRPO: objective", log_ratio_clamp)
        if max_len is not None and not max_len >= 1:
            raise ValueError(f"GRPO: objective.max_len={max_len!r} must be >= 1 or null")
        aggregation = SeqMeanTokenMean() if length_norm else ConstantNormaliser(max_len)
        super().__init__(TokenRatio(log_ratio_clamp), ClippedMin(float(clip_low), float(clip_high)), aggregation,
                         self.name, **shared)
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)
        self.length_norm, self.max_len, self.log_ratio_clamp = bool(length_norm), max_len, log_ratio_clamp
