"""Objectives on multi-turn batches: the loss sees the model's tokens only (the tools' results between its turns are
context), GSPO's sequence ratio spans the model's tokens of every turn, and the turn-level ratio clips each turn
on its own (gspo_lab.objectives.ratios.TurnRatio). Every conf/objective/*.yaml goes through the same checks."""

import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from gspo_lab import CONFIG_DIR
from gspo_lab.objectives import GSPO, Objective
from gspo_lab.objectives.aggregations import SeqMeanTokenMean
from gspo_lab.objectives.ratios import TurnRatio
from gspo_lab.objectives.surrogates import ClippedMin

NAMES = sorted(p.stem for p in (Path(CONFIG_DIR) / "objective").glob("*.yaml"))

# two rows, six positions: row 0 is turn 1 (2 tokens), a tool result (2 tokens), turn 2 (1 token), padding;
# row 1 is one turn of 3 tokens, then padding
TURNS = torch.tensor([[1, 1, 0, 0, 2, 0], [1, 1, 1, 0, 0, 0]])
ATTENDED = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])  # what the forward sees: tools' tokens too
MASK = (TURNS > 0).long()  # what the loss sees: the model's tokens
LOG_W = torch.tensor([[0.2, 0.4, 9.0, -9.0, -0.3, 5.0], [0.1, -0.1, 0.3, 7.0, 7.0, 7.0]], dtype=torch.float64)


def batch(tool_logp: float = 0.0):
    """logp, old_logp, advantages; the tools' and padding positions of logp set to `tool_logp`."""
    old = torch.full((2, 6), -1.0, dtype=torch.float64)
    logp = torch.where(MASK.bool(), old + LOG_W, torch.tensor(tool_logp, dtype=torch.float64))
    return logp.requires_grad_(True), old, torch.tensor([1.0, -1.0], dtype=torch.float64)


def test_gspo_sequence_ratio_spans_the_model_tokens_of_every_turn():
    logp, old, adv = batch()
    out = GSPO(clip_low=0.2, clip_high=0.2)(logp, old, adv, MASK, turns=TURNS)
    # log s_0 = (0.2 + 0.4 - 0.3) / 3 = 0.1 (the tool's tokens 9 and -9 are not the model's); log s_1 = 0.3 / 3
    assert out.metrics["ratio/seq/mean"].item() == pytest.approx(math.exp(0.1))
    assert out.metrics["mask/valid_tokens"].item() == 6


def test_turn_ratio_by_hand_on_two_turns_with_padding():
    objective = Objective(TurnRatio(), ClippedMin(0.2, 0.2), SeqMeanTokenMean(), "turn")
    logp, old, adv = batch()
    out = objective(logp, old, adv, MASK, turns=TURNS)
    out.loss.backward()
    # row 0, A = 1: turn 1 has log s = (0.2 + 0.4) / 2 = 0.3, s = 1.3499 > 1.2: clipped to 1.2 on both tokens (no
    # gradient); turn 2 has s = e^-0.3 = 0.7408 < 0.8, and min(0.7408, 0.8) keeps it. Row 1, A = -1: one turn,
    # s = e^0.1 = 1.1052 within [0.8, 1.2]. Loss = -(mean_t min(s A, clip(s) A)), rows averaged
    row0 = -(1.2 + 1.2 + math.exp(-0.3)) / 3
    row1 = math.exp(0.1)
    assert out.loss.item() == pytest.approx((row0 + row1) / 2, abs=1e-12)
    grad = torch.zeros(2, 6, dtype=torch.float64)
    grad[0, 4] = -math.exp(-0.3) / 3 / 2  # d/dlogp of -s/(3·2), s = exp(logp - old) over turn 2's one token
    grad[1, :3] = math.exp(0.1) / 3 / 2  # each of row 1's 3 tokens: s/3 (∂ log s / ∂ logp_t) summed over 3 terms/3
    torch.testing.assert_close(logp.grad, grad, rtol=0, atol=1e-12)
    assert out.metrics["clip/frac"].item() == pytest.approx(2 / 6)


def test_turn_ratio_on_one_turn_is_gspo_exactly():
    logp, old, adv = batch()
    mask = ATTENDED  # one turn per row, every token the model's
    turn = Objective(TurnRatio(), ClippedMin(0.2, 0.2), SeqMeanTokenMean(), "turn")(logp, old, adv, mask)
    (turn_grad,) = torch.autograd.grad(turn.loss, logp)
    gspo = GSPO(clip_low=0.2, clip_high=0.2)(logp, old, adv, mask)
    (gspo_grad,) = torch.autograd.grad(gspo.loss, logp)
    assert turn.loss.item() == pytest.approx(gspo.loss.item(), abs=1e-15)
    torch.testing.assert_close(turn_grad, gspo_grad, rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_the_tools_tokens_change_neither_loss_nor_gradient(name, compose):
    """Every objective: the log-probs at the tools' positions (and padding) may be anything; the loss and its
    gradient do not move, and nothing flows to those positions."""
    objective = instantiate(compose([f"objective={name}", "objective.beta=0.04"]).objective)
    results = []
    for tool_logp in (-0.7, -25.0):
        logp, old, adv = batch(tool_logp)
        ref = torch.where(MASK.bool(), old - 0.05, torch.tensor(tool_logp, dtype=torch.float64))
        torch.manual_seed(0)  # Clip-Cov and KL-Cov draw their tokens at random
        out = objective(logp, old, adv, MASK, ref_logp=ref, rollout_logp=ref, turns=TURNS)
        (grad,) = torch.autograd.grad(out.loss, logp)
        results.append((out.loss.detach(), grad, {k: v.item() for k, v in out.metrics.items()}))
    (loss_a, grad_a, metrics_a), (loss_b, grad_b, metrics_b) = results
    assert loss_a == loss_b and torch.equal(grad_a, grad_b) and metrics_a == metrics_b
    assert grad_a[~MASK.bool()].eq(0).all() and grad_a[MASK.bool()].ne(0).any()
