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
