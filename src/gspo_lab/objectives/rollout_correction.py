"""Corrections for the rollout engine's mismatch to the trainer, as the field applies them (TRL's
`vllm_importance_sampling_mode`: token/sequence × truncate/mask with [C_min, C_max]; verl's geometric-mean
rejection; DeepSeek-V3.2's off-policy sequence mask), and the diagnostics of that mismatch.

The completions were sampled by the engine (π_engine) while π_old comes from a trainer forward; each token's
policy-loss term is weighted by a detached importance weight built from ρ_t = π_old(y_t) / π_engine(y_t), with the
cap C (objective.rollout_correction_cap) and the optional floor C_min (objective.rollout_correction_min):
    tis_token  sg[clip(ρ_t, C_min, C)]                           (TRL token_truncate)
    tis_seq    sg[clip(Π_t ρ_t, C_min, C)] on every token         (TRL sequence_truncate)
    mis_token  sg[ρ_t] where C_min <= ρ_t <= C, else 0            (TRL token_mask; IcePop's token mask)
    mis_seq    sg[Π_t ρ_t] if C_min <= Π_t ρ_t <= C, else 0       (TRL sequence_mask)
    mis_geo    1 if C_min <= exp(mean_t log ρ_t) <= C, else 0      (verl's Geo-RS, `rollout_rs="seq_mean_k1"`)
Without C_min there is no lower bound (TRL's default), except for mis_geo, where it is 1 / C: verl reads a single
threshold u of a k1 rejection as the bounds [1/u, u]. A masked token or sequence keeps its place in the loss's
normaliser, as in TRL (its term is only zeroed).

Read from TRL's trl/trainer/grpo_trainer.py and grpo_config.py at commit f2cd577 (1.10.0.dev0) and verl's
verl/trainer/ppo/rollout_corr_helper.py at commit b178a3c (0.8.0.dev). Where a peer differs from its note, or from
this project's conventions:
- verl's code tests mean_t(-log ρ_t) (its k1 estimate) against [log lower, log upper], so its bounds apply to
  1 / ρ_geo; its rollout-correction note (docs/algo/rollout_corr_math.md §3.3.3) and IcePop bound the ratio itself.
  mis_geo follows the note: C_min <= ρ_geo <= C, which is verl's code with the threshold "1/C_1/C_min".
- verl drops a rejected sequence from the response mask, so it leaves the normaliser; here it keeps its place, as
  every correction here does (TRL): the micro-batch split (train.micro_batch_size) stays exact, and mis_geo is
  mis_seq with another statistic.

`off_policy_mask` is DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556 eq. 9; TRL
`off_policy_mask_threshold`): a sequence with a negative advantage whose mean log(π_engine / π_θ) exceeds δ is
dropped from the policy loss. The paper's π_old is the inference engine's, as TRL's `sampling_per_token_logps`.

`behaviour_weights` is the decoupled PPO loss's weight (objective.decoupled; Hilton et al., "Batch size-invariance
for policy optimization", arXiv 2110.00641; AReaL's `ppo_actor_loss_fn`, arXiv 2505.24298), for a rollout
that an older policy π_behave generated (rollout.max_staleness > 0, or an engine that differs): π_old is recomputed
as π_prox, the policy the clip is anchored to, and each policy-loss term is weighted by ρ = π_prox / π_behave,
dropped (weight 0) where ρ > C (objective.behave_weight_cap), as AReaL filters. ρ is taken at the level of the
objective's ratio (`level` of gspo_lab.objectives.ratios):
    token     ρ_t = π_prox(y_t) / π_behave(y_t)                                   AReaL's default, GRPO
    sequence  ρ_i = exp(mean_t log ρ_t) on every token of sequence i            GSPO, GSPO-token, GMPO
    turn      ρ_i,k = exp(mean_{t in turn k} log ρ_t) on the tokens of turn k     gspo_turn
The sequence form is length-normalised as GSPO's ratio s_i is, so that a sequence's behaviour weight and its clipped
ratio are on one scale: the product Π_t ρ_t of a 1,000-token sequence is 0 or inf in float32 at a mean |log ρ_t| of
0.09, where the geometric mean is 1.09. AReaL weights per token at every importance_sampling_level; this is the
sequence-level analogue that the GSPO paper's length normalisation calls for.

`diagnostics` are verl's (`rollout_corr_helper.py`, `compute_is_metrics` and `compute_offpolicy_metrics`):
    is/ess         (mean w)² / mean(w²) over tokens, w the weights the correction applies
    is/chi2_token  mean_t ρ_t² - 1                       (log ρ_t clamped to ±20, as verl)
    is/chi2_seq    mean_i (Π_t ρ_t)² - 1                  (log Π_t ρ_t clamped to ±20, as verl)
    is/ppl_ratio   mean_i exp(-mean_t log ρ_t) = PPL_old / PPL_engine per sequence, averaged
verl's ESS clamps its weights to [1/C, C] whatever it applies; here it is the ESS of the weights applied, which is
verl's value where they are clamped so (tis_* with C_min = 1/C). Sequence means leave out rows without a valid token
(verl counts them, with ρ = 1), as every sequence mean of this project does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lab.tensors import masked_mean, turn_mean

CORRECTIONS = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq", "mis_geo")
SEQUENCE_CORRECTIONS = ("tis_seq", "mis_seq", "mis_geo")  # one weight per sequence: fractions count sequences
SAFETY_BOUND = 20.0  # verl's bound on the log-ratios its χ² exponentiates (exp(40) is still finite in float32)


def check_correction_settings(where: str, rollout_correction: str, cap: float, floor: float | None, decoupled: bool,
                              behave_weight_cap: float) -> None:
    """The objective's correction keys (objective.rollout_correction, _cap, _min, decoupled, behave_weight_cap), else
    a ValueError naming `where`.key, the value and the rule."""
    if rollout_correction not in CORRECTIONS:
        raise ValueError(f"{where}.rollout_correction={rollout_correction!r} must be one of {list(CORRECTIONS)}")
    if not cap > 1:
        raise ValueError(f"{where}.rollout_correction_cap={cap!r} must be > 1")
    if floor is not None and not 0 < floor < 1:
        raise ValueError(f"{where}.rollout_correction_min={floor!r} must be in (0, 1) or null")
    if not isinstance(decoupled, bool):
        raise ValueError(f"{where}.decoupled={decoupled!r} must be true or false")
    if decoupled and rollout_correction != "none":
        raise ValueError(f"{where}.decoupled=true and objective.rollout_correction="
                         f"{rollout_correction!r} both weight π_old / π_engine; choose one")
    if not behave_weight_cap > 1:
        raise ValueError(f"{where}.behave_weight_cap={behave_weight_cap!r} must be > 1")


def correction_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str, cap: float,
                       floor: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached weights [B, T] (0 on padding) and the is/* metrics, for one of CORRECTIONS other than none.
    old_logp, rollout_logp, mask: [B, T], padding already zeroed in both log-probs; floor: C_min or None."""
    valid = mask.bool()
    log_rho = (old_logp - rollout_logp).detach()  # [B, T] log ρ_t, 0 on padding
    if mode == "mis_geo":
        floor = 1 / cap if floor is None else floor  # verl: a single threshold u means [1/u, u]
        log_rho = masked_mean(log_rho, mask, dim=-1)[:, None].expand_as(log_rho)  # mean_t log ρ_t: log ρ_geo
    elif mode in SEQUENCE_CORRECTIONS:
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)  # log Π_t ρ_t on every token of the row
    rho = log_rho.exp()  # [B, T]
    outside = (rho > cap) | (rho < floor) if floor is not None else rho > cap
    if mode.startswith("tis"):
        weights = rho.clamp(min=floor, max=cap)
    else:  # mis_geo rejects and does not reweight (verl's Geo-RS has no IS weight)
        weights = (torch.ones_like(rho) if mode == "mis_geo" else rho).masked_fill(outside, 0.0)
    weights = weights.masked_fill(~valid, 0.0)
    dtype = weights.dtype  # counts divided in the weights' dtype (float64 stays float64)
    if mode in SEQUENCE_CORRECTIONS:  # each sequence counted once
        rows = valid.any(-1)
        fraction = (outside[:, 0] & rows).sum().to(dtype) / rows.sum().clamp(min=1).to(dtype)
    else:
        fraction = (outside & valid).sum().to(dtype) / valid.sum().clamp(min=1).to(dtype)
    name = "is/capped_frac" if mode.startswith("tis") else "is/masked_frac"
    weight_mean = weights.sum() / valid.sum().clamp(min=1)
    return weights, {"is/weight_mean": weight_mean, name: fraction}


