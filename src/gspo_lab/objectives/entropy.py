"""Entropy control: the entropy bonus, its adaptive coefficient, and top-entropy token masking, as TRL ships them
(trl/trainer/grpo_trainer.py and grpo_config.py at commit f2cd577, 1.10.0.dev0).

    bonus       loss -= c · H̄, H̄ the mean over the loss's tokens of the policy's entropy over the whole vocabulary,
                H_t = -Σ_v π(v) log π(v) (Skywork-OR1, arXiv 2505.22312); a token mean whatever the aggregation,
                as TRL's, so c means the same for every objective                          objective.entropy_coef
    adaptive    c moves by Δ toward keeping H̄ at a target after every optimizer step, within [c_min, c_max], and
                is applied only while the last H̄ was at or below the target (Skywork-OR1; TRL's
                use_adaptive_entropy)                                    objective.entropy_target (null: off)
    top-ρ mask  only the tokens whose entropy is at or above the (1 - ρ) quantile of the batch's contribute to
                the policy loss ("Beyond the 80/20 rule", arXiv 2506.01939, ρ = 0.2; TRL's top_entropy_quantile);
                the normaliser keeps counting every token, as TRL's                 objective.top_entropy_quantile

The bonus and the mask are part of the objective (gspo_lab.objectives.base); the coefficient is state that lives
across steps, so the LightningModule holds an `EntropyCoefficient` and gives the objective its applied value.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def check_entropy_settings(where: str, entropy_coef: float, entropy_target: float | None, entropy_coef_delta: float,
                           entropy_coef_min: float, entropy_coef_max: float, top_entropy_quantile: float) -> None:
    """Each setting's rule, else a ValueError naming `where`.key, the value and the rule (the adaptive
    coefficient's step and bounds also without a target, where they are not used). A negative fixed entropy_coef
    is allowed, an entropy penalty, and logged as such."""
    def refuse(key: str, value, rule: str) -> None:
        raise ValueError(f"{where}.{key}={value!r} {rule}")

    if not math.isfinite(entropy_coef):
        refuse("entropy_coef", entropy_coef, "must be finite (0: no entropy bonus)")
    if not 0 <= top_entropy_quantile <= 1:
        refuse("top_entropy_quantile", top_entropy_quantile, "must be in [0, 1] (1: every token, the paper's 0.2)")
    if not entropy_coef_delta > 0:
        refuse("entropy_coef_delta", entropy_coef_delta, "must be > 0")
    if not entropy_coef_max >= 0:
        refuse("entropy_coef_max", entropy_coef_max, "must be >= 0")
    if not 0 <= entropy_coef_min <= entropy_coef_max:
        refuse("entropy_coef_min", entropy_coef_min, f"must satisfy 0 <= entropy_coef_min <= entropy_coef_max "
                                                     f"= {entropy_coef_max!r}")
    if entropy_target is None:
        if entropy_coef < 0:
            log.warning("%s.entropy_coef=%r < 0 is an entropy penalty, not a bonus: the loss adds %r x the mean "
                        "entropy, which drives the policy's entropy down (entropy minimisation, arXiv 2505.15134's "
                        "EM-FT term); a bonus is > 0", where, entropy_coef, -entropy_coef)
        return
    if not entropy_target > 0:
        refuse("entropy_target", entropy_target, "must be > 0 nats, or null for a fixed entropy_coef")
    if not entropy_coef_min <= entropy_coef <= entropy_coef_max:
        refuse("entropy_coef", entropy_coef, f"must be in [entropy_coef_min, entropy_coef_max] = "
                                             f"[{entropy_coef_min!r}, {entropy_coef_max!r}] with an entropy_target")


def top_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """[B, T] float: 1 on the valid tokens whose entropy is at or above the (1 - quantile) quantile of the valid
    tokens' entropies, 0 elsewhere; all 0 when no token is valid. As TRL's get_high_entropy_mask: torch.quantile
    (linear interpolation) of the entropies in float32, over the tokens given, one rank's (TRL gathers every
    rank's)."""
    valid = mask.bool()
    entropy = entropy.detach()
    values = entropy[valid].float()  # [N]
    if values.numel() == 0:
        return torch.zeros_like(entropy)
    threshold = torch.quantile(values, 1 - quantile)
    return ((entropy >= threshold) & valid).to(entropy.dtype)


class EntropyCoefficient:
    """The entropy bonus's coefficient over a run: fixed (`target` None), or Skywork-OR1's adaptive control as
    TRL's GRPOTrainer runs it, once per optimizer step:
        applied_k = c_k if H_{k-1} <= target else 0       (H_0 = inf: no bonus before the first measurement)
        c_{k+1}  = min(c_k + Δ, c_max) if H_k <= target else max(c_k - Δ, c_min)
    where H_k is the mean entropy over the policy loss's tokens of optimizer step k (all ranks). Saved in
    checkpoints (`state_dict`), so a resumed run goes on with the same coefficient.

    Args:
        coef: the coefficient c (objective.entropy_coef); with a target, its starting value.
        target: the target mean entropy in nats (objective.entropy_target); None: c stays fixed.
        delta, coef_min, coef_max: Δ and the bounds of c (objective.entropy_coef_delta, _min, _max).
    """

    def __init__(self, coef: float = 0.0, target: float | None = None, delta: float = 0.005, coef_min: float = 0.0,
                 coef_max: float = 1.0) -> None:
        self.coef, self.target, self.delta = float(coef), target, float(delta)
        self.coef_min, self.coef_max = float(coef_min), float(coef_max)
        self.last_entropy = math.inf

    @classmethod
    def of(cls, objective) -> EntropyCoefficient:
        """The objective's settings (an objective without them: no bonus)."""
        return cls(getattr(objective, "entropy_coef", 0.0), getattr(objective, "entropy_target", None),
                   getattr(objective, "entropy_coef_delta", 0.005), getattr(objective, "entropy_coef_min", 0.0),
                   getattr(objective, "entropy_coef_max", 1.0))

    @property
    def enabled(self) -> bool:
        """Whether the loss has an entropy bonus term (TRL's _entropy_bonus_enabled): a non-zero c or adaptive
        control, which keeps it even where c has come down to 0."""
        return self.coef != 0 or self.target is not None

    @property
    def applied(self) -> float:
        """The coefficient this optimizer step's loss uses."""
        if self.target is None or self.last_entropy <= self.target:
            return self.coef
        return 0.0

    def update(self, entropy: float) -> None:
        """After an optimizer step whose loss tokens had mean entropy `entropy`: the next coefficient."""
        if self.target is None:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = float(entropy)

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
