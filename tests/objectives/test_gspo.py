"""GSPO and GSPO-token on hand-sized tensors; expected values derived in the comments."""

import math

import pytest
import torch

from gspo_lab.objectives import GSPO, GSPOToken

# Two sequences, three columns. Row 0: two valid tokens, log-ratios (0.1, -0.3), A = +1.
# Row 1: three valid tokens, log-ratios (0.3, 0.3, 0.3), A = +2. Clip range [0.8, 1.2].
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-1.5, -0.5, -1.0]], dtype=torch.float64)
LOGP = OLD + torch.tensor([[0.1, -0.3, 0.0], [0.3, 0.3, 0.3]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, 2.0], dtype=torch.float64)


def test_gspo_hand_computed():
    out = GSPO(clip_low=0.2, clip_high=0.2)(LOGP, OLD, ADV, MASK)
    s0 = math.exp((0.1 - 0.3) / 2)  # 0.904837, inside [0.8, 1.2]: term = s0 * 1
    s1 = math.exp(0.9 / 3)  # 1.349859 > 1.2 with A > 0: the clipped branch binds, term = 1.2 * 2
    assert out.loss.item() == pytest.approx(-(s0 * 1 + 1.2 * 2) / 2, abs=1e-12)  # -1.6524187
    m = out.metrics
    assert m["clip/frac"].item() == pytest.approx(3 / 5)  # every token of row 1 counts, 5 valid tokens
    assert m["clip/frac_high"].item() == pytest.approx(3 / 5)
    assert m["clip/frac_low"].item() == 0
    assert m["clip/seq_frac"].item() == pytest.approx(1 / 2)  # one of two sequences
    assert m["ratio/seq/mean"].item() == pytest.approx((s0 + s1) / 2, abs=1e-12)  # sequence ratios
    assert m["ratio/seq/min"].item() == pytest.approx(s0, abs=1e-12)
    assert m["ratio/seq/max"].item() == pytest.approx(s1, abs=1e-12)
    assert m["ratio/token/max"].item() == pytest.approx(math.exp(0.3), abs=1e-12)  # token ratios: row 1's
    # k3 of KL(old || new) per token: e^x - 1 - x for x in (0.1, -0.3, 0.3, 0.3, 0.3)
    expected_kl = sum(math.exp(x) - 1 - x for x in (0.1, -0.3, 0.3, 0.3, 0.3)) / 5
    assert m["kl/old"].item() == pytest.approx(expected_kl, abs=1e-12)


def test_gspo_without_length_norm_uses_raw_sequence_ratio():
    out = GSPO(clip_low=0.2, clip_high=0.2, length_norm=False)(LOGP, OLD, ADV, MASK)
    s0 = math.exp(-0.2)  # 0.818731: inside the range
    # row 1: exp(0.9) = 2.4596 is clipped to 1.2, term 2.4
    assert out.loss.item() == pytest.approx(-(s0 + 2.4) / 2, abs=1e-12)  # -1.6093655


def test_gspo_lower_clip_binds_for_negative_advantage():
    # one token, log-ratio -0.5: s = 0.606531 < 0.8 with A = -1 -> min(-0.6065, -0.8) = -0.8, loss +0.8
    logp, old = torch.tensor([[-1.5]], dtype=torch.float64), torch.tensor([[-1.0]], dtype=torch.float64)
    logp.requires_grad_(True)
    out = GSPO(clip_low=0.2, clip_high=0.2)(logp, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1))
    assert out.loss.item() == pytest.approx(0.8)
    assert out.metrics["clip/frac_low"].item() == 1 and out.metrics["clip/frac_high"].item() == 0
    out.loss.backward()
    assert logp.grad.item() == 0  # the clipped branch carries no gradient


@pytest.mark.parametrize("side", ["high", "low"])
def test_gspo_clip_boundary_is_exclusive(side):
    # just inside the boundary: not clipped, gradient flows; just outside: clipped, no gradient
    clip, eps = 0.2, 1e-9
    sign = 1.0 if side == "high" else -1.0
    for offset, clipped in ((-eps, False), (eps, True)):
        edge = math.log1p(sign * (clip + offset))  # log of a ratio just inside / outside 1 ± clip
        old = torch.zeros(1, 1, dtype=torch.float64)
        logp = torch.full((1, 1), edge, dtype=torch.float64, requires_grad=True)
        adv = torch.tensor([sign], dtype=torch.float64)  # the side where the clip can bind
        out = GSPO(clip_low=clip, clip_high=clip)(logp, old, adv, torch.ones(1, 1))
        out.loss.backward()
        assert out.metrics["clip/frac"].item() == float(clipped)
        assert (logp.grad.item() == 0) == clipped


