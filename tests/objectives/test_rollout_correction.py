"""Rollout corrections on hand-sized tensors: GRPO on-policy (logp = old), so each token's term is -w A.

Row 0: log ρ_t = log π_old - log π_engine = (log 3, log 0.5), two tokens, A = +1.
Row 1: log ρ_t = (log 2, log 2), A = +1.   C = 2.
    tis_token: w = (2, 0.5 | 2, 2)   capped 1 of 4 (2 is not > 2)  loss -(1.25 + 2) / 2 = -1.625
    mis_token: w = (0, 0.5 | 2, 2)   masked 1 of 4 (2 is not > 2)  loss -(0.25 + 2) / 2 = -1.125
    tis_seq:   Π ρ = (1.5 | 4)  w = (1.5, 1.5 | 2, 2)  capped 1 of 2 sequences   loss -(1.5 + 2) / 2 = -1.75
    mis_seq:   w = (1.5, 1.5 | 0, 0)  masked 1 of 2 sequences   loss -(1.5 + 0) / 2 = -0.75
"""

import math

import pytest
import torch
from hydra.utils import instantiate

from gspo_lab.objectives import GRPO, GSPO
from gspo_lab.train import ConfigError, plan

OLD = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64)
ENGINE = OLD - torch.tensor([[math.log(3), math.log(0.5)], [math.log(2), math.log(2)]], dtype=torch.float64)
MASK = torch.ones(2, 2)
ADV = torch.tensor([1.0, 1.0], dtype=torch.float64)

CASES = {
    "tis_token": ([[2, 0.5], [2, 2]], -1.625, "is/capped_frac", 1 / 4),
    "mis_token": ([[0, 0.5], [2, 2]], -1.125, "is/masked_frac", 1 / 4),
    "tis_seq": ([[1.5, 1.5], [2, 2]], -1.75, "is/capped_frac", 1 / 2),
    "mis_seq": ([[1.5, 1.5], [0, 0]], -0.75, "is/masked_frac", 1 / 2),
}


@pytest.mark.parametrize("mode", sorted(CASES))
def test_each_correction_weights_the_terms_as_derived(mode):
    weights, loss, fraction_key, fraction = CASES[mode]
    logp = OLD.clone().requires_grad_(True)
    out = GRPO(clip_low=0.2, clip_high=0.2, rollout_correction=mode)(logp, OLD, ADV, MASK, rollout_logp=ENGINE)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert out.metrics[fraction_key].item() == pytest.approx(fraction)
    assert out.metrics["is/weight_mean"].item() == pytest.approx(sum(map(sum, weights)) / 4)
    out.loss.backward()  # d loss / d logp_t = -(1/2)(1/2) w_t A: the weight is detached, the ratio is 1
    assert torch.allclose(logp.grad, -torch.tensor(weights, dtype=torch.float64) / 4, atol=1e-12)


def test_no_correction_ignores_the_engine_and_padding_never_counts():
    plain = GRPO()(OLD, OLD, ADV, MASK, rollout_logp=ENGINE)
    assert plain.loss.item() == pytest.approx(-1.0) and "is/weight_mean" not in plain.metrics
    padded = torch.tensor([[1, 0], [1, 1]])  # row 0's second token (ρ = 0.5) is padding
    out = GSPO(rollout_correction="mis_seq")(OLD, OLD, ADV, padded, rollout_logp=ENGINE)
    # row 0: Π ρ = 3 > 2 -> masked; row 1: 4 -> masked; both sequences out
    assert out.metrics["is/masked_frac"].item() == 1 and out.loss.item() == 0


def test_bad_settings_and_a_correction_without_a_trainer_pi_old_are_refused(compose, tmp_path):
    with pytest.raises(ValueError, match=r"objective.rollout_correction='tis' must be one of"):
        GRPO(rollout_correction="tis")
    with pytest.raises(ValueError, match=r"objective.rollout_correction_cap=1.0 must be > 1"):
        GRPO(rollout_correction_cap=1.0)
    with pytest.raises(ConfigError, match=r"rollout_correction='tis_token' is invalid with rollout.logprobs_from_gen"):
        plan(compose(["algorithm=grpo", "objective.rollout_correction=tis_token", f"paths.output_dir={tmp_path}"]))
    plan(compose(["algorithm=grpo", "objective.rollout_correction=tis_token", "rollout.logprobs_from_generation=false",
                  f"paths.output_dir={tmp_path}"]))


