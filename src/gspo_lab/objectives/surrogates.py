"""The surrogate axis: each token's loss term (to minimise) from its importance ratio r [B, T] and advantage.

    ClippedMin   -min(r A, clip(r, 1 - ε_low, 1 + ε_high) A), optionally dual-clipped     PPO, GRPO, GSPO, DAPO
    Unclipped    -r A, for a ratio that clips itself                                       GMPO
    CISPO        -sg[min(r, ε_max)] A log π                                                CISPO
    SAPO         -(4/τ) σ(τ (r - 1)) A, τ = τ_pos where A > 0 else τ_neg                   SAPO
    VESPO        -sg[φ(W)] A log π, φ(W) = W^k e^{λ (1 - W)} on the sequence ratio W       VESPO
    DPPO         -sg[min(r, c)] A log π where π(y_t) did not move beyond δ in A's direction  DPPO-Binary-TV, -KL
    PolicyGradient  -A log π                                                               GPG
    DRO          -(A log π - (β/2) (log r)²)                                               verl's DRO

Each is a frozen dataclass called as `surrogate(ratio, batch) -> (per_token, metrics)`: the terms [B, T] and
its own detached metrics. A surrogate with a clip reports clip/* (`base.clip_fractions`); one without reports
its own analogue under its name (sapo/gate_mean, cispo/capped_frac, vespo/weight_mean): a fraction it limits
has `frac` in its name and is 0 on-policy, a mean weight ends in `_mean` and is 1 on-policy (what
tests/objectives/test_every_objective.py checks for every YAML); one that limits nothing (PolicyGradient, DRO)
reports nothing. Settings are checked on construction, with the key under `objective.surrogate`. Clip-Cov and
KL-Cov, which select tokens by a covariance over the batch, are in objectives/covariance.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gspo_lab.objectives.interface import MaskedBatch, check_positive, clip_fractions
from gspo_lab.tensors import masked_mean


def check_clip_range(where: str, clip_low: float, clip_high: float) -> None:
    """`where` is how the message names the keys' parent, e.g. "GSPO: objective"."""
    if not 0 < clip_low < 1:
        raise ValueError(f"{where}.clip_low={clip_low!r} must satisfy 0 < clip_low < 1")
    if not clip_high > 0:
        raise ValueError(f"{where}.clip_high={clip_high!r} must be > 0")


@dataclass(frozen=True)
class ClippedMin:
    """PPO's clipped surrogate (Schulman et al. 2017; GRPO and GSPO use it, arXiv 2507.18071 eqs. 2 and 5):
    J = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), the loss its negation.

    Args:
        clip_low, clip_high: the clip range [1 - clip_low, 1 + clip_high] (0 < clip_low < 1, clip_high > 0).
        dual_clip: c > 1, or None (default, off). Dual-clip PPO (Ye et al., arXiv 1912.09729), verl's
            `clip_ratio_c`: where A < 0 the loss is also capped at -c A, so a ratio far above 1 cannot push a
            bad token's probability down without bound. Reported as clip/frac_dual (tokens where r > c, A < 0).
    """

    clip_low: float
    clip_high: float
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        check_clip_range("ClippedMin: objective.surrogate", self.clip_low, self.clip_high)
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"ClippedMin: objective.surrogate.dual_clip={self.dual_clip!r} must be > 1 or null")

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        adv = batch.advantages  # [B, T]
        per_token, low, high = clipped_min(ratio, adv, self.clip_low, self.clip_high)  # [B, T]
        if self.dual_clip is not None:  # loss = min(loss, -c A) where A < 0
            per_token = torch.where(adv < 0, torch.minimum(per_token, -self.dual_clip * adv), per_token)
        with torch.no_grad():
            metrics = clip_fractions(low, high, batch)
            if self.dual_clip is not None:
                dual = (ratio.detach() > self.dual_clip) & (adv < 0)
                metrics["clip/frac_dual"] = masked_mean(dual.to(adv.dtype), batch.mask)
        return per_token, metrics


