"""Entropy control against TRL, on random batches with padding, an empty row and an all-equal group: the entropy bonus
(objective.entropy_coef), top-entropy masking (objective.top_entropy_quantile) and the adaptive coefficient's update
sequence (objective.entropy_target; gspo_lab.objectives.entropy), and where each meets micro-batches.

Each reference is written out from TRL's trl/trainer/grpo_trainer.py at commit f2cd577 (1.10.0.dev0),
independently of gspo-lab's code: get_high_entropy_mask, and _compute_loss's policy loss (loss_type "grpo" and
"dapo", importance_sampling_level "token" and "sequence"), entropy_mask, entropy bonus and adaptive update, for one
process and one micro-batch (gradient accumulation 1, so TRL's `normalizer` is 1 for "grpo" and the batch's valid
tokens, num_items_in_batch, for "dapo"). Where gspo-lab departs on purpose, the line that differs says so.
"""

import logging
import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from gspo_lab import CONFIG_DIR
from gspo_lab.objectives import GRPO, GSPO
from gspo_lab.objectives.entropy import EntropyCoefficient
from gspo_lab.objectives.micro_batches import denominator, weighted_loss
from gspo_lab.step.metrics import combine_micro_batches
from gspo_lab.tensors import micro_slices
from gspo_lab.train import ConfigError, plan

# the objectives with TRL loss types: objective -> (loss_type, importance_sampling_level, epsilon_low, epsilon_high)
TRL_LOSS = {"grpo": ("grpo", "token", 0.2, 0.27), "dapo": ("dapo", "token", 0.2, 0.28),
            "gspo": ("grpo", "sequence", 3e-4, 4e-4)}


@pytest.fixture
def batch(random_batch):
    """float64, 6 rows in groups of 2: row 2 empty, group (4, 5) all-equal (A = 0), π_θ 0.3 off π_old so clips
    bind (GSPO: 0.05); entropies in (0, 3) nats with NaN on padding, which must never count."""
    logp, old, adv, mask = random_batch(B=6, T=7, seed=0)
    mask[2] = 0
    adv[4:] = 0.0
    generator = torch.Generator().manual_seed(2)
    entropy = 3 * torch.rand(logp.shape, generator=generator, dtype=logp.dtype)
    return logp, old, adv, mask.double(), entropy.masked_fill(mask == 0, math.nan)


def trl_high_entropy_mask(entropies, mask, threshold):
    """TRL get_high_entropy_mask, one process (the gather across processes is the local tensor)."""
    local = entropies[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(local, threshold)
    masked_entropies = entropies * mask.float()
    entropy_mask = masked_entropies >= entropy_threshold
    return entropy_mask & mask.bool()


def trl_loss(logp, old, adv, mask, entropies, loss_type, level, eps_low, eps_high, entropy_coef=0.0,
             top_entropy_quantile=1.0):
    """TRL _compute_loss -> (loss, policy_loss, entropy_loss), entropies carrying their graph as under
    _entropy_bonus_enabled."""
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        entropy_mask = trl_high_entropy_mask(entropies, mask, 1 - top_entropy_quantile)
    advantages = adv.unsqueeze(1)
    log_ratio = logp - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if loss_type == "grpo":
        rows = mask.sum(-1) > 0  # TRL's .mean() also counts empty rows; gspo-lab leaves them out (aggregations.py)
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[rows].mean()
        normalizer = 1.0  # current_gradient_accumulation_steps
    else:  # dapo
        normalizer = mask.sum().clamp(min=1.0)  # num_items_in_batch / num_processes
        loss = (per_token_loss * mask).sum() / normalizer
    policy_loss = loss.detach()
    effective_mask = mask if entropy_mask is None else mask * entropy_mask
    if loss_type == "dapo":
        # gspo-lab departs here: TRL divides the kept tokens' entropy sum by every valid token (its normalizer), a
        # mean over the kept tokens (as its other loss types and its adaptive controller take it) only without the
        # mask; gspo-lab divides by the kept tokens for every loss type
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)
    else:
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / normalizer
    return loss - entropy_coef * entropy_loss, policy_loss, entropy_loss