# --- Against the peers' formulas, on a random batch --------------------------------------------------------------
# Each reference below is written out from the peer's source, independently of gspo-lab's code:
#   TRL   trl/trainer/grpo_trainer.py at commit f2cd577 (1.10.0.dev0): the IS ratio in _generate_and_score_completions,
#         get_off_policy_mask, and _compute_loss (per_token_kl, use_bias_correction_kl, loss_type "grpo" and "dapo")
#   verl  verl/trainer/ppo/rollout_corr_helper.py at commit b178a3c (0.8.0.dev): compute_rollout_rejection_mask
#         ("seq_mean_k1"), compute_is_metrics (ESS) and compute_offpolicy_metrics (χ², PPL ratio)
# Where gspo-lab departs from a peer on purpose, the reference says so on the line that differs.

SAFETY = 20.0  # verl's SAFETY_BOUND


@pytest.fixture
def peer_batch(random_batch):
    """float64, 6 rows in groups of 2 with padding: row 2 empty, group (4, 5) all-equal (A = 0), π_θ 0.3 off π_old,
    the engine 0.6 off π_old (so both bounds bind), the reference 0.2 off. Padding holds random finite numbers."""
    logp, old, adv, mask = random_batch(B=6, T=7, seed=0)
    mask[2] = 0
    adv[4:] = 0.0
    generator = torch.Generator().manual_seed(1)
    engine = old + 0.6 * torch.randn(old.shape, generator=generator, dtype=old.dtype)
    ref = old + 0.2 * torch.randn(old.shape, generator=generator, dtype=old.dtype)
    return logp, old, adv, mask.double(), engine, ref


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL: the vLLM importance-sampling ratio, [B, T] (token modes) or [B, 1] (sequence modes)."""
    per_token_logps_diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)


def trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    """TRL get_off_policy_mask: [B, 1], 1 keep, 0 drop."""
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (avg_seq_kl <= off_policy_threshold)).to(dtype=mask.dtype)


def trl_loss(logp, old, adv, mask, eps_low, eps_high, loss_type="grpo", is_ratio=None, off_policy=None, beta=0.0,
             ref=None, bias_correction_kl=False):
    """TRL _compute_loss with importance_sampling_level="token", loss_type "grpo" or "dapo" (one process)."""
    advantages = adv.unsqueeze(1)
    coef_1 = torch.exp(logp - old)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        if bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if off_policy is not None:
        per_token_loss = per_token_loss * off_policy
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "dapo":  # normalizer num_items_in_batch: the batch's valid tokens
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    rows = mask.sum(-1) > 0  # TRL's .mean() also counts empty rows; gspo-lab leaves them out (aggregations.py)
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[rows].mean()


def verl_geo_keep(log_ratio, response_mask, rollout_rs_threshold):
    """verl compute_rollout_rejection_mask with rollout_rs="seq_mean_k1": [B] bool, the sequences kept."""
    if "_" in rollout_rs_threshold:  # _parse_rollout_rs_thresholds, for a k1 option
        lower_str, upper_str = rollout_rs_threshold.split("_", 1)
    else:
        upper_str = rollout_rs_threshold
        lower_str = str(1.0 / float(upper_str))
    lower_log, upper_log = math.log(float(lower_str)), math.log(float(upper_str))
    token_k1 = -torch.clamp(log_ratio, min=-SAFETY, max=SAFETY)
    seq_stat = (token_k1 * response_mask).sum(-1) / (response_mask.sum(-1) + 1e-8)  # verl_F.masked_mean, axis=-1
    return (seq_stat >= lower_log) & (seq_stat <= upper_log)


def verl_ess(log_ratio, response_mask, rollout_is, rollout_is_threshold):
    """verl compute_rollout_correction_weights + compute_is_metrics: rollout_is_eff_sample_size. verl's 1e-8 guards
    against an empty mask (in masked_mean and the normalisation) are left out: float rounding, not 1e-8, is checked."""
    if rollout_is == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY, max=SAFETY))
    else:
        log_ratio_sum = (log_ratio * response_mask).sum(-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(log_ratio_sum, min=-SAFETY, max=SAFETY)).expand_as(log_ratio)
    weights = weights * response_mask
    weights_for_ess = weights.clamp(min=1.0 / rollout_is_threshold, max=rollout_is_threshold)
    mean_for_ess = (weights_for_ess * response_mask).sum() / response_mask.sum()
    normalized = weights_for_ess / mean_for_ess
    return 1.0 / ((normalized.square() * response_mask).sum() / response_mask.sum())


def verl_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    """verl compute_offpolicy_metrics: ppl_ratio, chi2_token, chi2_seq (guards left out, as in verl_ess)."""
    def masked_mean(values, axis=None):
        return (values * response_mask).sum(axis) / response_mask.sum(axis)

    log_ppl_diff = masked_mean(rollout_log_prob, -1) - masked_mean(old_log_prob, -1)
    log_ratio = old_log_prob - rollout_log_prob
    rho_token = torch.exp(torch.clamp(log_ratio, min=-SAFETY, max=SAFETY))
    log_ratio_sum = (log_ratio * response_mask).sum(-1)
    return {
        "is/ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "is/chi2_token": masked_mean(rho_token.square()) - 1.0,
        "is/chi2_seq": torch.exp(2.0 * torch.clamp(log_ratio_sum, min=-SAFETY, max=SAFETY)).mean() - 1.0,
    }


def ess_of(weights, mask):
    """(Σ w)² / (N Σ w²) over the valid tokens: verl's ESS formula on the weights a correction applies."""
    return (weights * mask).sum() ** 2 / (mask.sum() * (weights.square() * mask).sum())