def clipped_min(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped term -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) [B, T], and where the clipped branch
    binds below (r < 1 - clip_low, A < 0) and above (r > 1 + clip_high, A > 0), bool [B, T]."""
    clipped_r = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped_r * adv)  # J = min(r A, clip(r) A); the loss its negation
    r = ratio.detach()
    return per_token, (r < 1 - clip_low) & (adv < 0), (r > 1 + clip_high) & (adv > 0)


@dataclass(frozen=True)
class Unclipped:
    """J = r A with no clip, the loss its negation: for a ratio that clips itself (GMPO's
    `ratios.GeometricMeanRatio`, which reports the clip/* metrics)."""

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return -ratio * batch.advantages, {}


@dataclass(frozen=True)
class CISPO:
    """CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is capped and detached, and multiplies
    the REINFORCE term, so every token keeps a gradient: J = sg[min(r, cap)] A log π.

    The loss value is TRL's `loss_type="cispo"` (-sg[min(r, ε_high)] A log π, token mean over the batch with
    `aggregations.TokenMean`). The published recipe (ScaleRL, arXiv 2510.13786) caps at ε_max = 5, as TRL's
    docs recommend; TRL's literal default ε_high = 0.2 would scale every on-policy token by 0.2, so a cap
    below 1 is refused here. verl's `cispo` also clips below at 1 - ε_low; only the cap is offered, as in TRL.
    Reports cispo/capped_frac, the fraction of valid tokens whose weight is capped (r > cap), whatever the sign
    of A: the cap changes the gradient of both (TRL counts only A > 0).
    """

    cap: float = 5.0

    def __post_init__(self) -> None:
        if not self.cap >= 1:
            raise ValueError(f"CISPO: objective.surrogate.cap={self.cap!r} must be >= 1 (a cap below 1 scales every "
                             "on-policy token down)")

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        weight = ratio.detach().clamp(max=self.cap)  # sg[min(r, cap)]  [B, T]
        per_token = -weight * batch.advantages * batch.logp  # ∇ = -sg[min(r, cap)] A ∇ log π
        with torch.no_grad():
            capped = masked_mean((ratio.detach() > self.cap).to(weight.dtype), batch.mask)
        return per_token, {"cispo/capped_frac": capped}


@dataclass(frozen=True)
class SAPO:
    """SAPO's soft gate (Gao et al., "Soft Adaptive Policy Optimization", arXiv 2511.20347):
    J = f(r) A with f(r) = (4/τ) σ(τ (r - 1)), τ = tau_pos where A > 0, else tau_neg.

    ∇J = 4 σ (1 - σ) r A ∇ log π: the gate weight 4 σ (1 - σ) is 1 on-policy and decays smoothly as r leaves
    1, in place of a hard clip; reported as sapo/gate_mean (its mean over valid tokens). τ is built in the
    compute dtype, so float64 inputs give float64 maths (TRL builds it from Python floats in float32, where
    1.05 is 1.0499999523).

    Args:
        tau_pos, tau_neg: the gate temperatures (> 0); the paper's 1.0 and 1.05.
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        check_positive("SAPO: objective.surrogate", tau_pos=self.tau_pos, tau_neg=self.tau_neg)

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        adv = batch.advantages  # [B, T]
        tau = torch.where(adv > 0, adv.new_tensor(self.tau_pos), adv.new_tensor(self.tau_neg))  # [B, T]
        gate = torch.sigmoid(tau * (ratio - 1))  # σ(τ (r - 1))
        per_token = -(gate * 4 / tau) * adv  # -f(r) A
        with torch.no_grad():
            gate_mean = masked_mean(4 * gate * (1 - gate), batch.mask)
        return per_token, {"sapo/gate_mean": gate_mean}


LOG_W_MIN, LOG_W_MAX = math.log(1e-8), 20.0  # TRL's bounds on log W, kept so extreme ratios give φ ≈ 0, not NaN


@dataclass(frozen=True)
class VESPO:
    """VESPO's Gamma weight (arXiv 2602.10693, section 3.4), on the full sequence ratio W = Π_t π_θ/π_old
    (`ratios.SequenceRatio(length_norm=False)`): J = sg[φ(W)] A log π with φ(W) = W^k e^{λ (1 - W)}, φ(1) = 1,
    (k, λ) = (k_pos, lambda_pos) where A >= 0, else (k_neg, lambda_neg).

    As TRL's `loss_type="vespo"` (token mean with `aggregations.TokenMean`), with φ computed in log space and
    log W clamped to [log 1e-8, 20]. TRL also clamps each token's log-ratio to ±20 before the sum; here the
    sum is exact, which differs only when one token's |log r| > 20 (φ is then ~0 in both). Reports
    vespo/weight_mean, the mean φ over valid tokens (1 on-policy).

    Args:
        k_pos, lambda_pos, k_neg, lambda_neg: the exponent k >= 0 and the decay λ > 0 for each sign of A.
    """

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        check_positive("VESPO: objective.surrogate", lambda_pos=self.lambda_pos, lambda_neg=self.lambda_neg)
        for key, value in (("k_pos", self.k_pos), ("k_neg", self.k_neg)):
            if not value >= 0:
                raise ValueError(f"VESPO: objective.surrogate.{key}={value!r} must be >= 0")

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        adv = batch.advantages  # [B, T]
        with torch.no_grad():
            log_w = ratio.log().clamp(LOG_W_MIN, LOG_W_MAX)  # log W on every token of the sequence  [B, T]
            nonneg = adv >= 0
            k = torch.where(nonneg, adv.new_tensor(self.k_pos), adv.new_tensor(self.k_neg))
            lam = torch.where(nonneg, adv.new_tensor(self.lambda_pos), adv.new_tensor(self.lambda_neg))
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # log φ = λ + k log W - λ W
        per_token = -phi * adv * batch.logp  # ∇ = -φ(W) A ∇ log π
        return per_token, {"vespo/weight_mean": masked_mean(phi, batch.mask)}


@dataclass(frozen=True)
class DPPO:
    """DPPO-Binary (Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879): PPO's
    ratio clip replaced by a mask on how far π(y_t) moved from π_old(y_t), in the direction A pushes it, measured
    on the Bernoulli "the sampled token or another":
        tv  D = π_θ(y_t) - π_old(y_t)                   masked: A > 0 and D > δ_high, or A <= 0 and D < -δ_low
        kl  D = KL(Bern(π_old(y_t)) ‖ Bern(π_θ(y_t)))  masked: A > 0, π_θ > π_old and D > δ_high,
                                                         or A <= 0, π_θ < π_old and D > δ_low
    J = sg[min(r, c)] A log π on the kept tokens: the gradient min(r, c) A ∇ log π is the paper's eq. 11 (r A,
    no cap) below the cap.

    As verl's `dppo_tv` and `dppo_kl` (verl-project/verl 0.10.0.dev, commit 1dda039, core_algos.py; PR #5397 by
    the paper's authors), whose loss value is -sg[min(r, c)] A log π (the paper's -r A has the same gradient), with
    verl's 1e-8 in the kl's log((1 - π_old) / (1 - π_θ)). verl clamps the log-ratio to ±20 before the weight; here
    the ratio axis's is used (exact unless objective.ratio.log_ratio_clamp). The mask anchors on old_logp: the
    rollout's own log-probs under rollout.logprobs_from_generation (the paper's behaviour policy), else the
    trainer's π_old, as verl outside its bypass mode. Reports clip/* for the mask (low: masked with A < 0, high:
    masked with A > 0; verl's pg_clipfrac also counts masked tokens with A = 0, whose term is 0) and, with a cap,
    dppo/capped_frac (kept tokens with r > c: verl's pg_clipfrac_lower).

    Args:
        divergence: "tv" (DPPO-Binary-TV) or "kl" (DPPO-Binary-KL).
        divergence_low, divergence_high: δ (> 0) for a fall (A <= 0) and a rise (A > 0) of π(y_t); verl's recipe
            (examples/dppo_trainer) uses 0.15 for tv and 0.05 for kl.
        cap: c >= 1 of the truncated weight (verl's clip_ratio_c), or None (default): none, as the paper's eq. 11
            (its section 5.4 finds the truncation's bias harmful; verl's recipe sets c = 10000).
    """

    divergence: str = "tv"
    divergence_low: float = 0.15
    divergence_high: float = 0.15
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.divergence not in ("tv", "kl"):
            raise ValueError(f"DPPO: objective.surrogate.divergence={self.divergence!r} must be 'tv' or 'kl'")
        check_positive("DPPO: objective.surrogate", divergence_low=self.divergence_low,
                       divergence_high=self.divergence_high)
        if self.cap is not None and not self.cap >= 1:
            raise ValueError(f"DPPO: objective.surrogate.cap={self.cap!r} must be >= 1 or null (a cap below 1 scales "
                             "every on-policy token down)")

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        adv = batch.advantages  # [B, T]
        with torch.no_grad():
            rise, fall = self.moved(batch)  # bool [B, T]
            keep = torch.where(adv > 0, ~rise, ~fall).to(adv.dtype)  # M_t: A > 0 may not rise, A <= 0 not fall
            weight = ratio.detach() if self.cap is None else ratio.detach().clamp(max=self.cap)  # sg[min(r, c)]
        per_token = -adv * weight * batch.logp * keep  # ∇ = -M min(r, c) A ∇ log π; a product, so NaN stays NaN
        with torch.no_grad():
            metrics = clip_fractions(fall & (adv < 0), rise & (adv > 0), batch)
            if self.cap is not None:
                metrics["dppo/capped_frac"] = masked_mean((ratio.detach() > self.cap) * keep, batch.mask)
        return per_token, metrics

    def moved(self, batch: MaskedBatch) -> tuple[Tensor, Tensor]:
        """Where π(y_t) rose beyond δ_high and where it fell beyond δ_low, by this divergence; bool [B, T]."""
        logp = batch.logp.detach()
        prob, old_prob = torch.exp(logp), torch.exp(batch.old_logp)
        if self.divergence == "tv":
            return prob - old_prob > self.divergence_high, prob - old_prob < -self.divergence_low
        # KL(Bern(π_old) ‖ Bern(π_θ)) = π_old log(π_old / π_θ) + (1 - π_old) log((1 - π_old) / (1 - π_θ))
        kl = old_prob * (batch.old_logp - logp) + (1 - old_prob) * torch.log((1 - old_prob + 1e-8)
                                                                             / (1 - prob + 1e-8))
        return (kl > self.divergence_high) & (prob > old_prob), (kl > self.divergence_low) & (prob < old_prob)


@dataclass(frozen=True)
class PolicyGradient:
    """The plain policy gradient J = A log π: no ratio, no clip. GPG's loss (Chu et al., "GPG: A Simple and Strong
    Reinforcement Learning Baseline", arXiv 2504.02546), as verl's `gpg` policy loss (-A log π, verl 0.10.0.dev
    1dda039 core_algos.py); GPG's own correction of the advantages is an advantage estimator, not part of the loss.
    The ratio is not used (ratio/* are still reported). Reports nothing of its own: it limits nothing."""

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return -batch.advantages * batch.logp, {}  # ∇ = -A ∇ log π


@dataclass(frozen=True)
class DRO:
    """verl's `dro` policy loss (Direct Reward Optimization; verl-project/verl PR #7245, docs/algo/dro.md, which
    names no paper): the policy gradient with a quadratic penalty on each token's log-ratio,
    J = A log π - (β/2) (log π_θ/π_old)², the loss its negation; ∇J = (A - β log r) ∇ log π pulls a token that
    moved back toward π_old. The ratio axis is not used. Reports nothing of its own: the penalty is in
    loss/policy.

    Args:
        penalty_coef: β > 0 (verl's dro_beta, which has no default; verl's usage example sets 0.05).
    """

    penalty_coef: float = 0.05

    def __post_init__(self) -> None:
        check_positive("DRO: objective.surrogate", penalty_coef=self.penalty_coef)

    def __call__(self, ratio: Tensor, batch: MaskedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        log_ratio = batch.logp - batch.old_logp  # [B, T]
        return -(batch.advantages * batch.logp - 0.5 * self.penalty_coef * log_ratio**2), {}
