"""The objectives the field compares GSPO against, instantiated from their YAMLs with the published recipes, on
hand-sized float64 tensors; expected values and gradients derived in the comments from each method's
equations (as TRL 1.16's GRPOTrainer loss_type=<name>, TRL's experimental GMPOTrainer and verl implement them).

Shared inputs (those of test_gspo.py and test_grpo.py): row 0 has two valid tokens with log-ratios (0.1, -0.3),
log π = (-0.9, -2.3), A = +1; row 1 has three with log-ratios (0.3, 0.3, 0.3), log π = (-1.2, -0.2, -0.7),
A = +2; 5 valid tokens in all.
"""

import math

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from gspo_lab.objectives import Objective
from gspo_lab.objectives.aggregations import SeqMeanTokenMean
from gspo_lab.objectives.ratios import TokenRatio
from gspo_lab.objectives.surrogates import ClippedMin

OLD = torch.tensor([[-1.0, -2.0, 0.0], [-1.5, -0.5, -1.0]], dtype=torch.float64)
LOGP = OLD + torch.tensor([[0.1, -0.3, 0.0], [0.3, 0.3, 0.3]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, 2.0], dtype=torch.float64)
W0, W1, W2 = math.exp(0.1), math.exp(-0.3), math.exp(0.3)  # token ratios: 1.105171, 0.740818, 1.349859


def run(obj, logp=LOGP, old=OLD, adv=ADV, mask=MASK):
    logp = logp.clone().requires_grad_(True)
    out = obj(logp, old, adv, mask)
    out.loss.backward()
    return out, logp.grad


def grad(rows):
    return torch.tensor(rows, dtype=torch.float64)


@pytest.fixture(scope="module")
def make(compose):
    """make(name) -> the objective of conf/objective/<name>.yaml under algorithm=<name>, no other override."""
    return lambda name: instantiate(compose([f"algorithm={name}"]).objective)


def test_dapo_token_mean_and_clip_higher(make):
    # clip [0.8, 1.28]: 1.105 inside; 0.741 < 0.8 but A > 0, so the unclipped branch binds; 1.350 > 1.28 with
    # A = 2: clipped, term 1.28 * 2 = 2.56 on each of row 1's tokens. Token mean over the 5 tokens:
    # loss = -(W0 + W1 + 3 * 2.56) / 5 = -1.90520; d loss / d log π = -w A / 5 where unclipped
    out, g = run(make("dapo"))
    assert out.loss.item() == pytest.approx(-(W0 + W1 + 7.68) / 5, abs=1e-12)
    assert torch.allclose(g, grad([[-W0 / 5, -W1 / 5, 0], [0, 0, 0]]), atol=1e-12, rtol=0)
    assert out.metrics["clip/frac_high"].item() == pytest.approx(3 / 5)
    assert out.metrics["clip/seq_frac"].item() == pytest.approx(1 / 2)


def test_dr_grpo_constant_normaliser_and_unscaled_advantages(make, compose):
    # clip [0.8, 1.2]: row 1 clipped to 1.2 * 2 = 2.4 per token; Σ terms = W0 + W1 + 7.2 over B × max_len = 2 × 8
    # (max_len is rollout.max_new_tokens, 8 by default); d loss / d log π = -w A / 16 where unclipped
    out, g = run(make("dr_grpo"))
    assert out.loss.item() == pytest.approx(-(W0 + W1 + 7.2) / 16, abs=1e-12)
    assert torch.allclose(g, grad([[-W0 / 16, -W1 / 16, 0], [0, 0, 0]]), atol=1e-12, rtol=0)
    assert instantiate(compose(["algorithm=dr_grpo"]).advantage).scale == "none"


def test_cispo_detached_capped_weight_times_log_prob(make):
    # no ratio above the cap 5, so the weight is r: term = -sg[r] A log π; token mean over 5 tokens:
    # row 0: -W0 (-0.9) - W1 (-2.3) = 0.9 W0 + 2.3 W1; row 1: -2 W2 (-1.2 - 0.2 - 0.7) = 4.2 W2
    # gradient -sg[r] A / 5 on every valid token: none is cut off, unlike the clipped surrogate
    out, g = run(make("cispo"))
    assert out.loss.item() == pytest.approx((0.9 * W0 + 2.3 * W1 + 4.2 * W2) / 5, abs=1e-12)
    assert torch.allclose(g, grad([[-W0 / 5, -W1 / 5, 0], [-2 * W2 / 5] * 3]), atol=1e-12, rtol=0)
    assert out.metrics["cispo/capped_frac"] == 0