def loss_and_grad(objective, logp, *args, **kwargs):
    logp = logp.clone().requires_grad_(True)
    out = objective(logp, *args, **kwargs)
    out.loss.backward()
    return out, logp.grad


def reference_loss_and_grad(logp, *args, **kwargs):
    logp = logp.clone().requires_grad_(True)
    loss = trl_loss(logp, *args, **kwargs)
    loss.backward()
    return loss, logp.grad


def assert_same(out, grad, loss, reference_grad):
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, reference_grad, rtol=0, atol=1e-14)


TRL_MODES = {"tis_token": "token_truncate", "tis_seq": "sequence_truncate", "mis_token": "token_mask",
             "mis_seq": "sequence_mask"}


@pytest.mark.parametrize("clip_min", [None, 0.6])
@pytest.mark.parametrize("mode", sorted(TRL_MODES))
def test_two_sided_bounds_equal_trls_importance_sampling(mode, clip_min, peer_batch):
    """TRL's vllm_importance_sampling_mode with vllm_importance_sampling_clip_min/max = C_min/C: loss, gradient,
    the fraction outside [C_min, C] and the ESS of the weights applied."""
    logp, old, adv, mask, engine, _ = peer_batch
    objective = GRPO(clip_low=0.2, clip_high=0.28, rollout_correction=mode, rollout_correction_min=clip_min)
    out, grad = loss_and_grad(objective, logp, old, adv, mask, rollout_logp=engine)
    is_ratio = trl_is_ratio(old, engine, mask, TRL_MODES[mode], clip_min, 2.0)
    loss, reference_grad = reference_loss_and_grad(logp, old, adv, mask, 0.2, 0.28, is_ratio=is_ratio)
    assert_same(out, grad, loss, reference_grad)
    unbounded_mode = TRL_MODES[mode].replace("truncate", "mask")  # masking with no bounds: the raw ratios
    raw = trl_is_ratio(old, engine, mask, unbounded_mode, None, None)  # [B, T] or [B, 1]
    raw = raw[mask.bool()] if mode.endswith("token") else raw[mask.sum(-1) > 0, 0]  # valid tokens or sequences
    fraction = ((raw > 2.0) | (raw < (clip_min or 0.0))).double().mean()
    assert 0 < fraction < 1  # some weights bound, some not: the check can fail
    key = "is/capped_frac" if mode.startswith("tis") else "is/masked_frac"
    assert out.metrics[key].item() == pytest.approx(fraction.item(), rel=1e-12)
    weights = is_ratio.expand_as(mask) * mask
    assert out.metrics["is/weight_mean"].item() == pytest.approx((weights.sum() / mask.sum()).item(), rel=1e-12)
    assert out.metrics["is/ess"].item() == pytest.approx(ess_of(weights, mask).item(), rel=1e-12)
    if clip_min is not None:  # the lower bound binds, and changes the weights
        assert (raw < clip_min).any()
        unbounded = GRPO(rollout_correction=mode)(logp, old, adv, mask, rollout_logp=engine)
        assert abs(unbounded.metrics["is/weight_mean"].item() - out.metrics["is/weight_mean"].item()) > 1e-3


