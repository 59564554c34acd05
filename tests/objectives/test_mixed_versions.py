"""A partial rollout's sequence is written by several weight versions (gspo_lab.rollout.sources.lagged): each token's
behaviour log-prob is its own version's, and the objectives take them as they are, with no change. Hand-worked on
one row of four tokens, π_θ = π_prox (the current weights, version 5): tokens 0-1 were written by version 3, tokens
2-3 by version 4.

    log π_prox - log π_v3 = (log 2, log 2, log 4, log 4)     (version 3's log-probs of every token)
    log π_prox - log π_v4 = (log 0.5, log 0.5, 0, 0)          (version 4's)
    mixed, each token its writer's:  (log 2, log 2, 0, 0)     ratios r_t = (2, 2, 1, 1)

Bypass (π_old = the engine's mixed log-probs), A = -1, clip 0.2 for the token forms:
    token (GRPO):        -min(r A, clip(r) A) = max(r, clip(r)) = (2, 2, 1, 1)   loss 1.5, d loss / d logp_t = r_t / 4
    sequence (GSPO):     s = exp(mean log r) = sqrt 2      loss sqrt 2, d loss / d logp_t = sqrt 2 / 4
                         (version 3 alone would give 2 sqrt 2, version 4 alone 1 / sqrt 2)
    sequence-token:      the same value and gradient as GSPO
    turn (tokens 0-1 turn 1, 2-3 turn 2): turn ratios (2 | 1)                     loss 1.5
Decoupled (π_old = π_prox, π_behave the mixed log-probs), A = +1, cap C = 3: weights w = π_prox / π_behave
    token: (2, 2, 1, 1), loss -1.5;  sequence: sqrt 2 on every token, loss -sqrt 2;  turn: (2, 2 | 1, 1), loss -1.5
"""

import math

import pytest
import torch

from gspo_lab.objectives import GRPO, GSPO, GSPOToken, Objective
from gspo_lab.objectives.aggregations import SeqMeanTokenMean
from gspo_lab.objectives.ratios import TurnRatio
from gspo_lab.objectives.surrogates import ClippedMin

LOG2 = math.log(2)
PROX = torch.tensor([[-1.0, -1.5, -0.5, -2.0]], dtype=torch.float64)  # the current weights' log-probs
V3 = PROX - torch.tensor([[LOG2, LOG2, 2 * LOG2, 2 * LOG2]], dtype=torch.float64)
V4 = PROX - torch.tensor([[-LOG2, -LOG2, 0.0, 0.0]], dtype=torch.float64)
VERSIONS = torch.tensor([[3, 3, 4, 4]])
MIXED = torch.where(VERSIONS == 3, V3, V4)  # what the engine returned: each token under the version that wrote it
MASK = torch.ones(1, 4)
TURNS = torch.tensor([[1, 1, 2, 2]])
ROOT2 = math.sqrt(2)


def turn_objective(**settings) -> Objective:
    return Objective(TurnRatio(), ClippedMin(0.2, 0.2), SeqMeanTokenMean(), **settings)


BYPASS = {  # objective -> loss, d loss / d logp
    # A < 0: the pessimistic term is the unclipped ratio, so every token carries r_t / 4
    "token": (lambda: GRPO(clip_low=0.2, clip_high=0.2), 1.5, [0.5, 0.5, 0.25, 0.25]),
    "sequence": (GSPO, ROOT2, [ROOT2 / 4] * 4),
    "sequence_token": (GSPOToken, ROOT2, [ROOT2 / 4] * 4),
    "turn": (turn_objective, 1.5, [0.5, 0.5, 0.25, 0.25]),  # a turn's ratio r moves by r / 2 per token of it
}


@pytest.mark.parametrize("form", sorted(BYPASS))
def test_bypass_takes_each_tokens_own_version_as_pi_old(form):
    make, loss, grad = BYPASS[form]
    logp = PROX.clone().requires_grad_(True)
    out = make()(logp, MIXED, torch.tensor([-1.0], dtype=torch.float64), MASK, turns=TURNS)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([grad], dtype=torch.float64), atol=1e-12)


def test_the_sequence_ratio_is_the_geometric_mean_over_both_versions():
    """Not version 3's ratio alone (2 sqrt 2), nor version 4's (1 / sqrt 2; inside a clip range of 0.5)."""
    adv = torch.tensor([-1.0], dtype=torch.float64)
    alone = [GSPO(clip_low=0.5)(PROX, old, adv, MASK).loss.item() for old in (V3, V4)]
    assert alone == pytest.approx([2 * ROOT2, 1 / ROOT2], abs=1e-12)


DECOUPLED = {  # objective -> loss
    "token": (lambda **settings: GRPO(clip_low=0.2, clip_high=0.2, **settings), -1.5),
    "sequence": (GSPO, -ROOT2),
    "sequence_token": (GSPOToken, -ROOT2),
    "turn": (turn_objective, -1.5),
}


@pytest.mark.parametrize("form", sorted(DECOUPLED))
def test_the_decoupled_weight_takes_each_tokens_own_version_as_pi_behave(form):
    make, loss = DECOUPLED[form]
    out = make(decoupled=True, behave_weight_cap=3.0)(PROX, PROX, torch.tensor([1.0], dtype=torch.float64), MASK,
                                                      rollout_logp=MIXED, turns=TURNS)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert out.metrics["behave/masked_frac"].item() == 0