def test_cispo_cap_binds_for_either_sign_of_the_advantage(make):
    # one row, log-ratios (log 6, 0), log π = (-3 + log 6, -1), A = -1: weights (min(6, 5), 1) = (5, 1)
    # terms -w A log π = w log π: 5 (-3 + log 6) + (-1), mean of 2; gradient -w A / 2 = (2.5, 0.5)
    old = torch.tensor([[-3.0, -1.0]], dtype=torch.float64)
    logp = old + torch.tensor([[math.log(6), 0.0]], dtype=torch.float64)
    out, g = run(make("cispo"), logp, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2))
    assert out.loss.item() == pytest.approx((5 * (-3 + math.log(6)) - 1) / 2, abs=1e-12)
    assert torch.allclose(g, grad([[2.5, 0.5]]), atol=1e-12, rtol=0)
    assert out.metrics["cispo/capped_frac"].item() == pytest.approx(1 / 2)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_soft_gate_positive_advantages(make):
    # A > 0 everywhere, τ_pos = 1: term = -4 σ(r - 1) A; gradient -4 σ (1 - σ) r A times the aggregation's
    # weight 1/(B |y_i|): 1/4 on row 0, 1/6 on row 1
    out, g = run(make("sapo"))
    s = [sigmoid(w - 1) for w in (W0, W1, W2)]
    row0, row1 = (4 * s[0] + 4 * s[1]) / 2, 4 * s[2] * 2
    assert out.loss.item() == pytest.approx(-(row0 + row1) / 2, abs=1e-12)
    gate = [4 * x * (1 - x) for x in s]
    expected = grad([[-gate[0] * W0 / 4, -gate[1] * W1 / 4, 0], [-gate[2] * W2 * 2 / 6] * 3])
    assert torch.allclose(g, expected, atol=1e-12, rtol=0)
    assert out.metrics["sapo/gate_mean"].item() == pytest.approx((gate[0] + gate[1] + 3 * gate[2]) / 5, abs=1e-12)


def test_sapo_negative_advantage_uses_tau_neg_in_float64(make):
    # one token, log-ratio 0.2, A = -1, τ_neg = 1.05 (exactly, in float64): term = (4/1.05) σ(1.05 (e^0.2 - 1));
    # gradient -4 σ (1 - σ) r A = 4 σ (1 - σ) e^0.2. A float32 τ (1.0499999523) would be off by ~1e-8
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    out, g = run(make("sapo"), old + 0.2, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1))
    s = sigmoid(1.05 * (math.exp(0.2) - 1))
    assert out.loss.item() == pytest.approx(4 / 1.05 * s, abs=1e-14)
    assert g.item() == pytest.approx(4 * s * (1 - s) * math.exp(0.2), abs=1e-14)


def test_gmpo_clips_token_log_ratios_on_the_trust_region_side_before_the_geometric_mean(make):
    # bounds ±0.4 in log space. Row 0, A = +1, log w = (0.5, -0.6): for A > 0 only the top binds: (0.4, -0.6),
    # mean -0.1, r_0 = e^-0.1. Row 1, A = -1, log w = (0.5, -0.6, 0.1): only the bottom binds: (0.5, -0.4, 0.1),
    # mean 0.2/3, r_1 = e^(1/15). Loss = -(r_0 · 1 + r_1 · (-1)) / 2.
    # d loss / d log π = -(1/2) A_i r_i / |y_i| on unclipped tokens: row 0 (0, -r_0/4), row 1 (r_1/6, 0, r_1/6)
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.5, -0.5, -1.0]], dtype=torch.float64)
    logp = old + torch.tensor([[0.5, -0.6, 0.0], [0.5, -0.6, 0.1]], dtype=torch.float64)
    out, g = run(make("gmpo"), logp, old, torch.tensor([1.0, -1.0], dtype=torch.float64))
    r0, r1 = math.exp(-0.1), math.exp(0.2 / 3)
    assert out.loss.item() == pytest.approx((r1 - r0) / 2, abs=1e-12)
    assert torch.allclose(g, grad([[0, -r0 / 4, 0], [r1 / 6, 0, r1 / 6]]), atol=1e-12, rtol=0)
    m = out.metrics
    assert (m["clip/frac_high"].item(), m["clip/frac_low"].item()) == pytest.approx((1 / 5, 1 / 5))
    assert m["clip/seq_frac"].item() == 1  # both sequences have a clipped token
    # ratio/seq/* is the unclipped s_i of every objective: mean log w of row 0 -0.05, of row 1 0
    assert m["ratio/seq/mean"].item() == pytest.approx((math.exp(-0.05) + 1) / 2, abs=1e-12)


def test_luspo_weighs_each_sequence_by_its_length(make):
    # GSPO's s_i with clip [0.998, 1.0025]: s_0 = e^-0.1 is below it with A > 0, so unclipped, term -s_0;
    # s_1 = e^0.3 above it with A = 2: clipped, term -1.0025 · 2. LUSPO: (1/B) Σ_i |y_i| term_i
    # = -(2 s_0 + 3 · 2.005) / 2; gradient on row 0: -(1/2) · 2 · s_0 · (1/2) = -s_0/2 per token (GSPO's × |y_0|)
    out, g = run(make("luspo"))
    s0 = math.exp(-0.1)
    assert out.loss.item() == pytest.approx(-(2 * s0 + 3 * (1 + 2.5e-3) * 2) / 2, abs=1e-12)
    assert torch.allclose(g, grad([[-s0 / 2, -s0 / 2, 0], [0, 0, 0]]), atol=1e-12, rtol=0)
    assert out.metrics["clip/frac_high"].item() == pytest.approx(3 / 5)