@pytest.mark.parametrize("bounds, threshold", [((0.95, 1.1), f"{1 / 1.1}_{1 / 0.95}"), ((None, 1.1), "1.1")])
def test_geometric_rejection_equals_verls_seq_mean_k1(bounds, threshold, peer_batch):
    """mis_geo keeps a sequence iff C_min <= exp(mean_t log ρ_t) <= C: verl's seq_mean_k1 with the threshold
    "1/C_1/C_min" (verl bounds exp(-mean_t log ρ_t)); without C_min, verl's single threshold C ([1/C, C]). A kept
    sequence's terms are unweighted, a rejected one's zeroed in place (TRL's masking; verl drops it from the mask)."""
    logp, old, adv, mask, engine, _ = peer_batch
    clip_min, cap = bounds
    objective = GRPO(clip_low=0.2, clip_high=0.28, rollout_correction="mis_geo", rollout_correction_cap=cap,
                     rollout_correction_min=clip_min)
    out, grad = loss_and_grad(objective, logp, old, adv, mask, rollout_logp=engine)
    keep = verl_geo_keep(old - engine, mask, threshold)  # [B]
    rows = mask.sum(-1) > 0
    assert keep[rows].any() and not keep[rows].all()
    loss, reference_grad = reference_loss_and_grad(logp, old, adv, mask, 0.2, 0.28, is_ratio=keep.double()[:, None])
    assert_same(out, grad, loss, reference_grad)
    # verl's rollout_rs_seq_mean_k1_seq_masked_fraction: rejected sequences among those with a valid token
    masked_fraction = ((~keep) & rows).double().sum() / rows.sum()
    assert out.metrics["is/masked_frac"].item() == pytest.approx(masked_fraction.item(), rel=1e-12)
    weights = keep.double()[:, None] * mask
    assert out.metrics["is/ess"].item() == pytest.approx(ess_of(weights, mask).item(), rel=1e-12)


@pytest.mark.parametrize("with_engine", [True, False])
def test_off_policy_mask_equals_trls(with_engine, peer_batch):
    """DeepSeek-V3.2's off-policy sequence mask as TRL computes it: the engine's log-probs where given (else π_old)
    against π_θ; alone, and with a token TIS correction on top (TRL multiplies both)."""
    logp, old, adv, mask, engine, _ = peer_batch
    threshold = 0.1  # engine: rows 0 and 1 dropped; π_old: row 0 only (so the two readings differ)
    sampling = engine if with_engine else old
    off_policy = trl_off_policy_mask(adv.unsqueeze(1), logp, sampling, mask, threshold)  # [B, 1]
    rows = mask.sum(-1) > 0
    negative = rows & (adv < 0)
    assert not off_policy[negative].all() and off_policy[negative].any()  # some negative rows dropped, some kept
    objective = GRPO(clip_low=0.2, clip_high=0.28, off_policy_mask_threshold=threshold)
    out, grad = loss_and_grad(objective, logp, old, adv, mask, rollout_logp=engine if with_engine else None)
    loss, reference_grad = reference_loss_and_grad(logp, old, adv, mask, 0.2, 0.28, off_policy=off_policy)
    assert_same(out, grad, loss, reference_grad)
    dropped = (off_policy[:, 0] == 0) & rows
    assert out.metrics["off_policy/masked_frac"].item() == pytest.approx((dropped.sum() / rows.sum()).item())
    if with_engine:
        both = GRPO(clip_low=0.2, clip_high=0.28, off_policy_mask_threshold=threshold, rollout_correction="tis_token")
        out, grad = loss_and_grad(both, logp, old, adv, mask, rollout_logp=engine)
        is_ratio = trl_is_ratio(old, engine, mask, "token_truncate", None, 2.0)
        loss, reference_grad = reference_loss_and_grad(logp, old, adv, mask, 0.2, 0.28, is_ratio=is_ratio,
                                                       off_policy=off_policy)
        assert_same(out, grad, loss, reference_grad)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_bias_correction_equals_trls_use_bias_correction_kl(bias_correction, peer_batch, compose):
    """objective=dapo with beta = 0.1: TRL's loss_type="dapo" with per_token_kl, times coef_1 = π_θ / π_old under
    use_bias_correction_kl; kl/ref is TRL's "kl" metric (a token mean, as DAPO's aggregation)."""
    logp, old, adv, mask, _, ref = peer_batch
    cfg = compose(["objective=dapo", "objective.beta=0.1", f"objective.kl_bias_correction={bias_correction}"])
    out, grad = loss_and_grad(instantiate(cfg.objective), logp, old, adv, mask, ref_logp=ref)
    loss, reference_grad = reference_loss_and_grad(logp, old, adv, mask, 0.2, 0.28, loss_type="dapo", beta=0.1,
                                                   ref=ref, bias_correction_kl=bias_correction)
    assert_same(out, grad, loss, reference_grad)
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    if bias_correction:
        per_token_kl = per_token_kl * torch.exp(logp - old)
    assert out.metrics["kl/ref"].item() == pytest.approx(((per_token_kl * mask).sum() / mask.sum()).item(), rel=1e-12)


