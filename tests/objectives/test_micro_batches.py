"""A mini-batch split into micro-batches gives the mini-batch's loss, gradient and metrics, for every objective of
conf/objective, with the KL term, the rollout corrections and the off-policy mask
(gspo_lab.objectives.micro_batches)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from gspo_lab import CONFIG_DIR
from gspo_lab.objectives.micro_batches import denominator
from gspo_lab.step.metrics import combine_micro_batches
from gspo_lab.tensors import micro_slices

# Clip-Cov and KL-Cov select tokens over the whole mini-batch: the plan refuses micro-batches with them (checked
# in test_verl_policy_losses.py; the last test here shows why)
WHOLE_BATCH = {"clip_cov", "kl_cov"}
OBJECTIVES = sorted({p.stem for p in (Path(CONFIG_DIR) / "objective").glob("*.yaml")} - WHOLE_BATCH)


def batch(rows: int = 6, width: int = 7) -> dict[str, torch.Tensor]:
    """float64 inputs with ragged lengths, one empty row and off-policy ratios that some clips bind on."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 3, 0, 5, 1, 6])[:rows]
    mask = (torch.arange(width)[None] < lengths[:, None]).double()  # [B, T]
    old = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3
    return {
        "logp": (old + 0.3 * torch.randn(rows, width, generator=generator, dtype=torch.float64)).requires_grad_(),
        "old_logp": old,
        "advantages": torch.randn(rows, generator=generator, dtype=torch.float64),
        "mask": mask,
        "ref_logp": old + 0.2 * torch.randn(rows, width, generator=generator, dtype=torch.float64),
        "rollout_logp": old + 0.5 * torch.randn(rows, width, generator=generator, dtype=torch.float64),
    }


def accumulated(objective, inputs: dict, size: int | None):
    """The gradient of Σ_m (D_m / D) loss_m over micro-batches of `size` rows, and the combined metrics."""
    logp = inputs["logp"]
    logp.grad = None
    total = denominator(objective, inputs["mask"])
    parts = []
    for rows in micro_slices(len(logp), size):
        micro = {k: v[rows] for k, v in inputs.items()}
        out = objective(**micro)
        share = (denominator(objective, micro["mask"]) / total.clamp(min=1)).item()
        (out.loss * share).backward()
        mask = micro["mask"]
        parts.append(({k: v.item() for k, v in out.metrics.items()}, mask.sum().item(),
                      mask.bool().any(-1).sum().item(), share))
    return logp.grad.clone(), combine_micro_batches(objective, parts)


# the off-policy mask, the lower bound and the KL bias correction with them (is/ess is rebuilt, not averaged)
KNOBS = ["objective.off_policy_mask_threshold=0.1", "objective.rollout_correction_min=0.5",
         "objective.kl_bias_correction=true"]


@pytest.mark.parametrize("knobs", [False, True], ids=["", "knobs"])
@pytest.mark.parametrize("correction", ["none", "tis_token", "mis_seq", "mis_geo"])
@pytest.mark.parametrize("name", OBJECTIVES)
def test_micro_batches_give_the_mini_batchs_gradient_and_metrics(name, correction, knobs, compose):
    cfg = compose([f"objective={name}", "objective.beta=0.05", f"objective.rollout_correction={correction}",
                   "rollout.logprobs_from_generation=false", *(KNOBS if knobs else [])])
    objective = instantiate(cfg.objective)
    inputs = batch()
    whole_grad, whole = accumulated(objective, inputs, None)
    assert whole_grad.abs().max() > 0 and whole["kl/ref"] > 0
    for size in (1, 2, 4):
        grad, metrics = accumulated(objective, inputs, size)
        # float64: the same sums in another grouping, equal to a few roundings of values of order 1
        torch.testing.assert_close(grad, whole_grad, rtol=0, atol=1e-13)
        assert metrics.keys() == whole.keys()
        for key, value in whole.items():
            assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-13), (name, correction, size, key)


@pytest.mark.parametrize("name", ["gspo", "grpo"])
def test_the_decoupled_losss_metrics_are_the_mini_batchs(name, compose):
    """behave/masked_frac under GSPO's sequence-level weights is a share of sequences: micro-batches combined it by
    tokens (0.4 against the batch's 0.25 in the report)."""
    cfg = compose([f"objective={name}", "objective.decoupled=true", "objective.behave_weight_cap=1.3",
                   "rollout.logprobs_from_generation=false"])
    objective = instantiate(cfg.objective)
    _, whole = accumulated(objective, batch(), None)
    assert 0 < whole["behave/masked_frac"] < 1
    for size in (1, 2, 4):
        _, metrics = accumulated(objective, batch(), size)
        for key in ("behave/masked_frac", "behave/weight_mean", "behave/approx_kl"):
            assert metrics[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-13), (size, key)


def test_a_per_micro_batch_token_mean_would_be_wrong(compose):
    """The classic bug, shown on DAPO's token mean: micro-batches normalised by their own token counts give
    another gradient (so the test above can fail)."""
    objective = instantiate(compose(["objective=dapo"]).objective)
    inputs = batch()
    whole_grad, _ = accumulated(objective, inputs, None)
    logp = inputs["logp"]
    logp.grad = None
    slices = micro_slices(len(logp), 2)
    for rows in slices:
        (objective(**{k: v[rows] for k, v in inputs.items() if k not in ("ref_logp", "rollout_logp")}).loss
         / len(slices)).backward()
    assert (logp.grad - whole_grad).abs().max() > 1e-3


@pytest.mark.parametrize("name", sorted(WHOLE_BATCH))
def test_a_whole_batch_selection_is_not_the_micro_batches(name, compose):
    """Clip-Cov's and KL-Cov's covariance is centred on the whole batch's means and their count of tokens is a
    fraction of its tokens: micro-batches select other tokens, so their accumulated gradient is another (what
    the plan's refusal of train.micro_batch_size avoids)."""
    overrides = ["objective.surrogate.select_frac=0.2"]
    if name == "clip_cov":  # a band that holds this batch's covariances; draws seeded alike
        overrides += ["objective.surrogate.cov_low=0.0", "objective.surrogate.cov_high=10.0"]
    objective = instantiate(compose([f"objective={name}", *overrides]).objective)
    inputs = {k: v for k, v in batch().items() if k not in ("ref_logp", "rollout_logp")}
    torch.manual_seed(0)
    whole_grad, _ = accumulated(objective, inputs, None)
    torch.manual_seed(0)
    grad, _ = accumulated(objective, inputs, 2)
    assert (grad - whole_grad).abs().max() > 1e-3
