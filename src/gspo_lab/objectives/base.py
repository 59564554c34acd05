"""The objective, the one place where its three axes are put together (what they exchange: objectives/interface.py).

An objective is a pure function of tensors: `obj(logp, old_logp, advantages, mask)` returns an
`ObjectiveOutput` holding the scalar loss to minimise and detached, namespaced metrics. It never touches
trainer state. It is three independent choices (verl's `agg_loss` kept apart from its policy losses, with
Hydra `_target_`s instead of a string registry):
    ratio        how the importance ratio of every token is built          (objectives/ratios.py)
    surrogate    the per-token loss term made from that ratio              (objectives/surrogates.py)
    aggregation  how the per-token terms become one scalar                 (objectives/aggregations.py)
Masking, dtype promotion, the rollout corrections, the KL penalty, the entropy bonus and top-entropy mask
(objectives/entropy.py), the non-finite check and the metrics that every objective shares live here, once.

Shapes: B sequences, T completion positions.
    logp, old_logp  [B, T]  log-probs of the sampled completion tokens (logp carries the gradient)
    advantages      [B] or [B, T]
    mask            [B, T]  1 on completion tokens, 0 on padding
    entropy         [B, T]  the policy's entropy at each completion token (with its gradient for the bonus)
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lab.objectives.entropy import EntropyCoefficient, check_entropy_settings, top_entropy_mask
from gspo_lab.objectives.interface import (  # noqa: F401 - the axes' types, re-exported
    AggregationAxis, MaskedBatch, ObjectiveOutput, Ratio, RatioAxis, SurrogateAxis, check_positive, clip_fractions)
from gspo_lab.objectives.rollout_correction import (behaviour_weights, check_correction_settings, correction_weights,
                                                    diagnostics, off_policy_mask)
from gspo_lab.tensors import after_tool_metrics, k3, masked_mean  # noqa: F401 - k3, masked_mean: re-exported


class NonFiniteLossError(FloatingPointError):
    """Raised when an objective's loss is NaN or infinite; the message names the objective."""