def test_gspos_kl_bias_correction_uses_the_token_ratio_of_the_paper(peer_batch):
    """DeepSeek-V3.2 eq. 8 weights each token's k3 by π_θ(y_t) / π_old(y_t); TRL multiplies by its coef_1, which
    under importance_sampling_level="sequence" (GSPO) is the sequence ratio s_i. gspo-lab follows the paper."""
    logp, old, adv, mask, _, ref = peer_batch
    zero = torch.zeros_like(adv)  # no policy term: the loss is the KL term alone
    out = GSPO(beta=1.0, kl_bias_correction=True)(logp, old, zero, mask, ref_logp=ref)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    rows = mask.sum(-1) > 0

    def seq_mean_token_mean(values):
        return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1))[rows].mean()

    paper = seq_mean_token_mean(k3 * torch.exp(logp - old))
    seq_ratio = torch.exp(((logp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
    assert out.loss.item() == pytest.approx(paper.item(), rel=1e-12)
    assert abs(seq_mean_token_mean(k3 * seq_ratio).item() - paper.item()) > 1e-4


@pytest.mark.parametrize("mode", ["tis_token", "tis_seq"])
def test_diagnostics_equal_verls(mode, peer_batch):
    """is/chi2_token, is/chi2_seq and is/ppl_ratio are verl's compute_offpolicy_metrics of π_old against the engine
    (verl's sequence means also count the empty row, as ρ = 1; here it is left out); is/ess is verl's
    rollout_is_eff_sample_size where the weights are clamped as verl clamps them for it, [1/C, C]."""
    logp, old, adv, mask, engine, _ = peer_batch
    cap = 2.0
    objective = GRPO(rollout_correction=mode, rollout_correction_cap=cap, rollout_correction_min=1 / cap)
    out = objective(logp, old, adv, mask, rollout_logp=engine)
    rows = mask.sum(-1) > 0
    for key, value in verl_offpolicy_metrics(old[rows], engine[rows], mask[rows]).items():
        assert out.metrics[key].item() == pytest.approx(value.item(), rel=1e-12), key
    expected_ess = verl_ess(old - engine, mask, "token" if mode == "tis_token" else "sequence", cap)
    assert 0 < expected_ess < 0.99  # the weights are unequal: an ESS of 1 would not test the formula
    assert out.metrics["is/ess"].item() == pytest.approx(expected_ess.item(), rel=1e-12)


def test_diagnostics_come_with_a_correction_only(peer_batch):
    """Every run passes the engine's log-probs; without a correction π_old is usually the engine's own (ρ = 1), and
    mismatch/* measures the gap, so the is/* columns appear only where a correction is on."""
    logp, old, adv, mask, engine, _ = peer_batch
    plain = GRPO()(logp, old, adv, mask, rollout_logp=engine)
    assert not any(key.startswith("is/") for key in plain.metrics)
    corrected = GRPO(rollout_correction="mis_geo")(logp, old, adv, mask, rollout_logp=engine)
    assert {"is/ess", "is/chi2_token", "is/chi2_seq", "is/ppl_ratio"} <= corrected.metrics.keys()


@pytest.mark.parametrize("mode", ["tis_token", "tis_seq", "mis_token", "mis_seq", "mis_geo"])
def test_an_engine_equal_to_pi_old_gives_the_neutral_diagnostics(mode, peer_batch):
    """ρ = 1 everywhere: ESS 1, χ² 0, PPL ratio 1, every weight 1 and none bound."""
    logp, old, adv, mask, _, _ = peer_batch
    out = GRPO(rollout_correction=mode, rollout_correction_min=0.5)(logp, old, adv, mask, rollout_logp=old)
    expected = {"is/ess": 1, "is/chi2_token": 0, "is/chi2_seq": 0, "is/ppl_ratio": 1, "is/weight_mean": 1,
                "is/capped_frac" if mode.startswith("tis") else "is/masked_frac": 0}
    for key, value in expected.items():
        assert out.metrics[key].item() == pytest.approx(value, abs=1e-12), key


def test_new_settings_are_validated():
    with pytest.raises(ValueError, match=r"objective.rollout_correction_min=1.0 must be in \(0, 1\) or null"):
        GRPO(rollout_correction="tis_token", rollout_correction_min=1.0)
    with pytest.raises(ValueError, match=r"objective.rollout_correction_min=0 must be in \(0, 1\) or null"):
        GSPO(rollout_correction="mis_seq", rollout_correction_min=0)
    with pytest.raises(ValueError, match=r"objective.off_policy_mask_threshold=-0.1 must be > 0"):
        GRPO(off_policy_mask_threshold=-0.1)
