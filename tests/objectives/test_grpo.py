"""GRPO's token-level objective on hand-sized tensors; expected values derived in the comments."""

import math

import pytest
import torch

from gspo_lab.objectives import GRPO

# Same inputs as test_gspo: row 0 log-ratios (0.1, -0.3) with A = +1, row 1 (0.3, 0.3, 0.3) with A = +2.
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-1.5, -0.5, -1.0]], dtype=torch.float64)
LOGP = OLD + torch.tensor([[0.1, -0.3, 0.0], [0.3, 0.3, 0.3]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, 2.0], dtype=torch.float64)


def test_grpo_hand_computed():
    logp = LOGP.clone().requires_grad_(True)
    out = GRPO(clip_low=0.2, clip_high=0.2)(logp, OLD, ADV, MASK)
    w = [math.exp(0.1), math.exp(-0.3)]  # 1.105171 (inside), 0.740818 (below 0.8 but A > 0: unclipped binds)
    row0 = (w[0] + w[1]) / 2  # 0.9229945
    row1 = 1.2 * 2  # 1.349859 > 1.2 with A = 2: every token's clipped branch binds
    assert out.loss.item() == pytest.approx(-(row0 + row1) / 2, abs=1e-12)  # -1.66149725
    m = out.metrics
    assert m["clip/frac"].item() == pytest.approx(3 / 5)
    assert m["clip/frac_low"].item() == 0  # the low token has A > 0
    assert m["clip/seq_frac"].item() == pytest.approx((0 + 1) / 2)
    assert m["ratio/token/mean"].item() == pytest.approx((w[0] + w[1] + 3 * math.exp(0.3)) / 5, abs=1e-12)
    # the sequence ratio is reported for every objective: row 0 exp((0.1 - 0.3) / 2), row 1 exp(0.3)
    assert m["ratio/seq/mean"].item() == pytest.approx((math.exp(-0.1) + math.exp(0.3)) / 2, abs=1e-12)
    out.loss.backward()
    # d loss / d logp_0,t = -(1/2)(1/2) w_t A for unclipped tokens; clipped tokens and padding get 0
    expected = torch.tensor([[-w[0] / 4, -w[1] / 4, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp.grad, expected, atol=1e-12)


def test_dr_grpo_constant_normaliser():
    # Σ terms = 1.105171 + 0.740818 + 3 * 2.4 = 9.045989, divided by B × T = 2 × 3
    out = GRPO(clip_low=0.2, clip_high=0.2, length_norm=False)(LOGP, OLD, ADV, MASK)
    assert out.loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.3) + 7.2) / 6, abs=1e-12)
    # with max_len = 10 the normaliser is 2 × 10, whatever the padded width
    out = GRPO(clip_low=0.2, clip_high=0.2, length_norm=False, max_len=10)(LOGP, OLD, ADV, MASK)
    assert out.loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.3) + 7.2) / 20, abs=1e-12)


def test_grpo_lower_clip_binds_for_negative_advantage():
    # token log-ratio -0.5 -> w = 0.6065 < 0.8, A = -1: min(-0.6065, -0.8) = -0.8, loss 0.8
    out = GRPO(clip_low=0.2, clip_high=0.2)(
        torch.tensor([[-1.5, -1.0]]), torch.tensor([[-1.0, -1.0]]), torch.tensor([-1.0]), torch.ones(1, 2)
    )
    assert out.loss.item() == pytest.approx((0.8 + 1.0) / 2)  # second token on-policy: -(1 × -1) = 1
    assert out.metrics["clip/frac_low"].item() == pytest.approx(0.5)
    assert out.metrics["clip/seq_frac"].item() == 1  # the one sequence has a clipped token (one of its two)