def gradients(objective, logp, old, adv, mask, entropy, **kwargs):
    logp, entropy = logp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    out = objective(logp, old, adv, mask, entropy=entropy, **kwargs)
    out.loss.backward()
    return out, logp.grad, entropy.grad


def reference_gradients(logp, old, adv, mask, entropy, *args, **kwargs):
    logp = logp.clone().requires_grad_(True)
    entropy = entropy.nan_to_num(0.0).requires_grad_(True)  # TRL's entropies are finite on padding
    loss, policy_loss, entropy_loss = trl_loss(logp, old, adv, mask, entropy, *args, **kwargs)
    loss.backward()
    return loss, policy_loss, entropy_loss, logp.grad, entropy.grad


@pytest.mark.parametrize("coef, quantile", [(0.03, 1.0), (0.0, 0.2), (0.03, 0.2), (0.03, 0.0)])
@pytest.mark.parametrize("name", sorted(TRL_LOSS))
def test_entropy_bonus_and_top_entropy_mask_equal_trls(name, coef, quantile, batch, compose):
    """Loss, its gradient with respect to the log-probs and to the entropies, loss/policy (TRL's policy_loss),
    loss/entropy_bonus (coef x TRL's entropy_loss) and entropy/kept_frac (the kept share of the valid tokens)."""
    logp, old, adv, mask, entropy = batch
    if name == "gspo":
        logp = old + (logp - old) / 6  # GSPO's clip range is 3e-4 / 4e-4: sequence ratios on both sides of it
    cfg = compose([f"objective={name}", f"objective.entropy_coef={coef}", f"objective.top_entropy_quantile={quantile}"])
    out, grad, entropy_grad = gradients(instantiate(cfg.objective), logp, old, adv, mask, entropy)
    loss, policy_loss, entropy_loss, reference_grad, reference_entropy_grad = reference_gradients(
        logp, old, adv, mask, entropy, *TRL_LOSS[name], entropy_coef=coef, top_entropy_quantile=quantile)
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, reference_grad, rtol=0, atol=1e-14)
    assert out.metrics["loss/policy"].item() == pytest.approx(policy_loss.item(), rel=1e-12, abs=1e-15)
    if coef:
        assert out.metrics["loss/entropy_bonus"].item() == pytest.approx(coef * entropy_loss.item(), rel=1e-12)
        assert entropy_grad.abs().max() > 0  # the bonus reaches the entropies, only the valid ones
        torch.testing.assert_close(entropy_grad, reference_entropy_grad * mask, rtol=0, atol=1e-15)
    else:
        assert "loss/entropy_bonus" not in out.metrics and entropy_grad is None
    if quantile < 1:
        kept = trl_high_entropy_mask(entropy.nan_to_num(0.0), mask, 1 - quantile)
        assert out.metrics["entropy/kept_frac"].item() == pytest.approx((kept.sum() / mask.sum()).item(), rel=1e-12)
        assert 0 < kept.sum() < mask.sum() - 1  # the mask binds: the test could fail
        assert out.metrics["entropy/kept_mean"].item() == pytest.approx(
            (entropy.nan_to_num(0.0) * kept).sum().item() / kept.sum().item(), rel=1e-12)


