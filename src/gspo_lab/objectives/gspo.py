"""GSPO and GSPO-token (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071).

Both use the length-normalised sequence likelihood ratio s_i with the clipped surrogate and the mean over
sequences of the mean over tokens; they differ only in the ratio axis:
    GSPO        every token of sequence i carries s_i itself                        (eqs. 5-7)
    GSPO-token  s_i,t = sg[s_i] * π(y_i,t) / sg[π(y_i,t)], equal to s_i in value     (eqs. 13-17)
With one advantage per sequence their losses and gradients are identical; GSPO-token additionally accepts
per-token advantages.
"""

from __future__ import annotations

from typing import Any

from gspo_lab.objectives.aggregations import SeqMeanTokenMean
from gspo_lab.objectives.base import Objective
from gspo_lab.objectives.ratios import SequenceRatio, SequenceTokenRatio, check_log_ratio_clamp
from gspo_lab.objectives.surrogates import ClippedMin, check_clip_range


class GSPO(Objective):
    """Group Sequence Policy Optimization, arXiv 2507.18071 section 4.1 (eqs. 5-7).

    J = E_i[ min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i) ],
    s_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|).

    Args:
        clip_low, clip_high: the clip range [1 - clip_low, 1 + clip_high]; paper defaults 3e-4 / 4e-4.
        length_norm: True (the paper) raises the sequence likelihood ratio to 1/|y_i|; False keeps the raw
            ratio, the length-normalisation ablation.
        log_ratio_clamp: clamp log s_i to [-c, c] before exp(); None (default) keeps it exact.
        **shared: the keys every objective has (beta, rollout_correction, ...): see `Objective`.
    """

    name = "gspo"
    sequence_ratio = SequenceRatio  # the one thing GSPO-token changes

    def __init__(
        self,
        clip_low: float = 3e-4,
        clip_high: float = 4e-4,
        length_norm: bool = True,
        log_ratio_clamp: float | None = None,
        **shared: Any,
    ) -> None:
        prefix = f"{type(self).__name__}: objective"
        check_clip_range(prefix, clip_low, clip_high)
        check_log_ratio_clamp(prefix, log_ratio_clamp)
        ratio = self.sequence_ratio(bool(length_norm), log_ratio_clamp)
        super().__init__(ratio, ClippedMin(float(clip_low), float(clip_high)), SeqMeanTokenMean(), self.name,
                         **shared)
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)
        self.length_norm, self.log_ratio_clamp = bool(length_norm), log_ratio_clamp


class GSPOToken(GSPO):
    """GSPO-token, arXiv 2507.18071 section 4.3 (eqs. 13-17): GSPO's ratio with per-token advantages.

    s_i,t = sg[s_i] * π_θ(y_i,t | x, y_i,<t) / sg[π_θ(y_i,t | x, y_i,<t)]
    J = E_i[ (1/|y_i|) Σ_t min(s_i,t A_i,t, clip(s_i,t) A_i,t) ]

    With `length_norm=False`, s_i is the raw sequence ratio and each token's log-prob enters with weight
    |y_i| (see `ratios.SequenceTokenRatio`), so value and gradient still equal un-normalised GSPO's.
    """

    name = "gspo_token"
    sequence_ratio = SequenceTokenRatio
