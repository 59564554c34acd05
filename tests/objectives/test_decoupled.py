"""The decoupled PPO loss (objective.decoupled) on hand-sized tensors, against AReaL's `ppo_actor_loss_fn`
(areal/utils/functional.py): π_θ = π_prox (the recomputed π_old), so every ratio is 1 and each token's term is
-w A, w = π_prox / π_behave, dropped (0) where w > C, kept where w = C.

Row 0: log ρ_t = log π_prox - log π_behave = (log 3, log 0.5), A = +1.
Row 1: log ρ_t = (log 2, log 2), A = +1.
    token (GRPO), C = 2:     w = (0, 0.5 | 2, 2)             dropped 1 of 4 tokens   loss -(0.25 + 2) / 2 = -1.125
    sequence (GSPO), C = 2.5: ρ_i = (sqrt(1.5) | 2)          dropped 0 of 2          loss -(sqrt(1.5) + 2) / 2
    sequence (GSPO), C = 1.5: w = (sqrt(1.5) x 2 | 0, 0)      dropped 1 of 2          loss -sqrt(1.5) / 2
Each aggregation is the mean over sequences of the token mean, so d loss / d logp_t = -w_t A / 4 for both: the
weight carries no gradient (GRPO: d w_t / d logp_t = 1 at ratio 1; GSPO: d s_i / d logp_t = 1 / |y_i|).
"""

import math

import pytest
import torch

from gspo_lab.objectives import GRPO, GSPO, GSPOToken, Objective
from gspo_lab.objectives.aggregations import SeqMeanTokenMean
from gspo_lab.objectives.ratios import TurnRatio
from gspo_lab.objectives.rollout_correction import behaviour_weights
from gspo_lab.objectives.surrogates import ClippedMin
from gspo_lab.train import ConfigError, plan

PROX = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64)
BEHAVE = PROX - torch.tensor([[math.log(3), math.log(0.5)], [math.log(2), math.log(2)]], dtype=torch.float64)
MASK = torch.ones(2, 2)
ADV = torch.tensor([1.0, 1.0], dtype=torch.float64)
ROOT = math.sqrt(1.5)