def test_the_mask_keeps_the_top_fifth_and_an_empty_batch_keeps_nothing():
    """Ten valid tokens of entropies 0.1 ... 1.0, ρ = 0.2: the 0.8 quantile interpolates to 0.82, so 0.9 and 1.0 are
    kept (2 of 10); a padded token of high entropy never is. No valid token: nothing kept, the loss 0."""
    entropy = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 5.0], [0.6, 0.7, 0.8, 0.9, 1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]])
    logp = torch.zeros(2, 6, dtype=torch.float64)
    out = GRPO(top_entropy_quantile=0.2)(logp, logp, torch.tensor([1.0, -1.0]), mask, entropy=entropy)
    assert out.metrics["entropy/kept_frac"].item() == pytest.approx(0.2)
    assert out.metrics["entropy/kept_mean"].item() == pytest.approx(0.95)
    # on-policy, each kept token's term is -A; row 1 keeps 2 of its 5: -(-1) x 2 / 5, row 0 none; mean over rows
    assert out.loss.item() == pytest.approx(0.2)
    empty = GRPO(top_entropy_quantile=0.2, entropy_coef=0.1)(logp, logp, torch.tensor([1.0, -1.0]), 0 * mask,
                                                              entropy=entropy)
    assert empty.loss.item() == 0 and empty.metrics["entropy/kept_frac"].item() == 0


def test_an_applied_coefficient_replaces_the_configured_one(batch):
    """The module passes the adaptive coefficient of the step; 0 leaves only the policy loss."""
    logp, old, adv, mask, entropy = batch
    objective = GRPO(entropy_coef=0.05, entropy_target=1.0)
    zero = objective(logp, old, adv, mask, entropy=entropy, entropy_coef=0.0)
    assert zero.loss.item() == zero.metrics["loss/policy"].item() and zero.metrics["loss/entropy_bonus"].item() == 0
    half = objective(logp, old, adv, mask, entropy=entropy, entropy_coef=0.025)
    full = objective(logp, old, adv, mask, entropy=entropy)
    assert half.metrics["loss/entropy_bonus"].item() == pytest.approx(full.metrics["loss/entropy_bonus"].item() / 2)


def test_the_adaptive_coefficient_follows_skywork_or1_as_trl_updates_it():
    """c_0 = 0.05, Δ = 0.1, bounds [0, 0.25], target 1 nat; the step's entropy, then by hand (TRL: the coefficient
    applied is the one after the last update, and only while the last entropy was at or below the target; none
    before the first measurement):
        step  applied                     entropy  update
        1     0     (no entropy yet)      0.8      <= 1: c = min(0.05 + 0.1, 0.25) = 0.15
        2     0.15                        0.9      <= 1: c = 0.25
        3     0.25                        1.2      >  1: c = 0.15
        4     0     (1.2 > 1)             0.5      <= 1: c = 0.25
        5     0.25                        0.4      <= 1: c = min(0.35, 0.25) = 0.25
        6     0.25                        2.0      >  1: c = 0.15
        7     0     (2.0 > 1)             3.0      >  1: c = 0.05
        8     0                           1.0      <= 1 (at the target): c = 0.15
        9     0.15                        4.0      >  1: c = 0.05
        10    0                           5.0      >  1: c = max(-0.05, 0) = 0
    """
    entropies = [0.8, 0.9, 1.2, 0.5, 0.4, 2.0, 3.0, 1.0, 4.0, 5.0]
    applied = [0, 0.15, 0.25, 0, 0.25, 0.25, 0, 0, 0.15, 0]
    after = [0.15, 0.25, 0.15, 0.25, 0.25, 0.15, 0.05, 0.15, 0.05, 0]
    control = EntropyCoefficient(coef=0.05, target=1.0, delta=0.1, coef_min=0.0, coef_max=0.25)
    seen_applied, seen_after = [], []
    for entropy in entropies:
        seen_applied.append(control.applied)
        control.update(entropy)
        seen_after.append(control.coef)
    assert seen_applied == pytest.approx(applied, abs=1e-15) and seen_after == pytest.approx(after, abs=1e-15)
    resumed = EntropyCoefficient(coef=0.05, target=1.0, delta=0.1, coef_min=0.0, coef_max=0.25)
    resumed.load_state_dict(control.state_dict())
    assert (resumed.coef, resumed.applied) == (control.coef, control.applied)
    fixed = EntropyCoefficient(coef=0.05)
    fixed.update(0.1)
    assert fixed.enabled and fixed.applied == fixed.coef == 0.05  # without a target the coefficient stays


