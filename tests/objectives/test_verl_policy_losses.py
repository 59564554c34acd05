"""Clip-Cov, KL-Cov, DPPO-Binary-TV/-KL, GPG and DRO against verl's policy losses, written out again here from
verl-project/verl 0.10.0.dev, commit 1dda039, verl/trainer/ppo/core_algos.py (`compute_policy_loss_clip_cov`,
`_kl_cov`, `_dppo_tv`, `_dppo_kl`, `_gpg`, `_dro`, and `agg_loss`, `verl_F.masked_mean`), independently of gspo-lab's
code: loss, gradient and metrics to float64 rounding on random padded batches with an empty row and an
all-equal group (zero advantages). DPPO's mask metrics also follow prime-rl's `is_masked_low` / `_high`
(PrimeIntellect-ai/prime-rl 559b447, src/prime_rl/trainer/rl/loss.py).

Clip-Cov draws its tokens with torch.randperm on the global generator, as verl: each comparison seeds torch before
the objective and again before the reference, so both draw the same permutation; the batches have more candidates
than tokens to draw, so a different draw would change the loss (checked). KL-Cov's top-k and Clip-Cov's band are
checked to be unambiguous: no two covariances tie at the k-th place and none lies within 1e-6 of a band edge.
"""

from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate

from gspo_lab.objectives import Objective
from gspo_lab.objectives.aggregations import ConstantNormaliser, TokenMean
from gspo_lab.objectives.covariance import ClipCov, KLCov
from gspo_lab.objectives.ratios import TokenRatio
from gspo_lab.objectives.surrogates import DPPO, DRO, PolicyGradient
from gspo_lab.train import ConfigError, plan

SEEDS = (0, 1, 2)


def batch(seed: int, groups: int = 3, group_size: int = 4, width: int = 9, spread: float = 0.4):
    """float64 logp, old_logp (log-probs <= 0), advantages [B] and mask [B, T] (right padding), B = 12 in groups
    of 4: ragged lengths, row 2 empty, advantages centred in each group (both signs), group 1 (rows 4-7) a group
    whose rewards were all equal (A = 0)."""
    g = torch.Generator().manual_seed(seed)
    rows = groups * group_size
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[2] = 0
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    logp = -(old + spread * torch.randn(rows, width, generator=g, dtype=torch.float64)).abs()
    adv = torch.randn(groups, group_size, generator=g, dtype=torch.float64)
    adv = adv - adv.mean(-1, keepdim=True)
    adv[1] = 0
    return logp, old, adv.flatten(), mask


def verl_inputs(logp, old, adv, mask):
    """verl's tensors: the log-probs as given (a fresh leaf) and token-level advantages A_i · mask (its
    `advantages` are [B, T], zero on padding)."""
    return logp.clone().requires_grad_(True), old, adv[:, None] * mask, mask


def masked_mean(values, mask):  # verl_F.masked_mean: Σ v m / (Σ m + 1e-8)
    return (values * mask).sum() / (mask.sum() + 1e-8)


def token_mean(loss_mat, mask):  # agg_loss "token-mean" on one rank
    return (loss_mat * mask).sum() / mask.sum()


def seq_mean_token_sum_norm(loss_mat, mask, horizon):  # agg_loss "seq-mean-token-sum-norm", loss_scale_factor T
    seq_losses = (loss_mat * mask).sum(-1)
    seq_mask = (mask.sum(-1) > 0).double()
    return (seq_losses * seq_mask).sum() / seq_mask.sum() / horizon


def ours(objective, logp, old, adv, mask, seed=None):
    """The objective's output and gradient on a fresh leaf; `seed` seeds torch first (Clip-Cov's draw)."""
    logp = logp.clone().requires_grad_(True)
    if seed is not None:
        torch.manual_seed(seed)
    out = objective(logp, old, adv, mask)
    out.loss.backward()
    return out, logp.grad


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)


def close_to_verls_mean(actual, expected):
    """A metric against verl's masked_mean, whose 1e-8 in the denominator moves a mean over N tokens by 1e-8 / N
    relative (gspo-lab's has none)."""
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-14)


def composed(surrogate, aggregation=None):
    return Objective(TokenRatio(), surrogate, aggregation or TokenMean(), name="verl")


# ---- Clip-Cov -----------------------------------------------------------------------------------------------


def verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_cov_ratio,
                  clip_cov_lb, clip_cov_ub):
    """compute_policy_loss_clip_cov with loss_agg_mode token-mean: (loss, pg_clipfrac)."""
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask))
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0))
    if len(top_k_idx) > 0:
        top_k_idx = top_k_idx[torch.randperm(len(top_k_idx))[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = masked_mean((corr == 0).double(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return token_mean(pg_losses, response_mask), pg_clipfrac


def covariances(logp, adv, mask):
    """(A - mean A)(log π - mean log π) over the valid tokens, from the compacted valid entries."""
    valid = mask.bool()
    a, lp = adv[:, None].expand_as(logp)[valid], logp[valid]
    return (a - a.mean()) * (lp - lp.mean())


# clip 0.2 / 0.2 so the ratio clip excludes some tokens; a band that leaves some tokens above it; 10% drawn
CLIP_COV = dict(clip_low=0.2, clip_high=0.2, select_frac=0.1, cov_low=0.05, cov_high=0.5)


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_is_verls_loss_gradient_and_metrics(seed):
    logp, old, adv, mask = batch(seed)
    objective = composed(ClipCov(**CLIP_COV))
    out, grad = ours(objective, logp, old, adv, mask, seed=seed)
    ref_logp, ref_old, ref_adv, ref_mask = verl_inputs(logp, old, adv, mask)
    torch.manual_seed(seed)
    loss, pg_clipfrac = verl_clip_cov(ref_old, ref_logp, ref_adv, ref_mask, 0.2, 0.2, 0.1, 0.05, 0.5)
    loss.backward()
    close(out.loss, loss)
    close(grad, ref_logp.grad)
    close_to_verls_mean(out.metrics["cov/selected_frac"], pg_clipfrac)
    valid = mask.bool()
    cov = covariances(logp, adv, mask)
    ratio = torch.exp(logp - old)[valid]
    a = adv[:, None].expand_as(logp)[valid]
    clipped = ((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    in_band = (cov > 0.05) & (cov < 0.5)
    assert (cov - 0.05).abs().min() > 1e-6 and (cov - 0.5).abs().min() > 1e-6  # the band is unambiguous
    candidates = (in_band & ~clipped).sum().item()
    drawn = int(0.1 * valid.sum().item())
    assert candidates > drawn > 0 and clipped.any() and (cov >= 0.5).any()  # every branch is exercised
    close(out.metrics["cov/candidate_frac"], torch.tensor(candidates / valid.sum().item(), dtype=torch.float64))
    close(out.metrics["cov/mean"], cov.mean())
    close(out.metrics["clip/frac"], clipped.double().mean())


def test_clip_cov_draws_at_random_and_a_seed_repeats_the_draw():
    """The draw is what the test above matches: other seeds drop other tokens (other losses, where a dropped token
    has A != 0), the same seed the same ones."""
    logp, old, adv, mask = batch(1)
    objective = composed(ClipCov(**CLIP_COV))
    losses = [ours(objective, logp, old, adv, mask, seed=s)[0].loss.item() for s in (0, 1, 2, 3, 0)]
    assert len(set(losses[:4])) == 4 and losses[4] == losses[0]


def test_clip_cov_with_fewer_candidates_than_draws_drops_them_all_whatever_the_seed():
    """select_frac 1: every candidate is dropped, so the loss is the clipped term summed over the others (built
    here from the candidates' definition, no verl code)."""
    logp, old, adv, mask = batch(1)
    settings = {**CLIP_COV, "select_frac": 1.0}
    out, grad = ours(composed(ClipCov(**settings)), logp, old, adv, mask, seed=5)
    valid = mask.bool()
    ratio = torch.exp(logp - old)
    a = adv[:, None].expand_as(logp)
    term = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    clipped = ((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    cov = torch.zeros_like(logp)
    cov[valid] = covariances(logp, adv, mask)
    dropped = valid & ~clipped & (cov > 0.05) & (cov < 0.5)
    close(out.loss, (term * (valid & ~dropped)).sum() / valid.sum())
    assert (grad[dropped] == 0).all() and (grad[valid & ~dropped & (a != 0) & ~clipped] != 0).all()
    close(out.metrics["cov/selected_frac"], dropped.sum() / valid.sum().double())


# ---- KL-Cov -------------------------------------------------------------------------------------------------


def verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio, ppo_kl_coef):
    """compute_policy_loss_kl_cov with loss_agg_mode token-mean."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            rows, cols = large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            pg_losses[rows, cols] = pg_losses_kl[rows, cols]
    return token_mean(pg_losses, response_mask)


@pytest.mark.parametrize("select_frac, kl_coef", [(0.25, 1.0), (2e-3, 0.1)])  # ... and verl's config defaults
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_cov_is_verls_loss_gradient_and_metrics(seed, select_frac, kl_coef):
    logp, old, adv, mask = batch(seed)
    out, grad = ours(composed(KLCov(select_frac=select_frac, kl_coef=kl_coef)), logp, old, adv, mask)
    ref_logp, ref_old, ref_adv, ref_mask = verl_inputs(logp, old, adv, mask)
    loss = verl_kl_cov(ref_old, ref_logp, ref_adv, ref_mask, select_frac, kl_coef)
    loss.backward()
    close(out.loss, loss)
    close(grad, ref_logp.grad)
    cov = covariances(logp, adv, mask).sort(descending=True).values
    count = max(1, int(len(cov) * select_frac))
    assert cov[count - 1] - cov[count] > 1e-9  # the top-k is unambiguous
    close(out.metrics["cov/selected_frac"], torch.tensor(count / len(cov), dtype=torch.float64))
    close(out.metrics["cov/mean"], cov.mean())
    # the penalty changed the loss: without it the loss is the plain -r A token mean
    plain = token_mean(-ref_adv * torch.exp(ref_logp - ref_old), ref_mask)
    assert (loss - plain).abs() > 1e-6


# ---- DPPO ---------------------------------------------------------------------------------------------------


def verl_dppo(old_log_prob, log_prob, advantages, response_mask, divergence, low, high, clip_ratio_c, horizon):
    """compute_policy_loss_dppo_tv / _dppo_kl with loss_agg_mode seq-mean-token-sum-norm (the DPPO recipe):
    (loss, pg_clipfrac, pg_clipfrac_lower, the mask's masked tokens)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if divergence == "tv":
        valid_positive_mask = (prob - old_prob) <= high
        valid_negative_mask = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_positive_mask = (binary_kl <= high) | (prob <= old_prob)
        valid_negative_mask = (binary_kl <= low) | (prob >= old_prob)
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask).detach().double()
    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    loss = seq_mean_token_sum_norm(pg_losses, response_mask, horizon)
    pg_clipfrac = masked_mean(1.0 - valid_mask, response_mask)
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).double() * valid_mask, response_mask)
    return loss, pg_clipfrac, pg_clipfrac_lower, (1.0 - valid_mask) * response_mask


@pytest.mark.parametrize("cap", [None, 1.2])
@pytest.mark.parametrize("divergence, low, high", [("tv", 0.1, 0.15), ("kl", 0.03, 0.05)])
@pytest.mark.parametrize("seed", SEEDS)
def test_dppo_is_verls_loss_gradient_and_metrics(seed, divergence, low, high, cap):
    logp, old, adv, mask = batch(seed, spread=0.6)
    surrogate = DPPO(divergence=divergence, divergence_low=low, divergence_high=high, cap=cap)
    out, grad = ours(composed(surrogate, ConstantNormaliser(max_len=12)), logp, old, adv, mask)
    ref_logp, ref_old, ref_adv, ref_mask = verl_inputs(logp, old, adv, mask)
    loss, pg_clipfrac, pg_clipfrac_lower, masked = verl_dppo(ref_old, ref_logp, ref_adv, ref_mask, divergence, low,
                                                              high, float("inf") if cap is None else cap, 12)
    loss.backward()
    close(out.loss, loss)
    close(grad, ref_logp.grad)
    a = adv[:, None].expand_as(logp)
    # prime-rl's is_masked_high / is_masked_low: masked tokens with A > 0 and with A < 0
    close_to_verls_mean(out.metrics["clip/frac_high"], masked_mean(masked * (a > 0), mask))
    close_to_verls_mean(out.metrics["clip/frac_low"], masked_mean(masked * (a < 0), mask))
    # verl's pg_clipfrac also counts the masked tokens with A = 0 (their term is 0); here they are not clipped
    zero_adv_masked = masked_mean(masked * (a == 0), mask)
    close_to_verls_mean(out.metrics["clip/frac"] + zero_adv_masked, pg_clipfrac)
    assert (masked * (a > 0)).any() and (masked * (a < 0)).any()  # both directions bind on this batch
    if cap is None:
        assert "dppo/capped_frac" not in out.metrics
    else:
        close_to_verls_mean(out.metrics["dppo/capped_frac"], pg_clipfrac_lower)
        assert pg_clipfrac_lower > 0


def test_dppo_kl_masks_only_in_the_advantages_direction():
    """Hand-sized: π_old = 0.5 on every token; π rises to 0.9 or falls to 0.1 (binary KL 0.511 either way), with
    A = +1 or -1. Masked exactly where the move follows A: rise with A > 0, fall with A < 0; kept otherwise."""
    old = torch.full((1, 4), 0.5, dtype=torch.float64).log()
    logp = torch.tensor([[0.9, 0.1, 0.9, 0.1]], dtype=torch.float64).log()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    objective = composed(DPPO(divergence="kl", divergence_low=0.5, divergence_high=0.5))
    out, grad = ours(objective, logp, old, adv, torch.ones(1, 4))
    # kept: tokens 1 (fell, A > 0) and 2 (rose, A < 0): loss -(1 · 0.2 · log 0.1 - 1 · 1.8 · log 0.9) / 4
    close(out.loss, torch.tensor(-(0.2 * math.log(0.1) - 1.8 * math.log(0.9)) / 4, dtype=torch.float64))
    close(grad, torch.tensor([[0.0, -0.2 / 4, 1.8 / 4, 0.0]], dtype=torch.float64))
    assert out.metrics["clip/frac_high"] == 0.25 and out.metrics["clip/frac_low"] == 0.25


# ---- GPG and DRO --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_gpg_and_dro_are_verls_loss_and_gradient(seed):
    logp, old, adv, mask = batch(seed)
    for surrogate, verl_loss in [
        (PolicyGradient(), lambda lp, o, a: -lp * a),  # compute_policy_loss_gpg
        (DRO(penalty_coef=0.3), lambda lp, o, a: -(lp * a - 0.5 * 0.3 * (lp - o).square())),  # _dro
    ]:
        out, grad = ours(composed(surrogate), logp, old, adv, mask)
        ref_logp, ref_old, ref_adv, ref_mask = verl_inputs(logp, old, adv, mask)
        loss = token_mean(verl_loss(ref_logp, ref_old, ref_adv), ref_mask)
        loss.backward()
        close(out.loss, loss)
        close(grad, ref_logp.grad)
        own = {k for k in out.metrics if not k.startswith(("ratio/", "kl/", "mask/", "loss/"))}
        assert own == set()


# ---- configuration ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, surrogate, aggregation", [
    ("clip_cov", ClipCov(clip_low=1.0, clip_high=1.0, select_frac=2e-4, cov_low=1.0, cov_high=5.0), TokenMean()),
    ("kl_cov", KLCov(select_frac=2e-3, kl_coef=1.0), TokenMean()),
    ("dppo_tv", DPPO(divergence="tv", divergence_low=0.15, divergence_high=0.15, cap=None), ConstantNormaliser(8)),
    ("dppo_kl", DPPO(divergence="kl", divergence_low=0.05, divergence_high=0.05, cap=None), ConstantNormaliser(8)),
    ("gpg", PolicyGradient(), TokenMean()),
    ("dro", DRO(penalty_coef=0.05), TokenMean()),
])
def test_each_yaml_holds_its_recipe(name, surrogate, aggregation, compose):
    """The authors' 7B recipes (Clip-Cov, KL-Cov), verl's DPPO example (0.15 / 0.05, B x max_len; max_len is
    rollout.max_new_tokens, 8 by default), verl's gpg and its dro usage example (β 0.05)."""
    objective = instantiate(compose([f"algorithm={name}"]).objective)
    assert (objective.name, objective.surrogate, objective.aggregation) == (name, surrogate, aggregation)
    assert objective.ratio == TokenRatio() and objective.beta == 0 and objective.rollout_correction == "none"


def test_dppo_thresholds_scale_with_clip_scale(compose):
    objective = instantiate(compose(["algorithm=dppo_tv", "clip_scale=2.0"]).objective)
    assert (objective.surrogate.divergence_low, objective.surrogate.divergence_high) == (0.3, 0.3)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_the_plan_refuses_micro_batches_with_a_whole_batch_selection(name, compose, tmp_path):
    with pytest.raises(ConfigError, match=rf"train\.micro_batch_size is set, but objective={name} .*"
                                          r"train\.micro_batch_size=null"):
        plan(compose([f"algorithm={name}", "train.micro_batch_size=2", f"paths.output_dir={tmp_path}"]))


@pytest.mark.parametrize("make, message", [
    (lambda: ClipCov(clip_low=1.5), r"ClipCov: objective\.surrogate\.clip_low=1\.5 must satisfy 0 < clip_low <= 1"),
    (lambda: ClipCov(cov_low=5.0, cov_high=1.0), r"ClipCov: objective\.surrogate\.cov_low=5\.0 must be below"),
    (lambda: KLCov(select_frac=0.0), r"KLCov: objective\.surrogate\.select_frac=0\.0 must be in \(0, 1\]"),
    (lambda: KLCov(kl_coef=-1.0), r"KLCov: objective\.surrogate\.kl_coef=-1\.0 must be > 0"),
    (lambda: DPPO(divergence="js"), r"DPPO: objective\.surrogate\.divergence='js' must be 'tv' or 'kl'"),
    (lambda: DPPO(divergence_low=0.0), r"DPPO: objective\.surrogate\.divergence_low=0\.0 must be > 0"),
    (lambda: DPPO(cap=0.5), r"DPPO: objective\.surrogate\.cap=0\.5 must be >= 1 or null"),
    (lambda: DRO(penalty_coef=0.0), r"DRO: objective\.surrogate\.penalty_coef=0\.0 must be > 0"),
])
def test_bad_settings_are_refused_with_key_value_and_rule(make, message):
    with pytest.raises(ValueError, match=message):
        make()