class Objective:
    """An importance-weighted policy-gradient objective: ratio × surrogate × aggregation, plus an optional k3
    KL penalty, an optional correction for the rollout engine's mismatch, DeepSeek-V3.2's off-policy mask, and
    entropy control (gspo_lab.objectives.entropy: a bonus, its adaptive coefficient, a top-entropy token mask).

    Args:
        ratio: builds the per-token ratio from the batch (e.g. `ratios.SequenceRatio`).
        surrogate: turns the ratio into per-token loss terms (e.g. `surrogates.ClippedMin`).
        aggregation: reduces the terms to the loss (e.g. `aggregations.SeqMeanTokenMean`); the KL penalty is
            aggregated the same way.
        name: the objective's name in run labels and error messages (`dapo`).
        beta: coefficient of the k3 KL penalty to a reference policy; 0 needs no reference.
        rollout_correction: "none", or how each policy-loss term is weighted for the rollout engine's mismatch
            to the trainer (gspo_lab.objectives.rollout_correction): tis_token, tis_seq, mis_token, mis_seq,
            mis_geo. Any of them also logs the mismatch diagnostics is/ess, is/chi2_token, is/chi2_seq and
            is/ppl_ratio.
        rollout_correction_cap: C, the upper bound of those weights (> 1).
        rollout_correction_min: C_min, their lower bound (0 < C_min < 1); None: none (mis_geo: 1 / C).
        decoupled: the decoupled PPO loss (AReaL's) for rows an older policy generated: π_old is π_prox, each term
            × π_prox / π_behave (`rollout_logp`) at the ratio's level, 0 above behave_weight_cap
            (gspo_lab.objectives.rollout_correction.behaviour_weights). Not with a rollout_correction.
        behave_weight_cap: C of the decoupled loss (> 1; AReaL's behav_imp_weight_cap).
        off_policy_mask_threshold: δ of DeepSeek-V3.2's off-policy sequence mask (> 0); None: off.
        kl_bias_correction: multiply each token's k3 KL term by π_θ / π_old (DeepSeek-V3.2 eq. 8, TRL
            `use_bias_correction_kl`), so the penalty is an unbiased estimate of KL(π_θ || π_ref) on samples
            from π_old. The token ratio for every objective, as the paper: TRL multiplies by its ratio `coef_1`,
            which for GSPO (importance_sampling_level="sequence") is the sequence ratio, not an importance weight
            of the token whose KL it weights.
        entropy_coef: c of the entropy bonus, loss -= c · H̄ with H̄ the token mean of the policy's entropy over
            the loss's tokens (TRL's entropy_coef); 0: off. Negative: an entropy penalty (entropy minimisation,
            arXiv 2505.15134), allowed and logged. With a target, the adaptive coefficient's starting value (>= 0).
        entropy_target: the mean entropy in nats that Skywork-OR1's adaptive coefficient steers toward (TRL's
            entropy_target with use_adaptive_entropy); None: the coefficient stays entropy_coef.
        entropy_coef_delta, entropy_coef_min, entropy_coef_max: the adaptive coefficient's step and bounds.
        top_entropy_quantile: ρ, the share of tokens, those of highest entropy, that the policy loss keeps
            ("Beyond the 80/20 rule"; TRL's top_entropy_quantile); 1: every token.
    """

    def __init__(
        self,
        ratio: RatioAxis,
        surrogate: SurrogateAxis,
        aggregation: AggregationAxis,
        name: str = "objective",
        beta: float = 0.0,
        rollout_correction: str = "none",
        rollout_correction_cap: float = 2.0,
        rollout_correction_min: float | None = None,
        decoupled: bool = False,
        behave_weight_cap: float = 5.0,
        off_policy_mask_threshold: float | None = None,
        kl_bias_correction: bool = False,
        entropy_coef: float = 0.0,
        entropy_target: float | None = None,
        entropy_coef_delta: float = 0.005,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        top_entropy_quantile: float = 1.0,
    ) -> None:
        self.name = name
        if not beta >= 0:
            raise ValueError(f"{self.label}: objective.beta={beta!r} must be >= 0")
        check_correction_settings(f"{self.label}: objective", rollout_correction, rollout_correction_cap,
                                  rollout_correction_min, decoupled, behave_weight_cap)
        if off_policy_mask_threshold is not None:
            check_positive(f"{self.label}: objective", off_policy_mask_threshold=off_policy_mask_threshold)
        check_entropy_settings(f"{self.label}: objective", entropy_coef, entropy_target, entropy_coef_delta,
                               entropy_coef_min, entropy_coef_max, top_entropy_quantile)
        self.ratio, self.surrogate, self.aggregation = ratio, surrogate, aggregation
        self.beta = float(beta)
        self.rollout_correction, self.rollout_correction_cap = rollout_correction, float(rollout_correction_cap)
        self.rollout_correction_min = None if rollout_correction_min is None else float(rollout_correction_min)
        self.decoupled, self.behave_weight_cap = decoupled, float(behave_weight_cap)
        self.off_policy_mask_threshold = None if off_policy_mask_threshold is None else float(off_policy_mask_threshold)
        self.kl_bias_correction = bool(kl_bias_correction)
        self.entropy_coef, self.entropy_target = float(entropy_coef), entropy_target
        self.entropy_coef_delta, self.entropy_coef_min = float(entropy_coef_delta), float(entropy_coef_min)
        self.entropy_coef_max, self.top_entropy_quantile = float(entropy_coef_max), float(top_entropy_quantile)

    @property
    def needs_entropy(self) -> bool:
        """Whether a call needs the policy's entropy at each token: for the bonus or the top-entropy mask."""
        return EntropyCoefficient.of(self).enabled or self.top_entropy_quantile < 1

    @property
    def label(self) -> str:
        """How messages name this objective: its class (GSPO, GSPOToken, GRPO), or its name when composed in YAML."""
        return self.name if type(self) is Objective else type(self).__name__

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        ref_logp: Tensor | None = None,
        rollout_logp: Tensor | None = None,
        entropy: Tensor | None = None,
        entropy_coef: float | None = None,
        turns: Tensor | None = None,
    ) -> ObjectiveOutput:
        """`entropy` [B, T]: needed when `needs_entropy`; `entropy_coef`: the bonus's coefficient this step (an
        adaptive one, `EntropyCoefficient.applied`), None: objective.entropy_coef. `turns` [B, T]: a multi-turn
        batch's turn of each token (gspo_lab.rollout.multi_turn; what `ratios.TurnRatio` reads), None: one turn;
        `mask` is 1 on the model's tokens only, so every other axis sees those alone."""
        batch = self._prepare(logp, old_logp, advantages, mask, turns)
        if entropy is not None:
            entropy = torch.where(batch.mask.bool(), entropy.to(batch.logp.dtype), 0.0)  # [B, T]
        elif self.needs_entropy:
            raise ValueError(f"{self.label}: objective.entropy_coef, entropy_target and top_entropy_quantile need "
                             "the policy's entropy at each token (entropy=)")
        high_entropy = None
        if self.top_entropy_quantile < 1:
            high_entropy = top_entropy_mask(entropy, batch.mask, self.top_entropy_quantile)  # [B, T]
        ratio = self.ratio(batch)
        per_token, surrogate_metrics = self.surrogate(ratio.per_token, batch)  # [B, T]
        per_token, metrics = self._corrected(per_token, batch, rollout_logp, high_entropy)
        policy_loss = self.aggregation(per_token, batch)
        loss = policy_loss
        metrics["loss/policy"] = policy_loss
        if self.beta > 0:
            if ref_logp is None:
                raise ValueError(f"{self.label}: objective.beta={self.beta} > 0 needs ref_logp")
            ref = torch.where(batch.mask.bool(), ref_logp.to(batch.logp.dtype), 0.0)
            kl_ref = k3(ref, batch.logp)  # [B, T] k3 of KL(π_θ || π_ref), samples from π_θ
            if self.kl_bias_correction:  # DeepSeek-V3.2 eq. 8: the samples are π_old's, so × π_θ / π_old (not sg)
                kl_ref = kl_ref * torch.exp(batch.logp - batch.old_logp)
            kl_penalty = self.aggregation(kl_ref, batch)
            loss = loss + self.beta * kl_penalty
            metrics["kl/ref"] = kl_penalty
        bonus = None
        if high_entropy is not None:
            metrics["entropy/kept_mean"] = masked_mean(entropy, high_entropy)
        if EntropyCoefficient.of(self).enabled:
            tokens = batch.mask if high_entropy is None else high_entropy  # TRL: the policy loss's tokens
            loss, bonus = self._with_entropy_bonus(loss, entropy, tokens, entropy_coef)
            metrics["loss/entropy_bonus"] = bonus
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"{self.label}: the loss is {loss.item()} (non-finite); "
                "check the log-probs for NaN/inf or set objective.log_ratio_clamp (objective.ratio.log_ratio_clamp "
                "in a composed objective)"
            )
        metrics.update(ratio.metrics)
        metrics.update(surrogate_metrics)
        metrics.update(self._metrics(batch, ratio))
        metrics["loss/total"] = loss
        return ObjectiveOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()}, entropy_bonus=bonus)

    def _with_entropy_bonus(self, loss: Tensor, entropy: Tensor, tokens: Tensor, coef: float | None
                            ) -> tuple[Tensor, Tensor]:
        """loss - c · H̄ and c · H̄, H̄ = Σ H · tokens / Σ tokens: the mean entropy over the tokens the policy loss
        keeps, whatever the aggregation (TRL: `entropy_loss`, the same meaning of c for every loss_type)."""
        coef = self.entropy_coef if coef is None else coef
        bonus = coef * masked_mean(entropy, tokens)  # c · H̄  []
        return loss - bonus, bonus

    def _corrected(self, per_token: Tensor, batch: MaskedBatch, rollout_logp: Tensor | None,
                   high_entropy: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy terms [B, T] times the rollout correction's weights, the decoupled loss's behaviour weights,
        the off-policy mask and the top-entropy mask `high_entropy` (each off unless set), and their metrics. All
        leave the normaliser as it is (TRL)."""
        metrics: dict[str, Tensor] = {}
        valid = batch.mask.bool()
        engine = None if rollout_logp is None else torch.where(valid, rollout_logp.to(batch.logp.dtype), 0.0)
        if engine is None and (self.rollout_correction != "none" or self.decoupled):
            key = "decoupled=true" if self.decoupled else f"rollout_correction={self.rollout_correction!r}"
            raise ValueError(f"{self.label}: objective.{key} needs rollout_logp (the engine's log-probs, π_behave)")
        if self.rollout_correction != "none":
            weights, is_metrics = correction_weights(batch.old_logp, engine, batch.mask, self.rollout_correction,
                                                     self.rollout_correction_cap, self.rollout_correction_min)
            per_token = per_token * weights  # each term × sg[w]: the engine sampled, π_old is the trainer's
            metrics.update(is_metrics)
            metrics.update(diagnostics(batch.old_logp, engine, batch.mask, weights))
        if self.decoupled:
            level = getattr(self.ratio, "level", "token")
            weights, behave_metrics = behaviour_weights(batch.old_logp, engine, batch.mask, level,
                                                        self.behave_weight_cap, batch.turns)
            per_token = per_token * weights  # each term × sg[π_prox / π_behave]: the clip is anchored to π_prox
            metrics.update(behave_metrics)
        if self.off_policy_mask_threshold is not None:
            behaviour = batch.old_logp if engine is None else engine  # the paper's π_old is the engine's (TRL)
            keep, mask_metrics = off_policy_mask(batch.logp, behaviour, batch.advantages, batch.mask,
                                                 self.off_policy_mask_threshold)
            per_token = per_token * keep
            metrics.update(mask_metrics)
        if high_entropy is not None:  # "Beyond the 80/20 rule": only the high-entropy tokens' terms
            per_token = per_token * high_entropy
            metrics["entropy/kept_frac"] = masked_mean(high_entropy, batch.mask)
        return per_token, metrics

    def _prepare(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                 turns: Tensor | None = None) -> MaskedBatch:
        if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
            raise ValueError(
                f"{self.label}: logp, old_logp and mask must share one [B, T] shape; got "
                f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
            )
        if advantages.shape not in (logp.shape[:1], logp.shape):
            raise ValueError(
                f"{self.label}: advantages must be [B] or [B, T] = {tuple(logp.shape)}; got {tuple(advantages.shape)}"
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
        if turns is not None and turns.shape != logp.shape:
            raise ValueError(f"{self.label}: turns must be [B, T] = {tuple(logp.shape)}; got {tuple(turns.shape)}")
        turns = None if turns is None else torch.where(valid, turns.long(), 0)
        return MaskedBatch(logp, old_logp, adv, fmask, lengths, lengths > 0, turns)

    def _metrics(self, batch: MaskedBatch, ratio: Ratio) -> dict[str, Tensor]:
        """The metrics every objective reports, whatever its axes, each with one meaning for all objectives:
        ratio/seq/* the length-normalised sequence ratios s_i = exp(mean_t log π/π_old) (what GSPO clips),
        ratio/token/* the token ratios π/π_old (what GRPO clips), ratio/clamp_frac the valid tokens whose ratio
        the log-ratio clamp changed."""
        with torch.no_grad():
            mask, valid = batch.mask, batch.mask.bool()
            log_w = batch.logp.detach() - batch.old_logp  # [B, T]
            seq = torch.exp((log_w * mask).sum(-1) / batch.lengths.clamp(min=1))[batch.valid_rows]  # s_i  [N_rows]
            token = torch.exp(log_w[valid])  # w_i,t  [N_tokens]
            if token.numel() == 0:  # no valid token at all: report the on-policy values
                seq = token = mask.new_ones(1)
            metrics = {
                "ratio/seq/mean": seq.mean(), "ratio/seq/min": seq.min(), "ratio/seq/max": seq.max(),
                "ratio/token/mean": token.mean(), "ratio/token/min": token.min(), "ratio/token/max": token.max(),
                "ratio/clamp_frac": masked_mean(ratio.clamp_fired.to(mask.dtype), mask),
                "kl/old": masked_mean(k3(batch.logp.detach(), batch.old_logp), mask),
                "mask/empty_rows": (~batch.valid_rows).sum().to(mask.dtype),
                "mask/valid_tokens": mask.sum(),
            }
            if batch.turns is not None:
                metrics.update(after_tool_metrics(log_w, batch.turns, mask))
            return metrics