@pytest.mark.parametrize("length_norm", [True, False])
def test_gspo_token_equals_gspo_for_sequence_advantages(length_norm):
    torch.manual_seed(0)
    B, T = 6, 9
    old = -torch.rand(B, T, dtype=torch.float64) * 3
    base = old + 0.05 * torch.randn(B, T, dtype=torch.float64)
    mask = (torch.rand(B, T) > 0.3).long()
    adv = torch.randn(B, dtype=torch.float64)
    results = []
    for cls in (GSPO, GSPOToken):
        logp = base.clone().requires_grad_(True)
        out = cls(clip_low=0.02, clip_high=0.03, length_norm=length_norm)(logp, old, adv, mask)
        out.loss.backward()
        results.append((out.loss.detach(), logp.grad, out.metrics))
    (loss_a, grad_a, m_a), (loss_b, grad_b, m_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-12, rtol=0)
    assert torch.allclose(grad_a, grad_b, atol=1e-12, rtol=0)
    assert grad_a.abs().sum() > 0  # not vacuous: some sequences are inside the clip range
    assert m_a["clip/frac"] > 0  # ... and some outside
    for key in ("clip/frac", "clip/seq_frac", "ratio/seq/mean", "ratio/seq/max", "ratio/token/max", "kl/old"):
        assert m_a[key] == pytest.approx(m_b[key].item())


def test_gspo_token_takes_per_token_advantages_and_gspo_refuses_them():
    adv = torch.tensor([[1.0, -1.0, 0.0], [2.0, 2.0, 2.0]], dtype=torch.float64)
    # on-policy, so s = 1 and nothing clips: loss = -mean_i mean_t A_i,t = -((1 - 1)/2 + 2)/2 = -1
    out = GSPOToken(clip_low=0.2, clip_high=0.2)(OLD, OLD, adv, MASK)
    assert out.loss.item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="GSPOToken"):
        GSPO()(OLD, OLD, adv, MASK)
    # constant along valid tokens is one advantage per sequence, padding aside
    constant = torch.tensor([[1.0, 1.0, 7.0], [2.0, 2.0, 2.0]], dtype=torch.float64)
    assert GSPO()(OLD, OLD, constant, MASK).loss.item() == pytest.approx(-1.5)


def test_gspo_token_gradient_with_per_token_advantages_hand_computed():
    """∇J = (1/B) Σ_i (1/|y_i|) Σ_t s_i A_i,t ∇ log π(y_i,t) over tokens whose unclipped branch binds (eq. 17).
    Row 0: s_0 = exp(-0.1) = 0.904837 inside [0.8, 1.2], A = (+1, -1): both tokens unclipped,
    d loss / d logp = -(1/2)(1/2) s_0 A = (-0.226209, +0.226209).
    Row 1: s_1 = exp(0.3) = 1.349859 > 1.2, A = (+2, -1, +0.5): the positive-advantage tokens are clipped
    (gradient 0); for A = -1, min(-s_1, -1.2) = -s_1 is unclipped: -(1/2)(1/3) s_1 (-1) = s_1 / 6 = 0.224977.
    Loss: -(1/2)[(1/2)(s_0 - s_0) + (1/3)(1.2 * 2 - s_1 + 1.2 * 0.5)] = -0.2750235."""
    adv = torch.tensor([[1.0, -1.0, 0.0], [2.0, -1.0, 0.5]], dtype=torch.float64)
    logp = LOGP.clone().requires_grad_(True)
    out = GSPOToken(clip_low=0.2, clip_high=0.2)(logp, OLD, adv, MASK)
    s0, s1 = math.exp(-0.1), math.exp(0.3)
    assert out.loss.item() == pytest.approx(-(2.4 - s1 + 0.6) / 6, abs=1e-12)
    out.loss.backward()
    expected = torch.tensor([[-s0 / 4, s0 / 4, 0.0], [0.0, s1 / 6, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp.grad, expected, atol=1e-12, rtol=0)
    assert out.metrics["clip/frac"].item() == pytest.approx(2 / 5)  # row 1's two positive-advantage tokens
    assert out.metrics["clip/frac_high"].item() == pytest.approx(2 / 5)


@pytest.mark.parametrize("length_norm", [True, False])
def test_gspo_token_equals_gspo_where_the_log_ratio_clamp_fires(length_norm):
    """One sequence of two tokens, token log-ratios 2, A = -1, clip range [0.8, 1.2], clamp 0.5.
    GSPO: log s = 2 (length-normalised) or 4, clamped to 0.5, s = e^0.5 = 1.6487; with A < 0 the term is
    min(-s, -clip(s)) = -s, loss +s, and the clamp's gradient is 0 past its bound, so d loss / d logp = 0.
    GSPO-token's s_i,t = sg[s] π / sg[π] had gradient s / 2 = 0.82 per token (0.55 in the issue's example
    without the clip); it now carries the clamp's zero too."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    results = []
    for cls in (GSPO, GSPOToken):
        logp = torch.full((1, 2), 2.0, dtype=torch.float64, requires_grad=True)
        out = cls(clip_low=0.2, clip_high=0.2, length_norm=length_norm, log_ratio_clamp=0.5)(
            logp, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2))
        out.loss.backward()
        results.append((out.loss.item(), logp.grad))
    (loss_gspo, grad_gspo), (loss_token, grad_token) = results
    assert loss_gspo == pytest.approx(math.exp(0.5), abs=1e-12) and loss_token == pytest.approx(math.exp(0.5), abs=1e-12)
    assert grad_gspo.abs().max() == 0 and grad_token.abs().max() == 0