def test_vespo_gamma_weight_on_the_full_sequence_ratio(make):
    # W_0 = e^(0.1 - 0.3) = e^-0.2 with A ≥ 0: (k, λ) = (2, 3), φ_0 = exp(3 - 0.4 - 3 e^-0.2) = 0.794...;
    # W_1 = e^0.9 with A = 2: φ_1 = exp(3 + 1.8 - 3 e^0.9) = 0.0766...
    # terms -φ A log π, token mean: (φ_0 (0.9 + 2.3) + 2 φ_1 (1.2 + 0.2 + 0.7)) / 5; gradient -φ_i A_i / 5
    out, g = run(make("vespo"))
    phi0, phi1 = math.exp(3 - 0.4 - 3 * math.exp(-0.2)), math.exp(3 + 1.8 - 3 * math.exp(0.9))
    assert out.loss.item() == pytest.approx((3.2 * phi0 + 4.2 * phi1) / 5, abs=1e-12)
    assert torch.allclose(g, grad([[-phi0 / 5, -phi0 / 5, 0], [-2 * phi1 / 5] * 3]), atol=1e-12, rtol=0)
    assert out.metrics["vespo/weight_mean"].item() == pytest.approx((2 * phi0 + 3 * phi1) / 5, abs=1e-12)


def test_vespo_negative_advantage_uses_k_neg_and_lambda_neg(make):
    # one row, log-ratios (0.1, 0.1), log π = (-1, -2), A = -1: W = e^0.2, (k, λ) = (3, 2),
    # φ = exp(2 + 0.6 - 2 e^0.2); terms -φ A log π = φ log π, mean -1.5 φ; gradient -φ A / 2 = φ/2
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    out, g = run(make("vespo"), logp, logp - 0.1, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2))
    phi = math.exp(2 + 0.6 - 2 * math.exp(0.2))
    assert out.loss.item() == pytest.approx(-1.5 * phi, abs=1e-12)
    assert torch.allclose(g, grad([[phi / 2, phi / 2]]), atol=1e-12, rtol=0)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # one row, A = -1, token ratios (4, 0.5, 1.1), clip [0.8, 1.2], c = 3:
    # r = 4: -min(-4, -1.2) = 4, dual-clipped to min(4, 3) = 3 (no gradient); r = 0.5: clipped below, 0.8;
    # r = 1.1: 1.1 with gradient -r A / 3 = 1.1/3. Without the dual clip the first term is 4 with gradient 4/3.
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[math.log(4), math.log(0.5), math.log(1.1)]], dtype=torch.float64)
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 3)
    dual = Objective(TokenRatio(), ClippedMin(0.2, 0.2, dual_clip=3.0), SeqMeanTokenMean(), "dual")
    out, g = run(dual, logp, old, adv, mask)
    assert out.loss.item() == pytest.approx((3 + 0.8 + 1.1) / 3, abs=1e-12)
    assert torch.allclose(g, grad([[0, 0, 1.1 / 3]]), atol=1e-12, rtol=0)
    assert out.metrics["clip/frac_dual"].item() == pytest.approx(1 / 3)
    assert out.metrics["clip/frac_low"].item() == pytest.approx(1 / 3)
    plain, g = run(Objective(TokenRatio(), ClippedMin(0.2, 0.2), SeqMeanTokenMean(), "plain"), logp, old, adv, mask)
    assert plain.loss.item() == pytest.approx((4 + 0.8 + 1.1) / 3, abs=1e-12)
    assert g[0, 0].item() == pytest.approx(4 / 3, abs=1e-12)


@pytest.mark.parametrize("name, override, message", [
    ("dapo", "objective.surrogate.clip_low=1.5", r"ClippedMin: objective\.surrogate\.clip_low=1\.5 must satisfy 0 <"),
    ("dapo", "objective.surrogate.dual_clip=0.5", r"objective\.surrogate\.dual_clip=0\.5 must be > 1 or null"),
    ("dr_grpo", "objective.aggregation.max_len=0", r"objective\.aggregation\.max_len=0 must be >= 1"),
    ("cispo", "objective.surrogate.cap=0.2", r"CISPO: objective\.surrogate\.cap=0\.2 must be >= 1"),
    ("sapo", "objective.surrogate.tau_neg=0", r"SAPO: objective\.surrogate\.tau_neg=0 must be > 0"),
    ("vespo", "objective.surrogate.lambda_pos=0", r"VESPO: objective\.surrogate\.lambda_pos=0 must be > 0"),
    ("gmpo", "objective.ratio.clip_low=-0.4", r"GeometricMeanRatio: objective\.ratio\.clip_low=-0\.4 must be > 0"),
    ("luspo", "objective.ratio.log_ratio_clamp=0", r"SequenceRatio: objective\.ratio\.log_ratio_clamp=0 must be > 0"),
    ("dapo", "objective.beta=-1", r"dapo: objective\.beta=-1 must be >= 0"),
])
def test_bad_settings_name_the_key_value_and_rule(name, override, message, compose):
    with pytest.raises(InstantiationException, match=message):
        instantiate(compose([f"algorithm={name}", override]).objective)