def behaviour_weights(prox_logp: Tensor, behave_logp: Tensor, mask: Tensor, level: str, cap: float,
                      turns: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The decoupled loss's detached weights [B, T] (see the module docstring) and its metrics: behave/weight_mean
    (the mean weight over the valid tokens), behave/masked_frac (the share of weights over the cap, of tokens,
    sequences or turns by `level`, each counted once) and behave/approx_kl (the token mean of log π_prox - log
    π_behave, AReaL's behave_approx_kl). prox_logp, behave_logp, mask: [B, T], padding zeroed in both log-probs;
    level: token, sequence or turn; turns: [B, T] (gspo_lab.rollout.multi_turn), None: one turn per row.

    >>> prox = torch.tensor([[-1.0, -1.0, 0.0]]); behave = torch.tensor([[-1.5, -0.5, 0.0]])
    >>> mask = torch.tensor([[1.0, 1.0, 0.0]])  # log ρ_t = 0.5, -0.5: e^0.5 = 1.65 is over a cap of 1.5
    >>> behaviour_weights(prox, behave, mask, "token", 1.5)[0]
    tensor([[0.0000, 0.6065, 0.0000]])
    >>> behaviour_weights(prox, behave, mask, "sequence", 1.5)[0]  # exp(mean_t log ρ_t) = exp(0) = 1
    tensor([[1., 1., 0.]])
    """
    if level not in ("token", "sequence", "turn"):
        raise ValueError(f"behaviour_weights: level={level!r} must be token, sequence or turn")
    valid = mask.bool()
    turns = mask.long() if turns is None else turns  # [B, T] one turn per row unless given
    log_rho = (prox_logp - behave_logp).detach()  # [B, T] log ρ_t, 0 on padding
    if level == "sequence":
        log_rho = masked_mean(log_rho, mask, dim=-1)[:, None].expand_as(log_rho)  # log ρ_i on every token
    elif level == "turn":
        log_rho = turn_mean(log_rho, turns, mask)  # log ρ_i,k on every token of turn k
    rho = log_rho.exp()  # [B, T]
    over = (rho > cap) & valid  # [B, T]
    weights = torch.where(over | ~valid, 0.0, rho)  # [B, T]
    # each weight counted once: a token's, a sequence's or a turn's at its first token
    spans = turns if level == "turn" else mask.long()  # [B, T] what one weight covers (token: each valid token)
    first = valid & (torch.nn.functional.pad(spans, (1, 0))[:, :-1] != spans)  # [B, T] the first token of each
    counted = valid if level == "token" else first
    dtype = weights.dtype
    masked = (over & counted).sum().to(dtype) / counted.sum().clamp(min=1).to(dtype)
    return weights, {"behave/weight_mean": masked_mean(weights, mask), "behave/masked_frac": masked,
                     "behave/approx_kl": masked_mean((prox_logp - behave_logp).detach(), mask)}


def diagnostics(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, weights: Tensor) -> dict[str, Tensor]:
    """is/ess, is/chi2_token, is/chi2_seq and is/ppl_ratio (see the module docstring) of ρ_t = π_old / π_engine and
    the applied weights [B, T]; inputs as for `correction_weights`."""
    valid_rows = mask.bool().any(-1).to(mask.dtype)  # [B]
    log_rho = (old_logp - rollout_logp).detach()  # [B, T], 0 on padding
    weight_sq_mean = masked_mean(weights.square(), mask)
    ess = torch.where(weight_sq_mean > 0, masked_mean(weights, mask).square() / weight_sq_mean, 0.0)  # 0: all masked
    rho_token = log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()  # [B, T]
    log_rho_seq = log_rho.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B] log Π_t ρ_t
    ppl_ratio = torch.exp(-masked_mean(log_rho, mask, dim=-1))  # [B] exp(mean_t log π_engine - mean_t log π_old)
    return {
        "is/ess": ess,
        "is/chi2_token": masked_mean(rho_token.square() - 1, mask),  # E_t[ρ²] - 1 (0 without a valid token)
        "is/chi2_seq": masked_mean(torch.exp(2 * log_rho_seq) - 1, valid_rows),  # E_i[(Π ρ)²] - 1
        "is/ppl_ratio": masked_mean(ppl_ratio, valid_rows),
    }


def off_policy_mask(logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor, threshold: float
                    ) -> tuple[Tensor, dict[str, Tensor]]:
    """DeepSeek-V3.2's off-policy sequence mask M [B, T] (1 keep, 0 drop; arXiv 2512.02556 eq. 9, TRL
    `get_off_policy_mask`) and off_policy/masked_frac, the fraction of sequences with a dropped token.
        M_i,t = 0 if A_i,t < 0 and (1/|y_i|) Σ_t log(π_behaviour(y_t) / π_θ(y_t)) > δ, else 1
    logp: π_θ [B, T] (read detached); behaviour_logp: the engine's (or π_old without one); advantages [B, T]."""
    valid = mask.bool()
    seq_kl = masked_mean(behaviour_logp.detach() - logp.detach(), mask, dim=-1)[:, None]  # [B, 1]
    keep = (advantages >= 0) | (seq_kl <= threshold)  # [B, T]
    dropped = (~keep & valid).any(-1).to(mask.dtype)  # [B]
    return keep.to(mask.dtype), {"off_policy/masked_frac": masked_mean(dropped, valid.any(-1).to(mask.dtype))}
