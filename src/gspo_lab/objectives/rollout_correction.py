"""Corrections for the rollout engine's mismatch to the trainer, as the field applies them (TRL's
`vllm_importance_sampling_mode`: token/sequence × truncate/mask; truncated IS from Yao et al. 2025).

The completions were sampled by the engine (π_engine) while π_old comes from a trainer forward; each token's
policy-loss term is weighted by a detached importance weight built from ρ_t = π_old(y_t) / π_engine(y_t):
    tis_token  sg[min(ρ_t, C)]                        (TRL token_truncate)
    tis_seq    sg[min(Π_t ρ_t, C)] on every token      (TRL sequence_truncate)
    mis_token  sg[ρ_t] where ρ_t <= C, else 0          (TRL token_mask)
    mis_seq    sg[Π_t ρ_t] if it is <= C, else 0       (TRL sequence_mask)
A masked token or sequence keeps its place in the loss's normaliser, as in TRL (its term is only zeroed).
TRL also takes an optional lower bound; here only the cap C applies.
"""

from __future__ import annotations

from torch import Tensor

CORRECTIONS = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq")


def correction_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str, cap: float
                       ) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached weights [B, T] (0 on padding) and the is/* metrics, for one of CORRECTIONS other than none.
    old_logp, rollout_logp, mask: [B, T], padding already zeroed in both log-probs."""
    valid = mask.bool()
    log_rho = (old_logp - rollout_logp).detach()  # [B, T] log ρ_t, 0 on padding
    if mode.endswith("_seq"):
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)  # log Π_t ρ_t on every token of the row
    rho = log_rho.exp()  # [B, T]
    over = rho > cap
    weights = rho.clamp(max=cap) if mode.startswith("tis") else rho.masked_fill(over, 0.0)
    weights = weights.masked_fill(~valid, 0.0)
    dtype = weights.dtype  # counts divided in the weights' dtype (float64 stays float64)
    if mode.endswith("_seq"):  # each sequence counted once
        rows = valid.any(-1)
        fraction = (over[:, 0] & rows).sum().to(dtype) / rows.sum().clamp(min=1).to(dtype)
    else:
        fraction = (over & valid).sum().to(dtype) / valid.sum().clamp(min=1).to(dtype)
    name = "is/capped_frac" if mode.startswith("tis") else "is/masked_frac"
    weight_mean = weights.sum() / valid.sum().clamp(min=1)
    return weights, {"is/weight_mean": weight_mean, name: fraction}