CASES = {  # objective, cap -> weights, loss, behave/masked_frac
    "token": (GRPO, 2.0, [[0, 0.5], [2, 2]], -1.125, 1 / 4),
    "sequence": (GSPO, 2.5, [[ROOT, ROOT], [2, 2]], -(ROOT + 2) / 2, 0.0),
    "sequence_capped": (GSPO, 1.5, [[ROOT, ROOT], [0, 0]], -ROOT / 2, 1 / 2),
    "sequence_token": (GSPOToken, 1.5, [[ROOT, ROOT], [0, 0]], -ROOT / 2, 1 / 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_behaviour_weight_multiplies_each_term_as_derived(case):
    objective, cap, weights, loss, masked = CASES[case]
    logp = PROX.clone().requires_grad_(True)
    out = objective(decoupled=True, behave_weight_cap=cap)(logp, PROX, ADV, MASK, rollout_logp=BEHAVE)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert out.metrics["behave/masked_frac"].item() == pytest.approx(masked)
    assert out.metrics["behave/weight_mean"].item() == pytest.approx(sum(map(sum, weights)) / 4)
    # AReaL's behave_approx_kl: the token mean of log π_prox - log π_behave = (log 3 + log 0.5 + 2 log 2) / 4
    assert out.metrics["behave/approx_kl"].item() == pytest.approx(math.log(6) / 4)
    out.loss.backward()
    assert torch.allclose(logp.grad, -torch.tensor(weights, dtype=torch.float64) / 4, atol=1e-12)


def test_the_turn_form_weights_each_turn_by_its_own_geometric_mean():
    """One row: turn 1 = (log 3, log 0.5), a tool token, turn 2 = (log 2); C = 1.5. Turn 1's weight is sqrt(1.5),
    turn 2's is 2 > C: dropped. The tool token is nobody's. Loss -(2 sqrt(1.5) + 0) / 3 over the 3 model tokens."""
    prox = torch.tensor([[-1.0, -2.0, 0.0, -0.5]], dtype=torch.float64)
    behave = prox - torch.tensor([[math.log(3), math.log(0.5), 0.0, math.log(2)]], dtype=torch.float64)
    mask, turns = torch.tensor([[1.0, 1.0, 0.0, 1.0]]), torch.tensor([[1, 1, 0, 2]])
    weights, metrics = behaviour_weights(prox, behave * mask, mask, "turn", 1.5, turns)
    assert torch.allclose(weights, torch.tensor([[ROOT, ROOT, 0.0, 0.0]], dtype=torch.float64), atol=1e-12)
    assert metrics["behave/masked_frac"].item() == pytest.approx(1 / 2)  # 1 of 2 turns
    objective = Objective(TurnRatio(), ClippedMin(0.2, 0.2), SeqMeanTokenMean(), decoupled=True,
                          behave_weight_cap=1.5)
    out = objective(prox, prox, torch.tensor([1.0], dtype=torch.float64), mask, rollout_logp=behave, turns=turns)
    assert out.loss.item() == pytest.approx(-2 * ROOT / 3, abs=1e-12)


def test_a_behaviour_policy_equal_to_prox_leaves_the_loss_as_it_was():
    """Staleness 0 and an exact engine: every weight is 1, the decoupled loss is the plain one."""
    logp = PROX + torch.tensor([[0.1, -0.2], [0.05, 0.0]], dtype=torch.float64)
    for objective in (GRPO, GSPO):
        plain = objective()(logp, PROX, ADV, MASK)
        decoupled = objective(decoupled=True)(logp, PROX, ADV, MASK, rollout_logp=PROX)
        assert decoupled.loss.item() == pytest.approx(plain.loss.item(), abs=1e-15)
        assert decoupled.metrics["behave/weight_mean"].item() == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"objective.behave_weight_cap=1.0 must be > 1"):
        GSPO(decoupled=True, behave_weight_cap=1.0)
    with pytest.raises(ValueError, match=r"objective.decoupled=true and objective.rollout_correction='tis_token'"):
        GRPO(decoupled=True, rollout_correction="tis_token")
    with pytest.raises(ValueError, match=r"objective.decoupled='yes' must be true or false"):
        GRPO(decoupled="yes")
    with pytest.raises(ValueError, match=r"decoupled=true needs rollout_logp"):
        GSPO(decoupled=True)(PROX, PROX, ADV, MASK)


def test_stale_rollouts_without_a_correction_and_decoupled_bypass_are_refused_at_plan_time(compose, tmp_path):
    out = f"paths.output_dir={tmp_path}"
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=2 with a recomputed π_old .* Choose one: "
                                          r"rollout.logprobs_from_generation=true .* objective.decoupled=true .* "
                                          r"rollout.max_staleness=0"):
        plan(compose(["rollout.max_staleness=2", "rollout.logprobs_from_generation=false", out]))
    with pytest.raises(ConfigError, match=r"objective.decoupled=true is invalid with rollout.logprobs_from_generation"):
        plan(compose(["objective.decoupled=true", "rollout.logprobs_from_generation=true", out]))
    # the three ways out each plan
    for way in (["rollout.logprobs_from_generation=true"], ["objective.decoupled=true"],
                ["objective.rollout_correction=tis_token"]):
        plan(compose(["rollout.max_staleness=2", "rollout.logprobs_from_generation=false", out] + way))
    with pytest.raises(ConfigError, match=r"rollout.async_mode=overlap with rollout.backend=hf: overlap generates in "
                                          r"a process of its own .* RolloutEngine does not declare runs_apart = True"):
        plan(compose(["rollout.max_staleness=1", "rollout.async_mode=overlap", out]))
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=-1 is invalid: must be an integer >= 0"):
        plan(compose(["rollout.max_staleness=-1", out]))