def accumulated(objective, inputs: dict, size: int | None, weigh=weighted_loss):
    """The gradient of Σ_m weigh(out_m, D_m / D, N_m / N) over micro-batches of `size` rows, and the combined
    metrics."""
    logp = inputs["logp"]
    logp.grad = inputs["entropy"].grad = None
    total, tokens = denominator(objective, inputs["mask"]).clamp(min=1), inputs["mask"].sum().clamp(min=1)
    parts = []
    for rows in micro_slices(len(logp), size):
        micro = {k: v[rows] for k, v in inputs.items()}
        out = objective(**micro)
        share = denominator(objective, micro["mask"]) / total
        weigh(out, share, micro["mask"].sum() / tokens).backward()
        mask = micro["mask"]
        parts.append(({k: v.item() for k, v in out.metrics.items()}, mask.sum().item(),
                      mask.bool().any(-1).sum().item(), share.item()))
    return torch.cat([logp.grad, inputs["entropy"].grad]), combine_micro_batches(objective, parts)


# every conf/objective but Clip-Cov and KL-Cov, which the plan refuses with micro-batches (a whole-batch selection)
SPLITTABLE = sorted({p.stem for p in (Path(CONFIG_DIR) / "objective").glob("*.yaml")} - {"clip_cov", "kl_cov"})


@pytest.mark.parametrize("name", SPLITTABLE)
def test_micro_batches_give_the_mini_batchs_entropy_bonus(name, batch, compose):
    """With the bonus (and the KL term), micro-batches of 1, 2 and 4 rows accumulate the whole mini-batch's gradient
    with respect to the log-probs and the entropies, and its metrics, loss/total and loss/entropy_bonus included."""
    logp, old, adv, mask, entropy = batch
    cfg = compose([f"objective={name}", "objective.entropy_coef=0.03", "objective.beta=0.05"])
    objective = instantiate(cfg.objective)
    inputs = {"logp": logp.clone().requires_grad_(), "old_logp": old, "advantages": adv, "mask": mask,
              "ref_logp": old + 0.1, "entropy": entropy.nan_to_num(0.0).requires_grad_()}
    whole_grad, whole = accumulated(objective, inputs, None)
    for size in (1, 2, 4):
        grad, metrics = accumulated(objective, inputs, size)
        torch.testing.assert_close(grad, whole_grad, rtol=0, atol=1e-13)
        for key, value in whole.items():
            assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-13), (name, size, key)


def test_weighing_the_bonus_like_the_loss_would_be_wrong(batch, compose):
    """GRPO's sequence mean weighs a micro-batch by its rows, the bonus by its tokens: weighting the whole loss by
    D_m / D gives another gradient (so the test above can fail)."""
    logp, old, adv, mask, entropy = batch
    objective = instantiate(compose(["objective=grpo", "objective.entropy_coef=0.03"]).objective)
    inputs = {"logp": logp.clone().requires_grad_(), "old_logp": old, "advantages": adv, "mask": mask,
              "entropy": entropy.nan_to_num(0.0).requires_grad_()}
    whole_grad, _ = accumulated(objective, inputs, None)
    naive_grad, _ = accumulated(objective, inputs, 2, weigh=lambda out, share, token_share: out.loss * share)
    assert (naive_grad - whole_grad).abs().max() > 1e-4


@pytest.mark.parametrize("key, value, message", [
    ("top_entropy_quantile", 1.5, r"objective.top_entropy_quantile=1.5 must be in \[0, 1\]"),
    ("entropy_coef", math.inf, r"objective.entropy_coef=inf must be finite"),
])
def test_bad_entropy_settings_are_refused_naming_key_value_and_rule(key, value, message):
    with pytest.raises(ValueError, match=message):
        GSPO(**{key: value})


def test_bad_adaptive_settings_are_refused_naming_key_value_and_rule():
    with pytest.raises(ValueError, match=r"objective.entropy_target=0.0 must be > 0 nats, or null"):
        GRPO(entropy_target=0.0)
    with pytest.raises(ValueError, match=r"objective.entropy_coef_delta=0.0 must be > 0"):
        GRPO(entropy_target=1.0, entropy_coef_delta=0.0)
    with pytest.raises(ValueError, match=r"objective.entropy_coef_min=0.5 must satisfy 0 <= entropy_coef_min <= "
                                         r"entropy_coef_max = 0.1"):
        GRPO(entropy_target=1.0, entropy_coef_min=0.5, entropy_coef_max=0.1)
    with pytest.raises(ValueError, match=r"objective.entropy_coef=2.0 must be in \[entropy_coef_min, entropy_coef_"):
        GRPO(entropy_target=1.0, entropy_coef=2.0)
    with pytest.raises(ValueError, match=r"need the policy's entropy at each token"):
        GRPO(entropy_coef=0.1)(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))


@pytest.mark.parametrize("override, message", [
    ("objective.entropy_coef_delta=-0.005", r"objective.entropy_coef_delta=-0.005 must be > 0"),
    ("objective.entropy_coef_min=-0.1", r"objective.entropy_coef_min=-0.1 must satisfy 0 <= entropy_coef_min <= "
                                        r"entropy_coef_max = 1.0"),
    ("objective.entropy_coef_max=-1", r"objective.entropy_coef_max=-1 must be >= 0"),
])
@pytest.mark.parametrize("objective", ["gspo", "dapo"])  # a fixed class and one composed in YAML
def test_negative_adaptive_settings_are_refused_by_the_plan_also_without_a_target(objective, override, message,
                                                                                  compose, tmp_path):
    with pytest.raises(ConfigError, match=message):
        plan(compose([f"objective={objective}", override, f"paths.output_dir={tmp_path}"]))


def test_a_negative_entropy_coef_is_an_entropy_penalty_and_the_plan_says_so(compose, tmp_path, caplog):
    """A deliberate choice (entropy minimisation, arXiv 2505.15134), not refused: the run logs what it does."""
    with caplog.at_level(logging.WARNING, logger="gspo_lab.objectives.entropy"):
        objective = plan(compose(["objective.entropy_coef=-0.01", f"paths.output_dir={tmp_path}"])).objective
    assert "GSPO: objective.entropy_coef=-0.01 < 0 is an entropy penalty, not a bonus: the loss adds 0.01 x the mean " \
           "entropy" in caplog.text
    # H̄ = 2 on the one valid token: the loss is the policy term + 0.01 x 2
    logp, mask = torch.zeros(1, 2), torch.tensor([[1.0, 0.0]])
    out = objective(logp, logp, torch.ones(1), mask, entropy=torch.tensor([[2.0, 5.0]]))
    assert out.entropy_bonus.item() == pytest.approx(-0.02) and out.loss.item() == pytest.approx(-1 + 0.02)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gspo_lab.objectives.entropy"):
        plan(compose(["objective.entropy_coef=0.01", f"paths.output_dir={tmp_path}"]))
    assert "entropy_coef" not in caplog.text


def test_top_entropy_masking_with_micro_batches_is_refused_in_the_plan(compose, tmp_path):
    """TRL takes the quantile over the micro-batch it computes the loss of; here micro-batches would then keep other
    tokens than their mini-batch, and train.micro_batch_size is only a memory setting."""
    out = f"paths.output_dir={tmp_path}"
    with pytest.raises(ConfigError, match=r"objective.top_entropy_quantile=0.2 is invalid with train.micro_batch_size "
                                          r"set: .* set train.micro_batch_size=null"):
        plan(compose(["objective.top_entropy_quantile=0.2", "train.micro_batch_size=4", out]))
    plan(compose(["objective.top_entropy_quantile=0.2", out]))
    plan(compose(["objective.entropy_coef=0.01", "train.micro_batch_size=4", out]))  # the bonus splits exactly
